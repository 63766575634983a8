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
crosses the window's edge is computed with a window mask; steps in which every pair of every device is skipped are
not taken at all (`ring_steps`): K/V jump from one needed step to the next in one hop, so a windowed ring sends only
the K/V it reads (with the contiguous layout, chosen for a model windowed everywhere, one step for a window of one
device's share). GQA: queries are viewed as [kv_heads, group]; K/V are never repeated. The scale and soft cap are
the `AttentionSpec`'s (`spmdkit.kernels.attention_spec`).

2D (`RingLayout.ulysses` U > 1): the context axis is a ring of N = C/U positions of U consecutive devices; each
device trades its sequence piece for 1/U of the heads with the others of its position (all-to-alls,
`spmdkit.parallel.context.exchange`) before the ring, and back after it, in the forward and in the backward.

Backward (`jax.custom_vjp`, residuals out and lse: O(seq / N) per device; D = rowsum(dO * O) less the cotangent of
lse, taken where out is: under 2D before the exchange, which then carries D [B, H, S] rather than out). dQ
accumulates locally; K, V (one buffer) and the float32 dK, dV (one buffer) travel the ring, and after the last step
one more hop brings dK, dV home. With `segment_ids` (documents packed in a row) the keys' ids travel with K/V (one
more small hop) and every pair masks keys of other documents. The per-tile math (`fold`, `block_grads`) is
`spmdkit.kernels.attention_block`, shared with the blockwise kernel. `key_tile` scans the keys of a chunk pair in
tiles, bounding the scratch per pair to [heads, c, key_tile] instead of [heads, c, c].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from spmdkit.kernels.attention_block import F32, check_qkv, finish, initial_state, row_delta
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.kernels.blockwise_attention import from_kv_blocks, from_q_blocks, kv_blocks, q_blocks, row_blocks
from spmdkit.parallel.context.chunk_pair import PairOptions, bwd_pair, fwd_pair, merge_rows, split_rows
from spmdkit.parallel.context.chunks import pair_modes
from spmdkit.parallel.context.exchange import fold_repeats, gather_seq, to_heads, to_seq
from spmdkit.parallel.context.ring_layout import Ring, RingLayout, make_ring
from spmdkit.parallel.context.zigzag import (
    FULL,
    causal_work_balance,
    from_zigzag,
    inverse_zigzag_indices,
    ring_steps,
    to_zigzag,
    zigzag_indices,
)

# The layout helpers live in spmdkit.parallel.context.zigzag and are re-exported here.
__all__ = ["causal_work_balance", "from_zigzag", "inverse_zigzag_indices", "to_zigzag", "zigzag_indices"]
__all__ += ["RingLayout", "ring_attention"]

DEFAULT_LAYOUT = RingLayout()  # context, zigzag, batch over data x fsdp, heads over tensor


