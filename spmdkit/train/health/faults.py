"""Faults injected on purpose, for the tests of restarts, hangs and stragglers: `SPMDKIT_FAULTS` (an environment
variable, never a config key: a fault must not travel into a checkpoint's config).

It is a `;`-separated list of `PROCESS:PHASE[=STEP]:ACTION[=SECONDS][@ATTEMPT]`:
- PROCESS: a process index, or `*` for every process;
- PHASE: a phase of `spmdkit.train.health.phases` (`restore`, `compile`, `data`, `step`, `checkpoint`, ...), and with
  `=STEP` only that step's;
- ACTION: `kill` (SIGKILL itself), `stop` (SIGSTOP itself: frozen, as a hung process is), `exit` (exit status 1), or
  `delay=SECONDS` (sleep, every time the phase is entered: a slow process);
- `@ATTEMPT`: only in that attempt of a job that `spmdkit launch --max-restarts` restarts (`SPMDKIT_ATTEMPT`,
  0 first); without it, in every attempt.

`1:step=5:kill@0` kills process 1 as step 5 starts, in the first attempt only; `0:data:delay=0.2` slows process 0's
every batch by 0.2 s.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Mapping

from spmdkit.distributed.restarts import ATTEMPT
from spmdkit.errors import SpmdkitError

FAULTS = "SPMDKIT_FAULTS"
ACTIONS = ("kill", "stop", "exit", "delay")


@dataclasses.dataclass(frozen=True)
class Fault:
    process: int | None  # None: every process
    phase: str
    step: int | None  # None: every step
    action: str
    seconds: float = 0.0
    attempt: int | None = None  # None: every attempt


def parse_fault(text: str) -> Fault:
    """One `PROCESS:PHASE[=STEP]:ACTION[=SECONDS][@ATTEMPT]` entry."""
    try:
        where, _, attempt = text.strip().partition("@")
        process, phase, action = where.split(":")
        phase, _, step = phase.partition("=")
        action, _, seconds = action.partition("=")
        fault = Fault(
            None if process == "*" else int(process), phase, int(step) if step else None, action,
            float(seconds or 0), int(attempt) if attempt else None,
        )  # fmt: skip
    except ValueError:
        fault = None
    if fault is None or fault.action not in ACTIONS or (fault.action == "delay") != bool(fault.seconds):
        raise SpmdkitError(
            f"{FAULTS} entry {text!r} is not PROCESS:PHASE[=STEP]:ACTION[@ATTEMPT] with ACTION one of kill, stop, "
            "exit, delay=SECONDS (e.g. 1:step=5:kill@0)"
        )
    return fault


def attempt(env: Mapping[str, str] | None = None) -> int:
    """Which attempt of a restarted job this process belongs to (0: the first)."""
    value = (os.environ if env is None else env).get(ATTEMPT, "0")
    return int(value) if value.isdigit() else 0


class Faults:
    """The faults meant for this process; `at(phase, step)` runs those that match. A no-op without `SPMDKIT_FAULTS`
    (one empty-list check per phase)."""

    def __init__(self, process: int, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self.process, self.attempt = process, attempt(env)
        entries = [e for e in env.get(FAULTS, "").split(";") if e.strip()]
        self.faults = [f for f in map(parse_fault, entries) if f.process in (None, process)]

    def at(self, phase: str, step: int | None, before_stop: Callable[[], None] | None = None) -> None:
        """Run the faults of `phase` (at `step`): `before_stop` runs first (it publishes where the process is)."""
        for fault in self.faults:  # this process's already
            if fault.phase != phase or fault.step not in (None, step) or fault.attempt not in (None, self.attempt):
                continue
            if fault.action == "delay":
                time.sleep(fault.seconds)
                continue
            if before_stop is not None:
                before_stop()
            print(f"spmdkit: injected fault {fault.action} in {phase} (step {step}) ({FAULTS})", flush=True)
            if fault.action == "exit":
                os._exit(1)
            os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
