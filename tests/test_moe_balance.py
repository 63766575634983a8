"""Auxiliary-loss-free load balancing (`--model.balance-rate`): the rule against a hand computation, the bias a
training run ends with against the rule replayed on the loads its metrics.jsonl recorded, a balanced run against
a Switch-loss run on the same tokens, a bit-identical resume (bias included), the bias outside the optimizer, and
the refusals.

The runs are `tiny-moe` cut to two layers (one MoE layer of 8 experts, so metrics.jsonl's `expert_load` is that
layer's) on `expert=4,data=2` with two microbatches per step; each program compiles once (the session's compilation
cache serves the resumed run)."""

import os
import signal

import jax
import numpy as np
import pytest

from spmdkit.errors import SpmdkitError
from spmdkit.models import TransformerConfig
from spmdkit.train.config import MeshSettings, ModelSettings, RunSettings, TrainConfig
from spmdkit.train.loop import Trainer
from spmdkit.train.reporting.metrics import read_metrics
from spmdkit.train.step.balance import balanced_bias, max_over_mean

STEPS, STOP = 24, 12  # the straight runs' steps; the interrupted run stops after STOP and resumes
RATE = 0.02  # fast enough to act within STEPS (DeepSeek-V3's 0.001 is for runs of 10^5 steps)
BIAS = "router_correction_bias"


def _config(run_dir, balance: bool) -> TrainConfig:
    """Balanced (no Switch loss) or Switch-loss only, on the default data (the stdlib as bytes)."""
    model = ModelSettings(
        name="tiny-moe", dtype="float32", layers=2, balance_rate=RATE if balance else 0.0,
        load_balance_weight=0.0 if balance else 0.01,
    )  # fmt: skip
    run = RunSettings(
        run_dir=str(run_dir), steps=STEPS, batch_size=16, seq_len=32, grad_accum=2, log_every=1, eval_every=0,
        progress=False,
    )  # fmt: skip
    return TrainConfig(model=model, mesh=MeshSettings(mesh="expert=4,data=2"), run=run)


