"""Two checkpoint tiers: the persistent directory, and a fast node-local one (`--checkpoint.local-dir`) saved more
often, so that a killed node loses at most `local_every` steps instead of `every`.

The persistent `Checkpointer` holds the local tier (`LocalTier`, a store of the local directory) and routes each
step to the tier it is due on: every step of either tier is an ordinary checkpoint step (atomic, checksummed, its
data position and config included), and restore goes through `restore_latest`, with its checks. A step due on both
tiers is saved once, to the persistent one (it survives the node). A local save is waited for before training goes
on: a kill right after it must find it complete (a local disk is fast; the persistent tier stays asynchronous).

With every process of the job on one host, the local tier is one ordinary `Checkpointer` of the directory. A job
spanning several hosts cannot do that (Orbax has process 0 write a step's metadata and commit marker, which another
host's local disk would lack): each process keeps its own steps in `<local-dir>/process-<i>/`
(`layout.PER_PROCESS`), and a restore reads the newest step that every process holds intact, onto the
same mesh and processes. A step some processes lack (a replaced node), or one of another layout, falls back to the
newest step all hold or to the persistent tier; with neither, the run is refused in one line (the local steps would
be lost). Steps newer than where the run resumes are set aside as `<step>.unmatched-<time>`: the steps saved from
there must not meet them.

Orbax's own multi-tier checkpointing (`orbax.checkpoint.experimental.emergency`) is experimental ("do not use without
specific approval"), built around slices replicated along a mesh axis, and saves a single `state` item. It is not
used, only its mechanism for per-process local saves: our steps also hold the data iterator's position, the config
and the checksums, which our stores keep.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flax import nnx

from spmdkit.checkpoint.damage import CheckpointWarning, LayoutMismatch
from spmdkit.checkpoint.layout import PER_PROCESS, PREFIX, SHARED, process_directory
from spmdkit.checkpoint.manager import Accept, Checkpointer, Data
from spmdkit.distributed.gather import gather_over_processes
from spmdkit.errors import SpmdkitError
from spmdkit.rundir.identity import new_run_id
from spmdkit.rundir.lock import LOCK_FILE
from spmdkit.sharding.mesh import process_hosts

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
    check of its directories) refuses it, when it is, holds or lies in the persistent directory (symlinks resolved),
    or when it holds
    files other than checkpoint steps (and the processes' `process-<i>/` directories). Nothing is created."""
    if not local_dir:
        return None
    path = Path(local_dir).expanduser().absolute()
    check_writable(path, LOCAL_FLAG)
    persistent = Path(persistent_dir).expanduser().absolute()
    real, real_persistent = path.resolve(), persistent.resolve()  # a symlink into the other tier overlaps too
    if real == real_persistent or real.is_relative_to(real_persistent) or real_persistent.is_relative_to(real):
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


def own_local_dirs(local_dir: Path | None) -> dict[str, Path]:
    """`{LOCAL_FLAG: this process's process-<i>/}` when the job spans several hosts (each process locks its own, as
    `ownership.lock_run_directories` takes `each`), else empty; every process must ask (the hosts are gathered)."""
    if local_dir is None or len(set(process_hosts())) == 1:
        return {}
    return {LOCAL_FLAG: process_directory(local_dir)}


def open_checkpointer(
    directory: Path, settings: Any, kept_id: str | None = None, run_dir: Path | None = None
) -> Checkpointer:
    """The run's checkpointer: a `Checkpointer` of `directory`, with `settings.local_dir` holding the local tier
    (`settings`: the run's `CheckpointSettings`: every, keep, local_dir, local_every, resume); the local tier is
    this process's own (`process-<i>/`) when the job spans several hosts. With `run_dir`, its steps are the run's
    (`claim_steps`, given the id the run directory keeps); with `settings.resume` off, both tiers must be empty."""
    persistent = Checkpointer(directory, every=settings.every, keep=settings.keep)
    try:
        if settings.local_dir:
            several = len(set(process_hosts())) > 1
            local_dir = process_directory(Path(settings.local_dir)) if several else settings.local_dir
            layout = PER_PROCESS if several else SHARED
            local = Checkpointer(local_dir, every=settings.local_every, keep=LOCAL_KEEP, layout=layout)
            persistent.local = LocalTier(local)
        if not settings.resume and (steps := persistent.steps()):
            held = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            local = f" or {LOCAL_FLAG} {settings.local_dir}" if settings.local_dir else ""
            raise SpmdkitError(
                f"--no-resume, but {persistent.directory}{local} already holds {held} of an earlier run: pass a "
                f"fresh --checkpoint-dir{local and ' and ' + LOCAL_FLAG} or delete that directory (checkpoints "
                "are never overwritten)"
            )
        if run_dir is not None:
            claim_steps(persistent, kept_id, run_dir)
    except BaseException:
        persistent.close()
        raise
    return persistent


def claim_steps(checkpointer: Checkpointer, kept: str | None, run_dir: Path) -> str:
    """The run's id, recorded from now on in every step either tier of `checkpointer` saves (`rundir.identity`):
    `kept` (the id the run directory keeps), else the one the persistent directory's newest step records, else a new
    one; process 0's decides. SpmdkitError when a tier holds a step another run saved: it would be resumed, or
    rotated away by this run's saves. A collective (each process checks its own local steps)."""
    flags = ("--checkpoint-dir", LOCAL_FLAG)  # the flag naming each store's directory; each step's metadata read once
    stores = [(store, flag, store.owners()) for store, flag in zip(checkpointer.stores(), flags, strict=False)]
    persistent = [run["id"] for run in stores[0][2].values() if run is not None]
    run_id = gather_over_processes(kept or (persistent[-1] if persistent else new_run_id()))[0]
    own = next(filter(None, (_foreign(store, owners, run_id, flag) for store, flag, owners in stores)), "")
    problem = next(filter(None, gather_over_processes(own)), "")
    if problem:
        raise SpmdkitError(problem)
    for store, _, _ in stores:
        store.run = {"id": run_id, "run_dir": str(run_dir)}
    return run_id


