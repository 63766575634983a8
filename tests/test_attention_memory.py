"""Memory and FLOPs of the memory-efficient kernels, read from compiled programs (compiled only, never run): the
blockwise attention kernel's scratch grows linearly with the sequence where dot attention's grows quadratically,
causal blocks above the diagonal cost no FLOPs, the chunked loss never holds the whole float32 logits, and the
planner's activation memory follows the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.models import TransformerConfig
from spmdkit.models.attention import blockwise_attention, dot_attention
from spmdkit.models.loss import lm_loss
from spmdkit.models.transformer import cross_entropy, head_logits
from spmdkit.plan.estimate import estimate

# The backend (LLVM) optimisation level changes neither the HLO passes nor the buffers; -O0 halves compile time.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _compiled_layer(attention, seq: int, causal: bool = True):
    """Forward + backward of one attention layer, batch 1, float32, on one device."""
    q = jax.ShapeDtypeStruct((1, seq, HEADS, HEAD_DIM), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, KV_HEADS, HEAD_DIM), jnp.float32)

    def forward_backward(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, None, AttentionSpec(causal)), q, k, v)
        return out, *vjp(dout)

    return jax.jit(forward_backward).lower(q, kv, kv, q).compile(compiler_options=FAST)


def _temp(attention, seq: int) -> int:
    return _compiled_layer(attention, seq).memory_analysis().temp_size_in_bytes


def test_blockwise_scratch_grows_linearly_where_dot_grows_quadratically():
    blockwise = {seq: _temp(blockwise_attention, seq) for seq in (1024, 2048, 4096, 8192, 16384)}
    assert blockwise[16384] / blockwise[1024] <= 20, blockwise  # 16x the tokens
    assert all(blockwise[2 * s] <= 2.5 * blockwise[s] for s in (1024, 2048, 4096, 8192)), blockwise
    dot = {seq: _temp(dot_attention, seq) for seq in (1024, 2048, 4096)}  # (16k would need ~24 GB: not compiled)
    assert dot[4096] / dot[1024] >= 12, dot  # ~16x for 4x the tokens: the [seq, seq] scores, ~256x at 16k
    assert all(blockwise[s] < dot[s] for s in dot) and dot[4096] > 5 * blockwise[4096]


def test_causal_blocks_above_the_diagonal_cost_no_flops():
    causal = _compiled_layer(blockwise_attention, 4096, causal=True).cost_analysis()["flops"]
    full = _compiled_layer(blockwise_attention, 4096, causal=False).cost_analysis()["flops"]
    assert causal <= 0.6 * full, (causal, full)  # 36 of 64 block pairs at 8 blocks of 512


def test_chunked_loss_never_holds_the_whole_logits():
    """Llama 3's vocabulary (128,256), seq 4096, batch 1: the chunked loss's forward + backward keeps a quarter or
    less of the unchunked loss's temporary bytes (float32 logits [4096, 128256] = 2.1 GB, and their gradient)."""
    config = TransformerConfig(dtype="float32", vocab_size=128_256, embed=64)
    x = jax.ShapeDtypeStruct((1, 4096, config.embed), jnp.float32)
    scale, head = jax.ShapeDtypeStruct((config.embed,), jnp.float32), jax.ShapeDtypeStruct((64, 128_256), jnp.float32)
    targets = jax.ShapeDtypeStruct((1, 4096), jnp.int32)

    def temp(loss):
        grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        return grads.lower(x, scale, head, targets).compile(compiler_options=FAST).memory_analysis().temp_size_in_bytes

    chunked = temp(lambda x, s, h, t: lm_loss(x, s, h, t, config)[0])
    whole = temp(lambda x, s, h, t: cross_entropy(head_logits(x, s, h, config), t))
    assert whole > 4096 * 128_256 * 4  # the float32 logits at least
    assert chunked <= whole / 4, (chunked, whole)


