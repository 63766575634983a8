"""The math of one (query block, key block) pair of attention, in float32 accumulators.

Every function takes any leading dims `...` (ring attention: [batch]; the blockwise kernel: [pairs, batch]):
queries and their output gradient [..., kv_heads, group, bq, head_dim] (grouped-query heads viewed as
[kv_heads, group], so K/V are never repeated), keys and values [..., kv_heads, bk, head_dim], per-row statistics
[..., kv_heads, group, bq], and a visibility mask [..., bq, bk] (True: the query sees the key) or None (all see
all). With scores s = q k^T * scale, soft-capped to c tanh(s / c) when `softcap` c > 0 (Gemma 2), then masked to
-inf, the forward pass keeps per query row

    m' = max(m, rowmax(s))        l' = l exp(m - m') + rowsum(exp(s - m'))
    o' = o exp(m - m') + exp(s - m') v
    out = o / l                   lse = m + log(l)

(`fold` for one key block, `finish` at the end), and the backward pass, with D = rowsum(dO * out) (less the
cotangent of lse, if any), recomputes P from the saved lse (`block_grads`):

    P = exp(s - lse)     dV = P^T dO     dP = dO V^T     dS = P * (dP - D)
    dQ = dS' K * scale   dK = dS'^T Q * scale     (dS' = dS (1 - tanh(s / c)^2) under a soft cap, else dS)

`grouped_scores` and `grouped_values` are the scores and the output of whole sequences in the [batch, seq, heads,
head_dim] layout, for the kernels that hold every score at once (the reference, the KV-cache attention).

A query row that sees no key at all (padding: segment id 0) gets out = 0, lse = -inf and zero gradients: its
running max starts at the finite float32 minimum, so a fully masked block gives exp(-inf) = 0, never NaN.

Attention sinks (GPT-OSS): a learned logit per query head joins every row's softmax denominator as a key with a
zero value. The online softmax starts from it (m = sink, l = 1: `initial_state(q, sinks)`), so out and lse include
it; its gradient is -sum over rows of exp(sink - lse) D (`sink_grad`). `with_sinks` appends it to whole scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.errors import SpmdkitError

F32 = jnp.float32
INIT_MAX = float(np.finfo(np.float32).min)  # finite, so fully masked blocks never give exp(-inf + inf)

State = tuple[jax.Array, jax.Array, jax.Array]  # o [..., bq, D], m [..., bq], l [..., bq]: float32


def _and(a: jax.Array | None, b: jax.Array) -> jax.Array:
    return b if a is None else a & b


def visible(
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    causal: bool,
    q_seg: jax.Array | None = None,
    k_seg: jax.Array | None = None,
    k_len: int | None = None,
    window: int = 0,
) -> jax.Array | None:
    """Which keys each query sees: bool [..., bq, bk], or None when every query sees every key.

    q_pos [..., bq], k_pos [..., bk]: sequence positions (causal: a key is seen when k_pos <= q_pos; `window`
    W > 0: only when k_pos > q_pos - W, the W latest keys of a causal query, itself included; 0: no window);
    q_seg [..., bq], k_seg [..., bk]: segment ids (a key is seen when its id equals the query's and the query's
    is not 0, padding); k_len: keys at positions >= k_len are padding added to fill the last block.
    """
    mask = None
    if causal:
        mask = k_pos[..., None, :] <= q_pos[..., :, None]
    if window > 0:
        mask = _and(mask, k_pos[..., None, :] > q_pos[..., :, None] - window)
    if k_len is not None:
        mask = _and(mask, (k_pos < k_len)[..., None, :])
    if q_seg is not None:
        same = (q_seg[..., :, None] == k_seg[..., None, :]) & (q_seg[..., :, None] != 0)
        mask = _and(mask, same)
    return mask


def capped_scores(q: jax.Array, k: jax.Array, scale: float, softcap: float = 0.0) -> tuple[jax.Array, jax.Array | None]:
    """(s, t): s = q k^T * scale float32 [..., kv_heads, group, bq, bk], soft-capped to softcap * t with
    t = tanh(s / softcap) when softcap > 0 (t is None without a cap); nothing masked."""
    s = jnp.einsum("...hgqd,...hkd->...hgqk", q, k, preferred_element_type=F32) * scale
    if softcap <= 0:
        return s, None
    t = jnp.tanh(s / softcap)
    return softcap * t, t


def grouped_scores(q: jax.Array, k: jax.Array, scale: float, softcap: float = 0.0) -> jax.Array:
    """Every query against every key, whole sequences: q [batch, bq, heads, D], k [batch, bk, kv_heads, D] ->
    s = q k^T * scale float32 [batch, kv_heads, group, bq, bk], soft-capped when softcap > 0; nothing masked."""
    b, t, h, d = q.shape
    grouped = q.reshape(b, t, k.shape[2], h // k.shape[2], d)
    s = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=F32) * scale
    return softcap * jnp.tanh(s / softcap) if softcap > 0 else s


def grouped_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """probs [batch, kv_heads, group, bq, bk] times v [batch, bk, kv_heads, D] -> [batch, bq, heads, D]."""
    b, hk, g, t, _ = probs.shape
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, hk * g, v.shape[3])


def _masked(s: jax.Array, mask: jax.Array | None) -> jax.Array:
    return s if mask is None else jnp.where(mask[..., None, None, :, :], s, -jnp.inf)


def initial_state(q: jax.Array, sinks: jax.Array | None = None) -> State:
    """The online-softmax state of query rows q [..., kv_heads, group, bq, D] before any key: o = 0, m = INIT_MAX,
    l = 0; with `sinks` [heads] (heads = kv_heads x group), m = the row's sink and l = 1 (its exp(sink - m))."""
    o = jnp.zeros_like(q, dtype=F32)  # *_like: inside a shard_map the state varies over the axes q varies over
    if sinks is None:
        return o, jnp.full_like(o[..., 0], INIT_MAX), jnp.zeros_like(o[..., 0])
    sink = sinks.astype(F32).reshape(q.shape[-4], q.shape[-3])[:, :, None]
    return o, jnp.zeros_like(o[..., 0]) + sink, jnp.ones_like(o[..., 0])


