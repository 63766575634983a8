"""Ring attention over the `context` mesh axis, load-balanced (zigzag), with a hand-written ring backward.

Shapes (global): q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim], out like q.
seq is sharded over the context axis (N devices), batch over `batch_axes`, heads and kv_heads over
`heads_axis`. Each device holds 2 sequence chunks of c = seq / (2N) tokens (see `spmdkit.parallel.context.zigzag`
for which original chunks, and for changing the layout of the inputs and positions).

Forward (N steps). Keys and values travel around the ring: at step t device r holds the K/V chunks of device (r - t)
mod N, and the K/V for step t+1 are sent (`ppermute`, one packed buffer) before step t's math so the transfer
overlaps it. Every (query chunk, key chunk) pair is folded into the float32 online-softmax state of its query rows
(`spmdkit.kernels.attention_block` states the math). Under a causal mask a pair is computed in full (key chunk
before query chunk), with a triangular mask (the same chunk, only at step 0) or skipped (key chunk after query
chunk): `lax.switch` runs only the taken branch, so skipped pairs cost no FLOPs. A sliding window W (a query at true
position i sees keys i - W < j <= i) adds two cases, from the chunks' true positions (the zigzag layout permutes
chunks, never tokens within one): a key chunk wholly before the window of every query is skipped too, and one that
crosses the window's edge is computed with a window mask. GQA: queries are viewed as [kv_heads, group]; K/V are
never repeated. The scale and soft cap are the `AttentionSpec`'s (`spmdkit.kernels.attention_spec`).

Backward (`jax.custom_vjp`, residuals out and lse: O(seq / N) per device; D = rowsum(dO * O) less the cotangent of
lse). dQ accumulates locally; K, V (one buffer) and the float32 dK, dV (one buffer) travel the ring, and after the
last step one more hop brings dK, dV home. With `segment_ids` (documents packed in a row) the keys' ids travel with
K/V (one more small hop) and every pair masks keys of other documents. The per-tile math (`fold`, `block_grads`) is
`spmdkit.kernels.attention_block`, shared with the blockwise kernel. `key_tile` scans the keys of a chunk pair in
tiles, bounding the scratch per pair to [heads, c, key_tile] instead of [heads, c, c].
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmdkit.errors import SpmdkitError
from spmdkit.kernels.attention_block import F32, check_qkv, finish, initial_state, row_delta
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.kernels.blockwise_attention import from_kv_blocks, from_q_blocks, kv_blocks, q_blocks, row_blocks
from spmdkit.parallel.context.chunk_pair import PairOptions, bwd_pair, fwd_pair, merge_rows, split_rows
from spmdkit.parallel.context.zigzag import (
    FULL,
    causal_work_balance,
    check_load_balance,
    check_seq_len,
    from_zigzag,
    inverse_zigzag_indices,
    pair_mode,
    slot_chunk_ids,
    to_zigzag,
    zigzag_indices,
)

# The layout helpers live in spmdkit.parallel.context.zigzag and are re-exported here.
__all__ = ["causal_work_balance", "from_zigzag", "inverse_zigzag_indices", "to_zigzag", "zigzag_indices"]
__all__ += ["RingLayout", "ring_attention"]


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """Which mesh axes ring attention splits: the sequence over `axis_name` in the `load_balance` layout
    ("zigzag"; None, "none" or "contiguous": natural order), batch over `batch_axes`, heads and kv_heads over
    `heads_axis` (None: replicated). Axes absent from the mesh or of size 1 are ignored."""

    axis_name: str = "context"
    load_balance: str | None = "zigzag"
    batch_axes: tuple[str, ...] = ("data", "fsdp")
    heads_axis: str | None = "tensor"


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one ring-attention call (hashable: it is a custom_vjp non-diff argument): the layout
    with its absent axes dropped, the spec resolved (`key_tile` set) and the chunk length seq / (2N)."""

    mesh: Mesh
    layout: RingLayout
    spec: AttentionSpec
    chunk: int

    @property
    def n(self) -> int:
        return self.mesh.shape[self.layout.axis_name]

    @property
    def manual_axes(self) -> frozenset[str]:
        axes = self.layout
        return frozenset({axes.axis_name, *axes.batch_axes, *([axes.heads_axis] if axes.heads_axis else [])})

    @property
    def batch_spec(self) -> tuple[str, ...] | None:
        return self.layout.batch_axes or None

    @property
    def token_spec(self) -> P:
        """[batch, seq, heads, head_dim]."""
        return P(self.batch_spec, self.layout.axis_name, self.layout.heads_axis, None)

    @property
    def lse_spec(self) -> P:
        """[batch, heads, seq]."""
        return P(self.batch_spec, self.layout.heads_axis, self.layout.axis_name)

    def segment_spec(self, seg: jax.Array | None) -> P | None:
        """[batch, seq] segment ids, or None without them."""
        return None if seg is None else P(self.batch_spec, self.layout.axis_name)


