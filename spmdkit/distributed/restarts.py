"""Restarting a failed job (`spmdkit launch --max-restarts N`): the progress file its process 0 keeps, and the rule
that decides whether a failure is worth another attempt.

Every attempt's processes get `SPMDKIT_ATTEMPT` (0 first, then 1, 2, ...) and `SPMDKIT_PROGRESS_FILE`: a file the
launcher owns, where the trainer's process 0 keeps `{"step": S, "phase": ..., "attempt": k}` (S: the step it is in,
0 before the first), written atomically. After a failure the launcher reads S: a job that fails again and again at
the same step (a bug, bad data, a node that always dies there) is not helped by restarts, so N restarts in a row at
one step are the most it gets; a failure after progress (a different S) starts the count again. A job that fails
before any step (S 0, no file, or a record of an earlier attempt: step unknown) counts as one place.

Restarts back off: the first after a failure at a new place starts at once, each further one in a row there waits
twice as long as the one before, from 1 s up to `BACKOFF_CAP` (0, 1, 2, 4, ... 60 s). A usage error (status 2: a
bad flag, a bad `--mesh`) would only repeat: it is never restarted. N is at most `MAX_RESTARTS`.

Every process also keeps `SPMDKIT_HEARTBEAT_DIR/process-<i>.json` (its phase and step, rewritten about once a
second while its watchdog runs, removed when it ends): when the job fails, the launcher names a process whose file
stood still (`stalled`) as the one that stopped first, rather than the first to exit.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from spmdkit.errors import SpmdkitError

ATTEMPT = "SPMDKIT_ATTEMPT"  # 0 in a job's first attempt, k in its k-th restart
PROGRESS_FILE = "SPMDKIT_PROGRESS_FILE"  # where process 0 keeps {"step", "phase", "attempt"}
HEARTBEAT_DIR = "SPMDKIT_HEARTBEAT_DIR"  # where each process keeps process-<i>.json, its phase and step, live
UNKNOWN = -1  # the step when the progress file is missing or unreadable
USAGE_ERROR = 2  # the status of a user error (one line, `spmdkit: error: ...`): never restarted
MAX_RESTARTS = 100  # --max-restarts' limit (restarts in a row at one step; progress resets the count)
BACKOFF_CAP = 60.0  # seconds: the longest wait before a restart
STALL = 5.0  # seconds a live process's heartbeat file may stand still before it counts as stopped


def check_max_restarts(max_restarts: int) -> None:
    """--max-restarts N within 0-`MAX_RESTARTS`, else one line naming the limit."""
    if not 0 <= max_restarts <= MAX_RESTARTS:
        raise SpmdkitError(
            f"--max-restarts {max_restarts} must be in 0-{MAX_RESTARTS} (restarts in a row at one step; progress "
            "resets the count; 0: a failure ends the job)"
        )


def backoff(failures: int) -> float:
    """Seconds to wait before the restart after `failures` failures in a row at one place: 0, 1, 2, 4, ... 60."""
    return 0.0 if failures <= 1 else min(BACKOFF_CAP, 2.0 ** min(failures - 2, 16))


def read_record(path: str | os.PathLike | None) -> dict:
    """A progress or heartbeat record (`{"step", "phase", "attempt"}`); {} when missing, unreadable or malformed."""
    try:
        with open(path) as f:  # type: ignore[arg-type]
            record = json.load(f)
    except (OSError, ValueError, TypeError):
        return {}
    return record if isinstance(record, dict) else {}


def read_step(path: str | os.PathLike | None, attempt: int | None = None) -> int:
    """The step the progress file says the job is in; `UNKNOWN` when it is missing, unreadable, malformed or (with
    `attempt`) written by another attempt: one that failed before it wrote a record did not reach a step."""
    record = read_record(path)
    step = record.get("step")
    if attempt is not None and record.get("attempt") != attempt:
        return UNKNOWN
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else UNKNOWN


def stalled(directory: str | os.PathLike, running: Sequence[int], attempt: int) -> str | None:
    """Of the `running` processes, the one whose heartbeat file (of this `attempt`) stood still longest, if longer
    than `STALL` s: 'process 1 stopped responding 14 s earlier (last seen in step of step 12)'; None if none."""
    now, found = time.time(), []
    for process in running:
        path = os.path.join(directory, f"process-{process}.json")
        record = read_record(path)
        try:
            age = now - os.stat(path).st_mtime
        except OSError:
            continue
        if record.get("attempt") == attempt and age > STALL:
            found.append((age, process, record))
    if not found:
        return None
    age, process, record = max(found, key=lambda item: item[0])
    return (
        f"process {process} stopped responding {age:.0f} s earlier (last seen in {record.get('phase')} of step "
        f"{record.get('step')})"
    )


def write_progress(path: str | os.PathLike, step: int, phase: str, attempt: int) -> None:
    """Write the progress file atomically (a temporary file beside it, then `os.replace`): a reader sees the old
    record or the new one, never half of one."""
    temporary = f"{os.fspath(path)}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump({"step": step, "phase": phase, "attempt": attempt}, f)
    os.replace(temporary, path)


def where(step: int) -> str:
    """'at step 7', 'before the first step' (0) or 'at an unknown step' (no progress file)."""
    if step == UNKNOWN:
        return "at an unknown step"
    return "before the first step" if step == 0 else f"at step {step}"


def when(delay: float) -> str:
    return f"in {delay:g} s" if delay else "at once"


@dataclass
class SameStep:
    """The rule: after `max_restarts` restarts in a row at one step, the next failure at that step ends the job.
    `step`: where the last failure happened (0 and unknown are one place: before any step); `failures`: how many
    failures in a row happened there."""

    max_restarts: int
    step: int | None = None
    failures: int = 0

    def failed(self, step: int) -> bool:
        """Count a failure at `step`: True to restart the job, False to give up."""
        place = max(step, 0)
        self.failures = self.failures + 1 if place == self.step else 1
        self.step = place
        return self.failures <= self.max_restarts

    def restart_line(self, failure: str, step: int, attempt: int) -> str:
        """The line a restart prints: `failure` ('process 1 was killed by SIGKILL'), where, when, and which attempt
        (`attempt`: the coming one's SPMDKIT_ATTEMPT; shown counting from 1)."""
        return (
            f"spmdkit launch: {failure} {where(step)}; restarting the job {when(backoff(self.failures))} (attempt "
            f"{attempt + 1}; {self.failures} of {self.max_restarts} restarts at this step)"
        )

    def give_up_line(self, failure: str, step: int) -> str:
        """The line that ends the job once the rule says no more."""
        return (
            f"spmdkit launch: failed: {failure} {where(step)}, {self.failures} times in a row "
            f"(--max-restarts {self.max_restarts}): not restarting"
        )
