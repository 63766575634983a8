"""The watchdog: a job that waits too long in one phase ends, saying where it waited and for whom.

Each process runs two daemon threads beside its loop:
- the publisher writes where the process is (`{phase, step, seq}`, `seq` counting up once a second and at each
  phase change, at most every `interval / 2` s) into the job's key-value store (`spmdkit.distributed.kv`) under
  `spmdkit/health/<process>`; process 0 also writes the job's step to `SPMDKIT_PROGRESS_FILE` when `spmdkit launch
  --max-restarts` asks (how the launcher tells a failure that repeats at one step from one that made progress), and
  under `spmdkit launch` every process its phase and step to `SPMDKIT_HEARTBEAT_DIR/process-<i>.json` (a file that
  stands still names the process that stopped first; removed when the watchdog closes);
- the checker looks at the `PhaseClock` every `interval` s. When an open phase is past its deadline (`--health.
  step-timeout` for the steps, `--health.phase-timeout` for restore, compile, the first steps, eval and
  checkpoints), it logs the phase, the processes that have not arrived (a step behind this one, or whose `seq`
  stood still for two reads: frozen), and ends the process with status `HUNG` (75: a temporary failure, worth a
  restart). When no other process is to blame (every one is alive and at this step: a collective or the devices
  hang, or this process itself is late), it dumps every thread's Python stack first (`faulthandler`); a process that
  only waits for the ones named does not. Every process that waits does the same, so the job ends within the
  timeout plus a few seconds, and `spmdkit launch` restarts it under `--max-restarts`.

Joining the job (`jax.distributed.initialize`) has its own deadline, `SPMDKIT_INIT_TIMEOUT` (120 s). JAX's
heartbeat, which ends the whole job without a word when a process stops answering, is set above the longest of the
two timeouts by `spmdkit train` (`spmdkit.distributed.initialize.heartbeat_timeout`): the watchdog speaks first.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

from spmdkit.distributed import kv
from spmdkit.distributed.restarts import HEARTBEAT_DIR, PROGRESS_FILE, write_progress
from spmdkit.train.health.phases import PhaseClock, Span

HUNG = 75  # EX_TEMPFAIL
PREFIX = "spmdkit/health/"


class Watchdog:
    """Publishes where this process is and ends it when `clock` shows a phase past its deadline."""

    def __init__(self, clock: PhaseClock, process: int, processes: int, attempt: int = 0, interval: float = 1.0):
        self.clock, self.process, self.processes, self.attempt = clock, process, processes, attempt
        self.interval, self.seq = interval, 0
        self.progress = Path(os.environ[PROGRESS_FILE]) if process == 0 and os.environ.get(PROGRESS_FILE) else None
        beats = os.environ.get(HEARTBEAT_DIR)
        self.heartbeat = Path(beats) / f"process-{process}.json" if beats else None
        self._written_step: int | None = None
        self._changed, self._closed = threading.Event(), threading.Event()
        self._lock, self._file_lock = threading.Lock(), threading.Lock()
        self._threads = [
            threading.Thread(target=self._publish_loop, name="spmdkit-watchdog-publish", daemon=True),
            threading.Thread(target=self._check_loop, name="spmdkit-watchdog", daemon=True),
        ]
        clock.on_change, clock.before_stop = self._changed.set, self.publish

    def start(self) -> Watchdog:
        """Start the threads, unless there is nothing to watch (both timeouts 0) and no launcher reads progress."""
        if self.clock.step_timeout or self.clock.phase_timeout or self.progress or self.heartbeat:
            for thread in self._threads:
                thread.start()
        return self

    def close(self) -> None:
        with self._file_lock:  # not `_lock`: a put to a frozen store may hold that one forever
            self._closed.set()
            if self.heartbeat is not None:
                self.heartbeat.unlink(missing_ok=True)  # a process past its watchdog is not a frozen one
        self._changed.set()
        self.clock.on_change, self.clock.before_stop = (lambda: None), (lambda: None)

    # -- publishing -------------------------------------------------------------------------------------------

    def publish(self) -> None:
        """Write where this process is now (its heartbeat file, the store, and for process 0 the progress file)."""
        span = self.clock.innermost()
        with self._lock:
            self.seq += 1
            record = {"phase": span.name if span else "idle", "step": self.clock.step, "seq": self.seq}
            self._beat(record)  # first: a store that hangs (process 0 frozen) blocks the put below
            try:
                kv.put(f"{PREFIX}{self.process}", json.dumps(record))
            except Exception:  # noqa: BLE001 - a store that fails is the checker's to report, not this thread's
                pass
            if self.progress is None or record["step"] == self._written_step:
                return
            try:
                write_progress(self.progress, record["step"], record["phase"], self.attempt)
                self._written_step = record["step"]
            except OSError:
                pass  # the launcher then sees no progress: at worst it restarts less

    def _beat(self, record: dict) -> None:
        """Rewrite this process's heartbeat file (the launcher's), unless the watchdog is closed."""
        with self._file_lock:
            if self.heartbeat is not None and not self._closed.is_set():
                try:
                    write_progress(self.heartbeat, record["step"], record["phase"], self.attempt)
                except OSError:
                    pass  # the launcher then names the first process to exit, as without the file

    def _publish_loop(self) -> None:
        while not self._closed.is_set():
            self._changed.wait(self.interval)
            self._changed.clear()
            if not self._closed.is_set():
                self.publish()
                self._closed.wait(self.interval / 2)  # at most two writes a second, however fast the steps

    # -- checking ---------------------------------------------------------------------------------------------

    def _check_loop(self) -> None:
        while not self._closed.wait(self.interval):
            span = self.clock.overdue()
            if span is not None and not self._closed.is_set():
                self.fire(span)

    def fire(self, span: Span) -> None:
        """Log `span` and the processes not arrived, dump the stacks unless others are to blame, end the process
        (status HUNG)."""
        waited = time.monotonic() - span.started
        laggards = self.laggards()
        blamed = laggards.startswith(("not arrived: process", "the job's key-value store"))
        lines = [
            f"spmdkit watchdog: process {self.process} waited {waited:.1f} s in {span.where()} (timeout "
            f"{span.timeout:g} s, --health.{'step' if span.timeout == self.clock.step_timeout else 'phase'}-timeout)",
            f"spmdkit watchdog: {laggards}",
            f"spmdkit watchdog: ending process {self.process} (status {HUNG})"
            + (": it waits for the process(es) above" if blamed else "; its Python stacks follow"),
        ]
        print("\n".join(lines), file=sys.stderr, flush=True)
        if not blamed:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        os._exit(HUNG)

    def laggards(self) -> str:
        """Which processes have not arrived: from two reads of the store `interval * 2` s apart."""
        if self.processes == 1:
            return "this is the only process"
        first = kv.read_dir(PREFIX)
        time.sleep(self.interval * 2)
        second = kv.read_dir(PREFIX)
        if first is None or second is None:
            return "the job's key-value store (process 0) does not answer: process 0 is frozen or gone"
        return describe_laggards(_parse(first), _parse(second), self.clock.step, self.processes)


def _parse(values: dict[str, str]) -> dict[int, dict]:
    found = {}
    for key, value in values.items():
        try:
            found[int(key.rsplit("/", 1)[-1])] = json.loads(value)
        except (ValueError, TypeError):
            continue
    return found


def describe_laggards(first: dict[int, dict], second: dict[int, dict], step: int, processes: int) -> str:
    """'not arrived: process 1 (frozen: last seen in step of step 7), ...' from two reads of every process's record;
    a process absent from the store never published (it did not start, or died before)."""
    named = []
    for process in range(processes):
        now, before = second.get(process), first.get(process)
        if now is None:
            named.append(f"process {process} (never seen)")
        elif before is not None and now["seq"] == before["seq"]:
            named.append(f"process {process} (frozen: last seen in {now['phase']} of step {now['step']})")
        elif now["step"] < step:
            named.append(f"process {process} (behind: in {now['phase']} of step {now['step']})")
    if not named:
        return "not arrived: none found (every process is alive and at this step: a collective or the devices hang)"
    return "not arrived: " + ", ".join(named)
