"""Sliding-window attention, a custom score scale and logit soft-capping in every attention kernel: dot, blockwise
(several block sizes, blocks not dividing the window), ring (context 2 and 4, zigzag and contiguous), the cuDNN
wrapper (XLA's attention standing in for cuDNN on CPU) and the KV-cache attention (prefill and decode), each against
a dense reference written here from the definition, forward and gradients; the blockwise schedule computes every
visible score once (splitting partially visible blocks) and the ring's chunk pairs skip exactly the blocks outside
the window; the compiled FLOPs and scratch fall with the window.

Definition: scores s = q k^T * scale (scale None: 1/sqrt(head_dim)); softcap c > 0: s -> c tanh(s / c); then a
query at position i sees key j iff i - W < j <= i (window W > 0; 0: j <= i) and, with segment ids, j is of the
query's document and that is not padding (0); softmax over the seen keys; a row that sees nothing gives 0.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdkit.errors import SpmdkitError
from spmdkit.inference.attention import cache_attention
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.kernels.block_plan import BlockPlan
from spmdkit.models.attention import attend, blockwise_attention, cudnn_attention, dot_attention
from spmdkit.models.attention_choice import choose_attention
from spmdkit.parallel.context.ring_attention import RingLayout, from_zigzag, ring_attention, to_zigzag
from spmdkit.parallel.context.zigzag import DIAG, EDGE, FULL, SKIP, pair_mode
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules

ATOL = 2e-5  # float32, values and gradients of order 1 at these sizes
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 48, 4, 2, 8
PLAIN, CAPPED = {}, {"scale": 0.7, "softcap": 2.0}  # default scale, no cap; Gemma-like scale and cap


def _mask(seq: int, window: int, seg: np.ndarray | None) -> np.ndarray:
    """bool [batch or 1, seq, seq] from the definition."""
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    mask = (j <= i) & ((j > i - window) if window > 0 else True)
    mask = mask[None]
    if seg is not None:
        mask = mask & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    return mask


def reference(q, k, v, *, window=0, scale=None, softcap=0.0, seg=None, q_pos=None):
    """Dense attention from the definition. q [B, T, H, D], k/v [B, S, Hkv, D]; q_pos [B, T] the queries'
    positions (default 0..T-1, keys are at 0..S-1)."""
    b, t, h, d = q.shape
    s_len = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    k, v = jnp.repeat(k, h // k.shape[2], axis=2), jnp.repeat(v, h // v.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    if q_pos is None:
        mask = _mask(s_len, window, seg)
    else:
        i, j = np.asarray(q_pos)[:, :, None], np.arange(s_len)[None, None, :]
        mask = (j <= i) & ((j > i - window) if window > 0 else True)
    s = jnp.where(jnp.asarray(mask)[:, None], s, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
    w = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
    total = w.sum(-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", w / jnp.where(total > 0, total, 1.0), v)


def _inputs(seed=0, batch=BATCH, seq=SEQ, keys=None):
    rng = np.random.default_rng(seed)
    keys = seq if keys is None else keys
    q = rng.standard_normal((batch, seq, HEADS, HEAD_DIM), dtype=np.float32)
    k = rng.standard_normal((batch, keys, KV_HEADS, HEAD_DIM), dtype=np.float32)
    v = rng.standard_normal((batch, keys, KV_HEADS, HEAD_DIM), dtype=np.float32)
    dout = rng.standard_normal((batch, seq, HEADS, HEAD_DIM), dtype=np.float32)
    return q, k, v, dout


def _documents() -> np.ndarray:
    """Row 0: documents of 10, 15 and 17 tokens, then 6 of padding; row 1: 20 and 28 tokens."""
    return np.repeat(np.array([[1, 2, 3, 0], [1, 1, 2, 2]]), [10, 15, 17, 6], axis=1).astype(np.int32)


def _out_and_grads(attention, q, k, v, dout):
    """(out, dq, dk, dv): the gradients of sum(out * dout), a random cotangent."""

    def f(q, k, v):
        out, vjp = jax.vjp(attention, q, k, v)
        return (out, *vjp(dout))

    return jax.jit(f)(q, k, v)


def _assert_matches(kernel, *, window, options, seg=None, seed=0, batch=BATCH):
    q, k, v, dout = _inputs(seed, batch=batch)
    got = _out_and_grads(kernel, q, k, v, dout)
    want = _out_and_grads(lambda q, k, v: reference(q, k, v, window=window, seg=seg, **options), q, k, v, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape and np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=ATOL, rtol=0, err_msg=name)


WINDOWS = [1, 3, 100]  # one key (itself), a few keys, longer than the sequence


# --- dot and blockwise ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("options", [PLAIN, CAPPED], ids=["plain", "capped"])
@pytest.mark.parametrize("segments", [False, True], ids=["one-doc", "documents"])
def test_dot_attention(window, options, segments):
    seg = _documents() if segments else None
    kernel = lambda q, k, v: dot_attention(q, k, v, seg, AttentionSpec(window=window, **options))  # noqa: E731
    _assert_matches(kernel, window=window, options=options, seg=seg)


# (block_q, block_k): equal blocks dividing the sequence (split down to 1 position); neither dividing the window nor
# the sequence; unequal; unequal, split once (to 6 x 3).
BLOCKS = [(8, 8), (4, 7), (16, 3), (5, 5), (12, 6)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_q,block_k", BLOCKS)
@pytest.mark.parametrize("segments", [False, True], ids=["one-doc", "documents"])
def test_blockwise_attention(window, block_q, block_k, segments):
    seg = _documents() if segments else None
    options = CAPPED if (block_q + window) % 2 else PLAIN  # both, across the grid
    spec = AttentionSpec(window=window, block_q=block_q, block_k=block_k, **options)
    kernel = lambda q, k, v: blockwise_attention(q, k, v, seg, spec)  # noqa: E731
    _assert_matches(kernel, window=window, options=options, seg=seg)


@pytest.mark.parametrize("options", [{"softcap": 0.5}, {"scale": 2.0}, {"softcap": 30.0, "scale": 0.1}])
def test_scale_and_softcap_without_a_window(options):
    """A cap small enough to bite (0.5: every score is squashed), a large scale, Gemma 2's 30 with a small scale."""
    kernel = lambda q, k, v: blockwise_attention(q, k, v, None, AttentionSpec(block_q=16, block_k=16, **options))  # noqa: E731
    _assert_matches(kernel, window=0, options=options, seed=4)


