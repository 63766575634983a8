"""`spmdkit launch --max-restarts N`: a failed job is started again, whole, with real processes (a tiny child script
that fails on purpose in chosen attempts, and `spmdkit train` killed at random moments), the same-step rule that ends
a job that keeps failing at one step, Ctrl-C / SIGTERM never restarting, and the same loop in the sbatch script."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from support import BIN, error_lines, run_spmdkit

from spmdkit.distributed.restarts import BACKOFF_CAP, MAX_RESTARTS, SameStep, backoff, read_step, write_progress
from spmdkit.distributed.slurm import sbatch_script

# Process 0 writes the progress file (when the plan gives a step) and waits to be stopped; process 1 waits until
# that record is there, then fails as the plan says. An attempt past the plan's end succeeds.
CHILD = """
import json, os, signal, sys, time
attempt, me = int(os.environ["SPMDKIT_ATTEMPT"]), int(os.environ["SPMDKIT_PROCESS_ID"])
plan, progress = json.loads(sys.argv[1]), os.environ["SPMDKIT_PROGRESS_FILE"]
print(f"attempt {attempt} progress {progress}", flush=True)
if attempt >= len(plan):
    sys.exit(0)
step, action = plan[attempt]
if me == 0:
    if step is not None:
        with open(progress + ".tmp", "w") as f:
            json.dump({"step": step, "phase": "step", "attempt": attempt}, f)
        os.replace(progress + ".tmp", progress)
    time.sleep(60)
if step is not None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with open(progress) as f:
                if json.load(f)["attempt"] == attempt:
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
if action == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if action == "sleep":
    time.sleep(60)
sys.exit(1)
"""


def _launch(tmp_path: Path, plan: list, max_restarts: int, *flags: str) -> subprocess.CompletedProcess:
    """`spmdkit launch --processes 2 --max-restarts N -- python CHILD PLAN`."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    launch = ["launch", "--processes", "2", "--platform", "cpu", "--max-restarts", str(max_restarts), *flags, "--"]
    return run_spmdkit(*launch, sys.executable, str(script), json.dumps(plan), timeout=120)


def _restarts(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "restarting the job" in line]


def _failures(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("spmdkit launch: failed: ")]


# ----------------------------------------------------------------------------------------------- the rule


def test_progress_file_and_the_same_step_rule(tmp_path):
    path = tmp_path / "progress.json"
    assert read_step(path) == -1  # missing: unknown
    write_progress(path, 7, "step", 1)
    assert read_step(path) == 7 and json.loads(path.read_text()) == {"step": 7, "phase": "step", "attempt": 1}
    assert read_step(path, 1) == 7 and read_step(path, 2) == -1  # attempt 2 wrote nothing: it reached no step
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]  # no temporary file left
    for broken in ("", "{", "[1]", '{"step": "7"}', '{"step": -3}', '{"step": true}'):
        path.write_text(broken)
        assert read_step(path) == -1, broken
    rule = SameStep(2)
    assert [rule.failed(step) for step in (5, 5, 5)] == [True, True, False]  # 2 restarts at 5, then no more
    assert rule.give_up_line("process 1 exited with status 1", 5) == (
        "spmdkit launch: failed: process 1 exited with status 1 at step 5, 3 times in a row (--max-restarts 2): "
        "not restarting"
    )
    rule = SameStep(2)
    assert all(rule.failed(step) for step in (1, 2, 3, 4, 5, 6))  # progress each time: never gives up
    assert [rule.failed(step) for step in (-1, 0, -1)] == [True, True, False]  # unknown and 0: before any step
    assert SameStep(0).failed(3) is False
    assert [backoff(n) for n in range(1, 10)] == [0, 1, 2, 4, 8, 16, 32, BACKOFF_CAP, BACKOFF_CAP]
    assert backoff(MAX_RESTARTS + 1) == BACKOFF_CAP == 60


# ----------------------------------------------------------------------------------------------- local processes


