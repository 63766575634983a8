"""The key/value cache of autoregressive decoding: every layer's keys and values of every position seen so far.

Logically [layers, batch, max_len, kv_heads, head_dim] twice (keys, values) plus the positions held per row; held
as one buffer per layer (`k[l]`, `v[l]`: [batch, max_len, kv_heads, head_dim], the compute dtype, slot j = position
j), so that a decode step's attention reads each layer's cache where it lies (XLA would copy a slice of a stacked
cache before the matmul reads it: `spmdkit.inference.layerwise`).

    lengths  [batch] int32   positions held per row (the next token's position)

Logical names `(batch, None, kv_heads, head_dim)` per layer: under the inference rules `batch` is split over `data`
(each replica its rows) and `kv_heads` over `tensor` (each TP rank the heads its attention computes), so a decode
step reads only local keys and values. Grouped-query attention keeps the `kv_heads` un-repeated: the cache is
heads / kv_heads times smaller than the query heads would make it. When `tensor` does not divide `kv_heads`, the KV
heads are replicated (as their projections are; `spmdkit.sharding.rules`).

Bytes: 2 x layers x batch x max_len x kv_heads x head_dim x bytes per element (`cache_bytes`); per device divided
by `data` and, when it divides the KV heads, `tensor` (the planner's `spmdkit.plan.inference` says the same).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from spmdkit.models.config import TransformerConfig
from spmdkit.sharding.logical import logical_to_spec
from spmdkit.sharding.rules import Rules

CACHE_NAMES = ("batch", None, "kv_heads", "head_dim")  # one layer's [batch, max_len, kv_heads, head_dim]
ROW_NAMES = ("batch",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values, one [batch, max_len, kv_heads, head_dim] array per layer, and the positions held per row."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array


def layer_shape(config: TransformerConfig, batch: int, max_len: int) -> tuple[int, int, int, int]:
    """[batch, max_len, kv_heads, head_dim]: one layer's keys (or values)."""
    return (batch, max_len, config.kv_heads, config.head_dim)


def cache_bytes(config: TransformerConfig, batch: int, max_len: int) -> int:
    """2 x layers x batch x max_len x kv_heads x head_dim x bytes of the compute dtype (all devices together)."""
    b, s, k, d = layer_shape(config, batch, max_len)
    return 2 * config.layers * b * s * k * d * jnp.dtype(config.dtype).itemsize


def cache_shardings(config: TransformerConfig, batch: int, max_len: int, mesh: Mesh, rules: Rules) -> KVCache:
    """`NamedSharding`s of the cache's arrays under `rules` on `mesh` (a KVCache of shardings)."""
    spec = logical_to_spec(CACHE_NAMES, layer_shape(config, batch, max_len), mesh, rules.params, what="KV cache")
    rows = logical_to_spec(ROW_NAMES, (batch,), mesh, rules.params, what="cache lengths")
    per_layer = (NamedSharding(mesh, spec),) * config.layers
    return KVCache(per_layer, per_layer, NamedSharding(mesh, rows))


def empty_cache(config: TransformerConfig, batch: int, max_len: int, lengths: jax.Array | None = None) -> KVCache:
    """A zero cache (inside a traced function its layout comes from the caller's shardings)."""
    shape, dtype = layer_shape(config, batch, max_len), jnp.dtype(config.dtype)
    k = tuple(jnp.zeros(shape, dtype) for _ in range(config.layers))
    v = tuple(jnp.zeros(shape, dtype) for _ in range(config.layers))
    return KVCache(k, v, jnp.zeros((batch,), jnp.int32) if lengths is None else lengths)


def write_block(cache: jax.Array, new: jax.Array) -> jax.Array:
    """Prefill: new [batch, tokens, kv_heads, head_dim] into slots 0..tokens-1 of every row."""
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (0, 0, 0, 0))


# Row b's entry [kv_heads, head_dim] goes to cache[b, slot_b]: the batch is a scatter batch dim of both the cache
# and the indices, so GSPMD keeps each `data` shard's rows local and the layout stays as it is (no copy).
_TOKEN_SCATTER = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(1, 2),
    inserted_window_dims=(1,),
    scatter_dims_to_operand_dims=(1,),
    operand_batching_dims=(0,),
    scatter_indices_batching_dims=(0,),
)


def write_token(cache: jax.Array, new: jax.Array, slot: jax.Array) -> jax.Array:
    """Decode: each row's one new entry new [batch, 1, kv_heads, head_dim] into its own `slot` [batch].

    Only [batch, kv_heads, head_dim] is written, in place (the cache is a loop carry and the caller donates it).
    Slots are in range: a row stops before its position passes the cache's end."""
    return jax.lax.scatter(
        cache,
        slot.astype(jnp.int32)[:, None],
        new[:, 0].astype(cache.dtype),
        _TOKEN_SCATTER,
        indices_are_sorted=True,
        unique_indices=True,
    )