@functools.cache
def _train_step_temp(attention: str, seq: int) -> int:
    """Temp bytes of the compiled train step of a 4-layer model (vocab 4096), batch 2, on one device."""
    from flax import nnx

    from spmdkit.models import Transformer
    from spmdkit.sharding.mesh import make_mesh
    from spmdkit.sharding.partition import abstract_state, state_shardings
    from spmdkit.sharding.rules import make_rules
    from spmdkit.train.step.optimizer import OptimizerConfig, make_optimizer
    from spmdkit.train.step.state import TrainState, train_state_shardings
    from spmdkit.train.step.train_step import batch_shardings, make_train_step

    config = _model(attention)
    mesh, rules = make_mesh("fsdp=1", jax.devices()[:1]), make_rules(3)
    tx = make_optimizer(OptimizerConfig(warmup_steps=1), 3)

    def make():
        model = Transformer(config, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef, abstract = abstract_state(make)
    shardings = train_state_shardings(abstract, mesh, rules)
    grads = state_shardings(nnx.state(nnx.merge(graphdef, abstract)[0], nnx.Param), mesh, rules.params)
    leaves, treedef = jax.tree.flatten(abstract)
    pairs = zip(leaves, jax.tree.leaves(shardings), strict=True)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in pairs]
    specs = jax.tree.unflatten(treedef, specs)
    step = make_train_step(TrainState(graphdef, specs, shardings, grads), mesh, rules)
    batch = {k: jax.ShapeDtypeStruct((2, seq), np.int32, sharding=s) for k, s in batch_shardings(mesh, rules).items()}
    return step.lower(specs, batch).compile(compiler_options=FAST).memory_analysis().temp_size_in_bytes


def _model(attention: str) -> TransformerConfig:
    return TransformerConfig(dtype="float32", vocab_size=4096, attention=attention)


@pytest.mark.parametrize("seq", [512, 1024])
def test_planner_activations_follow_the_blockwise_kernel(seq):
    """The planner's activations for the blockwise kernel (O(seq) per head, its widest step's scores, one loss
    chunk's logits) are within 25% of the compiled step's temporary bytes; for dot it adds the [seq, seq] scores."""
    planned = estimate(_model("blockwise"), {}, device="cpu", batch_size=2, seq_len=seq).memory["activations"]
    compiled = _train_step_temp("blockwise", seq)
    assert planned == pytest.approx(compiled, rel=0.25), (planned, compiled)
    dot = estimate(_model("dot"), {}, device="cpu", batch_size=2, seq_len=seq).memory["activations"]
    layers, heads = _model("dot").layers, _model("dot").heads
    assert dot - planned >= 0.5 * layers * 2 * seq * (4 + 4) * heads * seq  # f32 softmax + its copy, every layer


def test_planner_picks_the_kernel_of_the_device_and_chunks_the_logits():
    """On an H100, auto is cuDNN: no [seq, seq] term; the explicit dot kernel at seq 8192 costs its scores. The
    logits of the loss count one chunk (Llama 3 8B-like: 128,256 vocabulary)."""
    model = TransformerConfig(vocab_size=128_256, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336)
    plan = lambda model: estimate(model, "fsdp=8", device="h100", batch_size=8, seq_len=8192)  # noqa: E731
    auto, dot = plan(model), plan(model.replace(attention="dot"))
    scores = 32 * 8192 * 8192 * (4 + 2) * 32  # per sequence: layers x [heads, seq, seq] float32 + bfloat16
    assert dot.memory["activations"] - auto.memory["activations"] == pytest.approx(scores, rel=0.01)
    one_chunk = plan(model.replace(loss_chunk=0)).memory["activations"]
    logits = 8192 * 128_256 * 4 * 2  # float32 logits and their gradient, one sequence per device
    assert one_chunk - auto.memory["activations"] == pytest.approx(logits * (1 - 512 / 8192), rel=0.01)
