"""One writer per run directory: an exclusive OS lock (`fcntl.flock`) on `DIR/.spmdkit-lock`, held for the whole run.

The lock file names its holder (host, pid, command, since when) as JSON. A second writer (`spmdkit train`, `ckpt
reshard` or `ckpt export` writing there) is refused in one line naming the holder. The OS drops a flock when its
process dies, so a lock left by a killed run is free: it is taken over, with a warning naming the dead holder. A clean
release deletes the file while still holding the lock; an acquirer checks that the file it locked is still the one
at the path (else it retries), so that a deleted lock is never held twice. With several JAX processes, process 0
takes the lock (or each process its own, on a node-local disk) and every process learns the verdicts (a gather)
before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

from spmdkit.distributed.gather import gather_over_processes
from spmdkit.errors import SpmdkitError, SpmdkitWarning

LOCK_FILE = ".spmdkit-lock"


class RunLockWarning(SpmdkitWarning):
    """A lock left by a process that no longer runs was taken over."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def describe_holder(holder: dict[str, Any] | None) -> str:
    """'spmdkit train (pid 123 on host h, since 2026-01-01 12:00:00)' of a lock file's content."""
    if not holder:
        return "another process (its lock file names none yet)"
    return (
        f"{holder.get('command', 'spmdkit')} (pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
        f"since {holder.get('since', '?')})"
    )


def same_file(path: Path, fd: int) -> bool:
    """Whether the open file `fd` is the one at `path` now (not one a releasing holder unlinked meanwhile)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        value = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class RunLock:
    """The exclusive lock of one directory, taken by `RunLock(directory, command, flag)` (process-local: see
    `lock_run` for many processes); `release()` (or the `with` block's end) deletes the file and frees it."""

    def __init__(self, directory: str | Path, command: str, flag: str = "--run-dir", label: str | None = None):
        self.directory = Path(directory).expanduser().absolute()
        self.label = label or f"{flag} {self.directory}"
        self.path = self.directory / LOCK_FILE
        self.made: list[Path] = []  # the directories this lock made (mkdir -p), outermost first
        self.fd: int | None = None
        try:
            self.made = [p for p in (self.directory, *self.directory.parents) if not p.exists()][::-1]
            self.directory.mkdir(parents=True, exist_ok=True)
            self._acquire(command, flag)
        except OSError as error:
            self._remove_made()
            raise SpmdkitError(f"cannot lock {self.path} ({error.strerror or error}): pass a writable {flag}") from None
        except BaseException:
            self._remove_made()
            raise

    def _acquire(self, command: str, flag: str) -> None:
        for _ in range(100):  # retried only when a releasing holder deleted the file we opened
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                for _ in range(20):  # the holder writes its record just after locking: an empty file is read again
                    if holder := _read_holder(fd):
                        break
                    time.sleep(0.05)
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise SpmdkitError(
                    f"{self.label} is in use by {describe_holder(holder)}: one writer per run directory; wait for it "
                    f"to end, or pass another {flag}"
                ) from None
            if not same_file(self.path, fd):
                os.close(fd)
                continue
            self.fd = fd
            self._take_over(_read_holder(fd))
            record = {"host": socket.gethostname(), "pid": os.getpid(), "command": command}
            record["since"] = time.strftime("%Y-%m-%d %H:%M:%S")
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            return
        raise SpmdkitError(f"cannot lock {self.path}: it keeps being replaced; is another run starting there?")

    def _take_over(self, stale: dict[str, Any] | None) -> None:
        """A record left in a free lock file: its writer ended without releasing (killed): warn, naming it."""
        if not stale:
            return
        here = stale.get("host") == socket.gethostname()
        pid = stale.get("pid")
        if here and isinstance(pid, int) and pid != os.getpid() and _alive(pid):
            state = f"pid {pid} is now another process"
        else:
            state = "it is no longer running" if here else "its lock was released"
        warnings.warn(
            f"took over the lock of {self.directory} left by {describe_holder(stale)}: {state} (it ended without "
            "releasing the lock, e.g. killed)",
            RunLockWarning,
            stacklevel=3,
        )

    def release(self, failed: bool = False) -> None:
        """Delete the lock file and free the lock; `failed`: also remove the directories the lock made, if empty."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):
            if same_file(self.path, fd):
                self.path.unlink()
        os.close(fd)
        if failed:
            self._remove_made()

    def _remove_made(self) -> None:
        """Remove the directories this lock made, where they are empty (their empty subdirectories too: what a
        run that failed before writing anything left, e.g. a fresh checkpoint directory); files are never touched."""
        for directory in reversed(self.made):
            inner = sorted((p for p in directory.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True)
            for path in [*inner, directory]:
                with contextlib.suppress(OSError):
                    path.rmdir()

    def __del__(self) -> None:  # a holder dropped without release (a Trainer never run)
        with contextlib.suppress(Exception):
            self.release()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self.release(failed=exc_type is not None)


def lock_run(
    directory: str | Path, command: str, flag: str = "--run-dir", label: str | None = None, *, each: bool = False
) -> RunLock | None:
    """The lock of `directory` for a job of any number of JAX processes: process 0 takes it (and gets it back), the
    others get None; with `each`, every process takes the lock of its own `directory` (a node-local one). Every
    process raises the same one-line SpmdkitError when one was refused (the first by index), holding nothing."""
    import jax

    if jax.process_count() == 1:
        return RunLock(directory, command, flag, label)
    lock, refusal = None, ""
    if each or jax.process_index() == 0:
        try:
            lock = RunLock(directory, command, flag, label)
        except SpmdkitError as error:
            refusal = str(error)
    refused = [(index, text) for index, text in enumerate(gather_over_processes(refusal)) if text]
    if refused:
        if lock is not None:
            lock.release(failed=True)
        index, text = refused[0]
        raise SpmdkitError(text if index == jax.process_index() else f"process {index}: {text}")
    return lock
