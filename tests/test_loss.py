"""The chunked LM head + cross-entropy: the reference's value and gradients (masked tokens and z-loss included), on one
device and sharded over fsdp=4,tensor=2, and how the sequence is cut into chunks.

Its memory (the float32 logits never whole) is in tests/test_attention_memory.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdkit.errors import SpmdkitError
from spmdkit.models import TransformerConfig
from spmdkit.models.config import loss_chunks
from spmdkit.models.loss import lm_loss
from spmdkit.models.transformer import cross_entropy, head_logits
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules

CONFIG = TransformerConfig(dtype="float32", vocab_size=300, embed=32, loss_chunk=16)
BATCH, SEQ = 8, 64  # 4 chunks of 16


@functools.cache
def _inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SEQ, CONFIG.embed), dtype=np.float32)
    scale = (1 + 0.1 * rng.standard_normal(CONFIG.embed)).astype(np.float32)
    head = (rng.standard_normal((CONFIG.embed, CONFIG.vocab_size)) / 6).astype(np.float32)
    targets = rng.integers(0, CONFIG.vocab_size, (BATCH, SEQ)).astype(np.int32)
    mask = (rng.random((BATCH, SEQ)) < 0.7).astype(np.float32)
    return x, scale, head, targets, mask


def _reference(x, scale, head, targets, mask, z_weight):
    """The full float32 logits, optax's cross-entropy, and the z-loss written out: mean over masked tokens."""
    logits = head_logits(x, scale, head, CONFIG)
    weights = jnp.ones(targets.shape) if mask is None else mask
    z = (weights * jax.nn.logsumexp(logits, axis=-1) ** 2).sum() / weights.sum()
    return cross_entropy(logits, targets, mask) + z_weight * z


def _chunked(x, scale, head, targets, mask, z_weight, config=CONFIG):
    ce, z = lm_loss(x, scale, head, targets, config, mask)
    return ce + z_weight * z


def _one_chunk(x, scale, head, targets, mask, z_weight):
    """The whole sequence in one chunk: the path that keeps the logits for the backward pass."""
    return _chunked(x, scale, head, targets, mask, z_weight, CONFIG.replace(loss_chunk=0))


def _value_and_grads(loss, mask, z_weight):
    x, scale, head, targets, full_mask = _inputs()
    mask = full_mask if mask else None
    fn = jax.jit(jax.value_and_grad(lambda x, s, h: loss(x, s, h, targets, mask, z_weight), argnums=(0, 1, 2)))
    return fn(x, scale, head)


def _rel(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))) / np.max(np.abs(np.asarray(want))))


@pytest.mark.parametrize("loss", [_chunked, _one_chunk], ids=["4 chunks", "one chunk"])
@pytest.mark.parametrize("mask,z_weight", [(False, 0.0), (True, 0.0), (True, 1e-2)], ids=["all", "masked", "z-loss"])
def test_chunked_loss_equals_the_reference(mask, z_weight, loss):
    value, grads = _value_and_grads(loss, mask, z_weight)
    want_value, want_grads = _value_and_grads(_reference, mask, z_weight)
    assert abs(float(value) - float(want_value)) <= 1e-6 * abs(float(want_value))
    for name, g, w in zip(("x", "norm scale", "head"), grads, want_grads, strict=True):
        assert _rel(g, w) < 1e-5, (name, _rel(g, w))


@pytest.mark.parametrize("chunked", [_chunked, _one_chunk], ids=["4 chunks", "one chunk"])
def test_sharded_chunked_loss_equals_the_one_device_reference(chunked):
    """fsdp=4,tensor=2: tokens split over fsdp, vocab over tensor; each device sums its chunks' head gradient and one
    reduction follows (the shard_map of `lm_loss`). Same value and gradients as the unsharded reference."""
    mesh, rules = make_mesh("fsdp=4,tensor=2"), make_rules(3)
    x, scale, head, targets, mask = _inputs()

    def loss(x, s, h):
        with use_rules(rules, mesh):
            return chunked(x, s, h, targets, mask, 1e-2)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, scale, head)
    want_value, want_grads = _value_and_grads(_reference, True, 1e-2)
    assert abs(float(value) - float(want_value)) <= 1e-6 * abs(float(want_value))
    for name, g, w in zip(("x", "norm scale", "head"), grads, want_grads, strict=True):
        assert _rel(g, w) < 1e-5, (name, _rel(g, w))


def test_chunks_divide_each_device_share_of_the_sequence():
    assert loss_chunks(4096, 512) == 8 and loss_chunks(4096, 0) == 1 and loss_chunks(256, 512) == 1
    assert loss_chunks(1000, 512) == 2  # 2 chunks of 500
    assert loss_chunks(96, 16, shards=4) == 6  # 24 positions per device: 6 chunks of 4 each
    assert loss_chunks(48, 16, shards=16) == 3  # 3 positions per device, one per chunk
    with pytest.raises(SpmdkitError, match="loss_chunk=-1 and z_loss=0.0 must be >= 0"):
        CONFIG.replace(loss_chunk=-1)


@pytest.mark.parametrize("chunk, logits_matmuls", [(0, 1), (16, 4)], ids=["one chunk", "4 chunks"])
def test_one_chunk_keeps_its_logits_rather_than_recomputing_the_head(chunk, logits_matmuls):
    """The compiled value-and-gradient's matmuls that make logits ([tokens, vocab], not d head [embed, vocab]): one
    chunk computes them once; chunked, the backward pass computes each chunk's again (the first chunk runs before
    the loop in both passes: 2 forward, 2 recomputed)."""
    x, scale, head, targets, mask = _inputs()
    config = CONFIG.replace(loss_chunk=chunk)
    grad = jax.value_and_grad(lambda x, s, h: lm_loss(x, s, h, targets, config, mask)[0], argnums=(0, 1, 2))
    text = jax.jit(grad).lower(x, scale, head).compile().as_text()
    shapes = re.findall(r"= f32\[(\d+),(\d+)\]\S* dot\(", text)
    logits = [rows for rows, cols in shapes if int(cols) == CONFIG.vocab_size and int(rows) != CONFIG.embed]
    assert len(logits) == logits_matmuls, shapes
