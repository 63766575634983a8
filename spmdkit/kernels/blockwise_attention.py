"""Blockwise (flash-attention style) attention on one device: online softmax over key blocks, O(seq) memory.

q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim] (heads = kv_heads x group; K/V are
never repeated). The sequence is cut into query blocks of `block_q` and key blocks of `block_k` positions (the
last block padded; padded keys are masked). Each query block folds the key blocks it needs into its float32
online-softmax state with `spmdkit.kernels.attention_block.fold`, the same function ring attention runs per hop.

Schedule (`spmdkit.kernels.block_plan`: which pairs a causal mask or a sliding window drops, which it cuts into
sub-block pairs): the pairs run in steps, each a batch of pairs with static shapes, one step after another; pairs
never built cost no FLOPs (the compiled program's `cost_analysis` shows the saving, about half at long sequences
under a causal mask). The steps of sub-blocks (`Step.split`) run on the blocks and the online-softmax state
(backward: the gradient accumulators) cut into sub-blocks of consecutive positions. Only steps that hold a
partially visible pair (the diagonal, the window's edge, the padded last key block) compute a mask; with
`segment_ids` every step does. `scale`, `softcap`, `window`: the `AttentionSpec`'s.

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

from spmdkit.kernels.attention_block import (
    F32,
    block_grads,
    check_qkv,
    finish,
    fold,
    initial_state,
    row_delta,
    sink_grad,
    visible,
)
from spmdkit.kernels.attention_spec import BLOCK_K, BLOCK_Q, AttentionSpec
from spmdkit.kernels.block_plan import BlockPlan, Step

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
    """acc[idx] = value for the query side of a step (distinct query blocks: a range, except where a window
    leaves some query blocks fewer key blocks than their neighbours)."""
    if _contiguous(idx):
        return lax.dynamic_update_slice_in_dim(acc, value, idx[0], axis=0)
    return acc.at[np.asarray(idx)].set(value)


def _split_rows(x: jax.Array | None, split: int, axis: int) -> jax.Array | None:
    """Blocks [n, ..., b (at `axis`), ...] -> [n x split, ..., b / split, ...]: block i's rows a b / split ..
    (a + 1) b / split - 1 become block i split + a (positions keep their order)."""
    if x is None or split == 1:
        return x
    x = x.reshape(x.shape[:axis] + (split, x.shape[axis] // split) + x.shape[axis + 1 :])
    x = jnp.moveaxis(x, axis, 1)
    return x.reshape((x.shape[0] * split, *x.shape[2:]))


def _merge_rows(x: jax.Array, split: int, axis: int) -> jax.Array:
    """The inverse of `_split_rows`."""
    if split == 1:
        return x
    x = jnp.moveaxis(x.reshape((x.shape[0] // split, split, *x.shape[1:])), 1, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])


def _resplit(arrays: tuple, axes: tuple[int, ...], factor: int) -> tuple:
    """Arrays of blocks (rows at `axes`, None passed through) cut in `factor` sub-blocks each."""
    return tuple(_split_rows(x, factor, a) for x, a in zip(arrays, axes, strict=True))


def _mask(plan: BlockPlan, step: Step, q_seg: jax.Array | None, k_seg: jax.Array | None) -> jax.Array | None:
    """The visibility of the step's pairs, [pairs, B or 1, bq, bk], or None when all is visible (q_seg and k_seg:
    segment ids in the step's blocks)."""
    segments = q_seg is not None
    if not (step.causal_mask or step.window_mask or (step.length_mask and not segments) or segments):
        return None
    bq, bk = plan.sizes(step)
    q_pos = jnp.asarray(step.q, jnp.int32)[:, None, None] * bq + jnp.arange(bq, dtype=jnp.int32)
    k_pos = jnp.asarray(step.k, jnp.int32)[:, None, None] * bk + jnp.arange(bk, dtype=jnp.int32)
    return visible(
        q_pos,
        k_pos,
        causal=step.causal_mask,
        window=plan.spec.window if step.window_mask else 0,
        q_seg=_take(q_seg, step.q) if segments else None,
        k_seg=_take(k_seg, step.k) if segments else None,
        k_len=plan.seq if step.length_mask and not segments else None,  # padded keys carry segment id 0
    )


# ---------------------------------------------------------------- forward, backward


def _after(x: jax.Array | None, previous: tuple[jax.Array, ...]) -> jax.Array | None:
    """x, made to wait until the previous step's results are complete: the added value is 0 at run time (no float
    is > +inf), which the compiler cannot prove, and it reads all of every result (one element could be computed
    alone). Without it XLA runs the steps side by side and keeps many steps' scores alive at once, up to O(seq^2)
    scratch (XLA:CPU drops `optimization_barrier`s before it schedules, so they cannot order the steps)."""
    if x is None or not previous:
        return x
    late = functools.reduce(jnp.logical_or, [jnp.any(p > jnp.inf) for p in previous])
    return x + late.astype(x.dtype)


STATE_AXES = (4, 4, 4)  # the rows axis of the online-softmax state o, m, l
FORWARD_AXES = (4, 3, 3, 2, 2)  # ... of the query, key and value blocks and the query and key segment ids
BACKWARD_AXES = (4, 4, 4, 4, 3, 3, 2, 2)  # q, dout, lse, delta, k, v, segment ids
GRAD_AXES = (4, 3, 3)  # dq, dk, dv


