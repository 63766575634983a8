"""The model's forward pass with a key/value cache: prefill a prompt bucket, or decode one token per row.

Built from the model's own modules, so that whatever they compute (projections and their biases, norms, RoPE and
its scaling, the MLP or the mixture of experts, the embedding and the head) is what generation computes:

    x = model.embed(tokens)
    per block:  q, k, v = block.attention.qkv(block.attention_input(x), positions, kind)
                write k, v into the layer's cache at the tokens' positions
                x = block.add(x, block.attention.out(cache_attention(q, keys, values, positions, spec)))
                x = block.mlp_half(x)                           (an MoE's aux is dropped)
    logits = model.head(x at each row's last position)

`kind` is the layer's static kind (`spmdkit.models.layer_plan`): its sliding window (the cache keeps every
position; a local layer's queries see only the last `window` of them), its RoPE.

Only the attention is generation's own (`spmdkit.inference.attention`): prefill attends within the prompt bucket
(the cache is empty before it), decode attends to the layer's cache. The blocks come one per layer, in layer order
(`spmdkit.inference.layerwise`: dense and mixture-of-experts blocks interleaved as `Transformer.run_layers` runs
them), and the walk over them is unrolled, each layer reading its own weight and cache buffers.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from spmdkit.inference.attention import cache_attention
from spmdkit.inference.cache import CACHE_NAMES, KVCache, write_block, write_token
from spmdkit.inference.layerwise import Layerwise
from spmdkit.models.layer_plan import LayerKind, layer_kinds
from spmdkit.models.transformer import Block
from spmdkit.sharding.logical import constrain

Mode = Literal["prefill", "decode"]


def block_step(
    block: Block, x: jax.Array, caches: tuple[jax.Array, jax.Array], positions: jax.Array, mode: Mode, kind: LayerKind
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block of kind `kind` over x [batch, tokens, embed] at `positions` [batch, tokens], reading and writing
    this layer's caches (k, v) [batch, max_len, kv_heads, head_dim]: (x, k cache, v cache)."""
    (k_cache, v_cache), attention = caches, block.attention
    q, k, v = attention.qkv(block.attention_input(x), positions, kind)
    if mode == "prefill":  # the prompt bucket from slot 0; it attends to itself (causal by position)
        k_cache, v_cache = write_block(k_cache, k), write_block(v_cache, v)
        keys, values = k, v
    else:  # one token per row, into the slot of its own position; it attends to the row's cache
        slot = positions[:, 0]
        k_cache, v_cache = write_token(k_cache, k, slot), write_token(v_cache, v, slot)
        keys, values = k_cache, v_cache
    # Pin the caches to their layout: with KV heads replicated (tensor > kv_heads) GSPMD would otherwise split
    # them like the query heads and all-gather them afterwards.
    k_cache, v_cache = constrain(k_cache, CACHE_NAMES), constrain(v_cache, CACHE_NAMES)
    attended = cache_attention(
        q, keys.astype(q.dtype), values.astype(q.dtype), positions, attention.spec(kind), attention.sink_logits()
    )
    x = block.add(x, attention.out(attended), "attention_post_norm")
    return block.mlp_half(x)[0], k_cache, v_cache


def run_cached(
    layers: Layerwise, x: jax.Array, positions: jax.Array, cache: KVCache, mode: Mode
) -> tuple[jax.Array, KVCache]:
    """Every block in layer order over x [batch, tokens, embed]: (x, the cache with the tokens written)."""
    ks, vs = list(cache.k), list(cache.v)
    kinds = layer_kinds(layers.model.config)
    for i, block in enumerate(layers.blocks):
        x, ks[i], vs[i] = block_step(block, x, (ks[i], vs[i]), positions, mode, kinds[i])
    return x, KVCache(tuple(ks), tuple(vs), cache.lengths)


def prefill(layers: Layerwise, tokens: jax.Array, lengths: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Prompts tokens [batch, bucket] (right-padded), their lengths [batch] -> (logits [batch, vocab] float32 at
    each row's last prompt token, the cache holding the prompts, lengths set). Positions 0..bucket-1; padding
    writes slots past a row's length, which the row never attends to and decode overwrites."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, cache = run_cached(layers, layers.model.embed(tokens), positions, cache, "prefill")
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [batch, 1, embed]
    return layers.model.head(last)[:, 0], KVCache(cache.k, cache.v, lengths)


def decode(layers: Layerwise, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """One token per row, tokens [batch], at position `cache.lengths` -> (logits [batch, vocab] float32, the cache
    with it written; lengths are left to the caller, which advances only the rows still generating)."""
    x, cache = run_cached(layers, layers.model.embed(tokens[:, None]), cache.lengths[:, None], cache, "decode")
    return layers.model.head(x)[:, 0], cache
