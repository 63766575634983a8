"""Two checkpoint tiers: the persistent directory, and a fast node-local one (`--checkpoint.local-dir`) saved more
often, so that a killed node loses at most `local_every` steps instead of `every`.

`TieredCheckpointer` has the interface the Trainer uses of a `Checkpointer`, and is made of two of them: every step of
either tier is an ordinary checkpoint step (atomic, checksummed, its data position and config included), and restore
goes through `restore_latest`, with its checks. A step due on both tiers is saved once, to the persistent one (it
survives the node). A local save is waited for before training goes on: a kill right after it must find it complete
(a local disk is fast; the persistent tier stays asynchronous).

With every process of the job on one host, the local tier is one ordinary `Checkpointer` of the directory. A job
spanning several hosts cannot do that (Orbax has process 0 write a step's metadata and commit marker, which another
host's local disk would lack): each process keeps its own steps in `<local-dir>/process-<i>/`
(`process_tier.ProcessCheckpointer`), and a restore reads the newest step that every process holds intact, onto the
same mesh and processes. A step some processes lack (a replaced node), or one of another layout, falls back to the
newest step all hold or to the persistent tier; with neither, the run is refused in one line (the local steps would
be lost). Steps newer than where the run resumes are set aside as `<step>.unmatched-<time>`: the steps saved from
there must not meet them.

Orbax's own multi-tier checkpointing (`orbax.checkpoint.experimental.emergency`) is experimental ("do not use without
specific approval"), built around slices replicated along a mesh axis, and saves a single `state` item. It is not
used, only its mechanism for per-process local saves: our steps also hold the data iterator's position, the config
and the checksums, which our `Checkpointer`s keep.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
from flax import nnx

from spmdkit.checkpoint.manager import Checkpointer, CheckpointWarning
from spmdkit.checkpoint.ownership import enclosing_run
from spmdkit.checkpoint.process_tier import PREFIX, LayoutMismatch, ProcessCheckpointer, process_directory
from spmdkit.checkpoint.run_lock import LOCK_FILE, RunLock, lock_run
from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh import process_hosts

__all__ = [
    "LOCAL_FLAG", "LOCAL_KEEP", "TieredCheckpointer", "check_local_dir", "lock_local_dir",
    "open_checkpointer",
]  # fmt: skip

LOCAL_FLAG = "--checkpoint.local-dir"
LOCAL_KEEP = 2  # the local tier only bridges the gap to the next persistent step


class _Older(SpmdkitError):
    """A tier reached a step older than the other tier's newest: that one is tried first (internal)."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"step {step} is older than the other tier's newest")


def check_local_dir(
    local_dir: str | None, persistent_dir: Path, check_writable: Callable[[Path, str], None]
) -> Path | None:
    """The local tier's directory (absolute; None without one); SpmdkitError when `check_writable` (the trainer's
    check of its directories) refuses it, when it is, holds or lies in the persistent directory, or when it holds
    files other than checkpoint steps (and the processes' `process-<i>/` directories). Nothing is created."""
    if not local_dir:
        return None
    path = Path(local_dir).expanduser().absolute()
    check_writable(path, LOCAL_FLAG)
    persistent = Path(persistent_dir).expanduser().absolute()
    if path == persistent or path.is_relative_to(persistent) or persistent.is_relative_to(path):
        raise SpmdkitError(
            f"{LOCAL_FLAG} {path} overlaps the checkpoint directory {persistent}: pass a directory of its own "
            "(on a node-local disk)"
        )
    if path.is_dir():
        foreign = sorted(p.name for p in path.iterdir() if not _ours(p.name))
        if foreign:
            listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise SpmdkitError(
                f"{LOCAL_FLAG} {path} holds files that are not checkpoint steps ({listed}): training would write "
                "among them; pass a new or empty directory, or the local directory of an earlier run"
            )
    return path


def _ours(name: str) -> bool:
    """Whether a name in the local directory is the tier's: a step, the lock, a process's directory."""
    return name[:1].isdigit() or name == LOCK_FILE or (name.startswith(PREFIX) and name[len(PREFIX) :].isdigit())


