"""Latent attention (DeepSeek's MLA) against the latent cache, kv_b absorbed: new queries never expand the cache.

The cache holds per position j the latent c_j = kv_a_norm(latent) [kv_lora_rank = R] and the rotated rope key
r_j [qk_rope_head_dim = P], shared by every head (`spmdkit.inference.cache`). kv_b [R, H, N + V] splits into
W_UK [R, H, N] (N = qk_nope_head_dim) and W_UV [R, H, V] (`LatentAttention.absorbed`). Head h's key and value at j
would be k_hj = [c_j W_UK[:, h] | r_j], v_hj = c_j W_UV[:, h]; by associativity

    q_h . k_hj = (W_UK[:, h] q_nope_h) . c_j + q_pe_h . r_j
    sum_j p_hj v_hj = (sum_j p_hj c_j) W_UV[:, h]

so with shapes (b batch, t new tokens, s cache slots):

    q_latent = einsum(q_nope [b, t, H, N], W_UK [R, H, N])          -> [b, t, H, R]
    scores   = (q_latent . c [b, s, R] + q_pe [b, t, H, P] . r [b, s, P]) * scale    -> [b, H, t, s] float32
    probs    = softmax over the slots a query sees (its position and before; its window; the sinks' logits)
    context  = probs . c                                               -> [b, t, H, R]
    out      = einsum(context, W_UV [R, H, V])                         -> [b, t, H, V]  (then `out`: o_proj)

A step reads R + P values per cached position instead of H x (2 head_dim), and multiplies by W_UK and W_UV once
per new token rather than once per cached position. The latent acts as one key/value head shared by all H query
heads (multi-query attention of width R + P), so `grouped_scores` and `grouped_values` with one KV head compute it.
Under tensor parallelism the query heads and W_UK, W_UV are split over `tensor` and the latent is replicated: every
matmul here is local, and o_proj's all-reduce is the only collective, as for the expanded heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spmdkit.kernels.attention_block import grouped_scores, grouped_values, visible, with_sinks
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.sharding.logical import constrain

_HEADS = ("batch", None, "heads", None)  # [batch, tokens, heads, R or V]: the heads split as the query's


def absorbed_attention(
    q: jax.Array,
    w_uk: jax.Array,
    w_uv: jax.Array,
    latent: jax.Array,
    rope_key: jax.Array,
    positions: jax.Array,
    spec: AttentionSpec,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of q [batch, tokens, heads, N + P] (= [q_nope | q_pe], RoPE applied) over the cached latent
    [batch, slots, R] and rope key [batch, slots, P] (slot j = position j), W_UK [R, heads, N] and W_UV [R, heads, V]
    absorbed (the module doc). positions [batch, tokens]: each query sees slots at or before its own. `spec`: the
    layer's (scale None: (N + P)^-1/2; window, soft cap as in `cache_attention`); sinks [heads] or None.
    Returns [batch, tokens, heads, V] in q's dtype, heads split as q's."""
    nope = w_uk.shape[-1]
    spec = spec.resolved(q.shape[3], latent.shape[1] + 1)  # every window applies
    q_latent = constrain(jnp.einsum("bthn,rhn->bthr", q[..., :nope], w_uk), _HEADS)
    cached_latent, cached_rope = latent.astype(q.dtype)[:, :, None], rope_key.astype(q.dtype)[:, :, None]
    scores = grouped_scores(q_latent, cached_latent, spec.scale)  # [batch, 1, heads, tokens, slots]
    scores = scores + grouped_scores(q[..., nope:], cached_rope, spec.scale)
    if spec.softcap > 0:  # capped after the two parts are summed: the cap of the whole q . k
        scores = spec.softcap * jnp.tanh(scores / spec.softcap)
    seen = visible(positions, jnp.arange(latent.shape[1]), causal=True, window=spec.window)  # [batch, tokens, slots]
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    if sinks is not None:
        probs = jax.nn.softmax(with_sinks(scores, sinks), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    context = constrain(grouped_values(probs.astype(q.dtype), cached_latent), _HEADS)  # [batch, tokens, heads, R]
    return constrain(jnp.einsum("bthr,rhv->bthv", context, w_uv), _HEADS)
