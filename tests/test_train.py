"""The training job: the CLI end to end, determinism, accumulation, the NaN guard, and bad input."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from spmdkit.errors import SpmdkitError
from spmdkit.train.config import MeshSettings, ModelSettings, RunSettings, TrainConfig, apply_overrides, load_toml
from spmdkit.train.loop import Trainer, train
from spmdkit.train.metrics import peak_flops, read_metrics, throughput
from spmdkit.train.optimizer import OptimizerConfig


def _cli(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run(
        [sys.executable, "-m", "spmdkit", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_cli_trains_fsdp_x_tensor_and_loss_falls(tmp_path):
    run_dir = tmp_path / "run"
    done = _cli(
        "train",
        "--cpu-devices",
        "8",
        "--mesh",
        "fsdp=4,tensor=2",
        "--steps",
        "60",
        "--run-dir",
        str(run_dir),
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FSDP over 4 devices x TP over 2" in done.stdout
    records = read_metrics(run_dir)
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "tflops_per_device", "mfu"):
        assert key in records[-1]
    assert records[0]["step"] == 1 and records[-1]["step"] == 60
    # starts near uniform over 264 tokens (ln 264 = 5.58), ends far below uniform-over-bytes ln 256 = 5.55
    assert records[0]["loss"] > 5.0
    assert records[-1]["loss"] < 3.0
    assert records[-1]["eval_loss"] < 3.0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["mesh"]["mesh"] == "fsdp=4,tensor=2" and config["run"]["steps"] == 60
    assert (run_dir / "loss.png").stat().st_size > 0
    assert any((run_dir / "tensorboard").iterdir())


def _config(tmp_path, name, **run):
    base = dict(
        steps=8, batch_size=16, seq_len=32, log_every=1, eval_every=0, run_dir=str(tmp_path / name), progress=False
    )
    return TrainConfig(
        model=ModelSettings(dtype="float32"),
        mesh=MeshSettings(mesh="fsdp=4,tensor=2"),
        run=RunSettings(**{**base, **run}),
    )


def test_same_config_twice_gives_identical_losses(tmp_path):
    first = train(_config(tmp_path, "a")).losses
    second = train(_config(tmp_path, "b")).losses
    assert first == second and len(first) == 8


def test_grad_accumulation_matches_one_big_batch(tmp_path):
    whole = train(_config(tmp_path, "whole")).losses
    accumulated = train(_config(tmp_path, "accum", grad_accum=4)).losses
    assert whole.keys() == accumulated.keys()
    for step in whole:
        assert abs(whole[step] - accumulated[step]) <= 2e-5 * abs(whole[step])


def test_nan_steps_are_skipped_and_parameters_kept(tmp_path):
    config = _config(tmp_path, "nan", steps=6, fail_steps=(2, 3))
    trainer = Trainer(config)
    before = None

    def snapshot(step, trainer, final):
        nonlocal before
        if step == 2:  # after the last good step (optimizer steps 0 and 1)
            before = [np.asarray(x) for x in jax.tree.leaves(trainer.state.state[0])]
        if step == 4:  # optimizer steps 2 and 3 had NaN gradients: nothing moved
            after = [np.asarray(x) for x in jax.tree.leaves(trainer.state.state[0])]
            assert all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))

    trainer.save_hook = snapshot
    result = trainer.run()
    assert result.skipped_steps == 2
    records = read_metrics(tmp_path / "nan")
    assert [r["skipped"] for r in records] == [0, 0, 1, 1, 0, 0]
    assert np.isfinite(records[-1]["loss"])


def test_too_many_bad_steps_stop_the_run(tmp_path):
    config = _config(tmp_path, "bad", steps=8, fail_steps=(1, 2, 3, 4))
    config = dataclasses.replace(config, optimizer=OptimizerConfig(max_bad_steps=3))
    with pytest.raises(SpmdkitError, match="NaN or Inf for 3 consecutive steps"):
        train(config)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mesh", "data=3"], "has 3 devices but 2 are present"),
        (["--mesh", "fsdp=2", "--batch-size", "3"], "does not divide over data x fsdp x expert = 2"),
        (["--data", "/nonexistent/tokens.bin"], "/nonexistent/tokens.bin"),
        (["--model", "huge"], "unknown model preset 'huge'"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--config", "/nonexistent.toml"], "config file /nonexistent.toml does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    done = _cli("train", "--cpu-devices", "2", "--steps", "2", "--no-progress", *args, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("spmdkit: error:")]
    assert len(lines) == 1 and message in lines[0], done.stderr[-1000:]


def test_toml_config_with_flag_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "tiny"\n[run]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1e-3\n')
    config = apply_overrides(apply_overrides(TrainConfig(), load_toml(path)), {"run": {"steps": 9}})
    assert (config.run.steps, config.run.seq_len, config.optimizer.lr) == (9, 64, 1e-3)
    with pytest.raises(SpmdkitError, match="unknown config key run.stepz"):
        apply_overrides(TrainConfig(), {"run": {"stepz": 1}})
    with pytest.raises(SpmdkitError, match="should be int"):
        apply_overrides(TrainConfig(), {"run": {"steps": "ten"}})


def test_mfu_arithmetic():
    assert peak_flops() is None  # CPU: unknown
    assert peak_flops(override_tflops=100.0) == 100e12
    speed = throughput(tokens_per_step=1000, step_time_s=0.5, flops_per_token=6e9, num_devices=4, peak=1e12)
    assert speed["tokens_per_sec"] == 2000
    assert speed["tflops_per_device"] == pytest.approx(2000 * 6e9 / 4 / 1e12)
    assert speed["mfu"] == pytest.approx(3.0)