@pytest.mark.parametrize(
    "seq,block_q,block_k,window",
    [(50, 8, 8, 1), (50, 4, 7, 9), (64, 16, 3, 20), (33, 5, 6, 7), (64, 8, 8, 16), (100, 16, 8, 21), (7, 4, 4, 2)],
)
def test_blockwise_plan_lists_exactly_the_scores_a_window_needs(seq, block_q, block_k, window):
    """Every visible (query, key) is computed by exactly one listed pair (whole blocks or, splitting the partially
    visible ones, sub-blocks), and every listed pair holds a visible one; a step never repeats a query block; its
    causal / window / length mask is set whenever one of its pairs holds a key that rule hides."""
    plan = _plan(seq, block_q, block_k, window)
    rows, cols = plan.num_q * block_q, plan.num_k * block_k
    i, j = np.indices((rows, cols))  # each score's query and key position
    visible = np.zeros((rows, cols), bool)
    visible[:seq, :seq] = _mask(seq, window, None)[0]
    computed = np.zeros((rows, cols), int)
    for step in plan.steps:
        bq, bk = plan.sizes(step)
        assert len(set(step.q)) == len(step.q), step
        for a, c in zip(step.q, step.k, strict=True):
            cut = np.s_[a * bq : (a + 1) * bq, c * bk : (c + 1) * bk]
            assert visible[cut].any(), (step, a, c)
            computed[cut] += 1
            assert step.causal_mask or not (j[cut] > i[cut]).any(), step
            assert step.window_mask or not (j[cut] <= i[cut] - window).any(), step
            assert step.length_mask or not (j[cut] >= seq).any(), step
    assert (computed[visible] == 1).all() and computed.max() == 1
    assert plan.widest_step() <= max(len(plan.key_blocks(i)) for i in range(plan.num_q)) * block_q * block_k


def _plan(seq: int, block_q: int, block_k: int, window: int = 0) -> BlockPlan:
    return BlockPlan(seq, AttentionSpec(window=window, block_q=block_q, block_k=block_k).resolved(HEAD_DIM, seq))


