"""One (query chunk, key chunk) pair of ring attention, per device: the statistics' layout and the key-tile loop.

Layouts (inside the shard_map, local shapes): the blockwise kernel's blocks (`q_blocks`, `kv_blocks`, `row_blocks`
of `spmdkit.kernels.blockwise_attention`), 2 of c positions (the slots): queries [2, B, kv_heads, group, c, D] so
grouped-query heads never repeat K/V, keys and values [2, B, kv_heads, c, D], segment ids [2, B, c]; per-row
statistics [2, B, kv_heads, group, c]. `fwd_pair` folds one key chunk into the online-softmax state (o, m, l) of
one query chunk; `bwd_pair` adds one pair's contributions to dq, dk, dv. Keys are scanned in tiles of `key_tile`,
bounding the scratch per pair to [heads, c, key_tile]. The math of each tile is `spmdkit.kernels.attention_block`
(`fold`, `block_grads`): the same functions the blockwise kernel runs, with the same `scale` and `softcap`.

Masks compare positions relative to the query chunk's first token (causal and window rules depend only on the
distance between a key and a query): `offset` is the key chunk's first true position less the query chunk's, 0 on
the diagonal pair. A window W > 0 hides keys at or before query - W.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from spmdkit.kernels.attention_block import block_grads, fold, visible
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.kernels.blockwise_attention import row_blocks


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


class PairOptions(NamedTuple):
    """What one chunk pair's masks and scores need besides q, k, v: the call's resolved `spec` (scale, softcap,
    window, key_tile), `diagonal` (the same chunk: keys after the query are hidden), `windowed` (the window's mask
    applies to this pair), segment ids q_seg, k_seg [B, c] of the query and key chunks (None: one document) and
    `offset` (the module doc)."""

    spec: AttentionSpec
    diagonal: bool
    windowed: bool = False
    q_seg: jax.Array | None = None
    k_seg: jax.Array | None = None
    offset: jax.Array | int = 0


def _tile_mask(c: int, index: jax.Array, pair: PairOptions, k_seg) -> jax.Array | None:
    """Which keys of tile `index` (segment ids `k_seg`) each of the c queries sees: on the diagonal pair keys after
    the query are hidden; under the window, keys W or more positions before the query; with segment ids, keys of
    other documents."""
    tile, window = pair.spec.key_tile, pair.spec.window if pair.windowed else 0
    k_pos = pair.offset + index * tile + jnp.arange(tile)
    return visible(jnp.arange(c), k_pos, causal=pair.diagonal, window=window, q_seg=pair.q_seg, k_seg=k_seg)


def _tiles(k, v, pair: PairOptions) -> tuple:
    """The scanned inputs of a key chunk: tile indices, K, V and segment-id tiles (None without segments)."""
    tile = pair.spec.key_tile
    tiles = jnp.arange(k.shape[2] // tile), key_tiles(k, tile), key_tiles(v, tile)
    return (*tiles, None if pair.k_seg is None else row_blocks(pair.k_seg, tile))


def fwd_pair(q, k, v, acc, pair: PairOptions):
    """Fold one key chunk into the online-softmax state acc = (o, m, l) of one query chunk, a tile at a time."""

    def tile_step(acc, xs):
        index, kt, vt, st = xs
        return fold(acc, q, kt, vt, _tile_mask(q.shape[-2], index, pair, st), pair.spec.scale, pair.spec.softcap), None

    return lax.scan(tile_step, acc, _tiles(k, v, pair))[0]


def bwd_pair(rows, k, v, grads, pair: PairOptions):
    """Gradient contributions of one chunk pair. rows = (q, dO, lse, D) of the query chunk;
    grads = (dq, dk, dv) float32 accumulators of the query chunk and the key chunk."""
    q, do, lse, delta = rows
    dq, dk, dv = grads

    def tile_step(dq, xs):
        index, kt, vt, st = xs
        mask = _tile_mask(q.shape[-2], index, pair, st)
        dq_t, dk_t, dv_t = block_grads(q, kt, vt, do, lse, delta, mask, pair.spec.scale, pair.spec.softcap)
        return dq + dq_t, (dk_t, dv_t)

    dq, (dk_t, dv_t) = lax.scan(tile_step, dq, _tiles(k, v, pair))
    return dq, dk + merge_tiles(dk_t), dv + merge_tiles(dv_t)
