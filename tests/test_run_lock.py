"""One writer per run directory (`spmdkit.rundir.lock`): two trainers started together on one run directory,
a lock left by a killed process, and a refused acquirer that leaves nothing behind."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from support import error_lines

from spmdkit.errors import SpmdkitError
from spmdkit.rundir.lock import LOCK_FILE, RunLock, RunLockWarning

TRAIN = ("--seq-len", "32", "--batch-size", "8", "--dtype", "float32", "--eval-every", "0", "--no-progress")
TRAIN += ("--cpu-devices", "8", "--mesh", "fsdp=8", "--checkpoint-every", "2")


def _strict_json(line: str):
    def refuse(constant):
        raise ValueError(f"bare {constant} in metrics.jsonl")

    return json.loads(line, parse_constant=refuse)


def _check_run(run_dir, previous: int, steps: int, log_every: int) -> None:
    """metrics.jsonl: strict JSON, each step once and in order, this trial's (steps `previous` + 1 to `steps`) those
    its winner logs: the first, every `log_every`-th, the last; config.json and the newest checkpoint's saved config:
    the winner's settings."""
    records = [_strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records]
    assert logged == sorted(set(logged)), logged
    expected = sorted({previous + 1, steps, *range(log_every, steps + 1, log_every)} - set(range(previous + 1)))
    assert [s for s in logged if s > previous] == expected, logged
    config = json.loads((run_dir / "config.json").read_text())
    saved = json.loads((run_dir / "checkpoints" / str(steps) / "config" / "metadata").read_text())
    assert config["run"]["steps"] == saved["run"]["steps"] == steps
    assert config["run"]["log_every"] == saved["run"]["log_every"] == log_every
    assert config["run"]["seed"] == saved["run"]["seed"] == 0
    assert not (run_dir / LOCK_FILE).exists()


def test_two_trainers_on_one_run_directory_one_runs_one_is_refused(tmp_path):
    """3 times, two `spmdkit train` started together on one run directory (each trial resumes the run the last one
    left, 4 steps further; the two differ in --log-every, which config.json records): one runs, the other is refused
    in one line naming the holder's pid, and the run left behind is consistent. Before the first, a lock file left by
    a killed trainer: the winner takes it over with a warning naming it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"host": socket.gethostname(), "pid": int(dead.stdout), "command": "spmdkit train", "since": "earlier"}
    (run_dir / LOCK_FILE).write_text(json.dumps(stale))
    for trial in range(1, 4):
        steps = 4 * trial
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "spmdkit",
                    "train",
                    *TRAIN,
                    "--steps",
                    str(steps),
                    "--log-every",
                    str(every),
                    "--run-dir",
                    str(run_dir),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for every in (1, 2)
        ]
        done = [(p, *p.communicate(timeout=300)) for p in procs]
        codes = sorted(p.returncode for p, _, _ in done)
        assert codes == [0, 2], [(p.returncode, err[-1500:]) for p, _, err in done]
        (winner, _, won), (_, _, refused) = sorted(done, key=lambda d: d[0].returncode)
        assert error_lines(refused) == [refused.strip()], refused
        assert f"is in use by spmdkit train (pid {winner.pid} on host {socket.gethostname()}" in refused
        assert "Traceback" not in won + refused and not error_lines(won)
        if trial == 1:
            assert f"took over the lock of {run_dir} left by spmdkit train (pid {stale['pid']}" in won
            assert "it is no longer running" in won
        _check_run(run_dir, steps - 4, steps, 1 if winner is procs[0] else 2)


def _holder(path):
    """A process holding the lock of `path` until killed; its pid once it holds it."""
    code = (
        "import sys; from spmdkit.rundir.lock import RunLock; lock = RunLock(sys.argv[1], 'spmdkit train'); "
        "print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_refuses_and_a_killed_holders_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        with pytest.raises(SpmdkitError) as refused:
            RunLock(run, "spmdkit ckpt export", "--out")
        message = str(refused.value)
        assert f"--out {run} is in use by spmdkit train (pid {holder.pid} on host {socket.gethostname()}" in message
        assert "\n" not in message
        # A refused acquirer of a directory it had to make removes it again.
        with pytest.raises(SpmdkitError):
            RunLock(run, "spmdkit train")
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    with pytest.warns(RunLockWarning, match=rf"left by spmdkit train \(pid {holder.pid} on host .*no longer running"):
        lock = RunLock(run, "spmdkit train")
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / LOCK_FILE).exists()
    with RunLock(run, "spmdkit train"):  # a clean release leaves no record: no warning
        pass


def test_a_lock_on_a_new_directory_refused_later_removes_what_it_made(tmp_path):
    new = tmp_path / "a" / "b"
    lock = RunLock(new, "spmdkit train")
    assert new.is_dir()
    lock.release(failed=True)
    assert not (tmp_path / "a").exists()


def test_with_two_processes_process_0_holds_the_lock_and_both_learn_the_verdict(tmp_path):
    """`spmdkit launch` of a 2-process trainer on a run directory whose lock another process holds: process 0 is
    refused, process 1 learns it from process 0 before writing anything; the directory is left as it was."""
    from pathlib import Path

    run = tmp_path / "run"
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "SPMDKIT_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", JAX_PLATFORMS="cpu")
    at = TRAIN.index("--cpu-devices")
    train = [*TRAIN[:at], *TRAIN[at + 2 :]]  # the launcher gives each process its devices
    with RunLock(run, "spmdkit train"):
        before = (run / LOCK_FILE).read_text()
        done = subprocess.run(
            [f"{bin_dir}/spmdkit", "launch", "--processes", "2", "--devices-per-process", "4", "--", "spmdkit",
             "train", *train, "--steps", "2", "--run-dir", str(run)],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert done.returncode != 0, done.stderr[-2000:]
        lines = done.stderr.splitlines()
        assert any(line.startswith(f"[0] spmdkit: error: --run-dir {run} is in use by spmdkit train") for line in lines)
        assert any(line.startswith(f"[1] spmdkit: error: process 0: --run-dir {run} is in use by") for line in lines)
        assert "Traceback" not in done.stderr
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE] and (run / LOCK_FILE).read_text() == before
