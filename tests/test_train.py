"""The training job: accumulation, the NaN guard, the command line (tyro, TOML, aliases) and bad input.

The CLI trains end to end in tests/test_launch.py (one process, and two processes giving the same losses);
determinism (the same config twice gives the same run) is the bit-identical resume of tests/test_checkpoint.py.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from support import error_lines, run_spmdkit

from spmdkit.cli.train import parse
from spmdkit.errors import SpmdkitError
from spmdkit.train.config import MeshSettings, ModelSettings, RunSettings, TrainConfig, apply_overrides
from spmdkit.train.loop import Trainer, train
from spmdkit.train.reporting.metrics import peak_flops, read_metrics, throughput
from spmdkit.train.step.optimizer import OptimizerConfig


def _config(tmp_path, name, **run):
    base = dict(
        steps=8, batch_size=16, seq_len=32, log_every=1, eval_every=0, run_dir=str(tmp_path / name), progress=False
    )
    return TrainConfig(
        model=ModelSettings(dtype="float32"),
        mesh=MeshSettings(mesh="fsdp=4,tensor=2"),
        run=RunSettings(**{**base, **run}),
    )


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

    def snapshot(step, trainer):
        nonlocal before
        if step == 2:  # after the last good step (optimizer steps 0 and 1)
            before = [np.asarray(x) for x in jax.tree.leaves(trainer.state.state[0])]
        if step == 4:  # optimizer steps 2 and 3 had NaN gradients: nothing moved
            after = [np.asarray(x) for x in jax.tree.leaves(trainer.state.state[0])]
            assert all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))

    trainer.step_hook = snapshot
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


def test_a_non_finite_loss_stops_the_run_unsaved_and_metrics_stay_json(tmp_path):
    """Parameters made NaN after step 1 (what a run blowing up, or token ids past the vocabulary, gives): step 2's
    loss is NaN, its update is skipped, the run stops with one line before saving it, and metrics.jsonl records the
    loss as null (strict JSON: no bare NaN)."""
    config = _config(tmp_path, "nan-loss", steps=4)
    config = apply_overrides(config, {"checkpoint": {"every": 1}})
    trainer = Trainer(config, log=lambda _: None)

    def poison(step, trainer):
        if step == 1:
            nan = lambda x: x * np.nan if np.issubdtype(x.dtype, np.floating) else x  # noqa: E731
            trainer.state.state = jax.tree.map(nan, trainer.state.state)

    trainer.step_hook = poison
    with pytest.raises(SpmdkitError) as stopped:
        trainer.run()
    message = str(stopped.value)
    assert "\n" not in message and message.startswith("the loss of step 2 is nan: its update was skipped and")
    assert "nothing of it saved (newest checkpoint: step 1); check the data" in message

    def refuse(constant):
        raise ValueError(constant)

    lines = (tmp_path / "nan-loss" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=refuse) for line in lines]
    assert [r["step"] for r in records] == [1, 2] and records[1]["loss"] is None and records[1]["skipped"] == 1
    assert trainer.checkpointer.steps() == [1]
    assert not (tmp_path / "nan-loss" / ".spmdkit-lock").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mesh", "data=3"], "has 3 devices but 2 are present"),
        (["--mesh", "fsdp=2", "--batch-size", "3"], "over data x fsdp x expert = 2 devices"),
        (["--data", "/nonexistent/tokens.bin"], "/nonexistent/tokens.bin"),
        (["--model", "huge"], "unknown model preset 'huge'"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--steps", "abc"], "--steps/--run.steps: invalid literal for int()"),
        (["--config", "/nonexistent.toml"], "config file /nonexistent.toml does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    done = run_spmdkit("train", "--cpu-devices", "2", "--steps", "2", "--no-progress", *args, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "usage:" not in done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and message in lines[0], done.stderr[-1000:]


def test_every_config_field_is_a_flag_and_the_short_flags_are_aliases(capsys):
    config, cpu_devices = parse(
        ["--steps", "7", "--optimizer.b2", "0.99", "--model.layers", "6", "--no-progress", "--no-resume",
         "--mesh", "fsdp=4,tensor=2", "--zero", "1", "--sequence-parallel", "--checkpoint-dir", "ck",
         "--run.fail-steps", "1", "2", "--cpu-devices", "4"]
    )  # fmt: skip
    assert (config.run.steps, config.optimizer.b2, config.model.layers, config.run.progress) == (7, 0.99, 6, False)
    assert (config.mesh.mesh, config.mesh.zero, config.mesh.sequence_parallel) == ("fsdp=4,tensor=2", 1, True)
    assert (config.checkpoint.resume, config.checkpoint.directory, config.run.fail_steps) == (False, "ck", (1, 2))
    assert cpu_devices == 4 and config.model.build().layers == 6
    with pytest.raises(SystemExit) as done:
        parse(["--help"])
    text = capsys.readouterr().out
    assert done.value.code == 0 and "--run.steps" in text and "--steps" in text
    for section in (OptimizerConfig, RunSettings, MeshSettings):
        for field in dataclasses.fields(section):
            assert field.name.replace("_", "-") in text, field.name


def test_toml_config_with_flag_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "tiny"\nlayers = 2\n[run]\nsteps = 7\nseq_len = 64\nprogress = false\n'
                    '[optimizer]\nlr = 1e-3\nb2 = 0.98\n')  # fmt: skip
    config, _ = parse(["--config", str(path), "--steps", "9"])
    assert (config.run.steps, config.run.seq_len, config.run.progress) == (9, 64, False)
    assert (config.optimizer.lr, config.optimizer.b2, config.model.build().layers) == (1e-3, 0.98, 2)
    for text, message in [
        ("[run]\nstepz = 1\n", "unknown config key run.stepz"),
        ('[run]\nsteps = "ten"\n', "run.steps='ten' must be of type int"),
        ("[run]\nsteps = true\n", "run.steps=True must be of type int"),
        ('[model]\ndtype = "f8"\n', "model.dtype='f8' must be of type Literal["),
        ("[run]\nsteps = 0\n", "--steps must be at least 1"),
        ("[runs]\nsteps = 1\n", "unknown config section [runs]"),
        ("run = 3\n", "config section run must be a table"),
        ("[run\n", "is not valid UTF-8 TOML"),
    ]:
        path.write_text(text)
        with pytest.raises(SpmdkitError, match=f"config file {path}") as error:
            parse(["--config", str(path)])
        assert message in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(SpmdkitError, match="unknown config key run.stepz"):
        apply_overrides(TrainConfig(), {"run": {"stepz": 1}})


def test_mfu_arithmetic():
    assert peak_flops() is None  # CPU: unknown
    assert peak_flops(override_tflops=None) is None
    assert peak_flops(override_tflops=100.0) == 100e12
    speed = throughput(tokens_per_step=1000, step_time_s=0.5, flops_per_token=6e9, num_devices=4, peak=1e12)
    assert speed["tokens_per_sec"] == 2000
    assert speed["tflops_per_device"] == pytest.approx(2000 * 6e9 / 4 / 1e12)
    assert speed["mfu"] == pytest.approx(3.0)