def _hop(x, ring: Ring, shift: int = 1):
    """Send `x` (an array or a tuple of them) `shift` steps around the ring: position r -> r + shift (under 2D,
    device u of position r to device u of position r + shift)."""
    u = ring.layout.ulysses
    perm = [(j, ((j // u + shift) % ring.n) * u + j % u) for j in range(ring.n * u)]
    return jax.tree.map(lambda a: lax.ppermute(a, ring.layout.axis_name, perm=perm), x)


# ---------------------------------------------------------------- one ring step: the 4 chunk pairs


def _take(x: jax.Array, i) -> jax.Array:
    return lax.dynamic_index_in_dim(x, i, keepdims=False)


def _put(x: jax.Array, i, value: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(x, value, i, axis=0)


def _pair_mode(ring: Ring, r, t, i, j) -> tuple[jax.Array, jax.Array]:
    """(`pair_mode`, offset) of query slot i on device r and key slot j of device (r - t) mod N (`pair_modes`'
    tables); offset: the key chunk's first true position less the query chunk's."""
    modes, offsets = pair_modes(ring.n, ring.layout.load_balance, ring.chunk, ring.spec.window)
    return jnp.asarray(modes)[t, r, i, j], jnp.asarray(offsets)[t, r, i, j]


def _ring_step(pair_fn, state, kv, ring: Ring, r, t):
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


def _position(ring: Ring, anchor: jax.Array) -> jax.Array:
    """This device's ring position, tied to the data (`anchor`, plus a zero made from it). The masks and pair
    modes of the ring's loops depend on loop indices and the position only; inside an enclosing layer scan JAX's
    partial evaluation would hoist all of them out of it, computed for every step, pair and tile at once and
    kept ([steps, 4, B, H, c, key_tile] floats and masks: 119 GB per device at Llama-3-8B x 128k, context=8)."""
    r = lax.axis_index(ring.layout.axis_name) // ring.layout.ulysses
    return r + anchor.reshape(-1)[0].astype(jnp.int32) * 0


def _ring_loop(pair_fn, state, kv, ring: Ring, anchor: jax.Array, send_back=None):
    """Run the N steps while K/V rotate; the hop for step t+1 is issued before step t's math. `send_back`
    (the backward's dK, dV hop) is applied after every step: N times, the last one bringing them home. `anchor`:
    an array of the step's data (`_position`)."""
    send_back = send_back or (lambda s, shift=1: s)
    steps = ring_steps(ring.n, ring.layout.load_balance, ring.chunk, ring.spec.window, ring.spec.causal)
    r = _position(ring, anchor)
    if len(steps) < ring.n:  # a window: only the steps it reads, unrolled (each jump is one hop)
        return _sparse_ring_loop(pair_fn, state, kv, ring, send_back, steps, r)

    def body(t, carry):
        kv, state = carry
        nxt = _hop(kv, ring)
        return nxt, send_back(_ring_step(pair_fn, state, kv, ring, r, t))

    if ring.n > 1:
        kv, state = lax.fori_loop(0, ring.n - 1, body, (kv, state))
    state = _ring_step(pair_fn, state, kv, ring, r, ring.n - 1)
    return send_back(state) if ring.n > 1 else state


def _sparse_ring_loop(pair_fn, state, kv, ring: Ring, send_back, steps: tuple[int, ...], r: jax.Array):
    """`_ring_loop` over the `steps` only (`ring_steps`: 0 and those some window reaches): K/V (and the dK, dV
    travelling with them) jump from step to step in one hop each, the next hop issued before a step's math; after
    the last step t the dK, dV go home in one more hop (n - t positions on). r: the ring position."""
    for here, nxt in zip(steps, (*steps[1:], None), strict=True):
        ahead = None if nxt is None else _hop(kv, ring, nxt - here)
        state = _ring_step(pair_fn, state, kv, ring, r, here)
        if nxt is not None:
            state, kv = send_back(state, nxt - here), ahead
    return send_back(state, ring.n - steps[-1]) if steps[-1] else state


# ---------------------------------------------------------------- forward and backward programs (per device)


def _pair_options(ring: Ring, q_seg, k_seg, i, j, offset, diagonal: bool, windowed: bool) -> PairOptions:
    """The options of query slot i against key slot j; q_seg, k_seg: segment ids [2, B, c] or None."""
    segments = (None, None) if q_seg is None else (_take(q_seg, i), _take(k_seg, j))
    return PairOptions(ring.spec, diagonal, windowed, *segments, offset)


def _forward_local(ring: Ring, q, k, v, seg):
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

    state = _ring_loop(pair, state, (jnp.stack([kv_blocks(k, c), kv_blocks(v, c)]), q_seg), ring, q)
    out, lse = finish(state)
    return from_q_blocks(out.astype(q.dtype), 2 * c), merge_rows(lse)


def _row_delta(out, dout, dlse):
    """D = rowsum(dO * out) - dlse, float32 [B, H, S] (lse's layout): out and dout [B, S, H, D]."""
    return jnp.swapaxes(row_delta(dout, out), 1, 2) - dlse.astype(F32)


def _backward_local(ring: Ring, q, k, v, seg, lse, dout, delta):
    """Per device: the cotangent dout of out, with lse and `_row_delta` -> dq, dk, dv with the shapes and dtypes of
    q, k, v. State: dq [2 (slot), ..] (stays), dk and dv [2 (slot), ..] (travel with K/V), float32."""
    kv_heads, c = k.shape[2], q.shape[1] // 2
    qs, dos = q_blocks(q, c, kv_heads), q_blocks(dout, c, kv_heads)
    rows = (qs, dos, split_rows(lse, kv_heads), split_rows(delta, kv_heads))
    q_seg = None if seg is None else row_blocks(seg, c)
    kv = jnp.stack([kv_blocks(k, c), kv_blocks(v, c)])

    def pair(state, kv, i, j, offset, diagonal, windowed):
        (kv, k_seg), (dq, dk, dv) = kv, state
        grads = (_take(dq, i), _take(dk, j), _take(dv, j))
        kj, vj = _take(kv[0], j), _take(kv[1], j)
        options = _pair_options(ring, q_seg, k_seg, i, j, offset, diagonal, windowed)
        dqi, dkj, dvj = bwd_pair(tuple(_take(x, i) for x in rows), kj, vj, grads, options)
        return _put(dq, i, dqi), _put(dk, j, dkj), _put(dv, j, dvj)

    def send_back(state, shift=1):  # dK, dV travel packed in one buffer
        dkv = _hop(jnp.stack(state[1:]), ring, shift)
        return state[0], dkv[0], dkv[1]

    dkv = jnp.zeros_like(kv, dtype=F32)
    dq, dk, dv = _ring_loop(pair, (jnp.zeros_like(qs, dtype=F32), dkv[0], dkv[1]), (kv, q_seg), ring, dout, send_back)
    seq = 2 * c
    return (
        from_q_blocks(dq, seq).astype(q.dtype),
        from_kv_blocks(dk, seq).astype(k.dtype),
        from_kv_blocks(dv, seq).astype(v.dtype),
    )


def _forward_device(ring: Ring, q, k, v, seg):
    """Per device: `_forward_local`, under 2D between the exchanges to and from the head split."""
    u, axis = ring.layout.ulysses, ring.layout.axis_name
    if u == 1:
        return _forward_local(ring, q, k, v, seg)
    k, v = (jnp.repeat(x, ring.kv_repeat, axis=2) for x in (k, v))
    q, k, v = (to_heads(x, axis, u) for x in (q, k, v))
    out, lse = _forward_local(ring, q, k, v, None if seg is None else gather_seq(seg, axis, u))
    return to_seq(out, axis, u), to_seq(lse, axis, u, seq_axis=2, heads_axis=1)


def _backward_device(ring: Ring, q, k, v, seg, out, lse, dout, dlse):
    """Per device: `_backward_local`, under 2D between the exchanges (the repeated kv heads' gradients summed). D is
    a row statistic, so it is taken before the exchange: the 1/D-th of out's bytes cross, not out."""
    u, axis = ring.layout.ulysses, ring.layout.axis_name
    delta = _row_delta(out, dout, dlse)
    if u == 1:
        return _backward_local(ring, q, k, v, seg, lse, dout, delta)
    k, v = (jnp.repeat(x, ring.kv_repeat, axis=2) for x in (k, v))
    q, k, v, dout = (to_heads(x, axis, u) for x in (q, k, v, dout))
    lse, delta = (to_heads(x, axis, u, seq_axis=2, heads_axis=1) for x in (lse, delta))
    seg = None if seg is None else gather_seq(seg, axis, u)
    dq, dk, dv = _backward_local(ring, q, k, v, seg, lse, dout, delta)
    return to_seq(dq, axis, u), *(fold_repeats(to_seq(x, axis, u), ring.kv_repeat) for x in (dk, dv))


def _shard_map(ring: Ring, fn, in_specs, out_specs):
    return jax.shard_map(
        functools.partial(fn, ring),
        mesh=ring.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=ring.manual_axes,
        check_vma=True,
    )


def _forward(ring: Ring, q, k, v, seg):
    tok, seg_spec = ring.token_spec, ring.segment_spec(seg)
    return _shard_map(ring, _forward_device, (tok, tok, tok, seg_spec), (tok, ring.lse_spec))(q, k, v, seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(ring: Ring, q, k, v, seg):
    return _forward(ring, q, k, v, seg)


def _attention_fwd(ring: Ring, q, k, v, seg):
    out, lse = _forward(ring, q, k, v, seg)
    return (out, lse), (q, k, v, seg, out, lse)


def _attention_bwd(ring: Ring, residuals, cotangents):
    tok, lse, seg = ring.token_spec, ring.lse_spec, ring.segment_spec(residuals[3])
    backward = _shard_map(ring, _backward_device, (tok, tok, tok, seg, tok, lse, tok, lse), (tok, tok, tok))
    return (*backward(*residuals, *cotangents), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------- public API


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    spec: AttentionSpec | None = None,
    *,
    mesh: Mesh,
    layout: RingLayout = DEFAULT_LAYOUT,
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
    ring = make_ring(q, k, mesh, layout, spec or AttentionSpec())
    out, lse = _attention(ring, q, k, v, segment_ids)
    return (out, lse) if return_lse else out