def _bias(state) -> np.ndarray:
    """The MoE stack's correction bias [moe_layers, experts] in a train state's (model, optimizer) state."""
    return np.asarray(state.state[0]["moe_blocks"]["mlp"][BIAS][...])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted runs: {"balance" | "switch": (TrainResult, metrics.jsonl records)}."""
    root, out = tmp_path_factory.mktemp("balance"), {}
    for name in ("balance", "switch"):
        result = Trainer(_config(root / name, name == "balance"), log=lambda _: None).run()
        out[name] = result, read_metrics(root / name)
    return out


def test_the_rule_moves_each_layers_bias_by_the_sign_of_its_mean_load_minus_the_load():
    bias = np.array([[0.0, 0.5, 0.0, -0.2], [0.1, 0.1, 0.1, 0.1]], np.float32)
    load = np.array([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]], np.float32)  # layer 1 balanced
    # layer 0: mean 0.25: expert 0 over (-), 1 and 2 at the mean (kept), 3 under (+); layer 1: kept
    want = np.array([[-0.1, 0.5, 0.0, -0.1], [0.1, 0.1, 0.1, 0.1]], np.float32)
    np.testing.assert_allclose(np.asarray(balanced_bias(bias, load, 0.1)), want, atol=1e-7)
    assert float(max_over_mean(load)) == 2.0  # the worst layer's max / mean: 0.5 / 0.25


def test_the_run_applies_the_rule_to_each_steps_loads(straight):
    """The final bias is the rule replayed over the per-step loads metrics.jsonl recorded (the mean over the two
    microbatches: the step's whole batch), and the recorded ratio is those loads' max / mean."""
    result, records = straight["balance"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and result.skipped_steps == 0
    loads = np.array([r["expert_load"] for r in records])  # [steps, experts]
    replayed = RATE * np.sign(1 / 8 - loads).sum(axis=0)
    np.testing.assert_allclose(_bias(result.state)[0], replayed, atol=1e-5)
    assert np.abs(replayed).max() >= 4 * RATE  # the bias did move
    ratios = [r["expert_load_max_over_mean"] for r in records]
    np.testing.assert_allclose(ratios, 8 * loads.max(axis=1), rtol=1e-4)


def test_balancing_evens_the_load_more_than_the_switch_loss(straight):
    """Same seed, same batches: over the last third of the steps the balanced run's max/mean load ratio is lower
    than the Switch-loss run's (the two start from the same router, so step 1's ratios are equal)."""
    ratio = {name: [r["expert_load_max_over_mean"] for r in records] for name, (_, records) in straight.items()}
    assert ratio["balance"][0] == ratio["switch"][0] > 1.5
    late = {name: np.mean(values[-STEPS // 3 :]) for name, values in ratio.items()}
    assert late["balance"] < late["switch"], late


def test_a_resumed_balanced_run_is_bit_identical_bias_included(straight, tmp_path):
    """SIGTERM after step STOP (the loop saves and stops), then a new Trainer resumes from the checkpoint: the
    last steps' losses and the final state, the correction bias among it, equal the uninterrupted run's bit for
    bit."""
    first = Trainer(_config(tmp_path / "run", True), log=lambda _: None)
    first.step_hook = lambda step, _: os.kill(os.getpid(), signal.SIGTERM) if step == STOP else None
    stopped = first.run()
    assert stopped.stopped_at == STOP and np.any(_bias(stopped.state) != 0)
    resumed = Trainer(_config(tmp_path / "run", True), log=lambda _: None).run()
    want = straight["balance"][0]
    assert resumed.losses == {step: want.losses[step] for step in range(STOP + 1, STEPS + 1)}
    np.testing.assert_array_equal(_bias(resumed.state), _bias(want.state))
    for a, b in zip(jax.tree.leaves(resumed.state.state), jax.tree.leaves(want.state.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_bias_is_outside_the_optimizer(straight):
    """No moments for it (the optimizer trains every other parameter), and the Switch run, which has no
    balance_rate, has no correction bias at all."""
    state = straight["balance"][0].state.state
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state[1])]
    assert any("'router'" in p for p in paths) and not any(BIAS in p for p in paths)
    assert BIAS not in straight["switch"][0].state.state[0]["moe_blocks"]["mlp"]


def test_balance_rate_implies_the_bias_and_bad_values_are_refused():
    assert TransformerConfig(experts=4, balance_rate=0.001).router_correction_bias
    assert not TransformerConfig(experts=4).router_correction_bias
    with pytest.raises(SpmdkitError, match="balance_rate=0.001 balances the experts .* this one is dense"):
        TransformerConfig(balance_rate=0.001)
    for bad in (-0.001, float("nan")):
        with pytest.raises(SpmdkitError, match=r"balance_rate=.* must be >= 0"):
            TransformerConfig(experts=4, balance_rate=bad)


def test_with_multi_token_prediction_only_the_main_stacks_bias_moves(tmp_path):
    """An MTP block of an MoE model is an MoE block with its own correction bias; the step's loads are the main
    stack's, so that bias moves and the MTP block's stays at its start (it crashed the step before: #39)."""
    config = _config(tmp_path, balance=True)
    config = TrainConfig(
        model=ModelSettings(**{**config.model.__dict__, "mtp_depth": 1}), mesh=config.mesh,
        run=RunSettings(**{**config.run.__dict__, "steps": 2, "grad_accum": 1}),
    )  # fmt: skip
    state = Trainer(config, log=lambda _: None).run().state.state[0]
    assert np.abs(np.asarray(state["moe_blocks"]["mlp"][BIAS][...])).max() == pytest.approx(2 * RATE)
    assert not np.asarray(state["mtp"]["blocks"]["mlp"][BIAS][...]).any()
