"""Collective matmuls: tensor parallelism's all-gather and reduce-scatter split into a ring overlapping the GEMMs.

With sequence parallelism the residual stream `x[b, s/n, e]` is sharded over the `n` devices of the tensor axis
along the sequence. A column-parallel projection (q/k/v, MLP up/gate, `w[e, f/n]`) needs the whole sequence: the
plain program all-gathers `x`, then multiplies. `all_gather_matmul` instead multiplies the chunk it holds while
passing it to the next device (`ppermute`): n partial GEMMs, n - 1 hops, each hop hidden behind a GEMM. A
row-parallel projection (attention out, MLP down, `w[f/n, e]`) yields partial sums of the whole sequence that a
reduce-scatter sums and shards; `matmul_reduce_scatter` computes, per step, the partial of the chunk some other
device ends up owning and adds it to the accumulator arriving from the previous device.

This is XLA:GPU's windowed einsum written out (`--overlap-tp` asks XLA for it; where XLA does not decompose, this
ring does the same). Both run inside `jax.shard_map` over the tensor axis, on each device's block; the loop is a
`fori_loop` under the named scope `RING_SCOPE`, so `spmdkit.inspect.levers.windowed_einsums` finds it in a
compiled program. Both are differentiable (the transpose of a `ppermute` is the reverse `ppermute`).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from spmdkit.sharding.logical import active_rules, logical_to_spec
from spmdkit.sharding.rules import Rules

RING_SCOPE = "collective_matmul"  # spmdkit.inspect.levers.RING_SCOPE reads the compiled program by this name


def _shift(x: jax.Array, axis: str, size: int) -> jax.Array:
    """Each device's block to the next device of the ring over `axis` (device i -> i + 1 mod size)."""
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % size) for i in range(size)])


def all_gather_matmul(x: jax.Array, w: jax.Array, axis: str) -> jax.Array:
    """`all_gather(x, axis, seq dim -2) @ w` on this device's blocks: x `[..., s/n, e]` (sequence sharded over
    `axis`), w `[e, f_local]`; returns `[..., s, f_local]`. After i hops a device holds the chunk of device
    (self - i) mod n and writes that chunk's rows of the result."""
    size, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    rows = x.shape[-2]

    def place(out: jax.Array, chunk: jax.Array, step: jax.Array | int) -> jax.Array:
        start = ((me - step) % size) * rows
        return jax.lax.dynamic_update_slice_in_dim(out, chunk @ w, start, axis=out.ndim - 2)

    def hop(step: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        out, chunk = carry
        return place(out, chunk, step), _shift(chunk, axis, size)  # the next hop overlaps this step's GEMM

    with jax.named_scope(RING_SCOPE):
        out = place(jnp.zeros((*x.shape[:-2], rows * size, w.shape[-1]), jnp.result_type(x, w)), x, 0)
        out, chunk = jax.lax.fori_loop(1, size - 1, hop, (out, _shift(x, axis, size)))
        return place(out, chunk, size - 1)


def matmul_reduce_scatter(h: jax.Array, w: jax.Array, axis: str) -> jax.Array:
    """`psum_scatter(h @ w, axis, seq dim -2)` on this device's blocks: h `[..., s, f_local]`, w `[f_local, e]`;
    returns `[..., s/n, e]`, this device's chunk of the sum over `axis`. At step i a device adds its partial of
    chunk (self - i - 1) mod n to the accumulator the previous device passed on; after n - 1 hops each device
    holds its own chunk, summed over the ring."""
    size, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    rows = h.shape[-2] // size

    def partial(step: jax.Array) -> jax.Array:
        start = ((me - step - 1) % size) * rows
        return jax.lax.dynamic_slice_in_dim(h, start, rows, axis=h.ndim - 2) @ w

    with jax.named_scope(RING_SCOPE):

        def hop(step: jax.Array, acc: jax.Array) -> jax.Array:
            return _shift(acc, axis, size) + partial(step)  # this step's GEMM does not wait for the hop

        return jax.lax.fori_loop(1, size, hop, partial(jnp.asarray(0)))


def rings(rules: Rules, sizes: Mapping[str, int]) -> bool:
    """Do the rules ask for the projections' rings (`--overlap-tp` under sequence parallelism) on a mesh of these
    axis sizes with more than one tensor device?"""
    return rules.overlap_tp and rules.sequence_parallel and sizes.get("tensor", 1) > 1


def ring_mesh() -> Mesh | AbstractMesh | None:
    """The mesh whose `tensor` axis the model's projections ring over while it is traced: with rules that ask for
    it (`--overlap-tp`) under sequence parallelism, on more than one tensor device, outside a region already
    manual over `tensor`; else None (the projections are plain einsums and XLA places the collectives)."""
    active = active_rules()
    if active is None:
        return None
    rules, mesh = active
    if not rings(rules, mesh.shape):
        return None
    context = jax.sharding.get_abstract_mesh()
    if {"tensor", "pipeline"} & set(context.manual_axes):  # Shardy cannot nest the ring in a pipeline stage
        return None
    return context if context.manual_axes else mesh  # in the accumulation region: its partly manual mesh


def _tensor_spec(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh | AbstractMesh) -> PartitionSpec:
    """The part of the logical names' layout that is the `tensor` axis: what the ring's shard_map splits (the
    other axes, FSDP's among them, stay automatic)."""
    spec = logical_to_spec(names, shape, mesh, active_rules()[0].params)
    on_tensor = [e == "tensor" or (isinstance(e, tuple) and "tensor" in e) for e in spec]
    return PartitionSpec(*("tensor" if split else None for split in on_tensor))


def column_parallel(x: jax.Array, w: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """x [batch, seq, embed] in sequence parallelism's layout (seq split over `tensor`) times w [embed, *out] (its
    logical `names`; the out dims split over `tensor`) -> [batch, seq, *out], whole sequence: `all_gather_matmul`
    in a shard_map over `tensor` (under `ring_mesh`)."""
    mesh = ring_mesh()
    w_spec = _tensor_spec(names, w.shape, mesh)
    out_spec = PartitionSpec(None, None, *w_spec[1:])

    def body(x: jax.Array, w: jax.Array) -> jax.Array:
        y = all_gather_matmul(x, w.reshape(w.shape[0], -1), "tensor")
        return y.reshape(*y.shape[:-1], *w.shape[1:])

    specs = (PartitionSpec(None, "tensor", None), w_spec)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec, axis_names={"tensor"})(x, w)


def row_parallel(h: jax.Array, w: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """h [batch, seq, *in] (the in dims split over `tensor`) times w [*in, embed] (its logical `names`) -> [batch,
    seq, embed] summed over `tensor` and left in sequence parallelism's layout (seq split over `tensor`):
    `matmul_reduce_scatter` in a shard_map over `tensor` (under `ring_mesh`)."""
    mesh = ring_mesh()
    w_spec = _tensor_spec(names, w.shape, mesh)
    contracted = w.ndim - 1

    def body(h: jax.Array, w: jax.Array) -> jax.Array:
        flat = h.reshape(*h.shape[: h.ndim - contracted], -1)
        return matmul_reduce_scatter(flat, w.reshape(-1, w.shape[-1]), "tensor")

    specs = (PartitionSpec(None, None, *w_spec[:contracted]), w_spec)
    out = PartitionSpec(None, "tensor", None)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out, axis_names={"tensor"})(h, w)