def test_failed_attempts_are_restarted_and_the_job_finishes(tmp_path):
    """Fails at step 3 (exit 1), then at step 5 (SIGKILL), then succeeds: 3 attempts, each told its number and the
    progress file, one line per restart; the progress file's directory is gone at the end."""
    done = _launch(tmp_path, [[3, "exit"], [5, "kill"]], 1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _restarts(done.stderr) == [
        "spmdkit launch: process 1 exited with status 1 at step 3; restarting the job at once (attempt 2; 1 of 1 "
        "restarts at this step)",
        "spmdkit launch: process 1 was killed by SIGKILL at step 5; restarting the job at once (attempt 3; 1 of 1 "
        "restarts at this step)",
    ]
    assert not _failures(done.stderr)
    assert len(re.findall(r"^spmdkit launch: (attempt \d: )?2 process\(es\) at ", done.stderr, re.M)) == 3
    for attempt in range(3):
        assert f"spmdkit launch: attempt {attempt + 1}: 2 process(es)" in done.stderr or attempt == 0
        for process in (0, 1):
            assert re.search(rf"^\[{process}\] attempt {attempt} progress ", done.stdout, re.M), done.stdout
    progress = {line.split(" progress ")[1] for line in done.stdout.splitlines()}
    assert len(progress) == 1 and not Path(progress.pop()).parent.exists()


def test_a_job_failing_at_the_same_step_ends_with_one_line(tmp_path):
    done = _launch(tmp_path, [[7, "exit"]] * 10, 3)
    assert done.returncode == 1, done.stderr[-3000:]
    restarts = _restarts(done.stderr)
    assert [re.search(r"job (.*) \(attempt (\d); (\d) of 3 restarts", line).groups() for line in restarts] == [
        ("at once", "2", "1"),  # backing off: 0 s, 1 s, 2 s
        ("in 1 s", "3", "2"),
        ("in 2 s", "4", "3"),
    ]
    assert _failures(done.stderr) == [
        "spmdkit launch: failed: process 1 exited with status 1 at step 7, 4 times in a row (--max-restarts 3): "
        "not restarting"
    ]
    assert "attempt 4 progress" not in done.stdout


def test_progress_resets_the_count(tmp_path):
    """--max-restarts 2, five failures at five steps: progress each time, so the job goes on and finishes."""
    done = _launch(tmp_path, [[step, "kill"] for step in (2, 4, 6, 8, 10)], 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_restarts(done.stderr)) == 5 and all("1 of 2 restarts" in line for line in _restarts(done.stderr))
    assert "[0] attempt 5 progress" in done.stdout


def test_failing_before_any_step_counts_too(tmp_path):
    """No progress file ever (step unknown): N restarts, then one line and the failing status (SIGKILL: 137)."""
    done = _launch(tmp_path, [[None, "kill"]] * 5, 2)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-3000:]
    assert len(_restarts(done.stderr)) == 2
    assert _failures(done.stderr) == [
        "spmdkit launch: failed: process 1 was killed by SIGKILL at an unknown step, 3 times in a row "
        "(--max-restarts 2): not restarting"
    ]


def test_without_max_restarts_a_failure_ends_the_job_as_before(tmp_path):
    done = _launch(tmp_path, [[3, "exit"]], 0)
    assert done.returncode == 1 and not _restarts(done.stderr)
    assert _failures(done.stderr) == [
        "spmdkit launch: failed: process 1 exited with status 1; then process 0 was killed by SIGTERM"
    ]


def test_sigterm_to_the_launcher_stops_and_never_restarts(tmp_path):
    script, err = tmp_path / "child.py", tmp_path / "err.txt"
    script.write_text(CHILD)
    launch = [f"{BIN}/spmdkit", "launch", "--processes", "2", "--platform", "cpu", "--max-restarts", "3", "--"]
    with open(err, "w") as e:
        proc = subprocess.Popen([*launch, sys.executable, str(script), json.dumps([[4, "sleep"]])], stderr=e)
    try:
        deadline = time.monotonic() + 30
        while "pids" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    assert "spmdkit launch: interrupted: " in err.read_text() and not _restarts(err.read_text())


