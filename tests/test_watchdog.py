"""Hangs and stragglers in real multi-process jobs (2 processes x 2 CPU devices, gloo): a process frozen with
SIGSTOP inside a step or inside a restore ends the job within the timeout, the survivor's log names it and the
phase (no stacks, no traceback), and so does the launcher's last line; a process slowed by an injected delay is
named as the straggler, and without the delay none is. Faults come from `SPMDKIT_FAULTS`
(spmdkit/train/health/faults.py), the test-only hook."""

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from support import BIN, job_env

from spmdkit.distributed.initialize import HEARTBEAT_MARGIN, heartbeat_timeout
from spmdkit.errors import SpmdkitError
from spmdkit.train.config import HealthSettings
from spmdkit.train.health.faults import Fault, Faults, parse_fault
from spmdkit.train.health.phases import PhaseClock
from spmdkit.train.health.watchdog import HUNG, describe_laggards

TIMEOUT = 8  # --health.step-timeout and --health.phase-timeout of the hang tests (the other one: 120 s)
# JAX's heartbeat as the jobs ask for it: below the watchdog's timeouts, as its default 30 s is below the default
# 600 s; `spmdkit train` keeps it above them (120 + 60 s here), so the watchdog speaks before JAX aborts the job
HEARTBEAT = "5"
TRAIN = "train --model tiny --mesh fsdp=4 --seq-len 32 --batch-size 8 --eval-every 0 --no-progress --log-every 2"


def _launch(run_dir: Path, *train: str, faults: str = "") -> tuple[subprocess.CompletedProcess, float]:
    """`spmdkit launch --processes 2 -- spmdkit train ...`: its result, and the seconds from the injected freeze
    (its line in the output) to the launcher's exit."""
    command = [f"{BIN}/spmdkit", "launch", "--processes", "2", "--devices-per-process", "2", "--", "spmdkit"]
    command += [*TRAIN.split(), "--run-dir", str(run_dir), *train]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=job_env(SPMDKIT_FAULTS=faults, SPMDKIT_HEARTBEAT_TIMEOUT=HEARTBEAT),
    )
    lines, frozen_at = [], None
    for line in process.stdout:
        lines.append(line)
        if frozen_at is None and "injected fault stop" in line:
            frozen_at = time.monotonic()
    code = process.wait(timeout=300)
    after = time.monotonic() - frozen_at if frozen_at is not None else -1.0
    return subprocess.CompletedProcess(command, code, "".join(lines), ""), after


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def hung_in_a_step(tmp_path_factory):
    """A job whose process 1 freezes as step 12 starts (checkpoints at steps 5 and 10 saved before)."""
    run_dir = tmp_path_factory.mktemp("hang") / "run"
    timeouts = ("--health.step-timeout", str(TIMEOUT), "--health.phase-timeout", "120")
    done, after = _launch(run_dir, "--steps", "30", "--checkpoint-every", "5", *timeouts, faults="1:step=12:stop")
    return run_dir, done, after


@pytest.mark.slow
def test_a_process_frozen_in_a_step_ends_the_job_and_is_named(hung_in_a_step):
    _, done, after = hung_in_a_step
    assert done.returncode == HUNG, done.stdout[-3000:]
    assert 0 <= after <= TIMEOUT + 15, (after, done.stdout[-3000:])
    said = re.search(r"\[0\] spmdkit watchdog: process 0 waited [\d.]+ s in (\w+) of step (\d+)", done.stdout)
    assert said and said[1] in ("step", "wait", "log") and int(said[2]) >= 12, done.stdout[-3000:]
    assert "[0] spmdkit watchdog: not arrived: process 1 (frozen: last seen in step of step 12)" in done.stdout
    assert "[0] spmdkit watchdog: ending process 0 (status 75): it waits for the process(es) above" in done.stdout
    assert "most recent call first" not in done.stdout and "Traceback" not in done.stdout  # no stacks: 1 is to blame
    # the launcher names the process that stopped first, not the first that exited
    failed = re.search(r"^spmdkit launch: failed: (.*)$", done.stdout, re.M)[1]
    assert re.fullmatch(
        r"process 1 stopped responding \d+ s earlier \(last seen in step of step 12\); then process 0 exited with "
        r"status 75; process 1 was killed by SIGKILL",
        failed,
    ), failed


@pytest.mark.slow
def test_without_a_delay_no_straggler_is_named(hung_in_a_step):
    records = _records(hung_in_a_step[0])
    assert [r["step"] for r in records] == [1, 2, 4, 6, 8, 10]  # the logged steps before the freeze
    assert all("slowest_process" in r and "straggler" not in r for r in records)


