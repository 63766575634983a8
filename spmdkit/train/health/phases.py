"""Where a process is and where its time goes: the phases of a run, each a named span.

`PhaseClock.phase(name, step)` wraps one span of the loop. Phases, and what each waits for:
- `restore` (the newest checkpoint; Orbax's barriers wait for every process), `compile`;
- `data` (the next batch: read, shard, transfer), `step` (dispatching the compiled step and reading the previous
  step's bad-step counter: the host's wait for the devices, and through their collectives for every process, is
  the nested `wait`), `log` (a logged step's record; its fetch is a `wait` too), `eval`, `checkpoint` (starting a
  save, and Orbax's barriers).

Every span is a `jax.profiler.TraceAnnotation` (what `--profile-steps` shows), adds its seconds to `totals` (a
nested span counts in its parent's total too), runs the test-only faults of `SPMDKIT_FAULTS` (`faults.py`) as it
starts, and has a deadline the watchdog checks (`watchdog.py`). Entering and leaving a span costs a few
microseconds: no device sync, no I/O.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

import jax

from spmdkit.train.health.faults import Faults

RUN_PHASES = ("data", "step", "wait", "log")  # the phases of the steps, whose deadline is the step timeout


@dataclasses.dataclass(frozen=True)
class Span:
    """One open phase: its name, the step it belongs to (None outside the steps), since when (time.monotonic()),
    and how long it may wait before the job counts as hung (seconds; 0: forever)."""

    name: str
    step: int | None
    started: float
    timeout: float

    def overdue(self, now: float) -> bool:
        return self.timeout > 0 and now - self.started > self.timeout

    def where(self) -> str:
        return self.name if self.step is None else f"{self.name} of step {self.step}"


class PhaseClock:
    """The open phases of this process (innermost last) and the seconds spent in each phase so far."""

    def __init__(self, step_timeout: float = 0.0, phase_timeout: float = 0.0, faults: Faults | None = None):
        self.step_timeout, self.phase_timeout = step_timeout, phase_timeout
        self.faults = faults
        self.open: list[Span] = []
        self.totals: collections.Counter[str] = collections.Counter()
        self.step = 0  # the newest step entered
        self.first_step: int | None = None  # the first step this process ran (its start-up ends there)
        self.on_change: Callable[[], None] = lambda: None  # the watchdog's: publish where this process is
        self.before_stop: Callable[[], None] = lambda: None  # the watchdog's: publish now (a fault freezes us)

    def timeout(self, name: str, step: int | None) -> float:
        """The step timeout for the phases of a step after the first two of this process (the first waits for the
        compiled program's first run, the second reads the first's result), the phase timeout for the rest."""
        first = self.first_step if self.first_step is not None else step
        if name in RUN_PHASES and step is not None and first is not None and step > first + 1:
            return self.step_timeout
        return self.phase_timeout

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """The span of phase `name` (of `step`)."""
        if step is not None:
            self.step = max(self.step, step)
            if self.first_step is None:
                self.first_step = step
        span = Span(name, step, time.monotonic(), self.timeout(name, step))
        self.open.append(span)
        self.on_change()
        try:
            if self.faults is not None and self.faults.faults:
                self.faults.at(name, step, before_stop=self.before_stop)
            with jax.profiler.TraceAnnotation(name):
                yield
        finally:
            self.open.remove(span)
            self.totals[name] += time.monotonic() - span.started
            self.on_change()

    def overdue(self, now: float | None = None) -> Span | None:
        """The innermost open span past its deadline, or None."""
        now = time.monotonic() if now is None else now
        return next((span for span in reversed(list(self.open)) if span.overdue(now)), None)

    def innermost(self) -> Span | None:
        spans = list(self.open)  # a copy: the watchdog's thread reads while the loop's thread changes it
        return spans[-1] if spans else None
