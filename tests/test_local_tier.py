"""The local checkpoint tier (`--checkpoint.local-dir`, `spmdkit.checkpoint.tiers`): a SIGKILL loses at most the
steps since the last local save and the resumed run is bit-identical to an uninterrupted one; restore takes the
newest intact step of either tier; bad local directories are refused in one line. A job on two (emulated) hosts keeps
each process's local steps apart, resumes from the newest step both hold, and refuses in one line when none is.

Real Orbax on real directories throughout; the kill is the test-only fault injection of `SPMDKIT_FAULTS`.
"""

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from fixtures import (
    abstract,  # noqa: F401 - a fixture: the tests name it as an argument
    random_state,
    shardings_for,
    synthetic_stream,
)
from support import file_hashes, flip_byte, job_env, read_only_dir, run_spmdkit

from spmdkit.checkpoint.layout import PER_PROCESS, process_directory
from spmdkit.checkpoint.manager import Checkpointer, CheckpointWarning
from spmdkit.checkpoint.tiers import LocalTier
from spmdkit.cli import main
from spmdkit.errors import SpmdkitError
from spmdkit.rundir.lock import LOCK_FILE, RunLock
from spmdkit.train.config import TrainConfig

STEPS = 12
TRAIN = "train --model tiny --cpu-devices 8 --mesh fsdp=8 --seq-len 32 --batch-size 8 --eval-every 0 --no-progress"
TIERS = ["--steps", str(STEPS), "--log-every", "1", "--checkpoint-every", "10", "--checkpoint.local-every", "2"]


