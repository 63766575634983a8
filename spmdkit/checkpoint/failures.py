"""Orbax failures as one line: what went wrong (the innermost cause, the OS reason when there is one), and the
noise a failed read or write leaves behind silenced (ERROR logs with tracebacks, orphaned coroutines)."""

from __future__ import annotations

import errno
import logging
import os
import sys
import warnings
from typing import Any

# OS reasons worth naming on their own: they say what to fix.
_REASONS = tuple(os.strerror(code) for code in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EIO))


def describe_error(error: BaseException) -> str:
    """'Type: first line' of the innermost cause (Orbax wraps TensorStore errors in generic ones)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def os_reason(error: BaseException) -> str | None:
    """The OS's reason ('No space left on device', 'Read-only file system', ...) anywhere in the error's chain."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        for reason in _REASONS:
            if reason in str(seen):
                return reason
        seen = seen.__cause__ or seen.__context__
    return None


def drop_orphaned_reads() -> None:
    """Silence the orphans of a failed Orbax restore or save. Its other reads and writes are abandoned mid-flight
    and, when finalised later (closed coroutines, callbacks onto the closed event loop), each reports an unraisable
    exception: dozens of tracebacks in the middle of the user's run. Installs (once) a `sys.unraisablehook` that
    drops exactly those and passes everything else on to the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "spmdkit_orphaned_reads", False):
        return

    def hook(unraisable: Any) -> None:
        error, source = unraisable.exc_value, unraisable.object
        name = getattr(source, "__qualname__", getattr(source, "__name__", ""))
        orphan = name.endswith(("_read_array_index_and_device_put", "write_fragment"))
        if not (orphan or (isinstance(error, RuntimeError) and str(error) == "Event loop is closed")):
            previous(unraisable)

    hook.spmdkit_orphaned_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    # The coroutines of an abandoned write, collected at exit: "coroutine '...async_save' was never awaited".
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


# Orbax's notices that every read of a checkpoint, or every save of a per-process directory, would print.
_NOTICES = ("Given directory is read only", "Global object size logging disabled")


class _Quiet(logging.Filter):
    """Drops Orbax's ERROR records (each with a traceback: the Checkpointer turns the failure into one line) and its
    `_NOTICES`, and asyncio's "Future exception was never retrieved" of the writes a failed save abandoned."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "asyncio":
            return "exception was never retrieved" not in message
        orbax = f"{os.sep}orbax{os.sep}" in record.pathname
        return not orbax or (record.levelno < logging.ERROR and not message.startswith(_NOTICES))


def quiet_orbax_errors() -> None:
    """Install (once) the filter: on absl's logger, through which Orbax logs, and on asyncio's; and the hook that
    drops the orphans of a failed read or write (a failure in a background thread comes with them)."""
    drop_orphaned_reads()
    for logger in (logging.getLogger("absl"), logging.getLogger("asyncio")):
        if not any(isinstance(f, _Quiet) for f in logger.filters):
            logger.addFilter(_Quiet())
