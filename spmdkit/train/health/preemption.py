"""Graceful stop on SIGTERM / SIGINT: the loop finishes the step it is in, saves a checkpoint, and exits 0.

`with StopRequest() as stop:` installs the handlers (main thread only; elsewhere it never fires) and puts the old
ones back on leaving. A second SIGINT while stopping raises `KeyboardInterrupt`
as usual. With several JAX processes they agree on the step to stop at (one signalled process stops them all).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import jax
import numpy as np

from spmdkit.distributed.gather import gather_over_processes

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "none"

    def requested(self) -> bool:
        """Whether to stop after this step; the same answer on every process (a collective when there are many)."""
        if jax.process_count() == 1:
            return self.signal is not None
        flags = gather_over_processes(np.int32(self.signal or 0))
        if self.signal is None and np.any(flags):
            self.signal = int(np.max(flags))
        return bool(np.any(flags))
