"""Context parallelism wired into the model: which attention runs, and the batch layout it needs.

With `attention="ring"` and a `context` axis of size N > 1, attention is `ring_attention` over that axis with
the zigzag layout: the data path permutes every per-token array of a batch once (`zigzag_batch`, on the host,
before the global arrays are made), and RoPE positions travel with their tokens. The token-mean loss does not
depend on token order, so nothing else changes.
"""

from __future__ import annotations

import jax
import numpy as np

from spmdkit.sharding.ring_attention import ring_attention, to_zigzag
from spmdkit.sharding.rules import active_rules

LOAD_BALANCE = "zigzag"
KEY_TILE = 512  # keys per tile inside a chunk pair: bounds attention scratch at long context


def context_size() -> int:
    """Size of the `context` axis of the mesh in force (1 without rules)."""
    active = active_rules()
    return 1 if active is None else active[1].shape.get("context", 1)


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal ring attention over `context`, with batch and head axes taken from the active rules.

    q [batch, seq, heads, head_dim], k/v [batch, seq, kv_heads, head_dim]; seq sharded over `context` in the
    zigzag layout. Requires `use_rules` to be active with a context axis > 1.
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
        load_balance=LOAD_BALANCE,
        batch_axes=sized(rules.params["batch"]),
        heads_axis=heads[0] if heads else None,
        key_tile=tile,
    )


def zigzag_batch(batch: dict[str, np.ndarray], context: int) -> dict[str, np.ndarray]:
    """Put every [batch, seq] array of a host batch into the zigzag layout for `context` devices."""
    if context <= 1:
        return batch
    return {name: np.ascontiguousarray(to_zigzag(x, axis=1, n=context)) for name, x in batch.items()}