def _train(root: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`spmdkit train` of STEPS steps, persistent tier every 10 steps, local tier (`root/local`) every 2."""
    args = [*TRAIN.split(), *TIERS, "--run-dir", str(root / "run"), "--checkpoint.local-dir", str(root / "local")]
    return run_spmdkit(*args, env=env, timeout=240)


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of RUN/metrics.jsonl (a resumed run writes the later steps again: the last record wins)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _final_params(run_dir: Path) -> dict[str, np.ndarray]:
    checkpointer = Checkpointer(run_dir / "checkpoints", read_only=True)
    try:
        assert checkpointer.steps()[-1] == STEPS
        tree = checkpointer.read_state(STEPS)
    finally:
        checkpointer.close()
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.slow
def test_sigkill_at_step_9_resumes_from_local_step_8_bit_identically(tmp_path):
    straight = _train(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]

    killed = _train(tmp_path / "killed", env={"SPMDKIT_FAULTS": "0:step=9:kill"})
    assert killed.returncode == -9, (killed.stdout + killed.stderr)[-3000:]
    local = tmp_path / "killed" / "local"
    assert sorted(p.name for p in local.iterdir() if p.name.isdigit()) == ["6", "8"]  # keep 2, each complete
    assert not [p for p in (tmp_path / "killed" / "run" / "checkpoints").iterdir() if p.name.isdigit()]

    resumed = _train(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 8 of" in resumed.stdout  # at most 1 step lost
    assert "Traceback" not in resumed.stdout + resumed.stderr
    want, got = _losses(tmp_path / "straight" / "run"), _losses(tmp_path / "killed" / "run")
    assert sorted(want) == list(range(1, STEPS + 1)) and got == want
    params, resumed_params = _final_params(tmp_path / "straight" / "run"), _final_params(tmp_path / "killed" / "run")
    assert resumed_params.keys() == params.keys() and params
    for key, value in params.items():
        np.testing.assert_array_equal(resumed_params[key], value, err_msg=key)


def _tiers(persistent: Checkpointer, local: Checkpointer) -> Checkpointer:
    """The persistent store holding the local one as its local tier (what `tiers.open_checkpointer` builds)."""
    persistent.local = LocalTier(local)
    return persistent


def _restore(tiers: Checkpointer, abstract, shardings):  # noqa: F811 - the fixture
    """(step, state, directory it came from, the steps warned about as damaged) of `restore_latest`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, state = tiers.restore_latest(abstract, shardings, synthetic_stream().iterator)
    damaged = [int(str(w.message).split()[2]) for w in caught if issubclass(w.category, CheckpointWarning)]
    return step, state, tiers.restored_from, damaged


def _assert_same(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_newest_intact_step_of_either_tier_wins(tmp_path, abstract):  # noqa: F811 - the fixture
    shardings = shardings_for(abstract, "fsdp=8")
    persistent, local = tmp_path / "persistent", tmp_path / "local"
    tiers = _tiers(Checkpointer(persistent, every=5, keep=3), Checkpointer(local, every=2, keep=2))
    stream, config, states = synthetic_stream(), json.loads(TrainConfig().to_json()), {}
    for step in range(1, 11):
        next(stream)
        if tiers.due(step):
            states[step] = random_state(abstract, shardings, seed=step)
            assert tiers.save(step, states[step], stream.iterator, config)
    tiers.close()
    # Step 10, due on both tiers, is saved once (persistent); the local tier keeps its newest 2.
    assert sorted(states) == [2, 4, 5, 6, 8, 10]
    assert Checkpointer(persistent).steps() == [5, 10] and Checkpointer(local).steps() == [6, 8]

    def reopen():
        return _tiers(Checkpointer(persistent, every=5, keep=3), Checkpointer(local, every=2, keep=2))

    step, state, where, damaged = _restore(reopen(), abstract, shardings)
    assert (step, where, damaged) == (10, persistent, [])  # the persistent tier's newest is newer than the local's
    _assert_same(state, states[10])

    # Both tiers' newest damaged: persistent 10 falls back below local 8, local 8 to 6, which beats persistent 5.
    flip_byte(persistent / "10" / "state", "model.embedding")
    flip_byte(local / "8" / "state", "model.embedding")
    step, state, where, damaged = _restore(reopen(), abstract, shardings)
    assert (step, where, sorted(damaged)) == (6, local, [8, 10])  # each warned about once
    _assert_same(state, states[6])
    assert {p.name.split(".")[0] for p in [*persistent.iterdir(), *local.iterdir()] if ".damaged-" in p.name} == {
        "8",
        "10",
    }  # set aside: training may save those steps again

    flip_byte(local / "6" / "state", "model.embedding")  # every local step damaged: the persistent tier's 5
    step, state, where, damaged = _restore(reopen(), abstract, shardings)
    assert (step, where, damaged) == (5, persistent, [6])
    _assert_same(state, states[5])


def test_a_local_tier_per_process_checks_its_own_part_and_its_layout(tmp_path, abstract):  # noqa: F811 - the fixture
    """A `PER_PROCESS` store (the local tier of a job on several hosts), in one process: its steps restore with
    this process's checksums (a damaged one falls back); a step of another mesh is not read: with no persistent step
    the run is refused in one line, else it resumes from the persistent step and sets the newer local one aside."""
    shardings = shardings_for(abstract, "fsdp=8")
    persistent, local = tmp_path / "persistent", tmp_path / "local"

    def tiers():
        local_tier = Checkpointer(process_directory(local), every=2, keep=2, layout=PER_PROCESS)
        return _tiers(Checkpointer(persistent, every=5, keep=3), local_tier)

    saving, stream, config, states = tiers(), synthetic_stream(), json.loads(TrainConfig().to_json()), {}
    for step in range(1, 9):
        next(stream)
        if saving.due(step):
            states[step] = random_state(abstract, shardings, seed=step)
            assert saving.save(step, states[step], stream.iterator, config)
    saving.close()
    assert _steps(local / "process-0") == ["6", "8"] and _steps(persistent) == ["5"]
    step, state, where, damaged = _restore(tiers(), abstract, shardings)
    assert (step, where, damaged) == (8, local / "process-0", [])
    _assert_same(state, states[8])

    flip_byte(local / "process-0" / "8" / "state", "model.embedding")
    step, state, where, damaged = _restore(tiers(), abstract, shardings)
    assert (step, where, damaged) == (6, local / "process-0", [8])
    _assert_same(state, states[6])

    other = shardings_for(abstract, "fsdp=4,tensor=2")  # another mesh: not read; with no persistent step, refused
    persistent.rename(tmp_path / "elsewhere")
    with pytest.raises(SpmdkitError, match="step 6, the newest all hold, was saved on another mesh") as refused:
        _restore(tiers(), abstract, other)
    assert "\n" not in str(refused.value) and f"{persistent} holds none" in str(refused.value)
    assert _steps(local / "process-0") == ["6"]  # left as they are

    (tmp_path / "elsewhere").rename(persistent)  # the persistent step, read onto the other mesh
    step, state, where, _ = _restore(tiers(), abstract, other)
    assert (step, where) == (5, persistent)
    _assert_same(state, states[5])
    assert not _steps(local / "process-0") and list((local / "process-0").glob("6.unmatched-*"))  # set aside


@pytest.fixture
def directories(tmp_path):
    """A fixture directory: a file, a read-only directory (None when it cannot be made), someone's files."""
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my own notes\n")
    (tmp_path / "link").symlink_to(tmp_path / "run" / "checkpoints")  # into the run's own checkpoints
    readonly = read_only_dir(tmp_path / "readonly")
    yield tmp_path, readonly
    if readonly:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(tmp_path / "readonly")], capture_output=True)
        (tmp_path / "readonly").chmod(0o755)