def test_false_is_restarted_with_backoff_and_ends_within_its_schedule(tmp_path):
    """`launch --max-restarts 3 -- false` (the audit's case, with fewer restarts): 3 restarts, the first at once,
    then after 1 s and 2 s; then one line. It ends within its schedule (3 s, plus starting `false` four times) and
    the launcher and its children stay small (peak RSS)."""
    measure = "import resource, subprocess, sys; subprocess.run(sys.argv[1:]); "
    measure += "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)"
    started = time.monotonic()
    command = [sys.executable, "-c", measure, f"{BIN}/spmdkit", "launch", "--max-restarts", "3", "--", "false"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    lines = done.stderr.splitlines()
    waits = [re.search(r"job (.*) \(attempt", line)[1] for line in _restarts(done.stderr)]
    assert waits == ["at once", "in 1 s", "in 2 s"], done.stderr
    assert _failures(done.stderr) == [
        "spmdkit launch: failed: process 0 exited with status 1 at an unknown step, 4 times in a row "
        "(--max-restarts 3): not restarting"
    ]
    assert 3 <= elapsed < 3 + 60, (elapsed, done.stderr)  # the waits' sum; starting Python and `false` the rest
    assert int(lines[-1]) < 2**20, lines[-1]  # KiB: under 1 GB


def test_a_usage_error_is_never_restarted():
    """A bad --mesh: every process exits 2 at once; the launcher says so and does not restart."""
    launch = ["launch", "--processes", "2", "--platform", "cpu", "--max-restarts", "3", "--"]
    path = {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = run_spmdkit(*launch, "spmdkit", "train", "--mesh", "nonsense=2", timeout=120, env=path)
    assert done.returncode == 2 and not _restarts(done.stderr), done.stderr[-3000:]
    assert "(status 2: a usage error, never restarted)" in _failures(done.stderr)[0], done.stderr[-3000:]
    assert "attempt 2" not in done.stderr


@pytest.mark.parametrize("slurm", [False, True])
@pytest.mark.parametrize("count", ["-1", str(MAX_RESTARTS + 1), "1000000000"])
def test_max_restarts_out_of_range_is_refused(slurm, count, monkeypatch):
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    where = ["--slurm", "--nodes", "2", "--dry-run"] if slurm else ["--processes", "2"]
    done = run_spmdkit("launch", *where, "--max-restarts", count, "--", "spmdkit", "train")
    assert done.returncode == 2 and done.stdout == ""
    assert error_lines(done.stderr) == [
        f"spmdkit: error: --max-restarts {count} must be in 0-100 (restarts in a row at one step; progress resets "
        "the count; 0: a failure ends the job)"
    ], done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------------------- SLURM

# srun emulated: each call logs its attempt and coordinator, then does what line N of `plan` says: "STEP STATUS"
# (process 0's progress record, then that exit status; STEP "-": no record) or "ok".
FAKE_SRUN = """#!/bin/bash
calls=$(( $(cat "$LOG" 2>/dev/null | wc -l) + 1 ))
echo "attempt=$SPMDKIT_ATTEMPT coordinator=$SPMDKIT_COORDINATOR progress=$SPMDKIT_PROGRESS_FILE" >> "$LOG"
read -r step status < <(sed -n "${calls}p" "$PLAN")
[ "$step" = ok ] && exit 0
[ "$step" = term ] && { kill -TERM "$PPID"; exit 1; }
record="{\\"step\\": $step, \\"phase\\": \\"step\\", \\"attempt\\": $SPMDKIT_ATTEMPT}"
[ "$step" = - ] || echo "$record" > "$SPMDKIT_PROGRESS_FILE"
exit "$status"
"""


def _run_script(tmp_path: Path, plan: list[str], max_restarts: int) -> tuple[subprocess.CompletedProcess, list]:
    """The sbatch script of `--max-restarts N` run under SLURM's variables (srun and scontrol emulated): (what it
    did, the attempts srun saw as (SPMDKIT_ATTEMPT, coordinator, progress file))."""
    (tmp_path / "srun").write_text(FAKE_SRUN)
    (tmp_path / "scontrol").write_text("#!/bin/bash\necho node01; echo node02\n")
    for name in ("srun", "scontrol"):
        (tmp_path / name).chmod(0o755)
    (tmp_path / "plan").write_text("".join(f"{line}\n" for line in plan))
    script = sbatch_script(["spmdkit", "train"], 2, 4, max_restarts=max_restarts)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "42", "TMPDIR": str(tmp_path)}
    env.update(SLURM_JOB_NODELIST="node[01-02]", SLURM_CPUS_PER_TASK="8")
    env.update(LOG=str(tmp_path / "log"), PLAN=str(tmp_path / "plan"))
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    calls = [re.match(r"attempt=(\d+) coordinator=(\S+) progress=(\S+)", line).groups() for line in open(env["LOG"])]
    assert not list(tmp_path.glob("spmdkit-42.*")), "the progress directory is left behind"
    return done, calls


def test_slurm_script_restarts_a_failed_step(tmp_path):
    """srun fails twice (at steps 3 and 5), then succeeds: the script exits 0 after 3 attempts, each with its
    SPMDKIT_ATTEMPT, its own coordinator port and the progress file in one directory on this node."""
    done, calls = _run_script(tmp_path, ["3 1", "5 137", "ok"], 3)
    assert done.returncode == 0, done.stderr
    assert [(a, c) for a, c, _ in calls] == [("0", "node01:20042"), ("1", "node01:20043"), ("2", "node01:20044")]
    assert len({p for _, _, p in calls}) == 1 and calls[0][2].startswith(f"{tmp_path}/spmdkit-42.")
    assert done.stderr.splitlines() == [
        "spmdkit launch: srun exited with status 1 at step 3; restarting the job at once (attempt 2; 1 of 3 "
        "restarts at this step)",
        "spmdkit launch: srun exited with status 137 at step 5; restarting the job at once (attempt 3; 1 of 3 "
        "restarts at this step)",
    ]


def test_slurm_script_gives_up_at_the_same_step(tmp_path):
    done, calls = _run_script(tmp_path, ["7 3"] * 10, 3)
    assert done.returncode == 3 and len(calls) == 4, done.stderr
    lines = done.stderr.splitlines()
    assert [re.search(r"job (.*) \(attempt \d; (\d) of 3 restarts", line).groups() for line in lines[:-1]] == [
        ("at once", "1"),
        ("in 1 s", "2"),
        ("in 2 s", "3"),
    ]
    assert lines[-1] == (
        "spmdkit launch: failed: srun exited with status 3 at step 7, 4 times in a row (--max-restarts 3): "
        "not restarting"
    )


def test_slurm_script_progress_and_unknown_steps(tmp_path):
    """Progress resets the count (4 failures at 4 steps with --max-restarts 1); failing before any step (no
    record: unknown) counts as one place."""
    done, calls = _run_script(tmp_path, ["1 1", "2 1", "3 1", "4 1", "ok"], 1)
    assert done.returncode == 0 and len(calls) == 5, done.stderr
    (tmp_path / "unknown").mkdir()
    done, calls = _run_script(tmp_path / "unknown", ["- 1", "- 1"], 1)
    assert done.returncode == 1 and len(calls) == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "spmdkit launch: failed: srun exited with status 1 at an unknown step, 2 times in a row "
        "(--max-restarts 1): not restarting"
    )
    (tmp_path / "stale").mkdir()  # attempt 1 fails before it writes a record: attempt 0's step 5 is not its own
    done, calls = _run_script(tmp_path / "stale", ["5 1", "- 1", "ok"], 1)
    assert done.returncode == 0 and len(calls) == 3 and "at an unknown step; restarting" in done.stderr, done.stderr
    (tmp_path / "usage").mkdir()  # a usage error: never restarted
    done, calls = _run_script(tmp_path / "usage", ["3 2", "ok"], 3)
    assert done.returncode == 2 and len(calls) == 1, done.stderr
    assert done.stderr.splitlines() == [
        "spmdkit launch: failed: srun exited with status 2 at step 3 (status 2: a usage error, never restarted)"
    ]


