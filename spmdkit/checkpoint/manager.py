"""Checkpoints: one store over Orbax's `CheckpointManager` (async, sharded, one directory per step).

A step directory holds three items:
- `state`: the train state (model parameters and optimizer state, the step count included) as a pure nested
  dict `{"model": ..., "optimizer": ...}`, saved sharded (OCDBT);
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

Composed in, not subclassed: who writes the directory (`layout`: all processes together, or each its own
`process-<i>/`), and a fast local tier (`tiers.LocalTier`: a store of the local directory) for the steps between.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx

from spmdkit.checkpoint.backend import open_manager, store_directory
from spmdkit.checkpoint.damage import CheckpointWarning, Damage, DamagedStep, LayoutMismatch, NonFiniteState
from spmdkit.checkpoint.failures import describe_error, drop_orphaned_reads, os_reason
from spmdkit.checkpoint.integrity import array_problems, fingerprints, name_list, path_text
from spmdkit.checkpoint.layout import SHARED, Layout
from spmdkit.checkpoint.tree import abstract_target, first_mismatch, from_saved_tree, to_saved_tree, unreadable_arrays
from spmdkit.distributed.initialize import lost_peer
from spmdkit.errors import SpmdkitError

if TYPE_CHECKING:
    from spmdkit.checkpoint.tiers import LocalTier


Accept = Callable[[int, dict[str, Any] | None], None]  # refuses a step (SpmdkitError) given its saved config
Data = grain.DatasetIterator | None
_OK, _DAMAGED, _OTHER_LAYOUT = 0, 1, 2  # what a process found of a step (agreed over the processes)


class Checkpointer:
    """Save and restore train states under one directory: `every` steps (0: only forced saves), keep `keep`.
    `layout` says who writes the directory (`layout.SHARED` or `PER_PROCESS`); `local`, set by
    `tiers.open_checkpointer`, a fast tier the steps between persistent ones go to. With a per-process layout or a
    local tier of one, `save`, `steps`, `agreed_steps` and `restore_latest` are collectives."""

    def __init__(
        self,
        directory: str | Path,
        *,
        every: int = 100,
        keep: int = 3,
        read_only: bool = False,
        layout: Layout = SHARED,
    ):
        self.directory = store_directory(directory, read_only)
        self.every, self.keep, self.layout = every, keep, layout
        self.manager = open_manager(
            self.directory, every=every, keep=keep, read_only=read_only, per_process=layout.per_process
        )
        self.local: LocalTier | None = None
        self.run: dict[str, str] | None = None  # the run recorded in each step saved (`tiers.claim_steps` sets it)
        self.restored_from: Path | None = None  # with a local tier: the directory of the step restored
        self._saved: int | None = None
        self._pending: int | None = None  # the step whose asynchronous save may still be running

    def stores(self) -> list[Checkpointer]:
        """This store and its local tier's, persistent first."""
        return [self] if self.local is None else [self, self.local.store]

    @property
    def last_saved(self) -> int | None:
        saved = [store._saved for store in self.stores() if store._saved is not None]
        return max(saved) if saved else None

    @last_saved.setter
    def last_saved(self, step: int | None) -> None:  # a resumed step is saved by no tier again
        for store in self.stores():
            store._saved = step

    # -- saving -------------------------------------------------------------------------------------------------

    def _due_store(self, step: int, force: bool) -> Checkpointer | None:
        """The store `step` is saved to: this one when due (or forced), else the local tier's when due there."""
        if force or self.manager.should_save(step):
            return self
        return self.local.store if self.local is not None and self.local.store.due(step) else None

    def due(self, step: int, force: bool = False) -> bool:
        """Whether `save(step, force=force)` would save (on either tier)."""
        return self._due_store(step, force) is not None

    def save(
        self,
        step: int,
        state: nnx.State,
        data: Data = None,
        config: dict[str, Any] | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Start an async save of `step` (when due, or `force`) on the tier it is due on; returns whether a save
        started. One save in flight at a time; a local tier's save is complete when this returns. NonFiniteState if
        the state holds NaN/Inf (nothing written); SpmdkitError if this or the previous save failed."""
        store = self._due_store(step, force)
        if store is None or step == self.last_saved:
            return False
        self.wait()  # Orbax waits for the previous save anyway; a failure of it is reported as its own
        tree = to_saved_tree(state)
        found = store.layout.fingerprints(tree)
        if store.layout.any_non_finite(found):
            bad = [f"{path} ({count})" for path, (_, count) in found.items() if count]
            raise NonFiniteState(
                f"step {step} not saved: NaN/Inf values in {name_list(bad, 3) or 'another process'}; the "
                f"checkpoints in {store.directory} are left as they are (newest: {store.newest()})"
            )
        if step in store.manager.all_steps():  # asked after the check above, a collective per process
            return False
        items: dict[str, Any] = {"state": store.layout.state_save(tree)}
        if data is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data)
        if config is not None:
            items["config"] = ocp.args.JsonSave(config)
        custom: dict[str, Any] = {"checksums": store.layout.record(tree, found, data, config)}
        if store.run is not None:
            custom["run"] = store.run
        try:
            saved = store.manager.save(step, args=ocp.args.Composite(**items), force=force, custom_metadata=custom)
        except Exception as error:  # noqa: BLE001 - a failed write, reported as one line
            raise store._write_error(step, error) from None
        if saved:
            store._saved = store._pending = step
            if store is not self:
                store.wait()
        return saved

    def poll(self) -> None:
        """Raise (as one line) the failure of an asynchronous save that has finished; never blocks."""
        for store in self.stores():
            if store._pending is not None and not store.manager.is_saving_in_progress():
                store.wait()

    def wait(self) -> None:
        """Block until the asynchronous saves are done; SpmdkitError if one failed."""
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - a failed background write, reported as one line
            raise self._write_error(step, error) from None
        finally:
            if self.local is not None:
                self.local.store.wait()

    def close(self) -> None:
        """Wait for the saves, then close the managers (each, whatever failed before)."""
        with contextlib.ExitStack() as closing:
            if self.local is not None:
                closing.callback(self.local.store.close)
            closing.callback(self.manager.close)
            self.wait()

    def newest(self) -> str:
        """'step N' of the newest complete step (a local tier's named with its directory), 'none', or 'unknown' for
        a directory that cannot be listed; for messages: no other process is asked."""
        newest, unknown = None, False
        for store in self.stores():
            try:
                steps = store.own_steps()
            except Exception:  # noqa: BLE001 - only for messages: a broken disk must not hide the first error
                unknown = True
                continue
            if steps and (newest is None or steps[-1] > newest[0]):
                newest = (steps[-1], store)
        if newest is None:
            return "unknown" if unknown else "none"
        return f"step {newest[0]}" + ("" if newest[1] is self else f" (in {newest[1].directory})")

    def _write_error(self, step: int | None, error: BaseException) -> BaseException:
        """One line for a failed save; a collective that failed because another process died stays itself (the
        CLI reports it as a lost peer, exit 1: a job to restart, not a usage error)."""
        drop_orphaned_reads()
        if lost_peer(error) is not None:
            return error
        reason = os_reason(error) or describe_error(error)
        return SpmdkitError(
            f"checkpoint step {step} could not be written to {self.directory} ({reason}); the newest complete "
            f"checkpoint is {self.newest()}: free space or fix the directory (or pass another --checkpoint-dir), "
            "then run again to resume"
        )

    # -- listing ------------------------------------------------------------------------------------------------

    def own_steps(self) -> list[int]:
        """The steps of this directory (no other process asked)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def owners(self) -> dict[int, dict[str, str] | None]:
        """The run each step of this directory records (`{"id", "run_dir"}`; None: none recorded, or unreadable
        metadata, which a restore reports as damage); no other process asked."""
        owners = {}
        for step in self.own_steps():
            try:
                run = (self.manager.metadata(step).custom_metadata or {}).get("run")
            except Exception:  # noqa: BLE001 - damage is the restore's and verify's to report
                run = None
            owners[step] = run if isinstance(run, dict) and isinstance(run.get("id"), str) else None
        return owners

    def held(self) -> list[list[int]]:
        """Every process's steps of this directory (a collective with a per-process layout)."""
        return self.layout.gather(self.own_steps())

    def agreed_steps(self) -> list[int]:
        """The steps of this directory every process holds: the ones a restore may read."""
        held = self.held()
        return sorted(set(held[0]).intersection(*held[1:]))

    def steps(self) -> list[int]:
        """The steps any process holds, of either tier."""
        return sorted({step for store in self.stores() for steps in store.held() for step in steps})

    # -- reading ------------------------------------------------------------------------------------------------

    def read_config(self, step: int) -> dict[str, Any]:
        """The config item of `step`."""
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

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

    def _check_items(self, step: int) -> dict[str, Any] | None:
        """The step's checksum record; Damage if its metadata is unreadable or an item is incomplete."""
        try:
            metadata = self.manager.metadata(step)
        except Exception as error:  # noqa: BLE001 - unreadable step metadata is damage
            raise Damage(f"unreadable metadata: {describe_error(error)}") from None
        listed = set((metadata.item_handlers or {}) if isinstance(metadata.item_handlers, dict) else ())
        checksums = (metadata.custom_metadata or {}).get("checksums")
        problem = self.layout.items_problem(self.directory / str(step), listed, checksums)
        if problem:
            raise Damage(problem)
        return checksums

    def restore(self, step: int, state: nnx.State, shardings: Any, data: Data = None) -> nnx.State:
        """The train state of `step`, placed on `shardings` (any mesh); restores `data`'s position in place (when
        the step holds one). DamagedStep (one line) if the step is damaged: see the module docstring."""
        target = abstract_target(state, shardings)
        try:
            try:
                saved = self.saved_shapes(step)
            except Exception as error:  # noqa: BLE001 - unreadable metadata is damage
                raise Damage(f"unreadable array metadata: {describe_error(error)}") from None
            if mismatch := first_mismatch(saved, target):
                raise SpmdkitError(
                    f"checkpoint step {step} in {self.directory} does not match this model: {mismatch}: use the "
                    f"model settings it was saved with (see 'spmdkit ckpt inspect {self.directory}'), or a fresh "
                    "--checkpoint-dir"
                )
            checksums = self._check_items(step)
            items: dict[str, Any] = {"state": self.layout.state_restore(target)}
            if data is not None and (self.directory / str(step) / "data").is_dir():
                self.layout.check_data(self.directory, step)
                items["data"] = grain.checkpoint.CheckpointRestore(data)
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(**items))
            except Exception as error:  # noqa: BLE001 - any failure to read a step means it is damaged
                drop_orphaned_reads()
                raise Damage(describe_error(error)) from None
            if jax.tree.structure(restored["state"]) != jax.tree.structure(target):
                raise Damage("it holds a tree of a different structure")
            problems = array_problems(checksums, self.layout.fingerprints(restored["state"]))
            if problems:
                raise Damage("; ".join(problems))
        except Damage as damage:
            raise DamagedStep(step, self.directory, str(damage)) from None
        return from_saved_tree(restored["state"], state)

    def check_read(self, step: int, found: dict[str, tuple[str, int]]) -> None:
        """DamagedStep unless the arrays another reader took from the step (`found`: 'model/...' -> (checksum,
        NaN/Inf count), as `integrity.fingerprints` gives them) are as saved: the step's items complete, every
        checksum matching, every value finite."""
        try:
            problems = array_problems(self._check_items(step), found)
        except Damage as damage:
            problems = [str(damage)]
        if problems:
            raise DamagedStep(step, self.directory, "; ".join(problems))

    def restore_latest(
        self, state: nnx.State, shardings: Any, data: Data = None, accept: Accept | None = None
    ) -> tuple[int, nnx.State] | None:
        """(step, state) of the newest intact step (of either tier), or None when there is no checkpoint at all.
        `accept(step, saved_config)` runs before a step is read (its config item, or None) and raises SpmdkitError
        to refuse it. Damaged steps are warned about once each, renamed `<step>.damaged-<time>` (so that training
        can save that step again) and skipped; SpmdkitError if every step is damaged. With a local tier, see
        `tiers.LocalTier.restore_latest`; `restored_from` names the directory of the step read."""
        if self.local is not None:
            return self.local.restore_latest(self, state, shardings, data, accept)
        return self.restore_newest(state, shardings, data, accept)

    def restore_newest(
        self, state: nnx.State, shardings: Any, data: Data, accept: Accept | None
    ) -> tuple[int, nnx.State] | None:
        """`restore_latest` of this directory alone, over the steps every process holds, the processes agreeing on
        each: a step damaged on any process is set aside by all; LayoutMismatch when the newest is of another
        process layout or mesh."""
        wanted, damaged = self.layout.wanted(abstract_target(state, shardings)), []
        for step in reversed(self.agreed_steps()):
            found, config = _OK, None  # what this process finds of the step without reading its arrays
            try:
                record = self._check_items(step) or {}
                if wanted is not None and record.get("layout") != wanted:
                    found = _OTHER_LAYOUT
                elif accept is not None:
                    config = self._saved_config(step)
            except Damage as damage:
                found, error = _DAMAGED, DamagedStep(step, self.directory, str(damage))
                warnings.warn(f"{error}; falling back to the previous step", CheckpointWarning, stacklevel=3)
            verdicts = self.layout.gather(found)
            if _OTHER_LAYOUT in verdicts:
                raise LayoutMismatch(f"step {step}, the newest all hold, was saved on another mesh or process layout")
            restored = None
            if max(verdicts) == _OK:
                if accept is not None:
                    accept(step, config)  # the same on every process: the same config and step
                try:
                    restored = self.restore(step, state, shardings, data)
                except DamagedStep as error:
                    warnings.warn(f"{error}; falling back to the previous step", CheckpointWarning, stacklevel=3)
            if all(self.layout.gather(int(restored is not None))) and restored is not None:
                self.set_aside(damaged)
                return step, restored
            damaged.append(step)
        if damaged:
            listed = ", ".join(map(str, damaged))
            raise SpmdkitError(f"every checkpoint step in {self.directory} is damaged ({listed}){self.layout.advice}")
        return None

    def _saved_config(self, step: int) -> dict[str, Any] | None:
        """The config item of `step` (None without one), read once `_check_items` found every item as saved."""
        if not (self.directory / str(step) / "config").is_dir():
            return None
        try:
            return self.read_config(step)
        except Exception as error:  # noqa: BLE001 - an unreadable config item is damage
            raise Damage(f"config/ is unreadable ({describe_error(error)})") from None

    def verify(self, step: int) -> list[str]:
        """What is wrong with `step` (empty: intact), by the rules `restore` applies; reads every array in full
        onto the host CPU and names each damaged one."""
        try:
            checksums = self._check_items(step)
            self._saved_config(step)
        except Damage as damage:
            return [str(damage)]
        device = jax.devices("cpu")[0]
        try:
            state = self.read_state(step, device)
        except Exception as error:  # noqa: BLE001 - find which arrays fail to read
            drop_orphaned_reads()
            try:
                names = unreadable_arrays(self.manager.item_metadata(step)["state"], self.directory / str(step), device)
            except Exception:  # noqa: BLE001 - not even one by one: the first error says why
                return [describe_error(error)]
            return [f"unreadable: {name_list(names)}" if names else describe_error(error)]
        return array_problems(checksums, fingerprints(state))

    def set_aside(self, steps: list[int], why: str = "damaged") -> None:
        """Rename `steps` out of Orbax's view as `<step>.<why>-<time>` (it would refuse to save those steps
        again), as the layout says: process 0 for all, or each process its own."""
        if steps:
            self.layout.set_aside(self.directory, steps, why)
            self.manager.reload()
