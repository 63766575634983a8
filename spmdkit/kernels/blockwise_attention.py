"""Blockwise (flash-attention style) attention on one device: online softmax over key blocks, O(seq) memory.

q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim] (heads = kv_heads x group; K/V are
never repeated). The sequence is cut into query blocks of `block_q` and key blocks of `block_k` positions (the
last block padded; padded keys are masked). Each query block folds the key blocks it needs into its float32
online-softmax state with `spmdkit.kernels.attention_block.fold`, the same function ring attention runs per hop.

Schedule (`spmdkit.kernels.block_plan`): the pairs run in steps, each a batch of pairs with static shapes, one
step after another. Under a causal mask, pairs whose key block lies wholly after the query block are never built:
they cost no FLOPs, and the compiled program's FLOPs (`cost_analysis`) show the saving (about half at long
sequences). Only steps that hold a partially visible pair (the diagonal, the padded last key block) compute a mask;
with `segment_ids` every step does.

Backward (`jax.custom_vjp`): the residuals are q, k, v, out and the float32 log-sum-exp per query row; every pair
is recomputed by `block_grads`. Scratch memory is a few arrays of one step's scores, [pairs, batch, heads,
block_q, block_k] float32 with pairs x block_q x block_k <= `STEP_SCORES`: O(1) in seq per head, never [seq, seq].
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdkit.errors import SpmdkitError
from spmdkit.kernels.attention_block import F32, block_grads, check_qkv, finish, fold, initial_state, row_delta, visible
from spmdkit.kernels.block_plan import BLOCK_K, BLOCK_Q, BlockPlan, Step

__all__ = ["BLOCK_K", "BLOCK_Q", "BlockPlan", "blockwise_attention"]

# ---------------------------------------------------------------- block layouts and static-index gathers


def _pad_seq(x: jax.Array, length: int) -> jax.Array:
    return x if x.shape[1] == length else jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def q_blocks(x: jax.Array, block: int, kv_heads: int) -> jax.Array:
    """[B, S, H, D] -> [blocks, B, kv_heads, group, block, D] (S padded to whole blocks)."""
    b, s, h, d = x.shape
    n = math.ceil(s / block)
    x = _pad_seq(x, n * block).reshape(b, n, block, kv_heads, h // kv_heads, d)
    return x.transpose(1, 0, 3, 4, 2, 5)


def from_q_blocks(x: jax.Array, seq: int) -> jax.Array:
    """[blocks, B, kv_heads, group, block, D] -> [B, seq, H, D]."""
    n, b, hk, g, block, d = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * block, hk * g, d)[:, :seq]


def kv_blocks(x: jax.Array, block: int) -> jax.Array:
    """[B, S, kv_heads, D] -> [blocks, B, kv_heads, block, D]."""
    b, s, hk, d = x.shape
    n = math.ceil(s / block)
    return _pad_seq(x, n * block).reshape(b, n, block, hk, d).transpose(1, 0, 3, 2, 4)


def from_kv_blocks(x: jax.Array, seq: int) -> jax.Array:
    """[blocks, B, kv_heads, block, D] -> [B, seq, kv_heads, D]."""
    n, b, hk, block, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, n * block, hk, d)[:, :seq]


def row_blocks(x: jax.Array, block: int) -> jax.Array:
    """Per-token ids [B, S] -> [blocks, B, block] (padding gets id 0)."""
    b, s = x.shape
    n = math.ceil(s / block)
    return _pad_seq(x, n * block).reshape(b, n, block).transpose(1, 0, 2)


def _contiguous(idx: tuple[int, ...]) -> bool:
    return idx == tuple(range(idx[0], idx[0] + len(idx)))


def _take(blocks: jax.Array, idx: tuple[int, ...]) -> jax.Array:
    """blocks[idx] along the leading dim; a slice when idx is a range, one block (leading dim 1, broadcast by the
    math) when idx repeats one block."""
    if _contiguous(idx):
        return blocks[idx[0] : idx[0] + len(idx)]
    if len(set(idx)) == 1:
        return blocks[idx[0]][None]
    return jnp.take(blocks, np.asarray(idx), axis=0)


def _add(acc: jax.Array, idx: tuple[int, ...], value: jax.Array) -> jax.Array:
    """acc[idx] += value along the leading dim (repeated indices add up)."""
    if _contiguous(idx):
        return lax.dynamic_update_slice_in_dim(acc, acc[idx[0] : idx[0] + len(idx)] + value, idx[0], axis=0)
    if len(set(idx)) == 1:
        return lax.dynamic_update_index_in_dim(acc, acc[idx[0]] + value.sum(0), idx[0], axis=0)
    return acc.at[np.asarray(idx)].add(value)


def _put(acc: jax.Array, idx: tuple[int, ...], value: jax.Array) -> jax.Array:
    """acc[idx] = value for the query side of a step (always a range of query blocks)."""
    return lax.dynamic_update_slice_in_dim(acc, value, idx[0], axis=0)


def _mask(plan: BlockPlan, step: Step, q_seg: jax.Array | None, k_seg: jax.Array | None) -> jax.Array | None:
    """The visibility of the step's pairs, [pairs, B or 1, block_q, block_k], or None when all is visible."""
    segments = q_seg is not None
    if not (step.causal_mask or (step.length_mask and not segments) or segments):
        return None
    q_pos = jnp.asarray(step.q, jnp.int32)[:, None, None] * plan.block_q + jnp.arange(plan.block_q, dtype=jnp.int32)
    k_pos = jnp.asarray(step.k, jnp.int32)[:, None, None] * plan.block_k + jnp.arange(plan.block_k, dtype=jnp.int32)
    return visible(
        q_pos,
        k_pos,
        causal=step.causal_mask,
        q_seg=_take(q_seg, step.q) if segments else None,
        k_seg=_take(k_seg, step.k) if segments else None,
        k_len=plan.seq if step.length_mask and not segments else None,  # padded keys carry segment id 0
    )


