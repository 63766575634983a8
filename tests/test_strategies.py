"""Every strategy against the one-device program: same numbers, right traffic, right memory.

Each strategy's step is compiled once (module cache) and run for three optimizer steps on the same batch.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from spmdkit.inspect.hlo import collective_report
from spmdkit.models import TransformerConfig
from spmdkit.models.transformer import MLP, RESIDUAL
from spmdkit.parallel.context.zigzag import zigzag_batch
from spmdkit.sharding.logical import logical_to_spec, use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.partition import init_sharded
from spmdkit.sharding.rules import make_rules
from spmdkit.tools.strategies import STRATEGIES
from spmdkit.train.step.optimizer import OptimizerConfig, make_optimizer
from spmdkit.train.step.state import create_train_state
from spmdkit.train.step.train_step import make_train_step

CONFIG = TransformerConfig(dtype="float32", heads=8, kv_heads=8, head_dim=8)
STEPS = 3
# the layouts checked against the one-device program ("cp": ring attention on a zigzag-permuted batch;
# "zero1_accumulated": 2 microbatches, reduced once over data x fsdp; "zero3_accumulated": 2 microbatches under
# ZeRO-3 with fsdp and tensor both automatic)
CHECKED = [
    "dp", "fsdp", "zero1", "zero2", "hsdp", "tp", "tp_sp", "data_fsdp_tensor", "cp", "zero1_accumulated",
    "zero3_accumulated",
]  # fmt: skip


def _batch(batch=8, seq=32, seed=0):
    tokens = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, seq + 1)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions}


@functools.cache
def run(name):
    """(losses, final params as numpy, compiled step, train state) of 3 steps under strategy `name`."""
    strategy = STRATEGIES[name]
    devices = jax.devices()[:1] if name == "one_device" else None
    mesh, rules = make_mesh(strategy.mesh, devices), make_rules(strategy.zero, strategy.sequence_parallel)
    context = mesh.shape["context"]
    config = CONFIG.replace(attention="ring") if context > 1 else CONFIG
    state = create_train_state(config, make_optimizer(OptimizerConfig(warmup_steps=1), STEPS), mesh, rules)
    step = make_train_step(state, mesh, rules, strategy.microbatches or 1)
    batch = zigzag_batch(_batch(), context)
    compiled = step.lower(state.state, batch).compile()
    current, losses = state.state, []
    for _ in range(STEPS):
        current, metrics = step(current, batch)
        losses.append(float(metrics["loss"]))
    params = [np.asarray(x) for x in jax.tree.leaves(current[0])]
    return losses, params, compiled, state


def relative_error(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(np.asarray(b)), 1e-30))


@pytest.mark.parametrize("name", CHECKED)
def test_same_numbers_as_one_device(name):
    losses, params, _, _ = run(name)
    base_losses, base_params, _, _ = run("one_device")
    assert losses[-1] < losses[0]  # it trains
    for got, want in zip(losses, base_losses, strict=True):
        assert abs(got - want) / abs(want) < 1e-5
    worst = max(relative_error(p, q) for p, q in zip(params, base_params, strict=True))
    assert worst < 1e-5, f"{name}: parameter relative error {worst:.2e}"


def _grad_bytes():
    return CONFIG.num_params() * 4


def test_dp_all_reduces_exactly_the_gradients():
    report = collective_report(run("dp")[2])
    grads = _grad_bytes()
    # the gradients (fused into few buffers) plus a handful of float32 scalars (the loss)
    assert grads <= report.bytes("all-reduce") <= grads + 64
    assert report.count("all-gather") == 0 and report.count("reduce-scatter") == 0


def test_fsdp_gathers_params_and_reduce_scatters_grads():
    _, _, compiled, state = run("fsdp")
    report = collective_report(compiled)
    shardings = jax.tree.leaves(state.shardings[0])
    leaves = jax.tree.leaves(state.state[0])
    sharded = sum(x.nbytes for x, s in zip(leaves, shardings, strict=True) if any(s.spec))
    replicated = sum(x.nbytes for x, s in zip(leaves, shardings, strict=True) if not any(s.spec))
    assert report.count("all-gather") > 0 and report.count("reduce-scatter") > 0
    # every gradient of a sharded weight is reduce-scattered (the embedding's and the LM head's included)
    assert report.count("all-to-all") == 0
    assert report.bytes("reduce-scatter") >= sharded
    # no full-gradient all-reduce: only the replicated norm scales and scalars are all-reduced
    assert report.bytes("all-reduce") <= replicated + 256


def _state_bytes(name):
    """Per-device argument bytes of the compiled step, less the batch."""
    _, _, compiled, state = run(name)
    mesh = state.shardings[0]["embedding"].mesh
    replicas = mesh.shape["data"] * mesh.shape["fsdp"]
    batch_bytes = 3 * 8 * 32 * 4 // replicas
    return compiled.memory_analysis().argument_size_in_bytes - batch_bytes


def test_fsdp_holds_an_eighth_of_dp_state():
    assert _state_bytes("fsdp") <= _state_bytes("dp") / 8 * 1.05


def test_zero1_full_params_eighth_of_optimizer_state():
    params = _grad_bytes()
    optimizer = _state_bytes("dp") - params  # AdamW moments (2 x params) and a few scalars
    expected = params + optimizer / 8
    assert abs(_state_bytes("zero1") - expected) / expected < 0.05
    assert abs(_state_bytes("zero2") - expected) / expected < 0.05


def _mlp_forward_report(sequence_parallel):
    mesh = make_mesh("tensor=8")
    rules = make_rules(3, sequence_parallel)
    mlp = init_sharded(lambda: MLP(CONFIG, rngs=nnx.Rngs(0)), mesh, rules)
    graphdef, params = nnx.split(mlp)
    x_sharding = NamedSharding(mesh, logical_to_spec(RESIDUAL, (4, 16, CONFIG.embed), mesh, rules.params))
    x = jax.device_put(jnp.ones((4, 16, CONFIG.embed)), x_sharding)

    @jax.jit
    def forward(params, x):
        with use_rules(rules, mesh):
            return nnx.merge(graphdef, params)(x)

    return collective_report(forward.lower(params, x).compile())


def test_tp_mlp_forward_has_one_all_reduce():
    report = _mlp_forward_report(sequence_parallel=False)
    assert report.count("all-reduce") == 1
    assert report.bytes("all-reduce") == 4 * 16 * CONFIG.embed * 4  # the whole [batch, seq, embed] output
    assert report.count("reduce-scatter") == 0 and report.count("all-gather") == 0


def test_sp_replaces_the_all_reduce_with_reduce_scatter_and_all_gather():
    report = _mlp_forward_report(sequence_parallel=True)
    full = 4 * 16 * CONFIG.embed * 4
    assert report.count("all-reduce") == 0
    assert report.count("reduce-scatter") == 1 and report.bytes("reduce-scatter") == full
    assert report.count("all-gather") == 1 and report.bytes("all-gather") == full // 8
    assert math.isclose(report.bytes(), full + full / 8)


def test_context_parallel_step_moves_kv_by_collective_permute_only():
    report = collective_report(run("cp")[2])
    assert report.count("collective-permute") > 0
    # K/V never gathered whole: the only all-gathers are ZeRO-3's parameter gathers over fsdp x context (the state
    # is sharded over both), each the size of one parameter, whole or one layer of a stacked one
    state = run("cp")[3]
    sizes = {x.nbytes for x in jax.tree.leaves(state.state[0])}
    sizes |= {x.nbytes // CONFIG.layers for x in jax.tree.leaves(state.state[0])}
    gathered = [c for c in report.collectives if c.opcode == "all-gather"]
    assert gathered and all(c.group_size == 8 and c.result_bytes in sizes for c in gathered)


def test_accumulation_reduces_gradients_once_per_step():
    """DP with 4 microbatches: one all-reduce of the gradient bytes per optimizer step, not one per microbatch."""
    mesh, rules = make_mesh("data=8"), make_rules(0)
    state = create_train_state(CONFIG, make_optimizer(OptimizerConfig(), STEPS), mesh, rules)
    compiled = make_train_step(state, mesh, rules, grad_accum=4).lower(state.state, _batch(batch=32)).compile()
    report = collective_report(compiled)
    assert _grad_bytes() <= report.bytes("all-reduce") <= _grad_bytes() + 64
