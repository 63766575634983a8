"""Mixture of experts: expert parallelism against the dense reference, the capacity rule against a sequential
reference, a full EP training step against one device, all-to-alls in the HLO, and load balancing at work.

Expert parallelism is proven on the routed layer alone (`expert_ffn` with its router, 8 cases); the whole model on
an EP mesh (router aux losses, loads and drops included) is the training-step test against one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from spmdkit.cli.train import parse_flags
from spmdkit.errors import SpmdkitError
from spmdkit.inspect.hlo import collective_report
from spmdkit.models import TransformerConfig
from spmdkit.models.moe import route
from spmdkit.models.presets import model_preset
from spmdkit.models.transformer import Transformer
from spmdkit.parallel.experts import ExpertWeights, capacity, dense_moe, expert_ffn, sequential_drops, slots
from spmdkit.plan.dispatch import choose_dispatch
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.train.config import TrainConfig
from spmdkit.train.step.optimizer import OptimizerConfig, make_optimizer
from spmdkit.train.step.program import build_program
from spmdkit.train.step.state import create_train_state
from spmdkit.train.step.train_step import loss_and_grads, make_train_step

# Two MoE layers (one scan), 8 experts; a capacity factor of 8 = experts means no expert can overflow.
CONFIG = TransformerConfig(
    dtype="float32", layers=2, heads=4, kv_heads=4, head_dim=8, mlp=32, experts=8, moe_every=1, capacity_factor=8.0
)
EP_MESHES = {2: "expert=2,data=4", 4: "expert=4,data=2", 8: "expert=8"}


def _batch(config, batch=8, seq=16, seed=0):
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq + 1)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@functools.cache
def ffn_and_grads(mesh_text, top_k, dispatch):
    """(y, d objective / d (x, router, expert weights), HLO report) of one routed MoE layer on `mesh_text` ('one': a
    device). The layer is what `MoE` runs: router logits x W_r, top-k routing, then `expert_ffn`; the objective is a
    fixed random projection of y, so every input gets a gradient. CONFIG's sizes: 8 experts, capacity factor 8
    (no expert overflows)."""
    b, s, d, e, f = 8, 16, CONFIG.embed, CONFIG.experts, CONFIG.mlp
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (b, s, d))
    router = jax.random.normal(keys[1], (d, e))
    w = ExpertWeights(
        *(jax.random.normal(k, shape) / 4 for k, shape in zip(keys[2:5], [(e, d, f)] * 2 + [(e, f, d)], strict=True))
    )
    probe = jax.random.normal(keys[5], (b, s, d))
    mesh = make_mesh("fsdp=1", jax.devices()[:1]) if mesh_text == "one" else make_mesh(mesh_text)
    rules = make_rules(3)

    def objective(x, router, w):
        with use_rules(rules, mesh):
            index, weight = route(jnp.einsum("bsd,de->bse", x, router), top_k)
            y, dropped = expert_ffn(x, index, weight, w, dispatch_kind=dispatch, factor=CONFIG.capacity_factor)
        return jnp.sum(y * probe), (y, dropped)

    step = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True))
    compiled = step.lower(x, router, w).compile()
    (_, (y, dropped)), grads = jax.device_get(compiled(x, router, w))
    return y, dropped, grads, collective_report(compiled)


# Dropless under EP is the capacity program with C = seq (see experts.py): one mesh shows it; capacity on all.
CASES = [(e, k, "capacity") for e in (2, 4, 8) for k in (1, 2)] + [(4, k, "dropless") for k in (1, 2)]


@pytest.mark.parametrize(("experts", "top_k", "dispatch"), CASES)
def test_expert_parallel_equals_dense_reference(experts, top_k, dispatch):
    y, dropped, grads, report = ffn_and_grads(EP_MESHES[experts], top_k, dispatch)
    ref_y, _, ref_grads, _ = ffn_and_grads("one", top_k, "dense")
    # two all-to-alls forward (tokens to their experts' devices and back) and their two transposes backward
    assert report.count("all-to-all", executed=True) == 4
    assert rel(y, ref_y) < 1e-5 and float(dropped) == 0.0
    leaves, ref_leaves = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(leaves) == len(ref_leaves) == 5
    worst = max(rel(g, r) for g, r in zip(leaves, ref_leaves, strict=True))
    assert worst < 1e-5, f"gradient relative error {worst:.2e}"
    assert np.abs(grads[1]).max() > 0  # the router learns


def test_dropless_grouped_matmul_on_one_device_equals_dense():
    y, _, grads, _ = ffn_and_grads("one", 2, "dropless")  # jax.lax.ragged_dot
    ref_y, _, ref_grads, _ = ffn_and_grads("one", 2, "dense")
    assert rel(y, ref_y) < 1e-5
    assert max(rel(g, r) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)) < 1e-5


def _skewed_routing(batch, seq, experts, top_k, seed=0):
    """Router output that overloads experts 0 and 1: index, weight [batch, seq, top_k]."""
    logits = jax.random.normal(jax.random.key(seed), (batch, seq, experts)) + jnp.array(
        [2.0, 1.0] + [0] * (experts - 2)
    )
    return route(logits, top_k)


def test_capacity_drops_exactly_what_the_sequential_rule_drops():
    b, s, d, e, k, factor = 8, 16, 16, 8, 2, 0.5
    index, weight = _skewed_routing(b, s, e, k)
    c = capacity(s, k, e, factor)
    want = np.array(sequential_drops(np.asarray(index).tolist(), e, c))
    assert 0 < (~want).sum() < want.size  # some but not all assignments dropped
    _, kept = slots(index, e, c)
    np.testing.assert_array_equal(np.asarray(kept), want)

    # The expert-parallel program drops the same ones: its output is the dense reference with the dropped
    # assignments' weights zeroed, and its drop fraction is the reference's.
    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], (b, s, d))
    w = ExpertWeights(
        *(jax.random.normal(kk, shape) / 4 for kk, shape in zip(keys[1:], [(e, d, 32)] * 2 + [(e, 32, d)], strict=True))
    )
    mesh, rules = make_mesh("expert=4,data=2"), make_rules(3)

    @jax.jit
    def ep(x, index, weight, w):
        with use_rules(rules, mesh):
            return expert_ffn(x, index, weight, w, dispatch_kind="capacity", factor=factor)

    y, dropped = ep(x, index, weight, w)
    expected = dense_moe(x, index, weight * want, w)
    assert rel(y, expected) < 1e-5
    assert float(dropped) == pytest.approx((~want).mean(), abs=1e-7)


@functools.cache
def train_three_steps(mesh_text):
    # A dense block, then an MoE block (moe_every=2).
    config = TransformerConfig(dtype="float32", layers=2, heads=4, kv_heads=4, mlp=32, experts=8, top_k=2, moe_every=2)
    mesh = make_mesh("fsdp=1", jax.devices()[:1]) if mesh_text == "one" else make_mesh(mesh_text)
    rules = make_rules(3)
    state = create_train_state(config, make_optimizer(OptimizerConfig(warmup_steps=1), 3), mesh, rules)
    step = make_train_step(state, mesh, rules)
    batch = _batch(config, seed=1)
    compiled = step.lower(state.state, batch).compile()
    current, records = state.state, []
    for _ in range(3):
        current, metrics = step(current, batch)
        records.append(jax.device_get(metrics))
    return records, [np.asarray(x) for x in jax.tree.leaves(current[0])], compiled, config


def test_expert_data_training_step_equals_one_device():
    """Default capacity (1.25): tokens are dropped, and identically, since a routing group is a sequence."""
    records, params, _, _ = train_three_steps("expert=4,data=2")
    base_records, base_params, _, _ = train_three_steps("one")
    assert records[0]["dropped"] > 0
    for got, want in zip(records, base_records, strict=True):
        for name in ("loss", "grad_norm", "load_balance_loss", "router_z_loss", "dropped"):
            assert abs(got[name] - want[name]) <= 1e-5 * abs(want[name]) + 1e-7, name
        assert rel(got["expert_load"], want["expert_load"]) < 1e-5
    # Parameters after two AdamW updates (the first step's learning rate is 0): Adam divides by sqrt(v), which
    # turns the last-bit differences of different summation orders into ~1e-5 (an attention weight: 1.1e-5).
    assert max(rel(p, q) for p, q in zip(params, base_params, strict=True)) < 3e-5


def test_four_all_to_alls_per_moe_layer_in_the_train_step():
    """Two forward (to the experts' devices and back) and their two transposes; the forward program's two per
    layer are checked by tests/test_examples.py::test_expert_parallel."""
    _, _, train, config = train_three_steps("expert=4,data=2")
    assert config.moe_layers == 1 and config.layers == 2
    assert collective_report(train).count("all-to-all", executed=True) == 4 * config.moe_layers


def _load_ratio_after_training(weight: float, steps: int = 150) -> tuple[float, float]:
    """Train a one-layer top-1 MoE on skewed tokens; (max/mean expert load at the start, over the last 20)."""
    config = TransformerConfig(
        dtype="float32", layers=1, heads=2, kv_heads=2, head_dim=8, mlp=32, experts=4, top_k=1, moe_every=1,
        dispatch="dropless", load_balance_weight=weight, router_z_weight=0.0,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    with nnx.use_eager_sharding(False):
        model = Transformer(config, rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model)
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, batch):
        metrics, grads = loss_and_grads(nnx.merge(graphdef, params), batch)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, metrics["expert_load"]

    ratios = []
    for _ in range(steps):
        tokens = np.minimum(rng.zipf(1.2, (8, 17)), 255).astype(np.int32)  # a few tokens dominate
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.tile(np.arange(16), (8, 1))}
        params, opt, load = step(params, opt, batch)
        ratios.append(float(np.max(load) * config.experts))
    return ratios[0], float(np.mean(ratios[-20:]))


def test_load_balancing_loss_balances_the_experts():
    start_on, end_on = _load_ratio_after_training(1.0)
    start_off, end_off = _load_ratio_after_training(0.0)
    assert start_on == start_off > 1.5  # the same skewed start (1 = balanced, 4 = one expert takes all)
    assert end_on < 0.75 * start_on  # the loss on: the load evens out
    assert end_off > start_off  # the loss off: it does not (here the router collapses further)


def test_moe_errors():
    with pytest.raises(SpmdkitError, match="top_k=3 must be between 1 and experts=2"):
        TransformerConfig(experts=2, top_k=3)
    with pytest.raises(SpmdkitError, match="moe_every=5 and dense_layers leave no mixture-of-experts layer"):
        TransformerConfig(experts=4, moe_every=5)
    with pytest.raises(SpmdkitError, match=r"dense_layers=\[4\] must be increasing layers 0..3"):
        TransformerConfig(experts=4, dense_layers=(4,))
    with pytest.raises(SpmdkitError, match="model.dispatch='sorted' must be of type Literal"):
        TransformerConfig(experts=4, dispatch="sorted")
    mesh, rules = make_mesh("expert=8"), make_rules(3)
    w = ExpertWeights(*(jnp.zeros(s) for s in [(4, 8, 8), (4, 8, 8), (4, 8, 8)]))
    index, weight = jnp.zeros((8, 4, 1), jnp.int32), jnp.ones((8, 4, 1))
    with use_rules(rules, mesh), pytest.raises(SpmdkitError, match="experts=4 is not divisible by mesh axis expert=8"):
        expert_ffn(jnp.zeros((8, 4, 8)), index, weight, w, dispatch_kind="capacity", factor=1.0)
    with pytest.raises(SpmdkitError, match="dispatch 'auto' is not resolved: build the model through build_program"):
        expert_ffn(jnp.zeros((8, 4, 8)), index, weight, w, dispatch_kind="auto", factor=1.0)


def test_auto_dispatch_takes_dropless_only_where_it_costs_no_more_expert_flops(monkeypatch):
    """`--moe-dispatch auto` by the planner's count (`spmdkit.plan.dispatch`): tiny-moe (8 experts, top-2, seq 128)
    with the batch split pads dropless to 128 slots per expert, 4 x the routed FLOPs, against capacity's 40 slots,
    1.25 x: capacity. At a capacity factor of 4 = E / k the capacity is the whole sequence, so dropless is as
    cheap and exact. On one batch shard dropless is a ragged_dot: dense (E x) where it is not grouped, 1 x where
    it is. build_program stores the choice in the model config and says why."""
    moe = model_preset("tiny-moe").replace(dispatch="auto")
    choice = choose_dispatch(moe, 128, batch_split=True, platform="cuda")
    assert choice.dispatch == "capacity" and choice.ratios == {"dropless": 4.0, "capacity": 1.25}
    assert choose_dispatch(moe.replace(capacity_factor=4.0), 128, True, "cuda").dispatch == "dropless"
    assert choose_dispatch(moe, 128, batch_split=False, platform="cpu").ratios["dropless"] == 8.0
    monkeypatch.setattr("spmdkit.plan.dispatch.GROUPED_RAGGED_DOT", frozenset({"cpu"}))
    assert choose_dispatch(moe, 128, batch_split=False, platform="cpu").dispatch == "dropless"
    assert choose_dispatch(moe, 128, batch_split=True, platform="cpu").dispatch == "capacity"
    monkeypatch.undo()
    flags = "--model tiny-moe --moe-dispatch auto --seq-len 128 --batch-size 8 --mesh expert=8"
    program = build_program(parse_flags(flags.split(), TrainConfig()))
    assert program.model_config.dispatch == "capacity" and program.config.model.dispatch == "auto"
    assert program.dispatch_reason.startswith("capacity 1.25: 1.25 x the routed FLOPs; dropless pads"), program
    explicit = build_program(parse_flags(f"{flags} --moe-dispatch dropless".split(), TrainConfig()))
    assert explicit.model_config.dispatch == "dropless" and explicit.dispatch_reason == "dropless: as configured"


def test_training_job_reports_router_metrics(tmp_path):
    """`spmdkit train --model tiny-moe --mesh expert=4,data=2` as a library call: it trains, and metrics.jsonl
    carries the aux losses, the drop fraction and the per-expert load histogram."""
    from spmdkit.train.config import MeshSettings, ModelSettings, RunSettings, TrainConfig
    from spmdkit.train.loop import train
    from spmdkit.train.reporting.metrics import read_metrics

    run = RunSettings(
        steps=3, batch_size=8, seq_len=16, log_every=1, eval_every=0, run_dir=str(tmp_path), progress=False
    )
    config = TrainConfig(
        model=ModelSettings(name="tiny-moe", dtype="float32", capacity_factor=1.0),
        mesh=MeshSettings(mesh="expert=4,data=2"),
        run=run,
    )
    result = train(config)
    records = read_metrics(tmp_path)
    assert len(records) == 3 and np.isfinite(result.losses[3]) and result.skipped_steps == 0
    for record in records:
        assert len(record["expert_load"]) == 8 and sum(record["expert_load"]) == pytest.approx(1.0, abs=1e-4)
        assert 0.0 <= record["dropped"] < 1.0 and record["load_balance_loss"] > 0 and record["router_z_loss"] > 0
    assert any(record["dropped"] > 0 for record in records)  # capacity factor 1: some overflow


def test_pipelining_an_moe_model_is_refused(tmp_path):
    from spmdkit.train.config import MeshSettings, ModelSettings, RunSettings, TrainConfig
    from spmdkit.train.loop import Trainer

    config = TrainConfig(
        model=ModelSettings(name="tiny-moe"),
        mesh=MeshSettings(mesh="pipeline=2,data=4"),
        run=RunSettings(steps=1, batch_size=16, seq_len=32, run_dir=str(tmp_path), progress=False),
    )
    with pytest.raises(SpmdkitError, match="pipelining a mixture-of-experts model is not supported yet"):
        Trainer(config)