def test_slurm_script_never_restarts_after_sigterm(tmp_path):
    """scancel or the time limit (SIGTERM to the batch script) while srun runs: srun's status, no restart."""
    done, calls = _run_script(tmp_path, ["term", "ok"], 3)
    assert done.returncode == 1 and len(calls) == 1 and "restarting" not in done.stderr, done.stderr


def test_slurm_dry_run_with_max_restarts(monkeypatch, capsys):
    from spmdkit.cli import main

    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert (
        main(["launch", "--slurm", "--nodes", "2", "--max-restarts", "2", "--dry-run", "--", "spmdkit", "train"]) == 0
    )
    script = capsys.readouterr().out
    assert "max_restarts=2 attempt=0" in script and "--kill-on-bad-exit=1" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


# ----------------------------------------------------------------------------------------------- end to end

STEPS = 14
TRAIN = ["spmdkit", "train", "--model", "tiny", "--mesh", "fsdp=4", "--steps", str(STEPS), "--seq-len", "32"]
TRAIN += ["--batch-size", "8", "--eval-every", "0", "--log-every", "1", "--checkpoint-every", "2", "--no-progress"]


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's whole records, read while the job writes it (a partial last line is left out)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.split("\n")[:-1]:
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


def _losses(run_dir: Path) -> dict[int, tuple]:
    """step -> (loss, grad_norm) of the records that have a loss; the last record of a step wins (a resumed job
    logs again the steps after its checkpoint)."""
    return {r["step"]: (r["loss"], r.get("grad_norm")) for r in _records(run_dir) if "loss" in r}


