"""Bits per byte: a loss that byte-level and BPE models share, so their runs compare on one axis.

    bits per byte = loss x tokens / bytes / ln 2

`loss` is the mean cross-entropy (nats) over the scored targets, `tokens` how many targets were scored (the sum of
the batch's `loss_mask`; every target for a batch without one), and `bytes` the UTF-8 bytes of text those targets
stand for: `sum(token_bytes[targets] * loss_mask)`, with `token_bytes` the int32 [vocab_size] table of
`DataStream.token_bytes` (`Tokenizer.token_bytes`: bytes per token id, 0 for BOS/EOS/specials). For byte-level
tokenizers (`bytes`, `bpe:N`, GPT-2/Llama-3/Qwen style) the count is exact per batch: a document's scored targets
sum to its text's UTF-8 bytes (its first token, BOS or not, is never a target); the EOS target's loss counts with
no bytes, which is the cost of knowing where a document ends. The embedded `stdlib` source (windows of bytes, no
mask) uses the `bytes` table: 1 per byte token, 0 for BOS/EOS.

The trainer's step (`spmdkit.train.step.train_step`) computes both next to the loss (with microbatches, it sums
`loss x tokens` and `text_bytes` over them before dividing). Whole-dataset figures are in
`dataset.json` (`tokens`, `bytes`) and per document in the index (`document_bytes.npy`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LN2 = math.log(2.0)


def target_bytes(targets: jax.Array, token_bytes: jax.Array, loss_mask: jax.Array | None = None) -> jax.Array:
    """Scalar float32: UTF-8 bytes of text the scored `targets` [batch, seq] stand for (`loss_mask` [batch, seq]
    selects the scored ones; None: all). Works inside `jit` and on numpy inputs."""
    counts = jnp.take(jnp.asarray(token_bytes), targets, mode="clip").astype(jnp.float32)
    if loss_mask is not None:
        counts = counts * loss_mask.astype(jnp.float32)
    return jnp.sum(counts)


def bits_per_byte(loss: jax.Array | float, tokens: jax.Array | float, text_bytes: jax.Array | float) -> jax.Array:
    """`loss` (mean nats per scored token) x `tokens` / `text_bytes` / ln 2."""
    return jnp.asarray(loss, jnp.float32) * tokens / jnp.maximum(text_bytes, 1.0) / LN2
