"""Attention of new queries against the key/value cache, grouped-query heads without repeating K/V.

`cache_attention(q, k, v, positions)`: q [batch, tokens, heads, head_dim] (tokens = 1 when decoding, the prompt
bucket when prefilling); k, v [batch, keys, kv_heads, head_dim] where key slot j holds position j. Each query sees
the slots at or before its own position: that is causal attention within a prompt, and, in decode, every row
attending to exactly its own length (rows of different lengths share one batch; slots past a row's length hold
stale or padding keys and are masked). Heads = kv_heads x group: q is viewed as [batch, tokens, kv_heads, group,
head_dim], so K/V are read once per KV head, never repeated. Scores and softmax in float32, the output in q's dtype.

The layer's `AttentionSpec` (`spmdkit.kernels.attention_spec`), with the meaning it has in every kernel: a window
W > 0 hides the slots j <= p - W of a query at position p (sliding-window attention over a full-length cache),
`scale` multiplies q k^T (None: 1/sqrt(head_dim)), `softcap` c > 0 caps the scores to c tanh(s / c) before masking.
`sinks` [heads] (GPT-OSS): each head's logit joins every row's softmax denominator, attending to nothing.

Under tensor parallelism q's heads and the cache's kv_heads are both split over `tensor`: the kernel is local.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spmdkit.kernels.attention_block import grouped_scores, grouped_values, visible, with_sinks
from spmdkit.kernels.attention_spec import AttentionSpec


def cache_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T * scale) v over the key slots j <= position of each query (and j > position - window).

    q: [batch, tokens, heads, head_dim]; k, v: [batch, keys, kv_heads, head_dim]; positions: [batch, tokens] int.
    Returns [batch, tokens, heads, head_dim] in q's dtype. `spec`: the module doc (None: no window, no cap).
    """
    spec = (spec or AttentionSpec()).resolved(q.shape[3], k.shape[1] + 1)  # every window applies
    scores = grouped_scores(q, k, spec.scale, spec.softcap)
    seen = visible(positions, jnp.arange(k.shape[1]), causal=True, window=spec.window)  # [batch, tokens, keys]
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    if sinks is not None:
        probs = jax.nn.softmax(with_sinks(scores, sinks), axis=-1)[..., :-1].astype(v.dtype)
    else:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return grouped_values(probs, v)