def _final_params(run_dir: Path) -> dict[str, np.ndarray]:
    from spmdkit.checkpoint.manager import Checkpointer

    checkpointer = Checkpointer(run_dir / "checkpoints", read_only=True)
    try:
        assert checkpointer.steps()[-1] == STEPS
        state = checkpointer.read_state(STEPS)
        return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)}
    finally:
        checkpointer.close()


def _launch_train(run_dir: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    launch = [f"{BIN}/spmdkit", "launch", "--processes", "2", "--devices-per-process", "2", *flags, "--"]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "JAX_PLATFORMS": "cpu"}
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*launch, *TRAIN, "--run-dir", str(run_dir)], stdout=out, stderr=out, env=env)
    return proc, log


def _pids(log: Path) -> list[int]:
    """The pids of the processes the launcher started last (its latest 'pids' line)."""
    return [int(p) for p in re.findall(r"^spmdkit launch: .*, pids (.*)$", log.read_text(), re.M)[-1].split(", ")]


@pytest.mark.slow
def test_a_job_killed_five_times_trains_like_an_uninterrupted_one(tmp_path):
    """`spmdkit launch --max-restarts 3 -- spmdkit train`, a random process SIGKILLed at 5 random moments (each after
    the job made progress since the last): the job finishes by itself, with the per-step losses and the final
    parameters of an uninterrupted run, bit for bit."""
    straight, log = _launch_train(tmp_path / "straight")
    assert straight.wait(timeout=300) == 0, log.read_text()[-3000:]
    expected = _losses(tmp_path / "straight")
    assert sorted(expected) == list(range(1, STEPS + 1))

    run_dir, rng = tmp_path / "killed", random.Random(0)
    proc, log = _launch_train(run_dir, "--max-restarts", "3")
    killed = []
    try:
        for kill in range(1, 6):
            deadline = time.monotonic() + 120
            while max(_losses(run_dir), default=0) < 2 * kill:  # progress since the last kill (it was before 2k-1)
                assert proc.poll() is None, f"the job ended before kill {kill}: {log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 0.3))
            victim = rng.choice(_pids(log))
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
        code = proc.wait(timeout=240)
    finally:
        proc.kill()
        proc.wait()
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert len(set(killed)) == 5 and len(_restarts(output)) == 5, output[-3000:]
    assert all(" was killed by SIGKILL at step " in line for line in _restarts(output)), _restarts(output)
    # a survivor says in one line that a peer is gone, or is stopped by the launcher first: never a traceback
    assert "Traceback" not in output, output[-3000:]
    assert _losses(run_dir) == expected
    records = _records(run_dir)  # each step once: a resumed attempt drops the records it writes again
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and records[-1]["restarts"] == 5
    assert 1 <= sum("resumed_from" in r for r in records) <= 5  # marks (a restart's mark is dropped by the next)
    found, wanted = _final_params(run_dir), _final_params(tmp_path / "straight")
    assert found.keys() == wanted.keys()
    for key in wanted:
        np.testing.assert_array_equal(found[key], wanted[key], err_msg=key)