BAD = [
    (["--checkpoint.local-dir", "{D}/local"], "go together: give both (a directory and N >= 1) or neither"),
    (["--checkpoint.local-every", "2"], "--checkpoint.local-dir None and --checkpoint.local-every 2 go together"),
    (["--checkpoint.local-dir", "{D}/afile", "--checkpoint.local-every", "2"], "local-dir {D}/afile is a file"),
    (["--checkpoint.local-dir", "{D}/readonly/l", "--checkpoint.local-every", "2"], "{D}/readonly/l is not writable"),
    (["--checkpoint.local-dir", "{D}/mine", "--checkpoint.local-every", "2"], "{D}/mine holds files that are not"),
    (["--checkpoint.local-dir", "{D}/run/checkpoints", "--checkpoint.local-every", "2"], "overlaps the checkpoint"),
    (["--checkpoint.local-dir", "{D}/link", "--checkpoint.local-every", "2"], "{D}/link overlaps the checkpoint"),
    (["--checkpoint.local-dir", "", "--checkpoint.local-every", "2"], "--checkpoint.local-dir is empty: pass a"),
]


@pytest.mark.parametrize("extra, fragment", BAD, ids=[" ".join(a).replace("{D}/", "") for a, _ in BAD])
def test_bad_local_directory_is_one_line_exit_2_nothing_written(directories, capsys, monkeypatch, extra, fragment):
    d, readonly = directories
    if "readonly" in " ".join(extra) and not readonly:
        pytest.skip("cannot make a read-only directory here")
    monkeypatch.chdir(d)
    before = file_hashes(d)
    argv = [*TRAIN.split(), "--steps", "2", "--run-dir", f"{d}/run", *extra]
    assert main([a.format(D=d) for a in argv]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("spmdkit: error: ") and fragment.format(D=d) in err, err
    assert file_hashes(d) == before  # nothing written


LAUNCH = ["launch", "--processes", "2", "--devices-per-process", "1", "--processes-per-host", "1", "--", "spmdkit"]
TWO_HOSTS = [*TRAIN.replace("--cpu-devices 8 --mesh fsdp=8", "--mesh fsdp=2").split(), *TIERS]


def _launch(root: Path, **env: str) -> subprocess.CompletedProcess:
    """`_train` as a job of two processes on two emulated hosts (`spmdkit launch --processes-per-host 1`), mesh
    fsdp=2: each process keeps its local steps in `root/local/process-<i>/`."""
    args = [*LAUNCH, *TWO_HOSTS, "--run-dir", str(root / "run"), "--checkpoint.local-dir", str(root / "local")]
    return subprocess.run(
        [sys.executable, "-m", "spmdkit", *args], capture_output=True, text=True, timeout=240, env=job_env(**env)
    )


def _steps(directory: Path) -> list[str]:
    return sorted((p.name for p in directory.iterdir() if p.name.isdigit()), key=int)


@pytest.fixture(scope="module")
def killed_two_hosts(tmp_path_factory) -> Path:
    """A two-host job (`_launch`) killed (SIGKILL, every process) as step 9 starts: local steps 6 and 8 on each
    process, no persistent step. Tests copy it before running it again."""
    root = tmp_path_factory.mktemp("two-hosts") / "killed"
    killed = _launch(root, SPMDKIT_FAULTS="*:step=9:kill")
    output = killed.stdout + killed.stderr
    assert killed.returncode != 0 and "killed by SIGKILL" in output, output[-3000:]
    assert sorted(p.name for p in (root / "local").iterdir() if p.is_dir()) == ["process-0", "process-1"]
    for process in ("process-0", "process-1"):  # each process's own steps, each complete (keep 2)
        assert _steps(root / "local" / process) == ["6", "8"]
        assert (root / "local" / process / "8" / "data" / f"process_{process[-1]}-of-2.json").is_file()
    assert not _steps(root / "run" / "checkpoints")
    return root


@pytest.mark.slow
def test_two_hosts_keep_local_steps_per_process_and_resume_from_step_8_bit_identically(tmp_path, killed_two_hosts):
    """The local tier of a job on two hosts: SIGKILL at step 9, rerun, resumed from the local step 8 that both
    processes hold; losses and final parameters equal an uninterrupted two-process run's bit for bit."""
    straight = _launch(tmp_path / "straight")
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-3000:]
    shutil.copytree(killed_two_hosts, tmp_path / "killed")
    resumed = _launch(tmp_path / "killed")
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert f"resumed from step 8 of {tmp_path / 'killed' / 'local' / 'process-0'}" in output
    assert "Traceback" not in output and "unmatched" not in output
    want, got = _losses(tmp_path / "straight" / "run"), _losses(tmp_path / "killed" / "run")
    assert sorted(want) == list(range(1, STEPS + 1)) and got == want
    params, resumed_params = _final_params(tmp_path / "straight" / "run"), _final_params(tmp_path / "killed" / "run")
    assert resumed_params.keys() == params.keys() and params
    for key, value in params.items():
        np.testing.assert_array_equal(resumed_params[key], value, err_msg=key)