def _hop(x, ring: _Ring):
    """Send `x` (an array or a tuple of them) one step around the ring: device r -> r + 1."""
    perm = [(j, (j + 1) % ring.n) for j in range(ring.n)]
    return jax.tree.map(lambda a: lax.ppermute(a, ring.layout.axis_name, perm=perm), x)


# ---------------------------------------------------------------- one ring step: the 4 chunk pairs


def _take(x: jax.Array, i) -> jax.Array:
    return lax.dynamic_index_in_dim(x, i, keepdims=False)


def _put(x: jax.Array, i, value: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(x, value, i, axis=0)


def _pair_mode(ring: _Ring, r, t, i, j) -> tuple[jax.Array, jax.Array]:
    """(`pair_mode`, offset) of query slot i on device r and key slot j of device (r - t) mod N; offset: the key
    chunk's first true position less the query chunk's."""
    ids = jnp.asarray(slot_chunk_ids(ring.n, ring.layout.load_balance), jnp.int32)
    q_id, k_id = ids[r, i], ids[(r - t) % ring.n, j]
    return pair_mode(q_id, k_id, ring.chunk, ring.spec.window), (k_id - q_id) * ring.chunk


def _ring_step(pair_fn, state, kv, ring: _Ring, r, t):
    """Fold the K/V held at step t into `state`: `pair_fn(state, kv, i, j, offset, diagonal, windowed)` for the 4
    pairs (query slot i, key slot j), looped (one traced copy); under `causal`, `lax.switch` runs only the taken
    branch of full / diagonal / skip (/ window edge)."""
    branches = (
        functools.partial(pair_fn, diagonal=False, windowed=False),
        functools.partial(pair_fn, diagonal=True, windowed=True),
        lambda state, kv, i, j, offset: state,
    )
    if ring.spec.window > 0:
        branches += (functools.partial(pair_fn, diagonal=False, windowed=True),)

    def pair(p, state):
        i, j = p // 2, p % 2
        if not ring.spec.causal:
            return branches[FULL](state, kv, i, j, 0)
        mode, offset = _pair_mode(ring, r, t, i, j)
        return lax.switch(mode, branches, state, kv, i, j, offset)

    return lax.fori_loop(0, 4, pair, state)


def _ring_loop(pair_fn, state, kv, ring: _Ring, send_back=None):
    """Run the N steps while K/V rotate; the hop for step t+1 is issued before step t's math. `send_back`
    (the backward's dK, dV hop) is applied after every step: N times, the last one bringing them home."""
    send_back = send_back or (lambda s: s)
    r = lax.axis_index(ring.layout.axis_name)

    def body(t, carry):
        kv, state = carry
        nxt = _hop(kv, ring)
        return nxt, send_back(_ring_step(pair_fn, state, kv, ring, r, t))

    if ring.n > 1:
        kv, state = lax.fori_loop(0, ring.n - 1, body, (kv, state))
    state = _ring_step(pair_fn, state, kv, ring, r, ring.n - 1)
    return send_back(state) if ring.n > 1 else state


# ---------------------------------------------------------------- forward and backward programs (per device)


def _pair_options(ring: _Ring, q_seg, k_seg, i, j, offset, diagonal: bool, windowed: bool) -> PairOptions:
    """The options of query slot i against key slot j; q_seg, k_seg: segment ids [2, B, c] or None."""
    segments = (None, None) if q_seg is None else (_take(q_seg, i), _take(k_seg, j))
    return PairOptions(ring.spec, diagonal, windowed, *segments, offset)


def _forward_local(ring: _Ring, q, k, v, seg):
    """Per device: q [B, 2c, H, D], k/v [B, 2c, Hkv, D] (seg [B, 2c] or None) -> out [B, 2c, H, D], lse [B, H, 2c]
    float32. State per query slot (leading axis 2): o [.., c, D], running max m and sum l [.., c], float32. The
    segment ids of the keys travel the ring with them."""
    c = q.shape[1] // 2
    qs = q_blocks(q, c, k.shape[2])
    q_seg = None if seg is None else row_blocks(seg, c)
    state = initial_state(qs)

    def pair(state, kv, i, j, offset, diagonal, windowed):
        (kv, k_seg) = kv
        acc = tuple(_take(s, i) for s in state)
        options = _pair_options(ring, q_seg, k_seg, i, j, offset, diagonal, windowed)
        new = fwd_pair(_take(qs, i), _take(kv[0], j), _take(kv[1], j), acc, options)
        return tuple(_put(s, i, a) for s, a in zip(state, new, strict=True))

    state = _ring_loop(pair, state, (jnp.stack([kv_blocks(k, c), kv_blocks(v, c)]), q_seg), ring)
    out, lse = finish(state)
    return from_q_blocks(out.astype(q.dtype), 2 * c), merge_rows(lse)


def _backward_local(ring: _Ring, q, k, v, seg, out, lse, dout, dlse):
    """Per device: the cotangents of (out, lse) -> dq, dk, dv with the shapes and dtypes of q, k, v.
    State: dq [2 (slot), ..] (stays), dk and dv [2 (slot), ..] (travel with K/V), float32."""
    kv_heads, c = k.shape[2], q.shape[1] // 2
    qs, dos = q_blocks(q, c, kv_heads), q_blocks(dout, c, kv_heads)
    delta = row_delta(dos, q_blocks(out, c, kv_heads)) - split_rows(dlse, kv_heads)
    rows = (qs, dos, split_rows(lse, kv_heads), delta)
    q_seg = None if seg is None else row_blocks(seg, c)
    kv = jnp.stack([kv_blocks(k, c), kv_blocks(v, c)])

    def pair(state, kv, i, j, offset, diagonal, windowed):
        (kv, k_seg), (dq, dk, dv) = kv, state
        grads = (_take(dq, i), _take(dk, j), _take(dv, j))
        kj, vj = _take(kv[0], j), _take(kv[1], j)
        options = _pair_options(ring, q_seg, k_seg, i, j, offset, diagonal, windowed)
        dqi, dkj, dvj = bwd_pair(tuple(_take(x, i) for x in rows), kj, vj, grads, options)
        return _put(dq, i, dqi), _put(dk, j, dkj), _put(dv, j, dvj)

    def send_back(state):  # dK, dV travel packed in one buffer
        dkv = _hop(jnp.stack(state[1:]), ring)
        return state[0], dkv[0], dkv[1]

    dkv = jnp.zeros_like(kv, dtype=F32)
    dq, dk, dv = _ring_loop(pair, (jnp.zeros_like(qs, dtype=F32), dkv[0], dkv[1]), (kv, q_seg), ring, send_back)
    seq = 2 * c
    return (
        from_q_blocks(dq, seq).astype(q.dtype),
        from_kv_blocks(dk, seq).astype(k.dtype),
        from_kv_blocks(dv, seq).astype(v.dtype),
    )


def _shard_map(ring: _Ring, fn, in_specs, out_specs):
    return jax.shard_map(
        functools.partial(fn, ring),
        mesh=ring.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=ring.manual_axes,
        check_vma=True,
    )


def _forward(ring: _Ring, q, k, v, seg):
    tok, seg_spec = ring.token_spec, ring.segment_spec(seg)
    return _shard_map(ring, _forward_local, (tok, tok, tok, seg_spec), (tok, ring.lse_spec))(q, k, v, seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(ring: _Ring, q, k, v, seg):
    return _forward(ring, q, k, v, seg)


def _attention_fwd(ring: _Ring, q, k, v, seg):
    out, lse = _forward(ring, q, k, v, seg)
    return (out, lse), (q, k, v, seg, out, lse)


def _attention_bwd(ring: _Ring, residuals, cotangents):
    tok, lse, seg = ring.token_spec, ring.lse_spec, ring.segment_spec(residuals[3])
    backward = _shard_map(ring, _backward_local, (tok, tok, tok, seg, tok, lse, tok, lse), (tok, tok, tok))
    return (*backward(*residuals, *cotangents), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------- public API


def _present(mesh: Mesh, axis: str | None) -> bool:
    return axis is not None and mesh.shape.get(axis, 1) > 1


def _check_divides(what: str, size: int, axes: tuple[str, ...], mesh: Mesh) -> None:
    devices = math.prod(mesh.shape[a] for a in axes)
    if size % devices:
        raise SpmdkitError(
            f"{what}={size} is not divisible by mesh axes {'x'.join(axes)} of size {devices}: change {what} or "
            f"shard it over other axes"
        )


def _make_ring(q, k, mesh: Mesh, layout: RingLayout, spec: AttentionSpec) -> _Ring:
    """Check the user inputs (but q, k, v and segment ids: `check_qkv`), resolve the axes (size-1 and absent axes
    are dropped) and the spec (its key tile: a divisor of the chunk, default the whole chunk)."""
    load_balance = check_load_balance(layout.load_balance)
    axis_name = layout.axis_name
    if axis_name not in mesh.shape:
        raise SpmdkitError(f"context axis {axis_name!r} is not in the mesh {dict(mesh.shape)}: set the layout's axis")
    chunk = check_seq_len(q.shape[1], mesh.shape[axis_name])
    batch_axes = tuple(a for a in layout.batch_axes if _present(mesh, a) and a != axis_name)
    heads_axis = layout.heads_axis if _present(mesh, layout.heads_axis) else None
    _check_divides("batch", q.shape[0], batch_axes, mesh)
    if heads_axis:
        _check_divides("heads", q.shape[2], (heads_axis,), mesh)
        _check_divides("kv_heads", k.shape[2], (heads_axis,), mesh)
    key_tile = chunk if spec.key_tile is None else spec.key_tile
    if key_tile < 1 or chunk % key_tile:
        raise SpmdkitError(
            f"key_tile={key_tile} does not divide the chunk length seq/(2 x context) = {chunk}: pick a divisor "
            f"of {chunk} or None"
        )
    spec = dataclasses.replace(spec.resolved(q.shape[3], q.shape[1]), key_tile=key_tile)
    return _Ring(mesh, RingLayout(axis_name, load_balance, batch_axes, heads_axis), spec, chunk)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    spec: AttentionSpec | None = None,
    *,
    mesh: Mesh,
    layout: RingLayout = RingLayout(),
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention with the sequence sharded over `layout.axis_name`.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim], heads a multiple of kv_heads
    (GQA: query head h uses kv head h // (heads / kv_heads)). Returns out [batch, seq, heads, head_dim] in
    q's dtype, in the same sequence layout as the inputs.

    Sharding (`RingLayout`): seq over `axis_name` (N devices; seq divisible by 2N), batch over the `batch_axes`
    present in the mesh, heads and kv_heads over `heads_axis`; the other mesh axes stay automatic. Callable from
    inside `jax.jit` on an Auto mesh. `load_balance="zigzag"`: the caller has put the sequence (and the positions
    used for RoPE) in the zigzag layout with `to_zigzag(x, n=N)`, so device r holds chunks r and 2N-1-r and causal
    work is balanced; the layout only matters when causal.

    `segment_ids` int32 [batch, seq], in the same layout as q (they travel the ring with K/V): 0 is padding,
    1, 2, ... the documents packed in a row; a query sees only keys of its own document (padding rows see
    nothing: output 0, no gradient). None: one document per row. `spec` (`AttentionSpec`; None: causal, the
    defaults): causal, window (true positions; chunk pairs wholly outside every window are skipped), scale,
    softcap, and `key_tile` (a divisor of seq / 2N, default the whole chunk), which bounds the per-pair scratch.
    Gradients come from a ring backward pass (`jax.custom_vjp`) that saves only out and lse. `return_lse`:
    return (out, lse), lse [batch, heads, seq] float32 the log-sum-exp of each query row's scaled scores (seq in
    q's layout; -inf for a row that sees no key), differentiable like `out`.
    """
    check_qkv(q, k, v, "ring attention", segment_ids)
    ring = _make_ring(q, k, mesh, layout, spec or AttentionSpec())
    out, lse = _attention(ring, q, k, v, segment_ids)
    return (out, lse) if return_lse else out
