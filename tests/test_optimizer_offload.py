"""`--optimizer.offload`: the AdamW moments in pinned host memory between steps.

On CPU (8 simulated devices, whose memories include `pinned_host`) a run with offload gives the losses and state of
one without, its moments stay on the host across steps, checkpoints and a resume; ZeRO stages, accumulation and a
pipeline combine with it. On the deviceless 8 x H100 compile the moments leave the device's memory for the host's,
by the planner's figure. `tiny`, a few steps, each program compiled once for the module.
"""

import os
import signal

import jax
import numpy as np
import pytest
from support import compile_in_parallel

from spmdkit.cli.train import parse_flags
from spmdkit.models.presets import PRESETS
from spmdkit.plan.estimate import estimate
from spmdkit.sharding.strategy import Strategy
from spmdkit.train.config import MeshSettings, ModelSettings, OptimizerConfig, RunSettings, TrainConfig
from spmdkit.train.loop import Trainer
from spmdkit.train.step.program import build_program

STEPS = 4


def _config(run_dir, offload: bool, **run) -> TrainConfig:
    settings = dict(steps=STEPS, batch_size=8, seq_len=32, log_every=1, eval_every=0, progress=False)
    return TrainConfig(
        model=ModelSettings(dtype="float32"),
        mesh=MeshSettings(mesh="fsdp=4,tensor=2"),
        optimizer=OptimizerConfig(offload=offload),
        run=RunSettings(run_dir=str(run_dir), **{**settings, **run}),
    )


def _kinds(state) -> dict[str, set]:
    """Memory kinds of the optimizer's arrays by rank: 'moments' (rank >= 1) and 'scalars'."""
    leaves = jax.tree.leaves(state[1])
    return {
        "moments": {x.sharding.memory_kind for x in leaves if x.ndim},
        "scalars": {x.sharding.memory_kind for x in leaves if not x.ndim},
    }


def _arrays(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Straight runs of STEPS steps without and with offload: {offload: TrainResult}."""
    root = tmp_path_factory.mktemp("offload")
    return {
        offload: Trainer(_config(root / str(offload), offload), log=lambda _: None).run() for offload in (False, True)
    }


def test_offload_gives_the_same_losses_and_state_with_the_moments_on_the_host(runs):
    plain, offloaded = runs[False], runs[True]
    assert sorted(offloaded.losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(list(offloaded.losses.values()), list(plain.losses.values()), rtol=1e-6, atol=0)
    for a, b in zip(_arrays(offloaded.state.state), _arrays(plain.state.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)  # float32 rounding: XLA fuses the update apart
    assert _kinds(offloaded.state.state) == {"moments": {"pinned_host"}, "scalars": {"device"}}
    assert _kinds(plain.state.state)["moments"] == {"device"}


def test_a_resumed_offload_run_is_bit_identical_to_a_straight_one(runs, tmp_path):
    """SIGTERM after step 2 (the loop saves and stops), then a new Trainer resumes from that checkpoint: the
    moments are restored into host memory, and the last steps and the final state equal the straight run's. The
    same checkpoint restores onto device memory without offload: the saved arrays carry no memory kind."""
    config = _config(tmp_path / "run", True)
    first = Trainer(config, log=lambda _: None)
    first.step_hook = lambda step, _: os.kill(os.getpid(), signal.SIGTERM) if step == 2 else None
    assert first.run().stopped_at == 2
    plain = Trainer(_config(tmp_path / "run", False), log=lambda _: None)
    plain.resume()
    plain.checkpointer.close()
    plain.release_lock()
    second = Trainer(config, log=lambda _: None)
    second.resume()
    assert second.start_step == plain.start_step == 2
    assert _kinds(second.state.state)["moments"] == {"pinned_host"} and _kinds(plain.state.state)["moments"] == {
        "device"
    }
    for a, b in zip(_arrays(second.state.state), _arrays(plain.state.state), strict=True):
        np.testing.assert_array_equal(a, b)
    resumed = second.run()
    straight = runs[True]
    assert resumed.losses == {step: straight.losses[step] for step in (3, 4)}
    for a, b in zip(_arrays(resumed.state.state), _arrays(straight.state.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert _kinds(resumed.state.state)["moments"] == {"pinned_host"}


def _two_steps(flags: str) -> tuple[list[float], dict[str, set]]:
    """Losses of two train steps of `tiny` (float32) on fixed random tokens, and the state's memory kinds after."""
    program = build_program(
        parse_flags(f"--model.dtype float32 --seq-len 32 --batch-size 16 {flags}".split(), TrainConfig())
    )
    keys = program.batch_keys()
    state = program.create_state()
    step, shapes = program.train_step(state, keys), program.abstract_batch(keys)
    tokens = np.random.default_rng(0).integers(0, program.model_config.vocab_size, (16, 33), dtype=np.int32)
    values = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.tile(np.arange(32), (16, 1))}
    batch = {k: jax.device_put(values[k].astype(np.int32), shapes[k].sharding) for k in keys}
    current, losses = state.state, []
    for _ in range(2):
        current, metrics = step(current, batch)
        losses.append(float(metrics["loss"]))
    return losses, _kinds(current)