@pytest.mark.slow
def test_two_hosts_one_process_lost_its_local_steps_and_no_persistent_step_is_refused(tmp_path, killed_two_hosts):
    """Process 1's node replaced (its local directory gone): no step both hold, none persistent; the job is refused
    in one line per process, naming what each holds, and process 0's steps are left in place."""
    shutil.copytree(killed_two_hosts, tmp_path / "lost")
    shutil.rmtree(tmp_path / "lost" / "local" / "process-1")
    refused = _launch(tmp_path / "lost")
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0, output[-3000:]
    errors = [line for line in output.splitlines() if "spmdkit: error:" in line]  # one per process ("[1] ...")
    fragment = "holds no step that every process holds intact on this mesh (process 0: steps 6, 8; process 1: none)"
    assert len(errors) == 2 and all(fragment in line and "holds none" in line for line in errors), output[-3000:]
    assert "Traceback" not in output
    assert _steps(tmp_path / "lost" / "local" / "process-0") == ["6", "8"]


@pytest.mark.slow
def test_two_hosts_each_process_locks_its_own_local_directory(tmp_path, killed_two_hosts):
    """Each host's disk is its own, so every process locks its `process-<i>/`: another job holding process 1's is
    named in one line by both processes, and nothing is written or set aside."""
    shutil.copytree(killed_two_hosts, tmp_path / "held")
    local = tmp_path / "held" / "local"
    with RunLock(local / "process-1", "another job", "--checkpoint.local-dir"):
        refused = _launch(tmp_path / "held")
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0, output[-3000:]
    errors = [line for line in output.splitlines() if "spmdkit: error:" in line]
    assert len(errors) == 2 and all(f"{local / 'process-1'} is in use by another job" in e for e in errors), output
    assert sum("process 1: --checkpoint.local-dir" in e for e in errors) == 1 and "Traceback" not in output
    assert [_steps(local / p) for p in ("process-0", "process-1")] == [["6", "8"], ["6", "8"]]
    # the killed run's stale lock files were taken over and released: only the steps' directories are compared
    kept = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != LOCK_FILE)  # noqa: E731
    assert kept(local) == kept(killed_two_hosts / "local")
