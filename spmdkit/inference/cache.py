"""The key/value cache of autoregressive decoding: every layer's keys and values of every position seen so far.

    k, v     [layers, batch, max_len, kv_heads, head_dim]   compute dtype; slot j holds position j
    lengths  [batch] int32                                   positions held per row (the next token's position)

Logical names `("layers", "batch", None, "kv_heads", "head_dim")`: under the inference rules `batch` is split over
`data` (each replica its rows) and `kv_heads` over `tensor` (each TP rank the heads its attention computes), so
a decode step reads only local keys and values. Grouped-query attention keeps the `kv_heads` un-repeated: the
cache is heads / kv_heads times smaller than the query heads would make it. When `tensor` does not divide
`kv_heads`, the KV heads are replicated (as their projections are; `spmdkit.sharding.rules`).

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

CACHE_NAMES = ("layers", "batch", None, "kv_heads", "head_dim")
ROW_NAMES = ("batch",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values [layers, batch, max_len, kv_heads, head_dim] and the positions held per row [batch]."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def cache_shape(config: TransformerConfig, batch: int, max_len: int) -> tuple[int, int, int, int, int]:
    """[layers, batch, max_len, kv_heads, head_dim] of one of the two arrays."""
    return (config.layers, batch, max_len, config.kv_heads, config.head_dim)


def cache_bytes(config: TransformerConfig, batch: int, max_len: int) -> int:
    """2 x layers x batch x max_len x kv_heads x head_dim x bytes of the compute dtype (all devices together)."""
    k = cache_shape(config, batch, max_len)
    return 2 * k[0] * k[1] * k[2] * k[3] * k[4] * jnp.dtype(config.dtype).itemsize


def cache_shardings(config: TransformerConfig, batch: int, max_len: int, mesh: Mesh, rules: Rules) -> KVCache:
    """`NamedSharding`s of the cache's arrays under `rules` on `mesh` (a KVCache of shardings)."""
    spec = logical_to_spec(CACHE_NAMES, cache_shape(config, batch, max_len), mesh, rules.params, what="KV cache")
    rows = logical_to_spec(ROW_NAMES, (batch,), mesh, rules.params, what="cache lengths")
    return KVCache(NamedSharding(mesh, spec), NamedSharding(mesh, spec), NamedSharding(mesh, rows))


def abstract_cache(config: TransformerConfig, batch: int, max_len: int, shardings: KVCache) -> KVCache:
    """The cache as `ShapeDtypeStruct`s (for lowering without allocating)."""
    shape, dtype = cache_shape(config, batch, max_len), jnp.dtype(config.dtype)
    return KVCache(
        jax.ShapeDtypeStruct(shape, dtype, sharding=shardings.k),
        jax.ShapeDtypeStruct(shape, dtype, sharding=shardings.v),
        jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=shardings.lengths),
    )


def empty_cache(config: TransformerConfig, batch: int, max_len: int, shardings: KVCache) -> KVCache:
    """A zero cache, born in its shards (no device holds more than its block)."""
    shape, dtype = cache_shape(config, batch, max_len), jnp.dtype(config.dtype)

    def make() -> KVCache:
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    return jax.jit(make, out_shardings=shardings)()


def write_block(cache: jax.Array, layer: jax.Array, new: jax.Array) -> jax.Array:
    """Prefill: new [batch, tokens, kv_heads, head_dim] into slots 0..tokens-1 of `layer` (the same for every row)."""
    return jax.lax.dynamic_update_slice(cache, new[None].astype(cache.dtype), (layer, 0, 0, 0, 0))


# Row b's entry [kv_heads, head_dim] goes to cache[layer, b, slot_b]: the batch is a scatter batch dim of both the
# cache and the indices (GSPMD keeps each `data` shard's rows local, and the layout stays as it is: no copy).
_TOKEN_SCATTER = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(1, 2),
    inserted_window_dims=(0, 2),
    scatter_dims_to_operand_dims=(0, 2),
    operand_batching_dims=(1,),
    scatter_indices_batching_dims=(0,),
)


def write_token(cache: jax.Array, layer: jax.Array, new: jax.Array, slot: jax.Array) -> jax.Array:
    """Decode: each row's one new entry new [batch, 1, kv_heads, head_dim] into its own `slot` [batch] of `layer`.

    Only [batch, kv_heads, head_dim] is written, in place (the cache is a loop carry and the caller donates it).
    Slots are in range: a row stops before its position passes the cache's end."""
    indices = jnp.stack([jnp.broadcast_to(layer, slot.shape).astype(jnp.int32), slot.astype(jnp.int32)], axis=-1)
    return jax.lax.scatter(
        cache, indices, new[:, 0].astype(cache.dtype), _TOKEN_SCATTER, indices_are_sorted=True, unique_indices=True
    )


def layer_of(cache: jax.Array, layer: jax.Array) -> jax.Array:
    """[batch, max_len, kv_heads, head_dim] of one layer."""
    return jax.lax.dynamic_index_in_dim(cache, layer, axis=0, keepdims=False)