def lock_local_dir(held: list[RunLock | None], local_dir: Path | None, run_dir: Path, command: str) -> None:
    """Append to `held` (the trainer's locks) the lock of the local tier's directory, taken as
    `ownership.lock_run_directories` takes the checkpoint directory's: none inside the run directory (its lock covers
    it), else the lock of the run directory holding it, or its own; on several hosts also every process's lock of
    its own `process-<i>/` (each host's disk is its own). All or none: a refusal releases `held`."""
    if local_dir is None or local_dir.is_relative_to(run_dir):
        return
    owner = enclosing_run(local_dir) or local_dir
    label = f"{LOCAL_FLAG} {local_dir}"
    if owner != local_dir:
        label += f" lies in the run directory {owner}, which"
    try:
        held.append(lock_run(owner, command, LOCAL_FLAG, label))
        if len(set(process_hosts())) > 1:
            own = process_directory(local_dir)
            held.append(lock_run(own, command, LOCAL_FLAG, f"{LOCAL_FLAG} {own}", each=True))
    except BaseException:
        for lock in reversed(held):
            if lock is not None:
                lock.release(failed=True)
        held.clear()
        raise


def open_checkpointer(directory: Path, settings: Any) -> Checkpointer | TieredCheckpointer:
    """The run's checkpointer: a `Checkpointer` of `directory`, or with `settings.local_dir` the two tiers
    (`settings`: the run's `CheckpointSettings`: every, keep, local_dir, local_every); the local tier is this
    process's own (`process-<i>/`) when the job spans several hosts."""
    persistent = Checkpointer(directory, every=settings.every, keep=settings.keep)
    if not settings.local_dir:
        return persistent
    try:
        if len(set(process_hosts())) > 1:
            local: Checkpointer = ProcessCheckpointer(
                process_directory(Path(settings.local_dir)), every=settings.local_every, keep=LOCAL_KEEP
            )
        else:
            local = Checkpointer(settings.local_dir, every=settings.local_every, keep=LOCAL_KEEP)
    except BaseException:
        persistent.close()
        raise
    return TieredCheckpointer(persistent, local)


