"""Checkpoints: a thin layer over Orbax's `CheckpointManager` (async, sharded, one directory per step).

A step directory holds three items:

- `state`: the train state (model parameters and optimizer state, the step count included) as a pure nested
  dict `{"model": ..., "optimizer": ...}`, saved sharded (OCDBT) with `StandardSave`;
- `data`: the grain iterator state, one JSON file per JAX process (`grain.checkpoint.CheckpointSave`);
- `config`: the run's resolved configuration as JSON (a plain dict: this module knows nothing of training).

Restore builds its target from the *current* shardings (a tree of `jax.ShapeDtypeStruct(..., sharding=...)`),
so a checkpoint saved on one mesh restores onto any other mesh or device count. A step that fails to read is
reported, set aside as `<step>.damaged-<time>`, and the next newest step is tried; a checkpoint whose shapes
differ from the model raises `SpmdkitError` naming the first differing array.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint import checkpoint_managers as policies

from spmdkit.errors import SpmdkitError

ITEMS = ("state", "data", "config")


class CheckpointWarning(UserWarning):
    """A damaged checkpoint step was skipped."""


def item_handlers() -> dict[str, ocp.CheckpointHandler]:
    """Handlers for every item, so a fresh manager (new process) can read metadata and restore."""
    return {
        "state": ocp.StandardCheckpointHandler(),
        "data": grain.checkpoint.CheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }


def _path_text(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def abstract_target(state: nnx.State, shardings: Any) -> dict[str, Any]:
    """The restore target: `{"model", "optimizer"}` trees of ShapeDtypeStructs carrying `shardings`."""
    leaves, treedef = jax.tree.flatten(state)
    sharding_leaves = jax.tree.leaves(shardings)
    if len(leaves) != len(sharding_leaves):
        raise ValueError(f"state has {len(leaves)} arrays but shardings has {len(sharding_leaves)}")
    abstract = treedef.unflatten(
        [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, sharding_leaves, strict=True)]
    )
    return to_saved_tree(abstract)


def to_saved_tree(state: nnx.State) -> dict[str, Any]:
    """nnx.State of (model, optimizer) -> the pure dict that is saved."""
    pure = nnx.to_pure_dict(state)
    return {"model": pure[0], "optimizer": pure[1]}


def from_saved_tree(saved: dict[str, Any], like: nnx.State) -> nnx.State:
    """Inverse of `to_saved_tree`, with the structure (Variable types, metadata) of `like`."""
    treedef = jax.tree.structure(like)
    leaves = jax.tree.leaves({0: saved["model"], 1: saved["optimizer"]})
    return treedef.unflatten(leaves)


def describe_error(error: BaseException) -> str:
    """'Type: first line' of the innermost cause (Orbax wraps TensorStore errors in generic ones)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def drop_orphaned_reads() -> None:
    """Silence the orphans of a failed Orbax restore. Its other array reads are abandoned mid-flight and, when
    finalised later (closed coroutines, callbacks onto the closed event loop), each reports an unraisable
    exception: dozens of tracebacks in the middle of the user's run. Installs (once) a `sys.unraisablehook`
    that drops exactly those and passes everything else on to the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "spmdkit_orphaned_reads", False):
        return

    def hook(unraisable: Any) -> None:
        error, source = unraisable.exc_value, unraisable.object
        orphan = getattr(source, "__name__", "") == "_read_array_index_and_device_put"
        if not (orphan or (isinstance(error, RuntimeError) and str(error) == "Event loop is closed")):
            previous(unraisable)

    hook.spmdkit_orphaned_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class Checkpointer:
    """Save and restore train states under one directory; `every` steps (0: only forced saves), keep `keep`."""

    def __init__(self, directory: str | Path, *, every: int = 100, keep: int = 3, read_only: bool = False):
        if keep < 1:
            raise SpmdkitError(f"--keep {keep} must be at least 1")
        if every < 0:
            raise SpmdkitError(f"--checkpoint-every {every} must be >= 0 (0 saves only at the end)")
        self.directory = Path(directory).expanduser().absolute()
        if read_only and not self.directory.is_dir():
            raise SpmdkitError(f"checkpoint directory {self.directory} does not exist: check the path")
        if read_only and (self.directory / "checkpoints").is_dir():  # a run directory: read its checkpoints
            self.directory = self.directory / "checkpoints"
        self.every, self.keep = every, keep
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.FixedIntervalPolicy(every) if every else policies.SpecificStepsPolicy(()),
            preservation_policy=policies.LatestN(keep),
            enable_async_checkpointing=True,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=item_handlers())
        self.last_saved: int | None = None

    # -- saving -------------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: nnx.State,
        data: grain.DatasetIterator | None = None,
        config: dict[str, Any] | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Start an async save of `step` (when due, or `force`); returns whether a save started."""
        if step == self.last_saved or step in self.manager.all_steps() or not self.due(step, force):
            return False
        items: dict[str, Any] = {"state": ocp.args.StandardSave(to_saved_tree(state))}
        if data is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data)
        if config is not None:
            items["config"] = ocp.args.JsonSave(config)
        saved = self.manager.save(step, args=ocp.args.Composite(**items), force=force)
        if saved:
            self.last_saved = step
        return saved

    def due(self, step: int, force: bool = False) -> bool:
        return force or self.manager.should_save(step)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    # -- reading ------------------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def read_config(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def saved_shapes(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """'model/embedding' -> (shape, dtype) of every saved array, from metadata only."""
        metadata = self.manager.item_metadata(step)["state"]
        if metadata is None:
            raise ValueError(f"step {step} has no state metadata")
        flat = jax.tree_util.tree_leaves_with_path(metadata)
        return {_path_text(path): (tuple(m.shape), str(m.dtype)) for path, m in flat}

    def read_state(self, step: int, device: jax.Device | None = None) -> dict[str, Any]:
        """The saved `{"model", "optimizer"}` arrays of `step`, whole on one device (default: the first)."""
        sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        metadata = self.manager.item_metadata(step)["state"]
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), metadata)
        return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]

    def check_compatible(self, step: int, target: dict[str, Any]) -> None:
        """SpmdkitError naming the first array whose shape differs between the checkpoint and `target`."""
        saved = self.saved_shapes(step)
        wanted = {_path_text(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(target)}
        for path, shape in wanted.items():
            found = saved.get(path, (None, None))[0]
            if found != shape:
                what = "is missing" if found is None else f"has shape {found}"
                raise SpmdkitError(
                    f"checkpoint step {step} in {self.directory} does not match this model: {path} {what} in the "
                    f"checkpoint but has shape {shape} here: use the model settings it was saved with (see "
                    f"'spmdkit ckpt inspect {self.directory}'), or a fresh --checkpoint-dir"
                )
        extra = sorted(set(saved) - set(wanted))
        if extra:
            raise SpmdkitError(
                f"checkpoint step {step} in {self.directory} does not match this model: it holds {extra[0]} "
                f"{saved[extra[0]][0]}, which this model lacks: use the model settings it was saved with, or a "
                f"fresh --checkpoint-dir"
            )

    def restore(
        self, step: int, state: nnx.State, shardings: Any, data: grain.DatasetIterator | None = None
    ) -> nnx.State:
        """The train state of `step`, placed on `shardings` (any mesh); restores `data`'s position in place."""
        target = abstract_target(state, shardings)
        self.check_compatible(step, target)
        items: dict[str, Any] = {"state": ocp.args.StandardRestore(target)}
        if data is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        if jax.tree.structure(restored["state"]) != jax.tree.structure(target):
            raise ValueError(f"step {step} restored a tree of a different structure")
        return from_saved_tree(restored["state"], state)

    def restore_latest(
        self, state: nnx.State, shardings: Any, data: grain.DatasetIterator | None = None
    ) -> tuple[int, nnx.State] | None:
        """(step, state) of the newest intact step, or None when there is no checkpoint at all.

        Damaged steps (unreadable, files missing) are warned about, renamed `<step>.damaged-<time>` so that
        training can save that step again, and skipped; if every step is damaged, SpmdkitError.
        """
        steps = self.steps()
        damaged = []
        for step in reversed(steps):
            try:
                restored = self.restore(step, state, shardings, data)
            except SpmdkitError:
                raise
            except Exception as error:  # noqa: BLE001 - any failure to read a step means it is damaged
                warnings.warn(
                    f"checkpoint step {step} in {self.directory} is damaged ({describe_error(error)}); "
                    "falling back to the previous step",
                    CheckpointWarning,
                    stacklevel=2,
                )
                damaged.append(step)
            else:
                self._set_aside(damaged)
                return step, restored
            drop_orphaned_reads()
        if damaged:
            raise SpmdkitError(
                f"every checkpoint step in {self.directory} is damaged ({', '.join(map(str, damaged))}): "
                "see 'spmdkit ckpt verify', then delete the damaged steps or use a fresh --checkpoint-dir"
            )
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Rename damaged steps out of Orbax's view (it would refuse to save those steps again)."""
        if steps and jax.process_index() == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for step in steps:
                path = self.directory / str(step)
                if path.exists():
                    path.rename(self.directory / f"{step}.damaged-{stamp}")
        if steps:
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("spmdkit_set_aside_damaged")
            self.manager.reload()
