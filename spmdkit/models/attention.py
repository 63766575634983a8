"""Attention kernels: softmax(q k^T / sqrt(head_dim)) v with grouped-query heads, and which one runs.

All kernels take q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim] (heads = kv_heads x
group; K/V are never repeated) and return [batch, seq, heads, head_dim] in q's dtype, with scores and softmax in
float32.

- `dot_attention`: the reference; materialises the scores [batch, kv_heads, group, seq, seq].
- `context_attention`: ring attention (`spmdkit.parallel.context`) over the `context` mesh axis of the active
  rules, in the zigzag layout (the data path permutes every per-token array of a batch once, `zigzag_batch`, and
  RoPE positions travel with their tokens; the token-mean loss does not depend on token order).

`attend(q, k, v, kind)` picks by the model's `attention` setting: "ring" runs ring attention when the active mesh
has a context axis of size > 1, else the dot kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spmdkit.parallel.context.ring_attention import ring_attention
from spmdkit.sharding.logical import active_rules

KEY_TILE = 512  # keys per tile inside a ring chunk pair: bounds attention scratch at long context


def dot_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v with grouped-query heads, K/V never repeated.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim]; heads = kv_heads x group.
    Scores and softmax in float32. Returns [batch, seq, heads, head_dim] in q's dtype.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(d)
    if causal:
        mask = jnp.tril(jnp.ones((s, k.shape[1]), bool))
        scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, s, h, d)


def context_size() -> int:
    """Size of the `context` axis of the mesh in force (1 without rules)."""
    active = active_rules()
    return 1 if active is None else active[1].shape.get("context", 1)


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal ring attention over `context`, with batch and head axes taken from the active rules.

    seq is sharded over `context` in the zigzag layout. Requires `use_rules` to be active with a context axis > 1.
    """
    rules, mesh = active_rules()
    sized = lambda axes: tuple(a for a in axes if mesh.shape.get(a, 1) > 1)  # noqa: E731
    heads = sized(rules.params["heads"])
    chunk = q.shape[1] // (2 * mesh.shape["context"])
    tile = KEY_TILE if chunk % KEY_TILE == 0 and chunk > KEY_TILE else None
    return ring_attention(
        q,
        k,
        v,
        mesh=mesh,
        axis_name="context",
        causal=True,
        load_balance="zigzag",
        batch_axes=sized(rules.params["batch"]),
        heads_axis=heads[0] if heads else None,
        key_tile=tile,
    )


def attend(q: jax.Array, k: jax.Array, v: jax.Array, kind: str) -> jax.Array:
    """Causal attention with the kernel `kind` asks for ("dot", or "ring" where the mesh has context > 1)."""
    if kind == "ring" and context_size() > 1:
        return context_attention(q, k, v)
    return dot_attention(q, k, v)
