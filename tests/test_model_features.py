"""The Hugging Face family features (q/k/v and output biases, MLP biases, tied embeddings, GELU, llama3 RoPE
scaling) train the same sharded as on one device: ZeRO-3 on fsdp=4,tensor=2 (the [embed] biases split over fsdp,
the [heads] and [mlp] ones over tensor) and the 1F1B pipeline (the tied table's gradient sums its lookup on the
first stage and its head on the last). Their forward against transformers is tests/test_hf_import.py."""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from spmdkit.models import Transformer, TransformerConfig
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.train.step.pipeline import pipeline_schedule
from spmdkit.train.step.state import create_train_state
from spmdkit.train.step.train_step import make_train_step

CONFIG = TransformerConfig(
    dtype="float32", layers=4, heads=8, kv_heads=4, qkv_bias=True, o_bias=True, mlp_bias=True, tie_embeddings=True,
    activation="gelu_pytorch_tanh", rope_type="llama3", rope_factor=8.0, rope_original_max_positions=8,
)  # fmt: skip
STEPS = 3
MESHES = {"fsdp4-tensor2": ("fsdp=4,tensor=2", 3, None), "1f1b": ("pipeline=4,data=2", 1, 8)}


def _batch():
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (16, 33)).astype(np.int32)
    positions = np.tile(np.arange(32, dtype=np.int32), (16, 1))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions}


@functools.cache
def run(kind):
    if kind == "one_device":
        mesh, zero, schedule = make_mesh("fsdp=1", jax.devices()[:1]), 3, None
    else:
        text, zero, microbatches = MESHES[kind]
        mesh = make_mesh(text)
        schedule = pipeline_schedule(kind, mesh, microbatches, 1, CONFIG.layers) if microbatches else None
    rules = make_rules(zero)
    # Plain SGD: a parameter's difference is then its gradients' (AdamW normalises each gradient, which would scale
    # the float32 noise of a nearly-zero one, such as k's bias, up to an lr-sized step).
    state = create_train_state(CONFIG, optax.apply_if_finite(optax.sgd(0.5), 2**30), mesh, rules)
    step = make_train_step(state, mesh, rules, pipeline=schedule)
    current, losses, batch = state.state, [], _batch()
    for _ in range(STEPS):
        current, metrics = step(current, batch)
        losses.append(float(metrics["loss"]))
    return losses, {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(current[0])}


def test_the_tie_is_one_parameter_and_the_biases_are_there():
    with nnx.use_eager_sharding(False):
        model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert "lm_head" not in params and model.lm_head_weight().shape == (CONFIG.embed, CONFIG.vocab_size)
    assert set(params["blocks"]["attention"]) == {"q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias"}
    assert {"gate_bias", "up_bias", "down_bias"} <= set(params["blocks"]["mlp"])
    assert sum(x.size for x in jax.tree.leaves(params)) == CONFIG.num_params()


@pytest.mark.parametrize("kind", list(MESHES))
def test_sharded_training_equals_one_device(kind):
    losses, params = run(kind)
    base_losses, base_params = run("one_device")
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    assert params.keys() == base_params.keys()
    for name, want in base_params.items():
        assert np.linalg.norm(params[name] - want) <= 1e-5 * np.linalg.norm(want), name
    bias = base_params["['blocks']['mlp']['down_bias'].value"]
    assert np.abs(bias).max() > 0  # the biases started at 0 and trained