class TieredCheckpointer:
    """A persistent and a local `Checkpointer` as one (see the module docstring); `directory` is the persistent
    one's (messages, the tokenizer's `hf/`); `restored_from` is the directory of the step `restore_latest` read
    (while it runs: of the step `accept` is asked about)."""

    def __init__(self, persistent: Checkpointer, local: Checkpointer):
        self.persistent, self.local = persistent, local
        self.directory = persistent.directory
        self.restored_from: Path | None = None

    @property
    def tiers(self) -> tuple[Checkpointer, Checkpointer]:
        return self.persistent, self.local

    @property
    def last_saved(self) -> int | None:
        saved = [tier.last_saved for tier in self.tiers if tier.last_saved is not None]
        return max(saved) if saved else None

    @last_saved.setter
    def last_saved(self, step: int | None) -> None:  # a resumed step is saved by neither tier again
        for tier in self.tiers:
            tier.last_saved = step

    # -- saving -------------------------------------------------------------------------------------------------

    def _tier(self, step: int, force: bool) -> Checkpointer | None:
        """The tier `step` is saved to: the persistent one when due there (or forced), else the local one."""
        if self.persistent.due(step, force):
            return self.persistent
        return self.local if self.local.due(step) else None

    def due(self, step: int, force: bool = False) -> bool:
        return self._tier(step, force) is not None

    def save(
        self,
        step: int,
        state: nnx.State,
        data: grain.DatasetIterator | None = None,
        config: dict[str, Any] | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """`Checkpointer.save` on the tier `step` is due on: one save in flight at a time (the other tier's is waited
        for first); a local save is complete when this returns."""
        tier = self._tier(step, force)
        if tier is None or step == self.last_saved:
            return False
        other = self.local if tier is self.persistent else self.persistent
        other.wait()
        saved = tier.save(step, state, data, config, force=force)
        if saved and tier is self.local:
            tier.wait()
        return saved

    def poll(self) -> None:
        for tier in self.tiers:
            tier.poll()

    def wait(self) -> None:
        try:
            self.persistent.wait()
        finally:
            self.local.wait()

    def close(self) -> None:
        try:
            self.persistent.close()
        finally:
            self.local.close()

    def newest(self) -> str:
        """'step N' of the newest complete step of either tier (the local tier's named), or 'none'."""
        found = [(tier.newest(), tier) for tier in self.tiers]
        numbered = [(int(text.split()[1]), tier) for text, tier in found if text.startswith("step ")]
        if not numbered:
            return "unknown" if any(text == "unknown" for text, _ in found) else "none"
        step, tier = max(numbered, key=lambda item: (item[0], item[1] is self.persistent))
        return f"step {step}" if tier is self.persistent else f"step {step} (in {tier.directory})"

    # -- reading ------------------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of both tiers, sorted."""
        return sorted(set(self.persistent.steps()) | set(self.local.steps()))

    def restore_latest(
        self,
        state: nnx.State,
        shardings: Any,
        data: grain.DatasetIterator | None = None,
        accept: Callable[[int, dict[str, Any] | None], None] | None = None,
    ) -> tuple[int, nnx.State] | None:
        """`Checkpointer.restore_latest` of the newest intact step of either tier (a tie goes to the persistent one),
        or None when neither holds a step; `restored_from` says which tier's directory the step came from. With a
        local tier per process (several hosts; a collective): a newest local step of another layout falls back to
        the persistent tier, local steps that cannot be resumed from with no persistent step are refused in one
        line, and the local steps above the one resumed from are set aside (see the module docstring)."""
        per_process, why = isinstance(self.local, ProcessCheckpointer), ""
        try:
            found = self._restore_newest(state, shardings, data, accept)
        except LayoutMismatch as mismatch:  # only a local tier per process raises it
            found, why = None, f"; {mismatch}"
            if self.persistent.steps():
                self.restored_from = self.persistent.directory
                found = self.persistent.restore_latest(state, shardings, data, accept)
        root = self.local.directory.parent if per_process else self.local.directory
        held = self.local.held() if isinstance(self.local, ProcessCheckpointer) else []
        others = [p for p in root.glob("*" if per_process else f"{PREFIX}*/*") if p.name.isdigit()]
        if found is None and (any(held) or others):
            what = "; ".join(f"process {i}: {_listed(steps)}" for i, steps in enumerate(held[:4]))
            if others:  # steps of a run with the other layout (one host / several hosts)
                what = f"it holds {len(others)} step(s) of a job on {'one host' if per_process else 'several hosts'}"
            raise SpmdkitError(
                f"{LOCAL_FLAG} {root} holds no step that every process holds intact on this mesh ({what}"
                f"{'; ...' if len(held) > 4 else ''}{why}), and {self.persistent.directory} holds none: resume with "
                "the processes, hosts and mesh that saved them, their local directories in place, or delete the "
                "local directories to start afresh"
            )
        if isinstance(self.local, ProcessCheckpointer) and (
            unmatched := self.local.set_aside_above(found[0] if found else 0)
        ):
            warnings.warn(
                f"local {_listed(unmatched)} in {self.local.directory}: not held by every process, of another "
                f"layout, or newer than where the run resumes ({f'step {found[0]}' if found else 'scratch'}): set "
                "aside as <step>.unmatched-<time>",
                CheckpointWarning,
                stacklevel=2,
            )
        return found

    def _restore_newest(
        self,
        state: nnx.State,
        shardings: Any,
        data: grain.DatasetIterator | None,
        accept: Callable[[int, dict[str, Any] | None], None] | None,
    ) -> tuple[int, nnx.State] | None:
        """The newest intact step of either tier: the tier with the newest step is read first, refusing (`_Older`)
        to go below the other tier's newest step; the steps it found damaged on the way are set aside, and the
        choice made again."""
        self.restored_from = None
        while True:
            listed = {id(t): t.agreed_steps() if isinstance(t, ProcessCheckpointer) else t.steps() for t in self.tiers}
            first, other = sorted(self.tiers, key=lambda t: (listed[id(t)][-1:], t is self.persistent), reverse=True)
            bound = listed[id(other)][-1] if listed[id(other)] else -1
            self.restored_from = first.directory  # what `accept` is asked about is in it
            try:
                found = first.restore_latest(state, shardings, data, _bounded(accept, bound))
            except _Older as older:  # every step of `first` above it is damaged (and warned about)
                first._set_aside([step for step in listed[id(first)] if step > older.step])
                continue
            except SpmdkitError as error:
                if bound < 0 or not _all_damaged(error, first):
                    raise
                first._set_aside(listed[id(first)])  # the other tier still holds steps
                continue
            self.restored_from = first.directory if found is not None else None
            return found


def _bounded(
    accept: Callable[[int, dict[str, Any] | None], None] | None, bound: int
) -> Callable[[int, dict[str, Any] | None], None]:
    """`accept`, refusing (`_Older`) the steps below `bound` first."""

    def check(step: int, config: dict[str, Any] | None) -> None:
        if step < bound:
            raise _Older(step)
        if accept is not None:
            accept(step, config)

    return check


def _listed(steps: list[int]) -> str:
    """'steps 6, 8', 'step 8' or 'none'."""
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}" if steps else "none"


def _all_damaged(error: SpmdkitError, tier: Checkpointer) -> bool:
    """Whether `error` is `Checkpointer.restore_latest`'s report that every step of `tier` is damaged."""
    return str(error).startswith(f"every checkpoint step in {tier.directory} is damaged")
