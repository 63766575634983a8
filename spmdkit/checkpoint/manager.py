"""Checkpoints: a thin layer over Orbax's `CheckpointManager` (async, sharded, one directory per step).

A step directory holds three items:
- `state`: the train state (model parameters and optimizer state, the step count included) as a pure nested
  dict `{"model": ..., "optimizer": ...}`, saved sharded (OCDBT) with `StandardSave`;
- `data`: the grain iterator state, one JSON file per JAX process (`grain.checkpoint.CheckpointSave`);
- `config`: the run's resolved configuration as JSON (a plain dict: this module knows nothing of training).

Every step records a checksum per array and per data/config file (`integrity`) in its `_CHECKPOINT_METADATA`. A
state holding NaN or Inf is never saved, so a run going bad cannot rotate its last good step out. Restore builds
its target from the *current* shardings (a tree of `jax.ShapeDtypeStruct(..., sharding=...)`), so a checkpoint
saved on one mesh restores onto any other mesh or device count, and then checks what it read: the checksums and
finiteness. A damaged step (unreadable, incomplete, checksums wrong, NaN/Inf) is reported with one warning, set
aside as `<step>.damaged-<time>`, and the next newest step is tried; `ckpt verify` applies the same rules. A
checkpoint whose shapes differ from the model raises `SpmdkitError` naming the first differing array. A save
that fails in the background is raised by the next `poll()`, `save()` or `wait()` as one line.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from spmdkit.checkpoint.failures import describe_error, drop_orphaned_reads, os_reason, quiet_orbax_errors
from spmdkit.checkpoint.integrity import (
    array_problems,
    checksum_record,
    data_process_count,
    fingerprints,
    item_problem,
    name_list,
    path_text,
)
from spmdkit.checkpoint.tree import abstract_target, first_mismatch, from_saved_tree, read_arrays, to_saved_tree
from spmdkit.errors import SpmdkitError, SpmdkitWarning

__all__ = ["Checkpointer", "CheckpointWarning", "DamagedStep", "NonFiniteState", "abstract_target", "to_saved_tree"]


class CheckpointWarning(SpmdkitWarning):
    """A damaged checkpoint step was skipped."""


class DamagedStep(SpmdkitError):
    """A step that cannot be restored as saved: unreadable, incomplete, wrong checksums, or NaN/Inf."""

    def __init__(self, step: int, directory: Path, problem: str):
        self.step, self.problem = step, problem
        super().__init__(
            f"checkpoint step {step} in {directory} is damaged ({problem}): see 'spmdkit ckpt verify {directory}'"
        )


class _Damage(Exception):
    """What is wrong with a step (internal: `restore` raises it as DamagedStep, `verify` reports it)."""


class NonFiniteState(SpmdkitError):
    """A state holding NaN or Inf values, refused by `save`."""


def item_handlers() -> dict[str, ocp.CheckpointHandler]:
    """Handlers for every item, so a fresh manager (new process) can read metadata and restore."""
    return {
        "state": ocp.StandardCheckpointHandler(),
        "data": grain.checkpoint.CheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }


class Checkpointer:
    """Save and restore train states under one directory; `every` steps (0: only forced saves), keep `keep`."""

    def __init__(self, directory: str | Path, *, every: int = 100, keep: int = 3, read_only: bool = False):
        if keep < 1:
            raise SpmdkitError(f"--keep {keep} must be at least 1")
        if every < 0:
            raise SpmdkitError(f"--checkpoint-every {every} must be >= 0 (0 saves only at the end)")
        self.directory = Path(directory).expanduser().absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise SpmdkitError(f"checkpoint directory {self.directory} is a file: pass a directory")
        if read_only and not self.directory.is_dir():
            raise SpmdkitError(f"checkpoint directory {self.directory} does not exist: check the path")
        if read_only and (self.directory / "checkpoints").is_dir():  # a run directory: read its checkpoints
            self.directory = self.directory / "checkpoints"
        self.every, self.keep = every, keep
        quiet_orbax_errors()
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.FixedIntervalPolicy(every) if every else policies.SpecificStepsPolicy(()),
            save_interval_steps=0 if read_only else 1,  # what Orbax sets for a reader, with a warning
            preservation_policy=policies.LatestN(keep),
            enable_async_checkpointing=True,
            # Directories made in the calling thread: made in the background, a failure (a read-only directory)
            # left the save waiting for their signal until the async timeout (20 minutes), deaf to SIGTERM.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=item_handlers())
        except OSError as error:
            raise SpmdkitError(
                f"cannot use checkpoint directory {self.directory} ({error.strerror or error}): pass a writable "
                "directory"
            ) from None
        self.last_saved: int | None = None
        self._pending: int | None = None  # the step whose asynchronous save may still be running

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
        """Start an async save of `step` (when due, or `force`); returns whether a save started. NonFiniteState if
        the state holds NaN/Inf (nothing written); SpmdkitError if this or the previous save failed."""
        if step == self.last_saved or not self.due(step, force):
            return False
        if self._pending is not None:
            self.wait()  # Orbax waits for the previous save anyway; a failure of it is reported as its own
        tree = to_saved_tree(state)
        found = self._fingerprints(tree)
        if self._any_non_finite(found):
            bad = [f"{path} ({count})" for path, (_, count) in found.items() if count]
            raise NonFiniteState(
                f"step {step} not saved: NaN/Inf values in {name_list(bad, 3) or 'another process'}; the "
                f"checkpoints in {self.directory} are left as they are (newest: {self.newest()})"
            )
        if step in self.manager.all_steps():  # asked after the check above, a collective in a process tier
            return False
        return self._write(step, tree, data, config, force, self._record(tree, found, data, config))

    @staticmethod
    def _any_non_finite(found: dict[str, tuple[str, int]]) -> bool:
        return any(count for _, count in found.values())

    @staticmethod
    def _record(tree: Any, found: dict[str, tuple[str, int]], data: Any, config: Any) -> dict[str, Any]:
        return checksum_record(found, data, config)

    def _write(self, step: int, tree: Any, data: Any, config: Any, force: bool, record: dict[str, Any]) -> bool:
        """Start the save of the items (`record`: the step's checksums); the one line of a failed write."""
        items: dict[str, Any] = {"state": self._state_save(tree)}
        if data is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data)
        if config is not None:
            items["config"] = ocp.args.JsonSave(config)
        try:
            custom = {"checksums": record}
            saved = self.manager.save(step, args=ocp.args.Composite(**items), force=force, custom_metadata=custom)
        except Exception as error:  # noqa: BLE001 - a failed write, reported as one line
            raise self._write_error(step, error) from None
        if saved:
            self.last_saved = self._pending = step
        return saved

    def due(self, step: int, force: bool = False) -> bool:
        return force or self.manager.should_save(step)

    def poll(self) -> None:
        """Raise (as one line) the failure of an asynchronous save that has finished; never blocks."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until the asynchronous save is done; SpmdkitError if it failed."""
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - a failed background write, reported as one line
            raise self._write_error(step, error) from None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()

    def newest(self) -> str:
        """'step N' of the newest complete step on disk, or 'none'."""
        try:
            steps = self.steps()
        except Exception:  # noqa: BLE001 - only for messages: a broken disk must not hide the first error
            return "unknown"
        return f"step {steps[-1]}" if steps else "none"

    def _write_error(self, step: int | None, error: BaseException) -> SpmdkitError:
        drop_orphaned_reads()
        reason = os_reason(error) or describe_error(error)
        return SpmdkitError(
            f"checkpoint step {step} could not be written to {self.directory} ({reason}); the newest complete "
            f"checkpoint is {self.newest()}: free space or fix the directory (or pass another --checkpoint-dir), "
            "then run again to resume"
        )

    # -- reading ------------------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def read_config(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def has_item(self, step: int, item: str) -> bool:
        return (self.directory / str(step) / item).is_dir()

    def saved_shapes(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """'model/embedding' -> (shape, dtype) of every saved array, from metadata only."""
        metadata = self.manager.item_metadata(step)["state"]
        if metadata is None:
            raise ValueError(f"step {step} has no state metadata")
        flat = jax.tree_util.tree_leaves_with_path(metadata)
        return {path_text(path): (tuple(m.shape), str(m.dtype)) for path, m in flat}

    def read_state(self, step: int, device: jax.Device | None = None) -> dict[str, Any]:
        """The saved `{"model", "optimizer"}` arrays of `step`, whole on one device (default: the first)."""
        sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        metadata = self.manager.item_metadata(step)["state"]
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), metadata)
        return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]

    def check_compatible(self, step: int, target: dict[str, Any]) -> None:
        """SpmdkitError naming the first array whose shape differs between the checkpoint and `target`."""
        try:
            saved = self.saved_shapes(step)
        except Exception as error:  # noqa: BLE001 - unreadable metadata is damage
            raise _Damage(f"unreadable array metadata: {describe_error(error)}") from None
        mismatch = first_mismatch(saved, target)
        if mismatch:
            raise SpmdkitError(
                f"checkpoint step {step} in {self.directory} does not match this model: {mismatch}: use the model "
                f"settings it was saved with (see 'spmdkit ckpt inspect {self.directory}'), or a fresh --checkpoint-dir"
            )

    def _step_record(self, step: int) -> tuple[set[str], dict[str, Any] | None]:
        """(the items the step lists, its checksum record or None) from its `_CHECKPOINT_METADATA`."""
        metadata = self.manager.metadata(step)
        listed = set((metadata.item_handlers or {}) if isinstance(metadata.item_handlers, dict) else ())
        return listed, (metadata.custom_metadata or {}).get("checksums")

    def _check_items(self, step: int) -> dict[str, Any] | None:
        """The step's checksum record; _Damage if its metadata is unreadable or an item is incomplete."""
        try:
            listed, checksums = self._step_record(step)
        except Exception as error:  # noqa: BLE001 - unreadable step metadata is damage
            raise _Damage(f"unreadable metadata: {describe_error(error)}") from None
        problem = item_problem(self.directory / str(step), listed, checksums)
        if problem:
            raise _Damage(problem)
        return checksums

    def restore(
        self, step: int, state: nnx.State, shardings: Any, data: grain.DatasetIterator | None = None
    ) -> nnx.State:
        """The train state of `step`, placed on `shardings` (any mesh); restores `data`'s position in place (when
        the step holds one). DamagedStep (one line) if the step is damaged: see the module docstring."""
        target = abstract_target(state, shardings)
        try:
            self.check_compatible(step, target)
            checksums = self._check_items(step)
            items: dict[str, Any] = {"state": self._state_restore(target)}
            if data is not None and self.has_item(step, "data"):
                self._check_process_count(step)
                items["data"] = grain.checkpoint.CheckpointRestore(data)
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(**items))
            except Exception as error:  # noqa: BLE001 - any failure to read a step means it is damaged
                drop_orphaned_reads()
                raise _Damage(describe_error(error)) from None
            if jax.tree.structure(restored["state"]) != jax.tree.structure(target):
                raise _Damage("it holds a tree of a different structure")
            problems = array_problems(checksums, self._fingerprints(restored["state"]))
            if problems:
                raise _Damage("; ".join(problems))
        except _Damage as damage:
            raise DamagedStep(step, self.directory, str(damage)) from None
        return from_saved_tree(restored["state"], state)

    # How the state item is written and read, and its checksums (a process tier overrides the three).
    _state_save, _state_restore = staticmethod(ocp.args.StandardSave), staticmethod(ocp.args.StandardRestore)
    _fingerprints = staticmethod(fingerprints)

    def check_read(self, step: int, found: dict[str, tuple[str, int]]) -> None:
        """DamagedStep unless the arrays another reader took from the step (`found`: 'model/...' -> (checksum,
        NaN/Inf count), as `integrity.fingerprints` gives them) are as saved: the step's items complete, every
        checksum matching, every value finite."""
        try:
            problems = array_problems(self._check_items(step), found)
        except _Damage as damage:
            problems = [str(damage)]
        if problems:
            raise DamagedStep(step, self.directory, "; ".join(problems))

    def _check_process_count(self, step: int) -> None:
        """SpmdkitError (not damage) when the step's data positions were saved by another number of processes."""
        saved = data_process_count(self.directory / str(step) / "data")
        if saved is not None and saved != jax.process_count():
            raise SpmdkitError(
                f"checkpoint step {step} in {self.directory} holds the data positions of {saved} process(es), this "
                f"run has {jax.process_count()}: resume it with {saved} process(es) (spmdkit launch --processes "
                f"{saved}, or as many SLURM tasks); the mesh and the devices per process may change"
            )

    def restore_latest(
        self,
        state: nnx.State,
        shardings: Any,
        data: grain.DatasetIterator | None = None,
        accept: Callable[[int, dict[str, Any] | None], None] | None = None,
    ) -> tuple[int, nnx.State] | None:
        """(step, state) of the newest intact step, or None when there is no checkpoint at all. `accept(step,
        saved_config)` runs before a step is read (its config item, or None) and raises SpmdkitError to refuse it.
        Damaged steps are warned about once each, renamed `<step>.damaged-<time>` (so that training can save that
        step again) and skipped; SpmdkitError if every step is damaged."""
        steps = self.steps()
        damaged = []
        for step in reversed(steps):
            try:
                if accept is not None:
                    try:
                        config = self._saved_config(step)
                    except _Damage as damage:
                        raise DamagedStep(step, self.directory, str(damage)) from None
                    accept(step, config)
                restored = self.restore(step, state, shardings, data)
            except DamagedStep as error:
                warnings.warn(f"{error}; falling back to the previous step", CheckpointWarning, stacklevel=2)
                damaged.append(step)
            else:
                self._set_aside(damaged)
                return step, restored
        if damaged:
            raise SpmdkitError(
                f"every checkpoint step in {self.directory} is damaged ({', '.join(map(str, damaged))}): "
                "see 'spmdkit ckpt verify', then delete the damaged steps or use a fresh --checkpoint-dir"
            )
        return None

    def _saved_config(self, step: int) -> dict[str, Any] | None:
        self._check_items(step)  # the config is believed only once every item matches its checksum
        if not self.has_item(step, "config"):
            return None
        try:
            return self.read_config(step)
        except Exception as error:  # noqa: BLE001 - an unreadable config item is damage
            raise _Damage(f"config/ is unreadable ({describe_error(error)})") from None

    def verify(self, step: int) -> list[str]:
        """What is wrong with `step` (empty: intact), by the rules `restore` applies; reads every array in full
        onto the host CPU and names each damaged one."""
        try:
            checksums = self._check_items(step)
            self._saved_config(step)
        except _Damage as damage:
            return [str(damage)]
        device = jax.devices("cpu")[0]
        try:
            state = self.read_state(step, device)
        except Exception as error:  # noqa: BLE001 - find which arrays fail to read
            drop_orphaned_reads()
            try:
                unreadable = read_arrays(self.manager.item_metadata(step)["state"], self.directory / str(step), device)
            except Exception:  # noqa: BLE001 - not even one by one: the first error says why
                return [describe_error(error)]
            names = [path for path, problem in unreadable.items() if problem]
            return [f"unreadable: {name_list(names)}" if names else describe_error(error)]
        return array_problems(checksums, fingerprints(state))

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
                multihost_utils.sync_global_devices("spmdkit_set_aside_damaged")
            self.manager.reload()