def sink_grad(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
    """d loss / d sinks [heads] from the rows' lse and D = rowsum(dO * out), both [..., kv_heads, group, bq]:
    the sink is a key of value 0, so dS = P (0 - D) with P = exp(sink - lse)."""
    hk, g = lse.shape[-3], lse.shape[-2]
    sink = sinks.astype(F32).reshape(hk, g)[:, :, None]
    total = -jnp.exp(sink - lse) * delta
    return total.reshape(-1, hk, g, lse.shape[-1]).sum((0, 3)).reshape(-1).astype(sinks.dtype)


def with_sinks(scores: jax.Array, sinks: jax.Array) -> jax.Array:
    """Whole scores [batch, kv_heads, group, bq, bk] float32 and one more key per row: its head's sink (the softmax
    of the result, less its last column, is attention with sinks)."""
    b, hk, g, t, _ = scores.shape
    column = jnp.broadcast_to(sinks.astype(F32).reshape(1, hk, g, 1, 1), (b, hk, g, t, 1))
    return jnp.concatenate([scores, column], axis=-1)


def fold(
    state: State, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float, softcap: float = 0.0
) -> State:
    """Fold one key block (k, v [..., kv_heads, bk, D]) into the state of the query block q; keys the mask hides
    score -inf."""
    o, m, denom = state
    s = _masked(capped_scores(q, k, scale, softcap)[0], mask)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("...hgqk,...hkd->...hgqd", p.astype(v.dtype), v, preferred_element_type=F32)
    return o * corr[..., None] + pv, m_new, denom * corr + p.sum(-1)


def finish(state: State) -> tuple[jax.Array, jax.Array]:
    """(out float32 [..., bq, D], lse float32 [..., bq]) of a state that has seen every key; rows that saw no
    key get out = 0 and lse = -inf."""
    o, m, denom = state
    seen = denom > 0
    safe = jnp.where(seen, denom, 1.0)
    return o / safe[..., None], jnp.where(seen, m + jnp.log(safe), -jnp.inf)


def row_delta(do: jax.Array, out: jax.Array) -> jax.Array:
    """D = rowsum(dO * out) in float32: [..., bq, D] -> [..., bq]."""
    return jnp.sum(do.astype(F32) * out.astype(F32), -1)


def block_grads(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    mask: jax.Array | None,
    scale: float,
    softcap: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Float32 (dq [..., kv_heads, group, bq, D], dk, dv [..., kv_heads, bk, D]) of one block pair, P recomputed
    from the rows' lse. Rows with lse = -inf (they saw no key) have every score -inf: P = 0 there. Under a soft cap
    dS is carried back through the tanh (1 - t^2, t taken before masking: finite everywhere)."""
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    s, t = capped_scores(q, k, scale, softcap)
    p = jnp.exp(_masked(s, mask) - lse[..., None])
    dv = jnp.einsum("...hgqk,...hgqd->...hkd", p.astype(do.dtype), do, preferred_element_type=F32)
    dp = jnp.einsum("...hgqd,...hkd->...hgqk", do, v, preferred_element_type=F32)
    ds = p * (dp - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dq = jnp.einsum("...hgqk,...hkd->...hgqd", ds.astype(k.dtype), k, preferred_element_type=F32) * scale
    dk = jnp.einsum("...hgqk,...hgqd->...hkd", ds.astype(q.dtype), q, preferred_element_type=F32) * scale
    return dq, dk, dv


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, kernel: str, segment_ids: jax.Array | None = None) -> None:
    """One SpmdkitError line unless q is [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim]
    with heads a multiple of kv_heads, and segment_ids (if any) [batch, seq] (`kernel` names the caller)."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise SpmdkitError(
            f"{kernel} takes q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim] of equal "
            f"shape; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise SpmdkitError(f"q {q.shape} and k/v {k.shape} differ in batch, seq or head_dim: make them equal")
    if q.shape[2] % k.shape[2]:
        raise SpmdkitError(
            f"heads={q.shape[2]} is not a multiple of kv_heads={k.shape[2]}: GQA needs heads = group x kv_heads"
        )
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(q.shape[:2]):
        raise SpmdkitError(f"segment_ids {tuple(segment_ids.shape)} must be [batch, seq] = {tuple(q.shape[:2])}")
