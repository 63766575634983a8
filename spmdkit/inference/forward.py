"""The model's forward pass with a key/value cache: prefill a prompt bucket, or decode one token per row.

Built from the model's own modules, so that whatever they compute (projections and their biases, norms, RoPE and
its scaling, the MLP or the mixture of experts, the embedding and the head) is what generation computes:

    x = model.embed(tokens)
    per block:  q, k, v = block.attention.qkv(block.attention_norm(x), positions)
                write k, v into the cache at the tokens' positions
                x = x + block.attention.out(cache_attention(q, keys, values, positions))
                x = x + block.mlp(block.mlp_norm(x))            (an MoE returns (y, aux): aux is dropped)
    logits = model.head(x at each row's last position)

Only the attention is generation's own (`spmdkit.inference.attention`): prefill attends within the prompt bucket
(the cache is empty before it), decode attends to the cache of the layer.

Blocks are walked in the model's layer order with a scan over each stacked group (as `Transformer.run_layers`
does): dense models one scan; mixture-of-experts models per group of `moe_every` layers, a scan over its dense
blocks then its MoE block. The cache is the scan's carry, indexed by the global layer number, and written in place.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit.inference.attention import cache_attention
from spmdkit.inference.cache import CACHE_NAMES, KVCache, layer_of, write_block, write_token
from spmdkit.models.layers import RESIDUAL
from spmdkit.models.transformer import Block, Transformer
from spmdkit.sharding.logical import constrain

Mode = Literal["prefill", "decode"]
Carry = tuple[jax.Array, jax.Array, jax.Array]  # x, k cache, v cache


def block_step(block: Block, carry: Carry, layer: jax.Array, positions: jax.Array, mode: Mode) -> Carry:
    """One pre-norm block over x [batch, tokens, embed] at `positions` [batch, tokens], reading and writing `layer`
    of the caches [layers, batch, max_len, kv_heads, head_dim]."""
    x, k_cache, v_cache = carry
    q, k, v = block.attention.qkv(block.attention_norm(x), positions)
    if mode == "prefill":  # the prompt bucket from slot 0; it attends to itself (causal by position)
        k_cache, v_cache = write_block(k_cache, layer, k), write_block(v_cache, layer, v)
        keys, values = k, v
    else:  # one token per row, into the slot of its own position; it attends to the row's cache
        slot = positions[:, 0]
        k_cache, v_cache = write_token(k_cache, layer, k, slot), write_token(v_cache, layer, v, slot)
        keys, values = layer_of(k_cache, layer), layer_of(v_cache, layer)
    # Pin the caches to their layout: with KV heads replicated (tensor > kv_heads) GSPMD would otherwise split
    # them like the query heads inside the loop and all-gather the whole cache after it.
    k_cache, v_cache = constrain(k_cache, CACHE_NAMES), constrain(v_cache, CACHE_NAMES)
    attended = cache_attention(q, keys.astype(q.dtype), values.astype(q.dtype), positions)
    x = constrain(x + block.attention.out(attended), RESIDUAL)
    out = block.mlp(block.mlp_norm(x))
    out = out[0] if isinstance(out, tuple) else out
    return constrain(x + out, RESIDUAL), k_cache, v_cache


def _scan_stack(blocks: Block, carry: Carry, first_layer: int, positions: jax.Array, mode: Mode) -> Carry:
    """`block_step` over a stack of blocks (parameters with a leading layer dim) at layers first_layer, ...

    A plain `lax.scan` over the stack's state, each layer's block merged inside the body, so the walk also runs
    inside other loops (the decode `while_loop`) without crossing nnx trace levels."""
    graphdef, state = nnx.split(blocks)
    count = jax.tree.leaves(state)[0].shape[0]

    def body(carry: Carry, xs: tuple) -> tuple[Carry, None]:
        layer_state, layer = xs
        return block_step(nnx.merge(graphdef, layer_state), carry, layer, positions, mode), None

    layers = first_layer + jnp.arange(count, dtype=jnp.int32)
    return jax.lax.scan(body, carry, (state, layers))[0]


def _stack_slice(blocks: Block, start: int, stop: int) -> Block:
    """Blocks [start, stop) of a stack, as a stack."""
    graphdef, state = nnx.split(blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[start:stop], state))


def run_cached(model: Transformer, x: jax.Array, positions: jax.Array, cache: KVCache, mode: Mode) -> tuple:
    """Every block in layer order: (x [batch, tokens, embed], k cache, v cache)."""
    c = model.config
    carry = (x, cache.k, cache.v)
    if not c.moe_layers:
        return _scan_stack(model.blocks, carry, 0, positions, mode)
    if c.moe_every == 1:
        return _scan_stack(model.moe_blocks, carry, 0, positions, mode)
    dense = c.moe_every - 1
    for group in range(c.moe_layers):
        first = group * c.moe_every
        carry = _scan_stack(
            _stack_slice(model.blocks, group * dense, (group + 1) * dense), carry, first, positions, mode
        )
        carry = _scan_stack(_stack_slice(model.moe_blocks, group, group + 1), carry, first + dense, positions, mode)
    return carry


def prefill(model: Transformer, tokens: jax.Array, lengths: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Prompts tokens [batch, bucket] (right-padded), their lengths [batch] -> (logits [batch, vocab] float32 at
    each row's last prompt token, the cache holding the prompts). Positions 0..bucket-1; padding writes slots
    past a row's length, which the row never attends to and decode overwrites."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, k, v = run_cached(model, model.embed(tokens), positions, cache, "prefill")
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [batch, 1, embed]
    return model.head(last)[:, 0], KVCache(k, v, lengths)


def decode(model: Transformer, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """One token per row, tokens [batch], at position `cache.lengths` -> (logits [batch, vocab] float32, the cache
    with it written; lengths are left to the caller, which advances only the rows still generating)."""
    positions = cache.lengths[:, None]
    x, k, v = run_cached(model, model.embed(tokens[:, None]), positions, cache, "decode")
    return model.head(x)[:, 0], KVCache(k, v, cache.lengths)
