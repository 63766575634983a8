"""Ring attention: same numbers as dense attention, the right collectives, the layout helpers, bad inputs."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from spmdkit.errors import SpmdkitError
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.parallel.context.ring_attention import (
    RingLayout,
    causal_work_balance,
    from_zigzag,
    inverse_zigzag_indices,
    ring_attention,
    to_zigzag,
    zigzag_indices,
)
from spmdkit.sharding.mesh import make_mesh

RTOL = 1e-5

# (mesh, causal, load_balance, batch, seq, heads, kv_heads, head_dim, key_tile). Together: context 2, 4, 8;
# causal zigzag, causal contiguous, non-causal; GQA ratio 1 and 4; seq 48 and 96 (not powers of two);
# key tiles; batch over data / fsdp, heads over tensor, an unused automatic axis (pipeline), and a "bare"
# mesh that has only the named axes (no data, no tensor).
CASES = [
    ("context=2,fsdp=4", True, "zigzag", 4, 32, 4, 4, 8, None),
    ("context=4,pipeline=2", True, "zigzag", 1, 48, 8, 2, 16, 3),
    ("bare:context=4,fsdp=2", True, "none", 2, 32, 4, 4, 8, None),
    ("context=4,data=2", False, "zigzag", 2, 96, 4, 1, 8, 6),
    ("context=8", True, "zigzag", 1, 32, 4, 1, 8, None),
    ("context=8", True, None, 1, 32, 4, 4, 8, 1),  # None: no balancing (contiguous)
    ("context=8", False, "none", 1, 16, 2, 2, 8, None),
    ("context=2,fsdp=2,tensor=2", True, "zigzag", 2, 32, 8, 2, 8, None),
]


def _mesh(text: str) -> jax.sharding.Mesh:
    if not text.startswith("bare:"):
        return make_mesh(text)
    names, sizes = zip(*(part.split("=") for part in text[5:].split(",")), strict=True)
    return jax.make_mesh(tuple(map(int, sizes)), names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _inputs(batch, seq, heads, kv_heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seq, heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((batch, seq, kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((batch, seq, kv_heads, head_dim), dtype=np.float32)
    dout = rng.standard_normal((batch, seq, heads, head_dim), dtype=np.float32)
    return q, k, v, dout


def _out_and_grads(attention):
    """jit-able f(q, k, v, dout) -> (out, dq, dk, dv) with dout the output cotangent."""

    def f(q, k, v, dout):
        out, vjp = jax.vjp(attention, q, k, v)
        return (out, *vjp(dout))

    return f


def _dense(causal):
    return jax.jit(_out_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)))


def _rel_err(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))) / np.max(np.abs(want)))


def _collectives(hlo: str) -> list[tuple[str, str]]:
    """(opcode, result type) of every collective instruction in compiled HLO text."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%\S+ = (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                     r"collective-permute)(?:-start)?\(", line)  # fmt: skip
        if m:
            found.append((m.group(2), m.group(1)))
    return found


def _elements(hlo_type: str) -> int:
    dims = re.match(r"\w+\[([\d,]*)\]", hlo_type).group(1)
    return int(np.prod([int(d) for d in dims.split(",") if d]))


@pytest.mark.parametrize("mesh_text,causal,load_balance,batch,seq,heads,kv_heads,head_dim,key_tile", CASES)
def test_matches_dense_attention_and_sends_only_kv(
    mesh_text, causal, load_balance, batch, seq, heads, kv_heads, head_dim, key_tile
):
    mesh = _mesh(mesh_text)
    n = mesh.shape["context"]
    q, k, v, dout = _inputs(batch, seq, heads, kv_heads, head_dim)
    spec, layout = AttentionSpec(causal, key_tile=key_tile), RingLayout(load_balance=load_balance)
    ring = _out_and_grads(lambda q, k, v: ring_attention(q, k, v, None, spec, mesh=mesh, layout=layout))
    order = (lambda x: to_zigzag(x, n=n)) if load_balance == "zigzag" else (lambda x: x)
    args = [order(x) for x in (q, k, v, dout)]
    compiled = jax.jit(ring).lower(*args).compile()
    got = [np.asarray(x) for x in compiled(*args)]
    if load_balance == "zigzag":
        got = [from_zigzag(x, n=n) for x in got]
    want = _dense(causal)(q, k, v, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == np.float32, name
        assert _rel_err(g, w) < RTOL, (name, _rel_err(g, w))

    # Traffic: only ring hops, each one packed K,V or dK,dV buffer of the local K/V size; no all-gather.
    local_kv = k.size // mesh.size * mesh.shape.get("pipeline", 1)  # k is replicated over the unused pipeline axis
    collectives = _collectives(compiled.as_text())
    opcodes = {op for op, _ in collectives}
    assert opcodes == {"collective-permute"}, collectives
    assert all(_elements(t) == 2 * local_kv for _, t in collectives), (local_kv, collectives)


def test_lse_output_and_its_gradient():
    """ring_attention(return_lse=True): lse [batch, heads, seq] = logsumexp of the scaled masked scores, and a
    cotangent on lse flows into dq, dk (the -dlse term of D)."""
    mesh = make_mesh("context=2,fsdp=4")
    q, k, v, dout = _inputs(4, 16, 2, 2, 8, seed=1)
    dlse = np.random.default_rng(2).standard_normal((4, 2, 16), dtype=np.float32)
    causal_mask = np.tril(np.ones((16, 16), bool))

    def dense(q, k, v):
        s = jnp.where(causal_mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]), -jnp.inf)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True), jax.nn.logsumexp(s, axis=-1)

    def value_and_grads(f, q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return (out, lse, *vjp((dout, dlse)))

    zz = [to_zigzag(x, n=2) for x in (q, k, v, dout)] + [to_zigzag(dlse, axis=2, n=2)]
    ring = functools.partial(ring_attention, mesh=mesh, return_lse=True)
    got = jax.jit(lambda *a: value_and_grads(ring, *a))(*zz)
    got = [from_zigzag(np.asarray(x), axis=2 if i == 1 else 1, n=2) for i, x in enumerate(got)]
    want = jax.jit(lambda *a: value_and_grads(dense, *a))(q, k, v, dout, dlse)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == np.float32 and _rel_err(g, w) < RTOL, (name, _rel_err(g, w))


@pytest.mark.parametrize("key_tile", [None, 3], ids=["whole-chunk", "tiles-of-3"])
def test_segment_ids_travel_with_kv(key_tile):
    """Documents packed in a row (and padding) on context=4: the segment ids, zigzagged like every per-token array,
    travel the ring with K/V; out and grads equal the one-device reference kernel on the natural order."""
    from spmdkit.models.attention import dot_attention

    mesh, n = make_mesh("context=4,fsdp=2"), 4
    q, k, v, dout = _inputs(2, 48, 4, 2, 8, seed=3)
    seg = np.stack([np.repeat([1, 2, 3, 0], [10, 20, 13, 5]), np.repeat([1, 2], [40, 8])]).astype(np.int32)
    zz_seg = to_zigzag(seg, n=n)
    ring = _out_and_grads(lambda q, k, v: ring_attention(q, k, v, zz_seg, AttentionSpec(key_tile=key_tile), mesh=mesh))
    got = [from_zigzag(np.asarray(x), n=n) for x in jax.jit(ring)(*[to_zigzag(x, n=n) for x in (q, k, v, dout)])]
    want = jax.jit(_out_and_grads(lambda q, k, v: dot_attention(q, k, v, seg)))(q, k, v, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert np.isfinite(g).all() and _rel_err(g, w) < RTOL, (name, _rel_err(g, w))
    assert np.all(got[0][seg == 0] == 0)  # padding rows see nothing


def test_zigzag_permutation_puts_chunks_r_and_2n_minus_1_minus_r_on_device_r():
    seq, n = 48, 4
    c = seq // (2 * n)
    x = np.arange(2 * seq).reshape(2, seq)
    z = to_zigzag(x, n=n)
    for r, shard in enumerate(np.split(z, n, axis=1)):
        first, second = shard[0, :c], shard[0, c:]
        np.testing.assert_array_equal(first, np.arange(r * c, (r + 1) * c))
        np.testing.assert_array_equal(second, np.arange((2 * n - 1 - r) * c, (2 * n - r) * c))
    np.testing.assert_array_equal(from_zigzag(z, n=n), x)
    np.testing.assert_array_equal(zigzag_indices(seq, n)[inverse_zigzag_indices(seq, n)], np.arange(seq))
    jz = to_zigzag(jnp.asarray(x.T), axis=0, n=n)  # jax arrays and other axes work the same
    np.testing.assert_array_equal(np.asarray(jz), z.T)
    np.testing.assert_array_equal(np.asarray(from_zigzag(jz, axis=0, n=n)), x.T)


def test_causal_work_balance():
    zigzag, zigzag_ratio = causal_work_balance(8, "zigzag")
    contiguous, contiguous_ratio = causal_work_balance(8, "none")
    # Pairs (query chunk, key chunk <= query chunk) over the 16 chunks, counted by hand: 16 * 17 / 2 = 136.
    assert sum(zigzag) == sum(contiguous) == 136
    assert zigzag == [17] * 8 and zigzag_ratio == 1.0
    assert contiguous[0] == 1 + 2 and contiguous[-1] == 15 + 16  # chunks 0, 1 and chunks 14, 15
    assert contiguous_ratio > 1.5
    assert causal_work_balance(8, "contiguous") == (contiguous, contiguous_ratio)


def _call(q_shape=(2, 32, 4, 8), kv_shape=(2, 32, 2, 8), mesh_text="context=4,fsdp=2", key_tile=None, **layout):
    q, k = np.zeros(q_shape, np.float32), np.zeros(kv_shape, np.float32)
    spec = AttentionSpec(key_tile=key_tile)
    return ring_attention(q, k, k, None, spec, mesh=make_mesh(mesh_text), layout=RingLayout(**layout))


def test_ring_attention_takes_at_most_8_parameters():
    """q, k, v, segment ids, the spec (`AttentionSpec`: causal, window, scale, softcap, key tile), the mesh, the
    layout (`RingLayout`: axes and load balance) and return_lse."""
    import inspect

    assert len(inspect.signature(ring_attention).parameters) <= 8


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(q_shape=(2, 36, 4, 8), kv_shape=(2, 36, 2, 8)), "not divisible by 2 x context size = 8"),
        (dict(q_shape=(2, 32, 6, 8), kv_shape=(2, 32, 4, 8)), "heads=6 is not a multiple of kv_heads=4"),
        (dict(load_balance="stripes"), "unknown load_balance 'stripes'"),
        (dict(axis_name="ctx"), "context axis 'ctx' is not in the mesh"),
        (dict(key_tile=3), "key_tile=3 does not divide the chunk length"),
        (dict(q_shape=(3, 32, 4, 8), kv_shape=(3, 32, 2, 8)), "batch=3 is not divisible by mesh axes fsdp"),
        (dict(kv_shape=(2, 32, 1, 8), mesh_text="context=4,tensor=2"), "kv_heads=1 is not divisible"),
        (dict(kv_shape=(2, 16, 2, 8)), "differ in batch, seq or head_dim"),
    ],
)
def test_bad_inputs_raise_spmdkit_error(kwargs, message):
    with pytest.raises(SpmdkitError, match=re.escape(message)):
        _call(**kwargs)


