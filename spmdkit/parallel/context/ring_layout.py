"""The static description of one ring-attention call: which mesh axes it splits (`RingLayout`), and the checked,
resolved record the ring program carries (`Ring`, built by `make_ring`). Pure bookkeeping, no collectives."""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmdkit.errors import SpmdkitError
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.parallel.context.chunks import check_load_balance, check_seq_len
from spmdkit.parallel.context.exchange import kv_repeat

__all__ = ["Ring", "RingLayout", "make_ring"]


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """Which mesh axes ring attention splits: the sequence over `axis_name` in the `load_balance` layout
    ("zigzag"; None, "none" or "contiguous": natural order), batch over `batch_axes`, heads and kv_heads over
    `heads_axis` (None: replicated). Axes absent from the mesh or of size 1 are ignored. `ulysses` U > 1: 2D
    context parallelism, the axis's C devices as C/U ring positions of U consecutive devices each, which trade
    their sequence pieces for 1/U of the heads (`spmdkit.parallel.context.exchange`) before the ring and back after
    it; the layout is then over the C/U positions (`to_zigzag(x, n=C/U)`)."""

    axis_name: str = "context"
    load_balance: str | None = "zigzag"
    batch_axes: tuple[str, ...] = ("data", "fsdp")
    heads_axis: str | None = "tensor"
    ulysses: int = 1


@dataclasses.dataclass(frozen=True)
class Ring:
    """Static description of one ring-attention call (hashable: it is a custom_vjp non-diff argument): the layout
    with its absent axes dropped, the spec resolved (`key_tile` set) and the chunk length seq / (2N)."""

    mesh: Mesh
    layout: RingLayout
    spec: AttentionSpec
    chunk: int
    kv_repeat: int = 1  # 2D: each device's kv heads repeated so that the Ulysses factor splits them

    @property
    def n(self) -> int:
        """Ring positions: the context axis's devices over the Ulysses factor."""
        return self.mesh.shape[self.layout.axis_name] // self.layout.ulysses

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


def _present(mesh: Mesh, axis: str | None) -> bool:
    return axis is not None and mesh.shape.get(axis, 1) > 1


def _check_divides(what: str, size: int, axes: tuple[str, ...], mesh: Mesh) -> None:
    devices = math.prod(mesh.shape[a] for a in axes)
    if size % devices:
        raise SpmdkitError(
            f"{what}={size} is not divisible by mesh axes {'x'.join(axes)} of size {devices}: change {what} or "
            f"shard it over other axes"
        )


def make_ring(q, k, mesh: Mesh, layout: RingLayout, spec: AttentionSpec) -> Ring:
    """Check the user inputs (but q, k, v and segment ids: `check_qkv`), resolve the axes (size-1 and absent axes
    are dropped) and the spec (its key tile: a divisor of the chunk, default the whole chunk)."""
    load_balance = check_load_balance(layout.load_balance)
    axis_name = layout.axis_name
    if axis_name not in mesh.shape:
        raise SpmdkitError(f"context axis {axis_name!r} is not in the mesh {dict(mesh.shape)}: set the layout's axis")
    u = layout.ulysses
    if u < 1 or mesh.shape[axis_name] % u:
        raise SpmdkitError(
            f"the Ulysses factor {u} does not divide {axis_name}={mesh.shape[axis_name]}: pick a divisor"
        )
    chunk = check_seq_len(q.shape[1], mesh.shape[axis_name] // u)
    batch_axes = tuple(a for a in layout.batch_axes if _present(mesh, a) and a != axis_name)
    heads_axis = layout.heads_axis if _present(mesh, layout.heads_axis) else None
    _check_divides("batch", q.shape[0], batch_axes, mesh)
    if heads_axis:
        _check_divides("heads", q.shape[2], (heads_axis,), mesh)
        _check_divides("kv_heads", k.shape[2], (heads_axis,), mesh)
    tensor = mesh.shape[heads_axis] if heads_axis else 1
    if (q.shape[2] // tensor) % u:
        raise SpmdkitError(
            f"2D context parallelism: heads={q.shape[2]} per tensor rank ({q.shape[2] // tensor}) do not split over "
            f"the Ulysses factor {u}: pick a factor that divides them"
        )
    repeat = kv_repeat(k.shape[2] // tensor, q.shape[2] // tensor, u)
    key_tile = chunk if spec.key_tile is None else spec.key_tile
    if key_tile < 1 or chunk % key_tile:
        raise SpmdkitError(
            f"key_tile={key_tile} does not divide the chunk length seq/(2 x context) = {chunk}: pick a divisor "
            f"of {chunk} or None"
        )
    spec = dataclasses.replace(spec.resolved(q.shape[3], q.shape[1]), key_tile=key_tile)
    return Ring(mesh, RingLayout(axis_name, load_balance, batch_axes, heads_axis, u), spec, chunk, repeat)
