"""The model's forward pass with a key/value cache: prefill a prompt bucket, or decode one token per row.

Built from the model's own modules, so that whatever they compute (projections and their biases, norms, RoPE and
its scaling, the MLP or the mixture of experts, the embedding and the head) is what generation computes:

    x = model.embed(tokens)
    per block:  q, k, v = block.attention.qkv(block.attention_input(x), positions, kind)
                write k, v into the layer's cache at the tokens' positions
                x = block.add(x, block.attention.out(cache_attention(q, keys, values, positions, spec)))
                (latent attention: q, latent, rope key; the latter two cached; decode absorbs kv_b)
                x = block.mlp_half(x)                           (an MoE's aux is dropped)
    logits = model.head(x at each row's last position)

`kind` is the layer's static kind (`spmdkit.models.layer_plan`): its sliding window (the cache keeps every
position; a local layer's queries see only the last `window` of them), its RoPE.

Only the attention is generation's own (`spmdkit.inference.attention`, `spmdkit.inference.latent`): prefill attends
within the prompt bucket (the cache is empty before it), decode attends to the layer's cache. The blocks come one
per layer, in layer order (`spmdkit.inference.layerwise`: dense and mixture-of-experts blocks interleaved as
`Transformer.run_layers` runs them), and the walk over them is unrolled, each layer reading its own weight and
cache buffers.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from spmdkit.inference.attention import cache_attention
from spmdkit.inference.cache import CACHE_NAMES, LATENT_NAMES, ROPE_KEY_NAMES, KVCache, write_block, write_token
from spmdkit.inference.latent import absorbed_attention
from spmdkit.inference.layerwise import Layerwise
from spmdkit.models.latent_attention import LatentAttention
from spmdkit.models.layer_plan import LayerKind, layer_kinds
from spmdkit.models.layers import Attention
from spmdkit.models.transformer import Block
from spmdkit.sharding.logical import constrain

Mode = Literal["prefill", "decode"]
Caches = tuple[jax.Array, jax.Array]


def _write(caches: Caches, new: Caches, positions: jax.Array, mode: Mode, names: tuple) -> Caches:
    """new (k, v) [batch, tokens, ...] into the layer's caches: a prompt bucket from slot 0, or one token per row
    into the slot of its own position. Pinned to their layout: with KV heads replicated (tensor > kv_heads) GSPMD
    would otherwise split them like the query heads and all-gather them afterwards."""
    if mode == "prefill":
        written = (write_block(caches[0], new[0]), write_block(caches[1], new[1]))
    else:
        written = (write_token(caches[0], new[0], positions[:, 0]), write_token(caches[1], new[1], positions[:, 0]))
    return constrain(written[0], names[0]), constrain(written[1], names[1])


def kv_attention(
    attention: Attention, x: jax.Array, caches: Caches, positions: jax.Array, mode: Mode, kind: LayerKind
) -> tuple[jax.Array, Caches]:
    """Keys and values cached per head: (attended [batch, tokens, heads, head_dim], the caches written)."""
    q, k, v = attention.qkv(x, positions, kind)
    caches = _write(caches, (k, v), positions, mode, (CACHE_NAMES, CACHE_NAMES))
    keys, values = (k, v) if mode == "prefill" else caches  # a prompt attends to itself (causal by position)
    spec, sinks = attention.spec(kind), attention.sink_logits()
    return cache_attention(q, keys.astype(q.dtype), values.astype(q.dtype), positions, spec, sinks), caches


def latent_attention(
    attention: LatentAttention,
    x: jax.Array,
    caches: Caches,
    positions: jax.Array,
    mode: Mode,
    kind: LayerKind,
    absorb: bool = True,
) -> tuple[jax.Array, Caches]:
    """Latent attention caching (latent, rope key) [batch, max_len, kv_lora_rank | qk_rope_head_dim]: a prompt
    attends to its own expanded keys and values (the training form); decode attends to the cache with kv_b
    absorbed (`spmdkit.inference.latent`), or, `absorb=False`, expands the whole cache per step (the reference the
    tests compare against). (attended [batch, tokens, heads, V or head_dim], the caches written)."""
    q = attention.queries(x, positions, kind)
    latent, rope_key = attention.compressed_kv(x, positions, kind)
    caches = _write(caches, (latent, rope_key), positions, mode, (LATENT_NAMES, ROPE_KEY_NAMES))
    spec, sinks = attention.spec(kind), attention.sink_logits()
    if mode == "decode" and absorb:
        return absorbed_attention(q, *attention.absorbed(), *caches, positions, spec, sinks), caches
    k, v = attention.expand(latent, rope_key) if mode == "prefill" else attention.expand(*caches)
    return cache_attention(q, k.astype(q.dtype), v.astype(q.dtype), positions, spec, sinks), caches


def block_step(
    block: Block, x: jax.Array, caches: Caches, positions: jax.Array, mode: Mode, kind: LayerKind, absorb: bool = True
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block of kind `kind` over x [batch, tokens, embed] at `positions` [batch, tokens], reading and writing
    this layer's caches (`spmdkit.inference.cache`): (x, k cache, v cache)."""
    attention, h = block.attention, block.attention_input(x)
    if isinstance(attention, LatentAttention):
        attended, caches = latent_attention(attention, h, caches, positions, mode, kind, absorb)
    else:
        attended, caches = kv_attention(attention, h, caches, positions, mode, kind)
    x = block.add(x, attention.out(attended), "attention_post_norm")
    return block.mlp_half(x)[0], *caches


def run_cached(
    layers: Layerwise, x: jax.Array, positions: jax.Array, cache: KVCache, mode: Mode, absorb: bool = True
) -> tuple[jax.Array, KVCache]:
    """Every block in layer order over x [batch, tokens, embed]: (x, the cache with the tokens written)."""
    ks, vs = list(cache.k), list(cache.v)
    kinds = layer_kinds(layers.model.config)
    for i, block in enumerate(layers.blocks):
        x, ks[i], vs[i] = block_step(block, x, (ks[i], vs[i]), positions, mode, kinds[i], absorb)
    return x, KVCache(tuple(ks), tuple(vs), cache.lengths)


def prefill(layers: Layerwise, tokens: jax.Array, lengths: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Prompts tokens [batch, bucket] (right-padded), their lengths [batch] -> (logits [batch, vocab] float32 at
    each row's last prompt token, the cache holding the prompts, lengths set). Positions 0..bucket-1; padding
    writes slots past a row's length, which the row never attends to and decode overwrites."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, cache = run_cached(layers, layers.model.embed(tokens), positions, cache, "prefill")
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [batch, 1, embed]
    return layers.model.head(last)[:, 0], KVCache(cache.k, cache.v, lengths)


def decode(layers: Layerwise, tokens: jax.Array, cache: KVCache, absorb: bool = True) -> tuple[jax.Array, KVCache]:
    """One token per row, tokens [batch], at position `cache.lengths` -> (logits [batch, vocab] float32, the cache
    with it written; lengths are left to the caller, which advances only the rows still generating). `absorb`:
    latent attention's decode form (`latent_attention`; False only to check it against the expanded one)."""
    x = layers.model.embed(tokens[:, None])
    x, cache = run_cached(layers, x, cache.lengths[:, None], cache, "decode", absorb)
    return layers.model.head(x)[:, 0], cache
