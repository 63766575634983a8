"""`Staging`: where `spmdkit data prepare` writes a dataset before it appears at `--out`, safe against kills.

Beside `--out` (`OUT`): `.OUT.spmdkit-prepare.lock`, a file holding an exclusive OS lock (`flock`) for the whole
run and naming its host and pid, and `.OUT.spmdkit-prepare-XXXXXXXX/`, the directory the dataset is written into
and renamed to `--out` when complete. A second prepare of the same `--out` while the first runs is refused in one
line naming the holder. A run killed (even by SIGKILL) leaves its directory and lock file behind; the next prepare
of the same `--out` takes the lock (the kernel released it with the dead process), removes every such directory
(they are recognisably ours and tied to that `--out` by name) and starts clean; the lock file goes at its end.
`remove_stale()` does the same cleaning first, also when `--out` exists by then (a run killed after its rename).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

from spmdkit.errors import SpmdkitError
from spmdkit.rundir.lock import same_file

MARK = ".spmdkit-prepare"
CACHE = "cache"  # scratch space inside the staging directory (e.g. the `datasets` Arrow cache), removed at the end


def staging_dirs(out: Path) -> list[Path]:
    """The staging directories of `--out` there are now (of this run or of earlier, killed ones)."""
    if not out.parent.is_dir():
        return []
    prefix = f".{out.name}{MARK}-"
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink())


def check_new_directory(out: str | Path) -> None:
    """SpmdkitError unless `out` does not exist yet and could be created (its nearest existing ancestor is a
    writable directory); nothing is created. `prepare` checks it before any input is read, `Staging` once it holds
    the lock."""
    path = Path(out).expanduser().absolute()
    if path.exists():
        raise SpmdkitError(f"--out {out} already exists: choose a new directory (prepared data is never overwritten)")
    existing = next(p for p in path.parents if p.exists())
    if not existing.is_dir():
        raise SpmdkitError(f"--out {out} lies under {existing}, which is a file: pass a new directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpmdkitError(f"--out {out} cannot be created ({existing} is not writable): pass a writable place")


class Staging:
    """Context manager: takes the lock, removes earlier runs' directories, makes a fresh one (`directory`);
    `commit()` renames it to `out`; leaving without a commit removes it. Either way the lock file goes."""

    def __init__(self, out: str | Path):
        self.out = Path(out).expanduser().absolute()
        self.lock = self.out.parent / f".{self.out.name}{MARK}.lock"
        self.directory: Path | None = None
        self._fd: int | None = None

    def __enter__(self) -> Staging:
        self._fd = self._take_lock()
        try:
            os.ftruncate(self._fd, 0)
            os.write(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
            for stale in staging_dirs(self.out):
                shutil.rmtree(stale)
            check_new_directory(self.out)
            self.directory = Path(tempfile.mkdtemp(prefix=f".{self.out.name}{MARK}-", dir=self.out.parent))
        except BaseException:
            self._release()
            raise
        return self

    def _take_lock(self) -> int:
        """An fd holding the exclusive lock on `self.lock` (the file at that path now, not one unlinked meanwhile)."""
        while True:
            try:
                self.out.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                raise SpmdkitError(f"cannot create --out {self.out} ({error.strerror or error})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                try:
                    holder = self.lock.read_text(errors="replace").strip() or "another process"
                except OSError:
                    holder = "another process"
                raise SpmdkitError(
                    f"another `spmdkit data prepare` ({holder}) is writing --out {self.out}: wait for it to end or "
                    "choose another --out"
                ) from None
            if same_file(self.lock, fd):
                return fd
            os.close(fd)  # its holder unlinked it as we opened it: take the one there now

    def remove_stale(self) -> None:
        """Remove what runs of `out` killed earlier left (their directories and lock file), unless one runs now
        (then `__enter__` says so). Creates nothing."""
        if not self.out.parent.is_dir() or not (self.lock.exists() or staging_dirs(self.out)):
            return
        try:
            self._fd = self._take_lock()
        except SpmdkitError:
            return
        try:
            for stale in staging_dirs(self.out):
                shutil.rmtree(stale)
        finally:
            self._release()

    @property
    def cache(self) -> Path:
        assert self.directory is not None
        return self.directory / CACHE

    def commit(self) -> None:
        """Move the finished dataset into place (atomic on one filesystem)."""
        assert self.directory is not None
        shutil.rmtree(self.cache, ignore_errors=True)
        try:
            os.rename(self.directory, self.out)
        except OSError as error:
            raise SpmdkitError(f"could not move the dataset into --out {self.out}: {error.strerror}") from None
        self.directory = None

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        self._release()

    def _release(self) -> None:
        if self._fd is not None:
            self.lock.unlink(missing_ok=True)  # while still held: a waiting run then finds --out in place, or no lock
            os.close(self._fd)
            self._fd = None
