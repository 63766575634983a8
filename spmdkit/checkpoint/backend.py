"""The one place an Orbax `CheckpointManager` and its item handlers are built, for every way spmdkit writes steps.

A step holds up to three items: `state` (the train state, OCDBT), `data` (the grain iterator positions) and `config`
(JSON). A shared directory is written by every process together (Orbax has process 0 write the metadata and the
commit marker). A per-process directory (`per_process`: the local tier of a job on several hosts) is written by its
own process alone: the mechanism of Orbax's emergency `_LocalCheckpointManager` (`MultiprocessingOptions(
primary_host=None, active_processes={this process})` and an `ArrayHandler(primary_host=None, replica_id=None)`), so
every process writes its shards, its metadata and its commit, atomically, with no barrier across processes.
"""

from __future__ import annotations

from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from spmdkit.checkpoint.failures import quiet_orbax_errors
from spmdkit.errors import SpmdkitError


def store_directory(directory: str | Path, read_only: bool) -> Path:
    """The store's directory (absolute; a run directory's `checkpoints/` for a reader); SpmdkitError when unusable."""
    path = Path(directory).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise SpmdkitError(f"checkpoint directory {path} is a file: pass a directory")
    if read_only and not path.is_dir():
        raise SpmdkitError(f"checkpoint directory {path} does not exist: check the path")
    return path / "checkpoints" if read_only and (path / "checkpoints").is_dir() else path


def _handlers(alone: ocp.options.MultiprocessingOptions | None, concurrent_gb: float | None) -> dict:
    """Handlers for every item, so a fresh manager (new process) can read metadata and restore; `alone`: each
    writes this process's part only (arrays: every shard it holds, copies too)."""
    if alone is None:
        sizes = {"save_concurrent_gb": concurrent_gb} if concurrent_gb else {}
        state: ocp.CheckpointHandler = ocp.StandardCheckpointHandler(**sizes)
        config = ocp.JsonCheckpointHandler()
    else:
        arrays = ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)
        registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
        state = ocp.PyTreeCheckpointHandler(
            use_ocdbt=True, use_zarr3=True, multiprocessing_options=alone, type_handler_registry=registry
        )
        config = ocp.JsonCheckpointHandler(multiprocessing_options=alone)
    return {"state": state, "data": grain.checkpoint.CheckpointHandler(), "config": config}


def open_manager(
    directory: Path,
    *,
    every: int = 0,
    keep: int | None = None,
    read_only: bool = False,
    per_process: bool = False,
    asynchronous: bool = True,
    concurrent_gb: float | None = None,
) -> ocp.CheckpointManager:
    """The Orbax manager of `directory`: a step saved every `every` steps (0: only forced saves), the newest `keep`
    kept (None: all); `per_process`: written by this process alone (see the module docstring); `concurrent_gb`:
    the most encoded state bytes in flight while saving. SpmdkitError (one line) when the directory is unusable."""
    if keep is not None and keep < 1:
        raise SpmdkitError(f"--keep {keep} must be at least 1")
    if every < 0:
        raise SpmdkitError(f"--checkpoint-every {every} must be >= 0 (0 saves only at the end)")
    quiet_orbax_errors()
    extra = {"create": not read_only, "read_only": read_only}
    if per_process:  # a directory this process writes alone (Orbax refuses to create its root)
        alone = ocp.options.MultiprocessingOptions(
            primary_host=None,
            active_processes={jax.process_index()},
            barrier_sync_key_prefix=f"spmdkit-local-{jax.process_index()}",
        )
        extra = {"multiprocessing_options": alone, "enable_per_process_directory_creation": True, "create": False}
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.FixedIntervalPolicy(every) if every else policies.SpecificStepsPolicy(()),
        save_interval_steps=0 if read_only else 1,  # what Orbax sets for a reader, with a warning
        preservation_policy=policies.LatestN(keep) if keep else None,
        enable_async_checkpointing=asynchronous,
        # Directories made in the calling thread: made in the background, a failure (a read-only directory)
        # left the save waiting for their signal until the async timeout (20 minutes), deaf to SIGTERM.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        cleanup_tmp_directories=not read_only,
        **extra,
    )
    for attempt in range(3):
        try:
            if per_process:
                directory.mkdir(parents=True, exist_ok=True)
            handlers = _handlers(extra.get("multiprocessing_options"), concurrent_gb)
            return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
        except OSError as error:
            # A reader lists the steps reading each one's metadata: a run rotating a step away under it fails the
            # listing, and the next listing no longer sees that step.
            if read_only and isinstance(error, FileNotFoundError) and directory.is_dir() and attempt < 2:
                continue
            raise SpmdkitError(
                f"cannot use checkpoint directory {directory} ({error.strerror or error}): pass a writable directory"
            ) from None
    raise AssertionError("unreachable")
