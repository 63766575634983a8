"""Stragglers: the process the others wait for, named from every process's own time per step.

In an SPMD step every collective waits for the slowest process, so each process's step time is the same: the
slowest's. What differs is how that time splits. A process's *own* time is the host work it does per step (reading
and sharding the batch, dispatching, its hooks): the window's wall time less its `wait` phases (`phases.py`: the
reads of device results, where a fast process waits for the collectives, and so for the slow one). The process
with the largest own time is the one the others wait for.

Every `--log-every` steps each process's own time per step is gathered (`process_allgather` of one float: a small
collective at a step where every process already syncs). The record of that step gets `slowest_process` and
`straggler_lag_s` (its own time per step over the median of the others'). When the lag exceeds
`--health.straggler-threshold` of the step time for `--health.straggler-windows` windows in a row, by the same
process, the record names it (`straggler`) and process 0 logs a warning. A process slowed inside its device work
(a throttled GPU) makes every process wait alike and is not told apart here: `--profile-steps` shows it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from spmdkit.distributed.gather import gather_over_processes
from spmdkit.train.health.phases import PhaseClock


def gather_own_times(own: float) -> np.ndarray:
    """Every process's own seconds per step, in process order (a collective: every process calls it)."""
    return np.asarray(gather_over_processes(np.float32(own)), float)


class StragglerWatch:
    """Judges each logged window; `window(seconds, steps)` returns the fields of its record."""

    def __init__(
        self, clock: PhaseClock, threshold: float, windows: int, warn: Callable[[str], None],
        gather: Callable[[float], np.ndarray] = gather_own_times,
    ):  # fmt: skip
        self.clock, self.threshold, self.windows, self.warn, self.gather = clock, threshold, windows, warn, gather
        self.suspect: int | None = None
        self.streak = 0
        self._waited = clock.totals["wait"]

    def window(self, seconds: float, steps: int) -> dict[str, Any]:
        """`seconds` of wall time for `steps` steps since the previous window."""
        waited, self._waited = self.clock.totals["wait"] - self._waited, self.clock.totals["wait"]
        owns = self.gather(max(seconds - waited, 0.0) / steps)
        if len(owns) == 1:
            return {}
        slowest = int(np.argmax(owns))
        lag = float(owns[slowest] - np.median(np.delete(owns, slowest)))
        if lag > self.threshold * seconds / steps:
            self.streak = self.streak + 1 if slowest == self.suspect else 1
            self.suspect = slowest
        else:
            self.streak, self.suspect = 0, None
        fields: dict[str, Any] = {"slowest_process": slowest, "straggler_lag_s": lag}
        if self.streak >= self.windows:
            fields["straggler"] = slowest
            self.warn(
                f"warning: process {slowest} is a straggler: its own time per step exceeds the others' median by "
                f"{lag:.3f} s ({lag / (seconds / steps):.0%} of a step) for {self.streak} logged windows in a row"
            )
        return fields