def _compiled_flops(seq: int, window: int, backward: bool = False) -> float:
    q = jax.ShapeDtypeStruct((1, seq, 4, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.float32)

    def attention(q, k, v):
        return blockwise_attention(q, k, v, None, AttentionSpec(window=window))

    def forward_backward(q, k, v, dout):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, *vjp(dout)

    fast = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    if backward:
        return jax.jit(forward_backward).lower(q, kv, kv, q).compile(compiler_options=fast).cost_analysis()["flops"]
    return jax.jit(attention).lower(q, kv, kv).compile(compiler_options=fast).cost_analysis()["flops"]


def test_a_window_cuts_the_compiled_flops_and_the_scratch():
    """seq 8192, blocks of 512 (compiled, never run): the FLOPs, forward and forward + backward, follow the scores
    the plan computes, a quarter or less of full causal's at window 1024, and the widest step holds a quarter or
    less of full causal's scores. The window's own fraction of full causal's scores is 0.23 at 1024 (whole blocks
    kept 45 of the 136 causal block pairs, 0.33); splitting the partially visible pairs down to 64 positions
    keeps 31.9 pairs' worth (0.234), window 512 17.4 (0.128)."""
    seq, block = 8192, 512
    full = _plan(seq, block, block)
    computed = lambda plan: sum(map(plan.scores, plan.steps))  # noqa: E731
    full_flops = {backward: _compiled_flops(seq, 0, backward) for backward in (False, True)}
    for window in (512, 1024):
        plan = _plan(seq, block, block, window)
        scores = computed(plan) / computed(full)
        assert scores <= 0.24, (window, scores)
        for backward in (False, True):
            flops = _compiled_flops(seq, window, backward) / full_flops[backward]
            assert flops <= 0.25 and abs(flops - scores) <= 0.02 * scores, (window, backward, flops, scores)
        assert plan.widest_step() <= full.widest_step() / 4, (window, plan.widest_step(), full.widest_step())


# --- ring -----------------------------------------------------------------------------------------------------

# (mesh, load_balance, window, segments, options): chunks of 12 (context=2) and 6 (context=4) tokens; windows
# inside a chunk, across one or more chunk boundaries, and longer than the sequence.
RING = [
    ("context=2,fsdp=4", "zigzag", 3, True, CAPPED),
    ("context=2,fsdp=4", None, 13, False, PLAIN),
    ("context=4,fsdp=2", "zigzag", 1, False, CAPPED),
    ("context=4,fsdp=2", "zigzag", 7, True, PLAIN),
    ("context=4,fsdp=2", None, 9, True, CAPPED),
    ("context=4,fsdp=2", "zigzag", 100, False, {"scale": 0.5}),
]


@pytest.mark.parametrize("mesh_text,load_balance,window,segments,options", RING)
def test_ring_attention(mesh_text, load_balance, window, segments, options):
    """Inputs in the zigzag layout when load-balanced (the window counts true positions), output and gradients
    brought back to the natural order."""
    mesh = make_mesh(mesh_text)
    n = mesh.shape["context"]
    order = (lambda x: to_zigzag(x, n=n)) if load_balance else (lambda x: x)
    back = (lambda x: from_zigzag(x, n=n)) if load_balance else (lambda x: x)
    seg = _documents() if segments else None

    def kernel(q, k, v):
        spec = AttentionSpec(window=window, key_tile=3, **options)
        layout = RingLayout(load_balance=load_balance, batch_axes=())
        out = ring_attention(
            order(q), order(k), order(v), None if seg is None else order(seg), spec, mesh=mesh, layout=layout
        )
        return back(out)

    _assert_matches(kernel, window=window, options=options, seg=seg)


@pytest.mark.parametrize("chunk,window", [(6, 1), (6, 6), (6, 7), (6, 13), (4, 9), (5, 100)])
def test_ring_pairs_outside_the_window_are_skipped(chunk, window):
    """The mode of every (query chunk, key chunk) pair from the visible (query, key) positions: SKIP when none is
    visible, FULL when all are, DIAG on the same chunk, EDGE when a window hides some of an earlier chunk."""
    chunks = 8
    visible = _mask(chunks * chunk, window, None)[0].reshape(chunks, chunk, chunks, chunk)
    for a in range(chunks):
        for b in range(chunks):
            seen = visible[a, :, b]
            want = DIAG if a == b else SKIP if not seen.any() else FULL if seen.all() else EDGE
            assert int(pair_mode(a, b, chunk, window)) == want, (a, b)


# --- cuDNN wrapper, cache attention, the kernel choice ----------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("segments", [False, True], ids=["one-doc", "documents"])
def test_cudnn_wrapper_window_and_scale(window, segments):
    """`local_window_size` mapped from the window gives the same visible keys (XLA's attention for cuDNN)."""
    seg = _documents() if segments else None
    options = {"scale": 0.3}
    kernel = lambda q, k, v: cudnn_attention(  # noqa: E731
        q, k, v, seg, AttentionSpec(window=window, **options), implementation="xla"
    )
    _assert_matches(kernel, window=window, options=options, seg=seg)


def test_cudnn_wrapper_under_rules_runs_per_device():
    mesh, rules = make_mesh("fsdp=4,tensor=2"), make_rules(3)

    def kernel(q, k, v):
        with use_rules(rules, mesh):
            return cudnn_attention(q, k, v, None, AttentionSpec(window=5), implementation="xla")

    _assert_matches(kernel, window=5, options=PLAIN, seed=5, batch=4)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("options", [PLAIN, CAPPED], ids=["plain", "capped"])
def test_cache_attention_prefill_and_decode(window, options):
    """Prefill: the prompt's tokens at positions 0..T-1 against a cache of 48 slots (slots past the prompt hold
    stale keys). Decode: one token per row at positions 17 and 40 (rows of different lengths)."""
    q, k, v, dout = _inputs(6, seq=20, keys=SEQ)
    prefill_pos = np.broadcast_to(np.arange(20), (BATCH, 20))
    for pos, sl in ((prefill_pos, slice(None)), (np.array([[17], [40]]), slice(0, 1))):
        qs, ds = q[:, sl], dout[:, sl]
        got = _out_and_grads(
            lambda q, k, v, p=pos: cache_attention(q, k, v, jnp.asarray(p), AttentionSpec(window=window, **options)),
            qs,
            k,
            v,
            ds,
        )
        want = _out_and_grads(
            lambda q, k, v, p=pos: reference(q, k, v, window=window, q_pos=p, **options), qs, k, v, ds
        )
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=ATOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("kind", ["dot", "blockwise"])
def test_attend_passes_the_options_on(kind):
    options = {"scale": 0.4, "softcap": 1.5}
    kernel = lambda q, k, v: attend(q, k, v, kind, None, AttentionSpec(window=6, block_q=16, block_k=16, **options))  # noqa: E731
    _assert_matches(kernel, window=6, options=options, seed=7)


def test_cudnn_is_never_chosen_with_a_soft_cap():
    settings = {"context": 1, "platform": "cuda", "dtype": "bfloat16", "head_dim": 64}
    assert choose_attention("auto", **settings) == "cudnn"
    assert choose_attention("auto", **settings, softcap=50.0) == "blockwise"
    assert choose_attention("auto", **{**settings, "context": 2}, softcap=50.0) == "ring"
    with pytest.raises(SpmdkitError, match=re.escape("--attention cudnn has no logit soft-capping")) as info:
        choose_attention("cudnn", **settings, softcap=50.0)
    assert "\n" not in str(info.value)
    q, k, v, _ = _inputs()
    with pytest.raises(SpmdkitError, match="cuDNN attention has no logit soft-capping"):
        cudnn_attention(q, k, v, None, AttentionSpec(softcap=50.0), implementation="xla")


@pytest.mark.parametrize(
    "options,message",
    [
        ({"window": -1}, "window=-1 must be 0 (unlimited) or, with causal=True, positive"),
        ({"window": 4, "causal": False}, "window=4 must be 0 (unlimited) or, with causal=True, positive"),
        ({"softcap": -1.0}, "softcap=-1.0 must be 0 (off) or positive"),
        ({"scale": 0.0}, "scale=0.0 must be positive"),
    ],
)
def test_bad_options_are_one_clear_error(options, message):
    """The spec every kernel takes refuses them once, when it is made."""
    with pytest.raises(SpmdkitError, match=re.escape(message)) as info:
        AttentionSpec(**options)
    assert "\n" not in str(info.value)
