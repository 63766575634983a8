"""The transformer trained through the pipeline program equals the one-device step, for every schedule."""

import functools

import jax
import numpy as np
import pytest
from support import run_spmdkit

from spmdkit.errors import SpmdkitError
from spmdkit.inspect.hlo import collective_report
from spmdkit.models import TransformerConfig
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.train.reporting.metrics import read_metrics
from spmdkit.train.step.optimizer import OptimizerConfig, make_optimizer
from spmdkit.train.step.pipeline import pipeline_schedule
from spmdkit.train.step.state import create_train_state
from spmdkit.train.step.train_step import make_train_step

CONFIG = TransformerConfig(dtype="float32", layers=4, heads=8, kv_heads=8)
STEPS = 3
CASES = {
    "1f1b": ("pipeline=4,data=2", 8, 1),
    "gpipe": ("pipeline=4,data=2", 4, 1),
    "interleaved": ("pipeline=2,fsdp=2,tensor=2", 4, 2),
}


def _batch():
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (16, 33)).astype(np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.tile(np.arange(32, dtype=np.int32), (16, 1)),
    }


@functools.cache
def run(kind):
    if kind == "one_device":
        mesh, schedule = make_mesh("fsdp=1", jax.devices()[:1]), None
    else:
        mesh_text, microbatches, virtual = CASES[kind]
        mesh = make_mesh(mesh_text)
        schedule = pipeline_schedule(kind, mesh, microbatches, virtual, CONFIG.layers)
    rules = make_rules(1)  # ZeRO-1: PP's partner
    state = create_train_state(CONFIG, make_optimizer(OptimizerConfig(warmup_steps=1), STEPS), mesh, rules)
    step = make_train_step(state, mesh, rules, pipeline=schedule)
    batch = _batch()
    compiled = step.lower(state.state, batch).compile()
    current, losses = state.state, []
    for _ in range(STEPS):
        current, metrics = step(current, batch)
        losses.append(float(metrics["loss"]))
    return losses, [np.asarray(x) for x in jax.tree.leaves(current[0])], compiled


@pytest.mark.parametrize("kind", list(CASES))
def test_pipelined_training_equals_one_device(kind):
    losses, params, _ = run(kind)
    base_losses, base_params, _ = run("one_device")
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    for got, want in zip(params, base_params, strict=True):
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


def test_stage_traffic_is_activation_sized_collective_permutes():
    report = collective_report(run("1f1b")[2])
    # one microbatch's float32 activation per device: [microbatch / data, seq, embed] = [1, 32, 64]
    activation = 1 * 32 * CONFIG.embed * 4
    permutes = [c for c in report.collectives if c.opcode == "collective-permute"]
    assert permutes and all(c.operand_bytes == activation for c in permutes)
    assert report.count("all-to-all") == 0


def test_layers_not_divisible_by_stages_is_an_error():
    with pytest.raises(SpmdkitError, match="layers"):
        pipeline_schedule("1f1b", make_mesh("pipeline=8"), 8, 1, 4)
    with pytest.raises(SpmdkitError, match="microbatches"):
        pipeline_schedule("1f1b", make_mesh("pipeline=4,data=2"), 2, 1, 4)


@pytest.mark.slow
def test_cli_trains_with_1f1b(tmp_path):
    args = ["--cpu-devices", "8", "--mesh", "pipeline=4,data=2", "--microbatches", "8", "--pipeline-schedule", "1f1b"]
    done = run_spmdkit("train", *args, "--steps", "20", "--run-dir", str(tmp_path), "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1f1b over 4 stages, 8 microbatches" in done.stdout
    records = read_metrics(tmp_path)
    assert records[-1]["loss"] < records[0]["loss"] - 1.5
    assert (tmp_path / "pipeline_schedule.png").stat().st_size > 0