@pytest.mark.slow
def test_a_process_frozen_in_a_restore_ends_the_job_and_is_named(hung_in_a_step):
    """The frozen job's run resumed (from step 10), process 1 freezing as its restore starts."""
    run_dir = hung_in_a_step[0]
    timeouts = ("--health.step-timeout", "120", "--health.phase-timeout", str(TIMEOUT))
    done, after = _launch(run_dir, "--steps", "30", "--checkpoint-every", "5", *timeouts, faults="1:restore:stop")
    assert done.returncode == HUNG and 0 <= after <= TIMEOUT + 15, (after, done.stdout[-3000:])
    assert re.search(r"\[0\] spmdkit watchdog: process 0 waited [\d.]+ s in \w+", done.stdout), done.stdout[-3000:]
    assert "not arrived: process 1 (frozen: last seen in restore of step 0)" in done.stdout, done.stdout[-3000:]
    assert "spmdkit launch: failed: process 1 stopped responding " in done.stdout, done.stdout[-3000:]
    assert "(last seen in restore of step 0)" in done.stdout.splitlines()[-1]


def test_the_default_deadlines_come_before_jax_heartbeat():
    """`spmdkit train` joins with JAX's heartbeat above its watchdog's deadlines (the longest + 60 s): with the
    defaults 600 s < 1800 s < 1860 s, as in the hang tests 8 s < 120 s < 180 s; a script's plain join keeps 30 s."""
    health = HealthSettings()
    longest = max(health.step_timeout, health.phase_timeout)
    beat = heartbeat_timeout({}, longest)
    assert (health.step_timeout, health.phase_timeout, beat) == (600, 1800, 1800 + HEARTBEAT_MARGIN)
    # the watchdog fires within a second of its deadline, reads the store twice (2 s; 5 s each when it hangs)
    assert health.step_timeout < health.phase_timeout < beat and longest + 1 + 2 + 2 * 5 < beat
    assert TIMEOUT < 120 < heartbeat_timeout({"SPMDKIT_HEARTBEAT_TIMEOUT": HEARTBEAT}, 120) == 180
    assert heartbeat_timeout({}) == 30 and heartbeat_timeout({"SPMDKIT_HEARTBEAT_TIMEOUT": "4000"}, 1800) == 4000


@pytest.mark.slow
def test_a_slowed_process_is_named_the_straggler(tmp_path):
    """Process 1 sleeps 0.3 s in every batch read: within three logged windows its records name it."""
    done, _ = _launch(tmp_path / "run", "--steps", "12", "--checkpoint-every", "0", faults="1:data:delay=0.3")
    assert done.returncode == 0, done.stdout[-3000:]
    records = _records(tmp_path / "run")
    named = [r["step"] for r in records if r.get("straggler") == 1]
    assert named and named[0] <= 8, records  # windows ending at steps 4, 6, 8: the third names it
    assert all(r["slowest_process"] == 1 and r["straggler_lag_s"] > 0.1 for r in records[2:])
    assert "[0] warning: process 1 is a straggler" in done.stdout


# ----------------------------------------------------------------------------------------------- the parts


def test_faults_are_parsed_and_refused_in_one_line():
    assert parse_fault("1:step=5:kill@0") == Fault(1, "step", 5, "kill", 0.0, 0)
    assert parse_fault("*:data:delay=0.25") == Fault(None, "data", None, "delay", 0.25, None)
    for bad in ("1:step:explode", "x:step:kill", "1:step:delay", "1:step=5", "1:step:kill=2"):
        with pytest.raises(SpmdkitError, match="SPMDKIT_FAULTS entry"):
            parse_fault(bad)
    faults = Faults(1, {"SPMDKIT_FAULTS": "0:step:kill;1:data:delay=0.01@1", "SPMDKIT_ATTEMPT": "1"})
    assert [f.process for f in faults.faults] == [1]  # another process's faults are not this one's
    started = time.monotonic()
    faults.at("data", 3)
    assert time.monotonic() - started >= 0.01


def test_phase_deadlines_and_totals():
    clock = PhaseClock(step_timeout=5, phase_timeout=50)
    with clock.phase("restore"):
        assert clock.innermost().timeout == 50
    for step in (11, 12, 13):  # the first two steps of a process get the phase timeout, the rest the step's
        with clock.phase("step", step), clock.phase("wait", step):
            assert clock.innermost().timeout == (50 if step < 13 else 5)
            assert clock.overdue(time.monotonic() + 51).name == "wait"
            assert clock.overdue() is None
    assert clock.step == 13 and clock.totals["step"] >= clock.totals["wait"] > 0 and not clock.open


def test_laggards_from_two_reads():
    first = {0: {"phase": "wait", "step": 7, "seq": 3}, 1: {"phase": "step", "step": 7, "seq": 9}}
    second = {0: {"phase": "wait", "step": 7, "seq": 5}, 1: {"phase": "step", "step": 7, "seq": 9}}
    assert describe_laggards(first, second, 7, 3) == (
        "not arrived: process 1 (frozen: last seen in step of step 7), process 2 (never seen)"
    )
    behind = {1: {"phase": "data", "step": 6, "seq": 10}}
    assert describe_laggards(first, {**second, **behind}, 7, 2) == "not arrived: process 1 (behind: in data of step 6)"
    assert describe_laggards(second, {0: {**second[0], "seq": 6}, **behind}, 6, 2).startswith("not arrived: none")