@pytest.mark.parametrize(
    "flags",
    [
        "--mesh data=2,fsdp=4 --zero 2 --grad-accum 2",
        "--mesh pipeline=2,fsdp=4 --microbatches 4",
    ],
)
def test_zero_stages_accumulation_and_pipeline_give_the_same_losses_with_offload(flags):
    plain, plain_kinds = _two_steps(flags)
    offloaded, kinds = _two_steps(f"{flags} --optimizer.offload")
    np.testing.assert_allclose(offloaded, plain, rtol=1e-6, atol=0)
    assert kinds["moments"] == {"pinned_host"} and plain_kinds["moments"] == {"device"}


def test_the_flag_and_the_planner():
    assert parse_flags(["--optimizer.offload"], TrainConfig()).optimizer.offload is True
    assert parse_flags([], TrainConfig()).optimizer.offload is False
    plain = estimate("llama3-8b", "fsdp=8", batch_size=8, seq_len=2048)
    moved = estimate("llama3-8b", Strategy("fsdp=8", offload=True), batch_size=8, seq_len=2048)
    moments = 2 * 4 * PRESETS["llama3-8b"].num_params() / 8  # AdamW's two float32 moments, sharded over fsdp=8
    assert plain.memory["optimizer"] == pytest.approx(moments, rel=0.01)
    assert moved.memory["optimizer"] == 0 and moved.host_bytes == pytest.approx(moments, rel=0.01)
    assert plain.total_memory - moved.total_memory == pytest.approx(moments, rel=0.01)
    # in and out over PCIe Gen5 x16 at ~50 GB/s per direction, every step
    assert moved.step_s - plain.step_s == pytest.approx(2 * moments / 50e9, rel=0.01)


def test_the_h100_compile_moves_the_optimizer_state_from_device_to_host_memory():
    """llama3-8b, fsdp=8, remat full, batch 8 x 2048 on 8 compile-only H100s: the device's bytes fall by the
    optimizer state's (within 10% of the planner's figure for it), which XLA reports as host bytes instead.
    `scripts/bench_optimizer_offload.py gpu` prints the numbers."""
    from spmdkit.targets import target_devices
    from spmdkit.targets.flags import gpu_compiler_options
    from spmdkit.tools.gpu_compile import lower_train_step, memory_bytes, planner_estimate

    devices, offloads = target_devices("h100", 8, 8), ("", " --optimizer.offload")
    flags = "--model llama3-8b --mesh fsdp=8 --model.remat full --seq-len 2048 --batch-size 8"
    programs = [build_program(parse_flags(f"{flags}{offload}".split(), TrainConfig()), devices) for offload in offloads]
    compiled = compile_in_parallel([lower_train_step(p) for p in programs], gpu_compiler_options())
    memory = {offload: memory_bytes(c) for offload, c in zip(offloads, compiled, strict=True)}
    plans = {offload: planner_estimate(p, "h100") for offload, p in zip(offloads, programs, strict=True)}
    share = plans[""].memory["optimizer"]
    assert share > 0 and plans[" --optimizer.offload"].host_bytes == pytest.approx(share)
    assert memory[""]["host"] == 0
    assert memory[" --optimizer.offload"]["host"] == pytest.approx(share, rel=0.1)
    saved = memory[""]["total"] - memory[" --optimizer.offload"]["total"]
    assert saved == pytest.approx(share, rel=0.1)  # XLA's own bytes against the planner's