# ---------------------------------------------------------------- forward, backward


def _after(x: jax.Array, previous: tuple[jax.Array, ...]) -> jax.Array:
    """x, made to wait until the previous step's results are complete: the added value is 0 at run time (no float
    is > +inf), which the compiler cannot prove, and it reads all of every result (one element could be computed
    alone). Without it XLA runs the steps side by side and keeps many steps' scores alive at once, up to O(seq^2)
    scratch (XLA:CPU drops `optimization_barrier`s before it schedules, so they cannot order the steps)."""
    if not previous:
        return x
    late = functools.reduce(jnp.logical_or, [jnp.any(p > jnp.inf) for p in previous])
    return x + late.astype(x.dtype)


def _forward(plan: BlockPlan, q, k, v, segment_ids):
    """out [B, S, H, D] in q's dtype and lse [blocks, B, kv_heads, group, block_q] float32."""
    kv_heads = k.shape[2]
    qb, kb, vb = q_blocks(q, plan.block_q, kv_heads), kv_blocks(k, plan.block_k), kv_blocks(v, plan.block_k)
    q_seg, k_seg = _segment_blocks(plan, segment_ids)
    state, new = initial_state(qb), ()
    for step in plan.steps:
        mask = _mask(plan, step, q_seg, k_seg)
        rows = tuple(_take(x, step.q) for x in state)
        queries, keys, values = (_after(x, new) for x in (_take(qb, step.q), _take(kb, step.k), _take(vb, step.k)))
        new = fold(rows, queries, keys, values, mask, plan.scale)
        state = tuple(_put(x, step.q, y) for x, y in zip(state, new, strict=True))
    out, lse = finish(state)
    return from_q_blocks(out.astype(q.dtype), plan.seq), lse


def _segment_blocks(plan: BlockPlan, segment_ids):
    if segment_ids is None:
        return None, None
    return row_blocks(segment_ids, plan.block_q), row_blocks(segment_ids, plan.block_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: BlockPlan, q, k, v, segment_ids):
    return _forward(plan, q, k, v, segment_ids)[0]


def _attention_fwd(plan: BlockPlan, q, k, v, segment_ids):
    out, lse = _forward(plan, q, k, v, segment_ids)
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(plan: BlockPlan, residuals, dout):
    q, k, v, segment_ids, out, lse = residuals
    kv_heads = k.shape[2]
    qb, kb, vb = q_blocks(q, plan.block_q, kv_heads), kv_blocks(k, plan.block_k), kv_blocks(v, plan.block_k)
    dob = q_blocks(dout, plan.block_q, kv_heads)
    delta = row_delta(dob, q_blocks(out, plan.block_q, kv_heads))
    q_seg, k_seg = _segment_blocks(plan, segment_ids)
    dq, dk, dv = jnp.zeros(qb.shape, F32), jnp.zeros(kb.shape, F32), jnp.zeros(vb.shape, F32)
    grads = ()
    for step in plan.steps:
        rows = tuple(_after(_take(x, step.q), grads) for x in (qb, dob))
        rows += tuple(_take(x, step.q) for x in (lse, delta))
        kv = tuple(_after(_take(x, step.k), grads) for x in (kb, vb))
        mask = _mask(plan, step, q_seg, k_seg)
        grads = gq, gk, gv = block_grads(rows[0], *kv, *rows[1:], mask, plan.scale)
        dq, dk, dv = _add(dq, step.q, gq), _add(dk, step.k, gk), _add(dv, step.k, gv)
    return (
        from_q_blocks(dq, plan.seq).astype(q.dtype),
        from_kv_blocks(dk, plan.seq).astype(k.dtype),
        from_kv_blocks(dv, plan.seq).astype(v.dtype),
        None,
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check(q, k, v, segment_ids, block_q: int, block_k: int) -> None:
    check_qkv(q, k, v, "blockwise attention")
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(q.shape[:2]):
        raise SpmdkitError(f"segment_ids {tuple(segment_ids.shape)} must be [batch, seq] = {tuple(q.shape[:2])}")
    if block_q < 1 or block_k < 1:
        raise SpmdkitError(f"block_q={block_q} and block_k={block_k} must be positive")


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> jax.Array:
    """softmax(q k^T / sqrt(head_dim)) v over blocks, without ever holding the [seq, seq] scores.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim], heads a multiple of kv_heads
    (query head h uses kv head h // (heads / kv_heads)). Returns [batch, seq, heads, head_dim] in q's dtype;
    scores, softmax statistics and gradient accumulators are float32.

    `segment_ids` int32 [batch, seq]: 0 is padding, 1, 2, ... the documents packed in a row; a query sees a key
    of its own document only (and, `causal`, at or before its position). Padding rows see nothing: their output
    is 0 and they pass no gradient. `None`: one document per row. `block_q`, `block_k`: positions per block (any
    sequence length; the last block is padded). Gradients: a custom VJP that saves out and the log-sum-exp.
    """
    _check(q, k, v, segment_ids, block_q, block_k)
    seq = q.shape[1]
    plan = BlockPlan(seq, min(block_q, seq), min(block_k, seq), causal, q.shape[3] ** -0.5)
    return _attention(plan, q, k, v, segment_ids)