def _foreign(store: Checkpointer, owners: dict[int, dict[str, str] | None], run_id: str, flag: str) -> str:
    """One line naming the steps of `store` another run saved (`owners`: its `Checkpointer.owners()`; '' when none)."""
    foreign = {step: run for step, run in owners.items() if run is not None and run["id"] != run_id}
    if not foreign:
        return ""
    run = foreign[max(foreign)]
    fix = (
        "pass a local directory of this run's own, or delete those steps once that run no longer needs them"
        if flag == LOCAL_FLAG
        else f"pass --run-dir {run.get('run_dir')} to continue that run, or a fresh --checkpoint-dir"
    )
    return (
        f"{flag} {store.directory} holds {_listed(sorted(foreign))} of another run (run {run['id']} of "
        f"{run.get('run_dir')}; this is run {run_id}): a run resumes and rotates away only its own steps; {fix}"
    )


class LocalTier:
    """The fast tier a persistent `Checkpointer` holds (see the module docstring): `store`, the store of the local
    directory, and how a restore chooses between the two."""

    def __init__(self, store: Checkpointer):
        self.store = store

    def restore_latest(
        self, persistent: Checkpointer, state: nnx.State, shardings: Any, data: Data, accept: Accept | None
    ) -> tuple[int, nnx.State] | None:
        """`Checkpointer.restore_latest` of the newest intact step of either tier (a tie goes to the persistent one),
        or None when neither holds a step; `persistent.restored_from` says which tier's directory the step came
        from. With a local tier per process (several hosts; a collective): a newest local step of another layout
        falls back to the persistent tier, local steps that cannot be resumed from with no persistent step are
        refused in one line, and the local steps above the one resumed from are set aside."""
        local, why = self.store, ""
        try:
            found = self._restore_newest(persistent, state, shardings, data, accept)
        except LayoutMismatch as mismatch:  # only a local tier per process raises it
            found, why = None, f"; {mismatch}"
            if persistent.own_steps():
                persistent.restored_from = persistent.directory
                found = persistent.restore_newest(state, shardings, data, accept)
        self._refuse_lost(persistent, found, why)
        # the local steps above where the run resumes: another timeline's, which the steps saved here must not meet
        unmatched = [s for s in local.own_steps() if s > (found[0] if found else 0)] if local.layout.per_process else []
        if unmatched:
            local.set_aside(unmatched, "unmatched")
            warnings.warn(
                f"local {_listed(unmatched)} in {local.directory}: not held by every process, of another "
                f"layout, or newer than where the run resumes ({f'step {found[0]}' if found else 'scratch'}): set "
                "aside as <step>.unmatched-<time>",
                CheckpointWarning,
                stacklevel=3,
            )
        return found

    def _refuse_lost(self, persistent: Checkpointer, found: Any, why: str) -> None:
        """SpmdkitError when nothing was restored though the local directory holds steps (they would be lost)."""
        per_process = self.store.layout.per_process
        root = self.store.directory.parent if per_process else self.store.directory
        held = self.store.held() if per_process else []
        others = [p for p in root.glob("*" if per_process else f"{PREFIX}*/*") if p.name.isdigit()]
        if found is None and (any(held) or others):
            what = "; ".join(f"process {i}: {_listed(steps)}" for i, steps in enumerate(held[:4]))
            if others:  # steps of a run with the other layout (one host / several hosts)
                what = f"it holds {len(others)} step(s) of a job on {'one host' if per_process else 'several hosts'}"
            raise SpmdkitError(
                f"{LOCAL_FLAG} {root} holds no step that every process holds intact on this mesh ({what}"
                f"{'; ...' if len(held) > 4 else ''}{why}), and {persistent.directory} holds none: resume with "
                "the processes, hosts and mesh that saved them, their local directories in place, or delete the "
                "local directories to start afresh"
            )

    def _restore_newest(
        self, persistent: Checkpointer, state: nnx.State, shardings: Any, data: Data, accept: Accept | None
    ) -> tuple[int, nnx.State] | None:
        """The newest intact step of either tier: the tier with the newest step is read first, refusing (`_Older`)
        to go below the other tier's newest step; the steps it found damaged on the way are set aside, and the
        choice made again."""
        tiers = (persistent, self.store)
        while True:
            listed = {id(t): t.agreed_steps() for t in tiers}
            first, other = sorted(tiers, key=lambda t: (listed[id(t)][-1:], t is persistent), reverse=True)
            bound = listed[id(other)][-1] if listed[id(other)] else -1
            persistent.restored_from = first.directory  # what `accept` is asked about is in it
            try:
                found = first.restore_newest(state, shardings, data, _bounded(accept, bound))
            except _Older as older:  # every step of `first` above it is damaged (and warned about)
                first.set_aside([step for step in listed[id(first)] if step > older.step])
                continue
            except SpmdkitError as error:
                if bound < 0 or not str(error).startswith(f"every checkpoint step in {first.directory} is damaged"):
                    raise
                first.set_aside(listed[id(first)])  # the other tier still holds steps
                continue
            persistent.restored_from = first.directory if found is not None else None
            return found


def _bounded(accept: Accept | None, bound: int) -> Accept:
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
