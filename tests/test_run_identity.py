"""A step belongs to the run that saved it (`spmdkit.rundir.identity`): a second run on the same local directory never
resumes the first's steps nor rotates them away; a `--checkpoint-dir` holding another run's steps is refused, and
names the run directory that continues them; a run directory that lost its id takes its checkpoints' id back; a
resume that changes the model's function is refused unless `--allow-config-change` names the field, and an allowed
change is recorded in `metrics.jsonl`.

One real run (`X`, 12 steps, the local tier every 2 steps and the persistent one only at the end), in this process;
every other run is refused before it trains, or resumes a copy of `X` for two steps.
"""

import json
import shutil

import pytest
from support import file_hashes

from spmdkit.cli import main
from spmdkit.rundir.identity import RUN_ID_FILE, write_run_id

F = "--model tiny --log-every 1 --seed 1 --batch-size 16 --seq-len 32 --dtype float32 --no-progress --eval-every 0"
TRAIN = ["train", *F.split(), "--mesh", "fsdp=8"]
LOCAL = ["--checkpoint-every", "0", "--checkpoint.local-every", "2"]


def _train(*args: str) -> int:
    return main([*TRAIN, *args])


def _one_error_line(capsys) -> str:
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("spmdkit: error: ") and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """Run X: 12 steps; `local/` keeps steps 8 and 10 (the newest two), `X/checkpoints/` step 12 (the end)."""
    d = tmp_path_factory.mktemp("identity")
    assert _train("--steps", "12", *LOCAL, "--checkpoint.local-dir", str(d / "local"), "--run-dir", str(d / "X")) == 0
    assert sorted(p.name for p in (d / "local").iterdir() if p.name.isdigit()) == ["10", "8"]
    return d


def test_a_second_run_on_the_same_local_directory_is_refused_and_takes_nothing(first_run, tmp_path, capsys):
    d = first_run
    capsys.readouterr()
    before = file_hashes(d)
    y = ["--steps", "20", "--lr", "0.0005", *LOCAL, "--checkpoint.local-dir", str(d / "local"), "--run-dir"]
    assert _train(*y, str(tmp_path / "Y")) == 2
    err = _one_error_line(capsys)
    run_id = (d / "X" / RUN_ID_FILE).read_text().strip()
    assert f"--checkpoint.local-dir {d / 'local'} holds steps 8, 10 of another run (run {run_id} of {d / 'X'}" in err
    assert file_hashes(d) == before and not (tmp_path / "Y").exists()  # X's steps all there, nothing of Y written


def test_another_runs_checkpoint_directory_is_refused_naming_its_run_directory(first_run, tmp_path, capsys):
    """A run directory that keeps another id (a run of its own) pointed at X's checkpoints. (A new run directory
    pointed there continues X: it takes the id of the steps.)"""
    d = first_run
    write_run_id(tmp_path, "0123456789abcdef")
    capsys.readouterr()
    before = file_hashes(d)
    assert _train("--steps", "14", "--checkpoint-dir", str(d / "X" / "checkpoints"), "--run-dir", str(tmp_path)) == 2
    err = _one_error_line(capsys)
    assert "holds step 12 of another run" in err and f"pass --run-dir {d / 'X'} to continue that run" in err, err
    assert file_hashes(d) == before


def test_a_changed_model_function_resumes_only_when_allowed_and_is_recorded(first_run, tmp_path, capsys):
    """X copied, its id file deleted (a run directory from before ids): the resume takes the checkpoints' id back.
    `--model.logit-softcap 1.0` is refused, then allowed."""
    shutil.copytree(first_run / "X", tmp_path / "X")
    run_id = (tmp_path / "X" / RUN_ID_FILE).read_text().strip()
    (tmp_path / "X" / RUN_ID_FILE).unlink()
    before = file_hashes(tmp_path)
    resume = ["--steps", "14", "--model.logit-softcap", "1.0", "--run-dir", str(tmp_path / "X")]
    capsys.readouterr()
    assert _train(*resume) == 2
    assert "(--model.logit-softcap 0.0 -> 1.0)" in _one_error_line(capsys)
    assert file_hashes(tmp_path) == before
    assert _train(*resume, "--allow-config-change", "model.logit-softcap") == 0
    records = [json.loads(line) for line in (tmp_path / "X" / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 12, "config_change": {"--model.logit-softcap": [0.0, 1.0]}} in records
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 15))
    assert (tmp_path / "X" / RUN_ID_FILE).read_text().strip() == run_id  # the checkpoints' id, taken back
