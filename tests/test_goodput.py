"""Goodput across a restart: a run killed at step 18 (SIGKILL, `SPMDKIT_FAULTS`) after its checkpoint of step 10
is restarted by `spmdkit launch --max-restarts 1`; it resumes from step 10, and the time it counts as lost to the
restart equals the time the re-run steps (11-17) take, within 20%. The job's totals continue in `metrics.jsonl`
and the summary."""

import json
import os

import pytest
from support import BIN, run_spmdkit

from spmdkit.train.health.goodput import LOST, Goodput
from spmdkit.train.health.phases import PhaseClock

TRAIN = ("train", "--model", "tiny", "--cpu-devices", "8", "--mesh", "fsdp=8", "--steps", "24", "--seq-len", "64")
TRAIN += ("--batch-size", "16", "--eval-every", "0", "--no-progress", "--log-every", "1", "--checkpoint-every", "10")


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """`spmdkit launch --max-restarts 1` of one process killed as step 18 starts in its first attempt; and the
    records as the killed attempt left them (run by hand: the same kill, no launcher)."""
    base = tmp_path_factory.mktemp("goodput")
    killed = run_spmdkit(*TRAIN, "--run-dir", str(base / "killed"), env={"SPMDKIT_FAULTS": "0:step=18:kill"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    first = [json.loads(line) for line in (base / "killed" / "metrics.jsonl").read_text().splitlines()]
    launch = ("launch", "--processes", "1", "--devices-per-process", "8", "--max-restarts", "1", "--", "spmdkit")
    train = [arg for arg in TRAIN if arg not in ("--cpu-devices", "8")]
    env = {"SPMDKIT_FAULTS": "0:step=18:kill@0", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    done = run_spmdkit(*launch, *train, "--run-dir", str(base / "run"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "killed by SIGKILL at step 18; restarting the job at once (attempt 2" in done.stderr, done.stderr[-3000:]
    records = [json.loads(line) for line in (base / "run" / "metrics.jsonl").read_text().splitlines()]
    return first, records, done.stdout


def test_the_time_lost_to_a_restart_is_the_redone_steps_time(restarted):
    first, records, _ = restarted
    assert [r["step"] for r in first] == list(range(1, 18)) and [r["step"] for r in records] == list(range(1, 25))
    resumed = records[10]
    assert resumed["step"] == 11 and resumed["resumed_from"] == 10 and resumed["redone_steps"] == 7
    assert all(r["restarts"] == (r["step"] > 10) for r in records)
    assert sum("resumed_from" in r for r in records) == 1  # the first record after the resume marks it
    rerun = sum(r["step_time_s"] for r in records[10:17])  # steps 11-17, the second time
    assert resumed["lost_redone_s"] == pytest.approx(rerun, rel=0.2)
    assert records[-1]["lost_redone_s"] == resumed["lost_redone_s"]  # no later restart


def test_the_job_totals_add_up(restarted):
    _, records, stdout = restarted
    last = records[-1]
    # the rest: the restart's gap (process start-up before /proc counts it is in start-up), logging
    assert -0.05 < last["lost_other_s"] < 0.2 * last["wall_s"]
    assert last["goodput"] == pytest.approx(last["productive_s"] / last["wall_s"])
    assert last["lost_startup_s"] > last["lost_compile_s"] > 0  # two start-ups, each compiling
    # the job's clock did not start again: from step 10 to the resumed step 11 it counts the redone steps 11-17 of
    # the first attempt and the restart (a comparison with the run killed by hand depends on the compile cache)
    assert records[10]["wall_s"] - records[9]["wall_s"] > records[10]["lost_redone_s"] > 0
    assert "1 restart(s); lost: start-up" in stdout and "redone steps" in stdout


def _record(step: int, productive: float, **lost: float) -> dict:
    values = {bucket: lost.get(bucket, 0.0) for bucket in LOST}
    fields = {f"lost_{bucket}_s": seconds for bucket, seconds in values.items()}
    return {"step": step, "time": 1000.0 + step, "wall_s": 100.0 + step, "productive_s": productive, **fields}


def test_a_resume_moves_the_dropped_steps_productive_time_to_redone():
    records = [_record(4, 2.0, startup=30.0), _record(8, 4.0, startup=30.0), _record(12, 7.0, startup=30.0)]
    records[2]["lost_redone_s"] = 0.5  # an earlier restart's
    goodput = Goodput(PhaseClock(), started=2000.0)
    goodput.resume(records, 8)
    assert goodput.job_start == 1012.0 - 112.0
    assert goodput.carried["productive"] == 4.0 and goodput.carried["redone"] == 0.5 + 3.0
    assert goodput.carried["startup"] == 30.0 and goodput.restarts == 1
    assert goodput.resumed == {"resumed_from": 8, "redone_steps": 4}
    fresh = Goodput(PhaseClock(), started=5.0)
    fresh.resume([{"step": 3, "loss": 1.0}], 3)  # records of an older spmdkit: nothing to continue
    assert fresh.job_start == 5.0 and fresh.restarts == 0
