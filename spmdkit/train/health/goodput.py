"""Goodput: the share of the wall time since the job's first start that went into steps that count.

    goodput = productive / wall,   wall = productive + startup + redone + checkpoint + data + eval + other

- productive: the time of the logged windows of steps, less the data and checkpoint phases inside them, for the
  steps that were not redone;
- startup: each attempt's process start to its first step (joining, building, restoring; `compile` is the part
  spent compiling, reported beside it);
- redone: the steps a restart ran again (after the checkpoint it resumed from), as long as they took the first time;
- checkpoint, data, eval: the phases of those names (`phases.py`), from the main thread: a save's asynchronous
  writing is not a stall and is not counted;
- other: the rest (the time between a crash and the restart, logging).

The count lives in `metrics.jsonl`: every logged record carries the job's totals so far (`goodput`, `wall_s`,
`productive_s`, `lost_<bucket>_s`, `restarts`), so a resumed run (by `spmdkit launch --max-restarts` or by hand)
continues them from the records it keeps and the ones it drops: the dropped records' productive time becomes redone.
The first record after a resume says so (`resumed_from`, `redone_steps`). A fresh run directory starts a new job.
"""

from __future__ import annotations

import os
import time
from typing import Any

from spmdkit.train.health.phases import PhaseClock

LOST = ("startup", "compile", "redone", "checkpoint", "data", "eval")


def process_start_time() -> float:
    """When this process started (seconds since the epoch): now less its age, both ages from /proc in the kernel's
    clock ticks (Linux; 10 ms); elsewhere: now."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
            return time.time() - (float(uptime.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return time.time()


class Goodput:
    """The job's time, bucket by bucket; `record(...)` gives the fields of each logged record."""

    def __init__(self, clock: PhaseClock, started: float | None = None, attempt: int = 0):
        self.clock = clock
        self.started = process_start_time() if started is None else started
        self.job_start = self.started
        self.carried = {bucket: 0.0 for bucket in (*LOST, "productive")}  # earlier attempts' totals
        self.restarts = self.attempt = attempt  # under `spmdkit launch --max-restarts`, its count is exact
        self.resumed: dict[str, Any] = {}  # for the first record after a resume
        self.productive = 0.0  # this attempt's
        self.first_step_at: float | None = None
        self._window_phases = self._phase_seconds()

    def _phase_seconds(self) -> dict[str, float]:
        return {name: self.clock.totals[name] for name in ("checkpoint", "data", "eval", "compile")}

    def resume(self, records: list[dict[str, Any]], step: int) -> None:
        """Continue the totals of the records of `metrics.jsonl` (read before the records past `step` are
        dropped): those kept give the totals at `step`, the dropped ones' productive time is redone."""
        counted = [r for r in records if "wall_s" in r and "time" in r]
        kept = [r for r in counted if r["step"] <= step]
        dropped = [r for r in counted if r["step"] > step]
        last = (dropped or kept or [None])[-1]
        if last is None:
            return
        self.job_start = last["time"] - last["wall_s"]
        self.carried = {bucket: last[f"lost_{bucket}_s"] for bucket in LOST}
        self.carried["productive"] = kept[-1]["productive_s"] if kept else 0.0
        self.carried["redone"] += last["productive_s"] - self.carried["productive"]
        self.restarts = max(last.get("restarts", 0) + 1, self.attempt)
        redone = max((r["step"] for r in dropped), default=step) - step
        self.resumed = {"resumed_from": step, "redone_steps": redone}

    def first_step(self) -> None:
        """The first step of this attempt starts: its start-up ends."""
        if self.first_step_at is None:
            self.first_step_at = time.time()
            self._window_phases = self._phase_seconds()

    def window(self, seconds: float) -> None:
        """A logged window of steps took `seconds` (wall): its productive part is what data and checkpoints left."""
        now = self._phase_seconds()
        stalls = sum(now[name] - self._window_phases[name] for name in ("checkpoint", "data"))
        self.productive += max(seconds - stalls, 0.0)
        self._window_phases = now

    def record(self) -> dict[str, Any]:
        """The job's totals now, as fields of a logged record."""
        now = time.time()
        phases = self._phase_seconds()
        lost = {bucket: self.carried[bucket] for bucket in LOST}
        lost["startup"] += (self.first_step_at or now) - self.started
        for name in ("compile", "checkpoint", "data", "eval"):
            lost[name] += phases[name]
        productive = self.carried["productive"] + self.productive
        wall = now - self.job_start
        other = wall - productive - sum(v for k, v in lost.items() if k != "compile")  # compile is inside startup
        fields: dict[str, Any] = {"time": now, "wall_s": wall, "productive_s": productive, "restarts": self.restarts}
        fields.update({f"lost_{bucket}_s": seconds for bucket, seconds in lost.items()})
        fields.update(lost_other_s=other, goodput=productive / wall if wall > 0 else 0.0)
        fields.update(self.resumed)
        self.resumed = {}
        return fields
