"""The local tier of a job spanning several hosts: every process keeps its own steps, in `<local-dir>/process-<i>/`.

A node-local directory holds only what its own host wrote, so each process saves, alone, the shards of the state it
can address, its data iterator's position and the config, through an Orbax `CheckpointManager` of its own: the
mechanism of Orbax's emergency `_LocalCheckpointManager` (`MultiprocessingOptions(primary_host=None,
active_processes={this process})` and an `ArrayHandler(primary_host=None, replica_id=None)`, so every process writes
its shards, its metadata and its commit, atomically, with no barrier across processes). Emulated hosts sharing one
machine's disk and real nodes both work: the directories differ by process index.

A step checks as the shared tier's do (`integrity`), restricted to this process: its checksums are of the elements
its shards hold, its digests of its own iterator file and the config; it records the process layout (which blocks
of which array this process held, out of how many processes), which a restore must match: the shards are read back
by the process that wrote them, onto the same mesh. A state holding NaN/Inf anywhere is saved by no process (the
processes tell each other their counts). Restore is collective: the processes gather the steps each holds and try
the newest that all hold, agreeing after each check whether every process read its part intact.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint import checkpoint_managers as policies

from spmdkit.checkpoint.failures import describe_error, quiet_orbax_errors
from spmdkit.checkpoint.integrity import FORMAT, block_sums, fingerprint_text, path_text
from spmdkit.checkpoint.item_checks import digest, items_problem
from spmdkit.checkpoint.manager import Checkpointer, CheckpointWarning, DamagedStep, _Damage
from spmdkit.checkpoint.tree import abstract_target
from spmdkit.errors import SpmdkitError

__all__ = ["PREFIX", "LayoutMismatch", "ProcessCheckpointer", "process_directory"]

PREFIX = "process-"  # `<local-dir>/process-<i>/`: process i's steps
_OK, _DAMAGED, _OTHER_LAYOUT = 0, 1, 2  # what a process found of a step, gathered


class LayoutMismatch(SpmdkitError):
    """The newest step every process holds was saved by another process layout or mesh (not damage)."""


class _SizeNotice(logging.Filter):
    """Drops Orbax's notice, at every save with `primary_host=None`, that it does not log the global size."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Global object size logging disabled")


def process_directory(local_dir: Path) -> Path:
    """This process's directory of the local tier."""
    return Path(local_dir) / f"{PREFIX}{jax.process_index()}"


def _gather(values: list[int]) -> list[list[int]]:
    """Every process's list of non-negative integers (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return [list(values)]
    from jax.experimental import multihost_utils

    width = int(np.max(multihost_utils.process_allgather(np.int32(len(values))))) or 1
    padded = np.full(width, -1, np.int32)
    padded[: len(values)] = values
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), width)
    return [[int(v) for v in row if v >= 0] for row in rows]


def _handlers(options: ocp.options.MultiprocessingOptions) -> dict[str, ocp.CheckpointHandler]:
    """The items' handlers, each writing this process's part only (arrays: every shard it holds, copies too)."""
    arrays = ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    return {
        "state": ocp.PyTreeCheckpointHandler(
            use_ocdbt=True, use_zarr3=True, multiprocessing_options=options, type_handler_registry=registry
        ),
        "data": grain.checkpoint.CheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(multiprocessing_options=options),
    }


def _blocks(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """The distinct blocks ((start, stop) per dimension) of an array `shape` this process's devices hold."""
    found = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        found.add(tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True)))
    return sorted(found)