def _forward(plan: BlockPlan, q, k, v, segment_ids, sinks):
    """out [B, S, H, D] in q's dtype and lse [blocks, B, kv_heads, group, block_q] float32. Steps of sub-blocks
    (`Step.split`) run on the blocks and the state viewed at their size; the state starts from the sinks."""
    kv_heads = k.shape[2]
    whole = (q_blocks(q, plan.block_q, kv_heads), kv_blocks(k, plan.block_k), kv_blocks(v, plan.block_k))
    whole += _segment_blocks(plan, segment_ids)
    blocks, state, split, new = whole, initial_state(whole[0], sinks), 1, ()
    for step in plan.steps:
        if step.split != split:
            state = _resplit(state, STATE_AXES, step.split // split)
            blocks = _resplit(tuple(_after(x, new) for x in whole), FORWARD_AXES, step.split)
            split = step.split
        qb, kb, vb, q_seg, k_seg = blocks
        mask = _mask(plan, step, q_seg, k_seg)
        rows = tuple(_take(x, step.q) for x in state)
        queries, keys, values = (_after(x, new) for x in (_take(qb, step.q), _take(kb, step.k), _take(vb, step.k)))
        new = fold(rows, queries, keys, values, mask, plan.spec.scale, plan.spec.softcap)
        state = tuple(_put(x, step.q, y) for x, y in zip(state, new, strict=True))
    out, lse = finish(state)
    return from_q_blocks(out.astype(q.dtype), plan.seq), _merge_rows(lse, split, STATE_AXES[2])


def _segment_blocks(plan: BlockPlan, segment_ids) -> tuple:
    if segment_ids is None:
        return None, None
    return row_blocks(segment_ids, plan.block_q), row_blocks(segment_ids, plan.block_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: BlockPlan, q, k, v, segment_ids, sinks):
    return _forward(plan, q, k, v, segment_ids, sinks)[0]


def _attention_fwd(plan: BlockPlan, q, k, v, segment_ids, sinks):
    out, lse = _forward(plan, q, k, v, segment_ids, sinks)
    return out, (q, k, v, segment_ids, sinks, out, lse)


def _attention_bwd(plan: BlockPlan, residuals, dout):
    q, k, v, segment_ids, sinks, out, lse = residuals
    kv_heads = k.shape[2]
    qb, kb, vb = q_blocks(q, plan.block_q, kv_heads), kv_blocks(k, plan.block_k), kv_blocks(v, plan.block_k)
    dob = q_blocks(dout, plan.block_q, kv_heads)
    delta = row_delta(dob, q_blocks(out, plan.block_q, kv_heads))
    whole = (qb, dob, lse, delta, kb, vb, *_segment_blocks(plan, segment_ids))
    blocks, split, grads = whole, 1, ()
    acc = jnp.zeros(qb.shape, F32), jnp.zeros(kb.shape, F32), jnp.zeros(vb.shape, F32)
    for step in plan.steps:
        if step.split != split:
            acc = _resplit(acc, GRAD_AXES, step.split // split)
            blocks = _resplit(tuple(_after(x, grads) for x in whole), BACKWARD_AXES, step.split)
            split = step.split
        rows = tuple(_after(_take(x, step.q), grads) for x in blocks[:2])
        rows += tuple(_take(x, step.q) for x in blocks[2:4])
        kv = tuple(_after(_take(x, step.k), grads) for x in blocks[4:6])
        mask = _mask(plan, step, *blocks[6:])
        grads = gq, gk, gv = block_grads(rows[0], *kv, *rows[1:], mask, plan.spec.scale, plan.spec.softcap)
        acc = _add(acc[0], step.q, gq), _add(acc[1], step.k, gk), _add(acc[2], step.k, gv)
    dq, dk, dv = acc  # blocks of the last step's size: the layouts below read any block size
    return (
        from_q_blocks(dq, plan.seq).astype(q.dtype),
        from_kv_blocks(dk, plan.seq).astype(k.dtype),
        from_kv_blocks(dv, plan.seq).astype(v.dtype),
        None,
        None if sinks is None else sink_grad(sinks, lse, delta),
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T * scale) v over blocks, without ever holding the [seq, seq] scores.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim], heads a multiple of kv_heads
    (query head h uses kv head h // (heads / kv_heads)); nothing sharded (one device's arrays, or batch and heads
    split by the compiler). Returns [batch, seq, heads, head_dim] in q's dtype; scores, softmax statistics and
    gradient accumulators are float32.

    `segment_ids` int32 [batch, seq]: 0 is padding, 1, 2, ... the documents packed in a row; a query sees a key
    of its own document only (and, causal, at or before its position). Padding rows see nothing: their output
    is 0 and they pass no gradient. `None`: one document per row. `spec` (`AttentionSpec`; None: causal, the
    defaults): causal, window, scale, softcap and the positions per block `block_q`, `block_k` (any sequence
    length; the last block is padded). `sinks` [heads] float32 (GPT-OSS; None: none): each head's logit joins
    every row's softmax denominator, attending to nothing. Gradients: a custom VJP that saves out and the
    log-sum-exp (the sinks' included).
    """
    check_qkv(q, k, v, "blockwise attention", segment_ids)
    spec = (spec or AttentionSpec()).resolved(q.shape[3], q.shape[1])
    return _attention(BlockPlan(q.shape[1], spec), q, k, v, segment_ids, sinks)
