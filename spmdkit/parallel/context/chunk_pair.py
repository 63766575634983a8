"""The math of one (query chunk, key chunk) pair of ring attention, per device, in float32 accumulators.

Layouts (inside the shard_map, local shapes): queries as [2 (slot), B, kv_heads, group, c, D] so grouped-query heads
never repeat K/V; keys and values as [2 (slot), B, kv_heads, c, D]; per-row statistics [2, B, kv_heads, group, c].
`fwd_pair` folds one key chunk into the online-softmax state (o, m, l) of one query chunk; `bwd_pair` adds one
pair's contributions to dq, dk, dv. Keys are scanned in tiles of `key_tile`, bounding the scratch per pair to
[heads, c, key_tile]. The formulas are in `spmdkit.parallel.context.ring_attention`'s docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def split_q(x: jax.Array, kv_heads: int) -> jax.Array:
    """[B, 2c, H, D] -> [2 (slot), B, kv_heads, group, c, D]."""
    b, s2, h, d = x.shape
    return x.reshape(b, 2, s2 // 2, kv_heads, h // kv_heads, d).transpose(1, 0, 3, 4, 2, 5)


def merge_q(x: jax.Array) -> jax.Array:
    """[2, B, kv_heads, group, c, D] -> [B, 2c, H, D]."""
    _, b, hk, g, c, d = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, 2 * c, hk * g, d)


def split_kv(x: jax.Array) -> jax.Array:
    """[B, 2c, kv_heads, D] -> [2 (slot), B, kv_heads, c, D]."""
    b, s2, hk, d = x.shape
    return x.reshape(b, 2, s2 // 2, hk, d).transpose(1, 0, 3, 2, 4)


def merge_kv(x: jax.Array) -> jax.Array:
    """[2, B, kv_heads, c, D] -> [B, 2c, kv_heads, D]."""
    _, b, hk, c, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, 2 * c, hk, d)


def split_rows(x: jax.Array, kv_heads: int) -> jax.Array:
    """Per-row statistics [B, H, 2c] -> [2, B, kv_heads, group, c]."""
    b, h, s2 = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, 2, s2 // 2).transpose(3, 0, 1, 2, 4)


def merge_rows(x: jax.Array) -> jax.Array:
    """[2, B, kv_heads, group, c] -> [B, H, 2c]."""
    _, b, hk, g, c = x.shape
    return x.transpose(1, 2, 3, 0, 4).reshape(b, hk * g, 2 * c)


def key_tiles(x: jax.Array, tile: int) -> jax.Array:
    """[B, kv_heads, c, D] -> [c / tile, B, kv_heads, tile, D]."""
    b, hk, c, d = x.shape
    return x.reshape(b, hk, c // tile, tile, d).transpose(2, 0, 1, 3, 4)


def merge_tiles(x: jax.Array) -> jax.Array:
    """[c / tile, B, kv_heads, tile, D] -> [B, kv_heads, c, D]."""
    nt, b, hk, tile, d = x.shape
    return x.transpose(1, 2, 0, 3, 4).reshape(b, hk, nt * tile, d)


def scores(q: jax.Array, k: jax.Array, tile_index: jax.Array, diagonal: bool, scale: float) -> jax.Array:
    """s = q k^T * scale, [B, kv_heads, group, c, tile] float32; on the diagonal pair keys after the query
    are set to -inf (both chunks are the same chunk, so local offsets compare positions)."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q, k, preferred_element_type=F32) * scale
    if diagonal:
        tile = k.shape[2]
        q_pos = jnp.arange(q.shape[3])[:, None]
        k_pos = tile_index * tile + jnp.arange(tile)[None, :]
        s = jnp.where(k_pos <= q_pos, s, -jnp.inf)
    return s


def fwd_pair(q, k, v, acc, *, diagonal: bool, scale: float, key_tile: int):
    """Fold one key chunk into the online-softmax state acc = (o, m, l) of one query chunk."""

    def tile_step(acc, xs):
        o, m, denom = acc
        index, kt, vt = xs
        s = scores(q, kt, index, diagonal, scale)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(vt.dtype), vt, preferred_element_type=F32)
        return (o * corr[..., None] + pv, m_new, denom * corr + p.sum(-1)), None

    tiles = k.shape[2] // key_tile
    xs = (jnp.arange(tiles), key_tiles(k, key_tile), key_tiles(v, key_tile))
    return lax.scan(tile_step, acc, xs)[0]


def bwd_pair(rows, k, v, grads, *, diagonal: bool, scale: float, key_tile: int):
    """Gradient contributions of one chunk pair. rows = (q, dO, lse, D) of the query chunk;
    grads = (dq, dk, dv) float32 accumulators of the query chunk and the key chunk."""
    q, do, lse, delta = rows
    dq, dk, dv = grads

    def tile_step(dq, xs):
        index, kt, vt = xs
        p = jnp.exp(scores(q, kt, index, diagonal, scale) - lse[..., None])
        dv_t = jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(do.dtype), do, preferred_element_type=F32)
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", do, vt, preferred_element_type=F32)
        ds = p * (dp - delta[..., None])
        dq = dq + jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(kt.dtype), kt, preferred_element_type=F32) * scale
        dk_t = jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(q.dtype), q, preferred_element_type=F32) * scale
        return dq, (dk_t, dv_t)

    tiles = k.shape[2] // key_tile
    xs = (jnp.arange(tiles), key_tiles(k, key_tile), key_tiles(v, key_tile))
    dq, (dk_t, dv_t) = lax.scan(tile_step, dq, xs)
    return dq, dk + merge_tiles(dk_t), dv + merge_tiles(dv_t)
