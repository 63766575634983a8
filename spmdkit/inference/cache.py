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

Latent attention (DeepSeek's MLA, `kv_lora_rank` > 0) caches what its keys and values are computed from instead:
`k[l]` holds the latent c_kv [batch, max_len, kv_lora_rank] (after kv_a_norm) and `v[l]` the rotated rope key k_pe
[batch, max_len, qk_rope_head_dim] shared by every head (`LatentAttention.compressed_kv`): kv_lora_rank +
qk_rope_head_dim values per token and layer instead of heads x (head_dim + head_dim) (576 against 49,152 for
DeepSeek-V3: 128 heads x (192 + 192), values padded to the keys' head dim). Names `(batch, None, latent)` and
`(batch, None, None)`: rows over `data` as above; there are no heads to split, so under `tensor` the latent is
replicated (each TP rank holds and reads all of it) and the heads split in the absorbed matmuls instead
(`spmdkit.inference.latent`).

Bytes: 2 x layers x batch x max_len x kv_heads x head_dim x bytes per element, or layers x batch x max_len x
(kv_lora_rank + qk_rope_head_dim) x bytes for latent attention (`cache_bytes`); per device divided by `data` and,
when it divides the KV heads, `tensor` (the planner's `spmdkit.plan.inference` says the same).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from spmdkit.models.config import TransformerConfig
from spmdkit.sharding.logical import logical_to_spec
from spmdkit.sharding.rules import Rules

CACHE_NAMES = ("batch", None, "kv_heads", "head_dim")  # one layer's [batch, max_len, kv_heads, head_dim]
LATENT_NAMES = ("batch", None, "latent")  # latent attention's c_kv [batch, max_len, kv_lora_rank]
ROPE_KEY_NAMES = ("batch", None, None)  # and its k_pe [batch, max_len, qk_rope_head_dim]
ROW_NAMES = ("batch",)
Shape = tuple[int, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values, one [batch, max_len, kv_heads, head_dim] array per layer (latent attention: the latent and
    the rope key, the module doc), and the positions held per row."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array


def layer_shapes(config: TransformerConfig, batch: int, max_len: int) -> tuple[Shape, Shape]:
    """One layer's (k, v) shapes: [batch, max_len, kv_heads, head_dim] each, or latent attention's latent
    [batch, max_len, kv_lora_rank] and rope key [batch, max_len, qk_rope_head_dim]."""
    if config.kv_lora_rank:
        return (batch, max_len, config.kv_lora_rank), (batch, max_len, config.qk_rope_head_dim)
    return (batch, max_len, config.kv_heads, config.head_dim), (batch, max_len, config.kv_heads, config.head_dim)


def layer_names(config: TransformerConfig) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """The logical names of one layer's (k, v) buffers (the module doc)."""
    return (LATENT_NAMES, ROPE_KEY_NAMES) if config.kv_lora_rank else (CACHE_NAMES, CACHE_NAMES)


def cache_bytes(config: TransformerConfig, batch: int, max_len: int) -> int:
    """Layers x (the elements of one layer's k and v) x bytes of the compute dtype (all devices together)."""
    k, v = layer_shapes(config, batch, max_len)
    return config.layers * (math.prod(k) + math.prod(v)) * jnp.dtype(config.dtype).itemsize


def cache_shardings(config: TransformerConfig, batch: int, max_len: int, mesh: Mesh, rules: Rules) -> KVCache:
    """`NamedSharding`s of the cache's arrays under `rules` on `mesh` (a KVCache of shardings)."""
    (k_shape, v_shape), (k_names, v_names) = layer_shapes(config, batch, max_len), layer_names(config)
    k_spec = logical_to_spec(k_names, k_shape, mesh, rules.params, what="KV cache")
    v_spec = logical_to_spec(v_names, v_shape, mesh, rules.params, what="KV cache")
    rows = logical_to_spec(ROW_NAMES, (batch,), mesh, rules.params, what="cache lengths")
    k, v = (NamedSharding(mesh, k_spec),) * config.layers, (NamedSharding(mesh, v_spec),) * config.layers
    return KVCache(k, v, NamedSharding(mesh, rows))


def empty_cache(config: TransformerConfig, batch: int, max_len: int, lengths: jax.Array | None = None) -> KVCache:
    """A zero cache (inside a traced function its layout comes from the caller's shardings)."""
    (k_shape, v_shape), dtype = layer_shapes(config, batch, max_len), jnp.dtype(config.dtype)
    k = tuple(jnp.zeros(k_shape, dtype) for _ in range(config.layers))
    v = tuple(jnp.zeros(v_shape, dtype) for _ in range(config.layers))
    return KVCache(k, v, jnp.zeros((batch,), jnp.int32) if lengths is None else lengths)


def write_block(cache: jax.Array, new: jax.Array) -> jax.Array:
    """Prefill: new [batch, tokens, ...] into slots 0..tokens-1 of every row of cache [batch, max_len, ...]."""
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (0,) * cache.ndim)


def _token_scatter(ndim: int) -> jax.lax.ScatterDimensionNumbers:
    """Row b's entry [...] goes to cache[b, slot_b] of a cache of `ndim` dims: the batch is a scatter batch dim of
    both the cache and the indices, so GSPMD keeps each `data` shard's rows local and the layout stays as it is (no
    copy)."""
    return jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(1, ndim - 1)),
        inserted_window_dims=(1,),
        scatter_dims_to_operand_dims=(1,),
        operand_batching_dims=(0,),
        scatter_indices_batching_dims=(0,),
    )


def write_token(cache: jax.Array, new: jax.Array, slot: jax.Array) -> jax.Array:
    """Decode: each row's one new entry new [batch, 1, ...] into its own `slot` [batch] of cache [batch, max_len,
    ...].

    Only [batch, ...] is written, in place (the cache is a loop carry and the caller donates it). Slots are in range:
    a row stops before its position passes the cache's end."""
    return jax.lax.scatter(
        cache,
        slot.astype(jnp.int32)[:, None],
        new[:, 0].astype(cache.dtype),
        _token_scatter(cache.ndim),
        indices_are_sorted=True,
        unique_indices=True,
    )