def test_layout_helpers_reject_bad_lengths():
    with pytest.raises(SpmdkitError, match="pad the sequence to a multiple of 8"):
        to_zigzag(np.zeros((1, 20)), n=4)
    with pytest.raises(SpmdkitError, match="unknown load_balance"):
        causal_work_balance(4, "zig")


def test_the_ring_inside_a_layer_scan_keeps_nothing_per_step():
    """The ring's masks and pair modes depend on loop indices and the ring position only; tied to the data, they
    stay in the ring's loops. Untied, a layer scan's partial evaluation hoisted them out of it, computed and kept
    for every step and chunk pair: here 994 MB of temporaries against 55 MB for one call, 119 GB per device for
    Llama-3-8B at 128k tokens on context=8. Two layers now need what one does, within half."""
    mesh = make_mesh("context=8")
    q = jax.ShapeDtypeStruct((1, 16384, 8, 8), jnp.bfloat16)
    ring = functools.partial(ring_attention, mesh=mesh, spec=AttentionSpec(key_tile=512))

    def one(x):
        return ring(x, x, x).astype(jnp.float32).sum()

    def layers(x):
        return lax.scan(lambda y, _: (ring(y, y, y), None), x, None, length=2)[0].astype(jnp.float32).sum()

    with jax.set_mesh(mesh):
        temps = [jax.jit(jax.grad(f)).lower(q).compile().memory_analysis().temp_size_in_bytes for f in (one, layers)]
    assert temps[1] < 1.5 * temps[0], temps