def layout(tree: Any) -> str:
    """Digest of which blocks of which array this process holds, out of how many processes: a step is read back
    only by a process of the same layout (arrays or ShapeDtypeStructs with shardings)."""
    blocks = {path_text(p): _blocks(x.sharding, tuple(x.shape)) for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    return digest({"process": [jax.process_index(), jax.process_count()], "blocks": blocks})


def process_fingerprints(tree: Any) -> dict[str, tuple[str, int]]:
    """'model/embedding' -> (checksum, NaN/Inf count) of the elements this process's shards hold (each once):
    `integrity`'s checksum restricted to them. Local: no other process is asked."""
    found = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        total, seen = np.zeros(3, np.uint64), set()
        for shard in x.addressable_shards:
            block = tuple(s.indices(n)[:2] for s, n in zip(shard.index, x.shape, strict=True))
            if block not in seen:
                seen.add(block)
                offsets = tuple(start for start, _ in block)
                total += np.array(block_sums(np.asarray(shard.data), offsets, tuple(x.shape)), np.uint64)
        first, second, bad = (int(v) % 2**32 for v in total)
        found[path_text(path)] = (fingerprint_text(first, second), bad)
    return found


class ProcessCheckpointer(Checkpointer):
    """This process's steps of the local tier (see the module docstring): a `Checkpointer` whose manager and checks
    are this process's alone; `save`, `steps`, `agreed_steps` and `restore_latest` are collectives."""

    def __init__(self, directory: str | Path, *, every: int, keep: int):
        """`Checkpointer`'s, with this process's own Orbax manager of `directory` (made here: Orbax does not)."""
        self.directory = Path(directory).expanduser().absolute()
        self.every, self.keep = every, keep
        quiet_orbax_errors()
        if not any(isinstance(f, _SizeNotice) for f in logging.getLogger("absl").filters):
            logging.getLogger("absl").addFilter(_SizeNotice())
        alone = ocp.options.MultiprocessingOptions(
            primary_host=None,
            active_processes={jax.process_index()},
            barrier_sync_key_prefix=f"spmdkit-local-{jax.process_index()}",
        )
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.FixedIntervalPolicy(every) if every else policies.SpecificStepsPolicy(()),
            preservation_policy=policies.LatestN(keep),
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            cleanup_tmp_directories=True,
            multiprocessing_options=alone,
            enable_per_process_directory_creation=True,
            create=False,  # Orbax refuses to create a root with `active_processes` set
        )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers(alone))
        except OSError as error:
            raise SpmdkitError(
                f"cannot use checkpoint directory {self.directory} ({error.strerror or error}): pass a writable "
                "directory"
            ) from None
        self.last_saved: int | None = None
        self._pending: int | None = None

    @staticmethod
    def _any_non_finite(found: dict[str, tuple[str, int]]) -> bool:
        """Whether any process holds NaN/Inf (a collective: every process refuses alike)."""
        return any(row[0] for row in _gather([sum(count for _, count in found.values())]))

    @staticmethod
    def _record(tree: Any, found: dict[str, tuple[str, int]], data: Any, config: Any) -> dict[str, Any]:
        """This process's checksums, the digests of its items and its layout."""
        arrays = {path: checksum for path, (checksum, _) in found.items()}
        return {"format": FORMAT, "arrays": arrays, "layout": layout(tree), "items": _digests(data, config)}

    # -- reading ------------------------------------------------------------------------------------------------

    def own_steps(self) -> list[int]:
        """This process's steps (no other process asked)."""
        return Checkpointer.steps(self)

    def held(self) -> list[list[int]]:
        """Every process's steps (a collective)."""
        return _gather(self.own_steps())

    def steps(self) -> list[int]:
        """The steps any process holds (a collective)."""
        return sorted({step for steps in self.held() for step in steps})

    def agreed_steps(self) -> list[int]:
        """The steps every process holds (a collective): the ones a restore may read."""
        held = self.held()
        return sorted(set(held[0]).intersection(*held[1:]))

    def newest(self) -> str:
        """'step N' of this process's newest step (messages: no other process is asked)."""
        try:
            steps = self.own_steps()
        except Exception:  # noqa: BLE001 - only for messages
            return "unknown"
        return f"step {steps[-1]}" if steps else "none"

    def _check_items(self, step: int) -> dict[str, Any] | None:
        """The step's checksum record; _Damage if its metadata is unreadable or an item of this process's is
        incomplete or does not match its digest."""
        try:
            listed, checksums = self._step_record(step)
        except Exception as error:  # noqa: BLE001 - unreadable step metadata is damage
            raise _Damage(f"unreadable metadata: {describe_error(error)}") from None
        step_dir = self.directory / str(step)
        for item in sorted(listed | {"state"}):
            if not (step_dir / item).is_dir():
                raise _Damage(f"{item}/ is missing")
        problem = items_problem(step_dir, (checksums or {}).get("items"))
        if problem:
            raise _Damage(problem)
        return checksums

    def _check_process_count(self, step: int) -> None:
        """Nothing: the step's layout, checked before, names the process count."""

    # `Checkpointer.restore` reads this process's part of the step, onto the layout it was saved from.
    _fingerprints, _state_save = staticmethod(process_fingerprints), staticmethod(ocp.args.PyTreeSave)

    @staticmethod
    def _state_restore(target: Any) -> ocp.args.PyTreeRestore:
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        return ocp.args.PyTreeRestore(item=target, restore_args=restore_args)

    def _verdict(self, step: int, wanted: str) -> tuple[int, dict[str, Any] | None]:
        """(what this process finds of `step` without reading its arrays, the step's config); warns of damage."""
        try:
            record = self._check_items(step) or {}
            if record.get("layout") != wanted:
                return _OTHER_LAYOUT, None
            return _OK, self._saved_config(step)
        except _Damage as damage:
            warnings.warn(f"{DamagedStep(step, self.directory, str(damage))}", CheckpointWarning, stacklevel=3)
            return _DAMAGED, None

    def restore_latest(
        self,
        state: nnx.State,
        shardings: Any,
        data: grain.DatasetIterator | None = None,
        accept: Callable[[int, dict[str, Any] | None], None] | None = None,
    ) -> tuple[int, nnx.State] | None:
        """`Checkpointer.restore_latest` over the steps every process holds, the processes agreeing on each (a
        collective): a step damaged on any process is set aside by all; LayoutMismatch when the newest is of
        another process layout or mesh."""
        wanted, damaged = layout(abstract_target(state, shardings)), []
        for step in reversed(self.agreed_steps()):
            found, config = self._verdict(step, wanted)
            verdicts = [row[0] for row in _gather([found])]
            if _OTHER_LAYOUT in verdicts:
                raise LayoutMismatch(f"step {step}, the newest all hold, was saved on another mesh or process layout")
            if _OK == max(verdicts) and accept is not None:
                accept(step, config)  # the same on every process: the same config and step
            restored = None
            if _OK == max(verdicts):
                try:
                    restored = self.restore(step, state, shardings, data)
                except DamagedStep as error:
                    warnings.warn(f"{error}; falling back to the previous step", CheckpointWarning, stacklevel=2)
            everywhere = all(row[0] for row in _gather([int(restored is not None)]))
            if everywhere and restored is not None:
                self._set_aside(damaged)
                return step, restored
            damaged.append(step)
        if damaged:
            raise SpmdkitError(
                f"every checkpoint step in {self.directory} is damaged ({', '.join(map(str, damaged))}) on some "
                "process: see the warnings, then delete the damaged steps or use a fresh --checkpoint.local-dir"
            )
        return None

    def _set_aside(self, steps: list[int], why: str = "damaged") -> None:
        """Rename this process's copies of `steps` out of Orbax's view (no other process waited for)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for step in steps:
            path = self.directory / str(step)
            if path.exists():
                path.rename(self.directory / f"{step}.{why}-{stamp}")
        if steps:
            self.manager.reload()

    def set_aside_above(self, step: int) -> list[int]:
        """Set aside this process's steps above `step`, where the run resumes: another timeline's, which the
        steps saved from here must not meet; returns them."""
        newer = [s for s in self.own_steps() if s > step]
        self._set_aside(newer, "unmatched")
        return newer


def _digests(data: grain.DatasetIterator | None, config: dict[str, Any] | None) -> dict[str, str]:
    """`item_checks.item_digests` of this process's part: its own iterator file and the config."""
    digests = {}
    if data is not None:
        digests[f"data/process_{jax.process_index()}-of-{jax.process_count()}.json"] = digest(data.get_state())
    if config is not None:
        digests["config"] = digest(config)
    return digests
