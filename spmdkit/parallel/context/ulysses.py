"""Ulysses context parallelism: all-to-alls trade the sequence split for a head split, any local kernel attends.

Shapes (global): q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim], out like q; seq is
sharded over the context axis (C devices) in natural order, batch over `batch_axes`, heads over `heads_axes` (T
devices). Per device (DeepSpeed-Ulysses, arXiv:2309.14509):

    q, k, v  [b, s/C, h/T, d]  --all-to-all over context (split heads, gather seq)-->  [b, s, h/(T C), d]
    out      [b, s, h/(T C), d] = local(q, k, v)       (any kernel on the whole sequence: cuDNN on a GPU)
    out      [b, s, h/(T C), d]  --all-to-all back (split seq, gather heads)-->        [b, s/C, h/T, d]

Each device sends (C-1)/C of q, k, v and out per layer forward, a constant as C grows (the ring sends (C-1)/C of
K/V per layer too, but its bytes are the whole sequence's K/V); the backward is JAX's transpose of the same
all-to-alls. The local kernel sees the sequence whole and in order, so causal masks, windows, soft caps and packed
documents (the segment ids are gathered over context) are its own; no load balancing is needed (every device
attends all positions of its heads). cuDNN takes packed documents as a dense [seq, seq] mask per sequence, so at
long context packed rows want the blockwise kernel (`--attention blockwise`: `ulysses_blockwise`).

GQA: after the exchange every device needs the kv heads of its query heads. With kv_heads/T not divisible by C,
each device repeats its kv heads r = C / gcd(kv_heads/T, C) times before the exchange (r divides the group
heads/kv_heads because heads/T is divisible by C), the repeat's transpose summing their gradients. Requires heads
divisible by T x C (else the ring: `--context-parallel ring`).

Output parts (`parts` > 1): the second exchange is the one Ulysses cannot hide, since the output projection reads
its result next. Split into P head parts, part p's exchange runs beside part p + 1's attention, and the last part's
beside the projection of the ones before it, when the caller projects each part by its own rows (`HeadParts`):
out W_o = sum_p out_p W_o[rows_p]. The same bytes move, in P all-to-alls of 1/P the size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmdkit.errors import SpmdkitError
from spmdkit.kernels.attention_block import check_qkv
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.kernels.blockwise_attention import blockwise_attention
from spmdkit.parallel.context.exchange import gather_seq, kv_repeat, to_heads, to_seq
from spmdkit.parallel.nested_region import nested_region

# kernel(q, k, v, segment_ids, spec) on one device's arrays: q [b, s, h, d], k and v [b, s, kv, d] (the whole
# sequence), segment ids [b, s] or None.
LocalKernel = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None, AttentionSpec], jax.Array]

__all__ = ["HeadParts", "UlyssesLayout", "choose_parts", "ulysses_attention"]


@dataclasses.dataclass(frozen=True)
class HeadParts:
    """Attention's output [batch, seq, heads, head_dim] as P = `len(parts)` arrays [batch, seq, heads / P, head_dim]
    (seq over context, heads over the tensor axes, like the whole), exchanged one after another. `split` = (T, C):
    the heads' tensor and context factors. Part p holds, in order, the heads t h/T + c h/(T C) + p n + i (t < T,
    c < C, i < n = h / (T C P)): device c attended heads c h/(T C) .. of its tensor shard, cut in P parts."""

    parts: tuple[jax.Array, ...]
    split: tuple[int, int]

    def rows(self, w: jax.Array) -> tuple[jax.Array, ...]:
        """w [heads, ...] (a projection's input heads first) -> each part's rows [heads / parts, ...]."""
        T, C = self.split
        n = w.shape[0] // (T * C * len(self.parts))
        tiled = w.reshape(T, C, len(self.parts), n, *w.shape[1:])
        return tuple(tiled[:, :, p].reshape(T * C * n, *w.shape[1:]) for p in range(len(self.parts)))


def exchanged_heads(heads: int, kv_heads: int, tensor: int, context: int) -> tuple[int, int]:
    """(query heads, kv heads) one device attends after the exchange: kv heads that do not split over `tensor` are
    repeated to the query heads first (as the model's kernel table does), then `kv_repeat` times for `context`."""
    kv = kv_heads if kv_heads % tensor == 0 else heads
    repeat = kv_repeat(kv // tensor, heads // tensor, context)
    return heads // (tensor * context), kv // tensor * repeat // context


def part_refusal(heads: int, kv_heads: int, parts: int) -> str | None:
    """Why a device's `heads` query heads (reading `kv_heads` kv heads) cannot be cut into `parts` parts that each
    read whole kv heads, or None when they can."""
    if parts < 1 or heads % parts:
        return f"the {heads} heads each device attends do not split into {parts} parts"
    size, group = heads // parts, heads // kv_heads
    if size % group and group % size:
        return f"parts of {size} heads cut the {group} query heads that share a kv head"
    return None


def choose_parts(
    requested: int, heads: int, kv_heads: int, tensor: int, context: int, blocker: str | None = None
) -> int:  # fmt: skip
    """The head parts Ulysses exchanges attention's output in (`ulysses_attention`'s `parts`). `requested`: 0 (auto:
    2 where the heads allow and nothing blocks, else 1), 1 (whole) or P; `blocker`: why the output projection cannot
    take parts (it is not one plain einsum: FP8, LoRA on it, --overlap-tp), or None. An explicit P > 1 that cannot
    run raises SpmdkitError."""
    if requested == 1:
        return 1
    mine, kv = exchanged_heads(heads, kv_heads, tensor, context)
    reason = blocker or part_refusal(mine, kv, requested or 2)
    if reason is None:
        return requested or 2
    if requested == 0:
        return 1
    raise SpmdkitError(f"--model.ulysses-parts {requested}: {reason}: use 1 (or 0, auto)")


@dataclasses.dataclass(frozen=True)
class UlyssesLayout:
    """Which mesh axes Ulysses splits: the sequence over `axis_name` (natural order), batch over `batch_axes`, heads
    and kv heads over `heads_axes` (major to minor). Axes absent from the mesh, of size 1 or already manual are
    dropped."""

    axis_name: str = "context"
    batch_axes: tuple[str, ...] = ("data", "fsdp")
    heads_axes: tuple[str, ...] = ("tensor",)


def _kv_part(part: int, size: int, group: int) -> slice:
    """The kv heads the query heads [part x size, (part + 1) x size) read, `group` query heads per kv head (a part
    holds whole groups, or lies inside one: `part_refusal`)."""
    first = part * size // group
    return slice(first, first + max(size // group, 1))


def _local_program(
    q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None = None, sinks: jax.Array | None = None, *,
    axis: str, repeat: int, local: LocalKernel, spec: AttentionSpec, parts: int = 1,
) -> tuple[jax.Array, ...]:  # fmt: skip
    """Per device: [b, s/C, h, d] in, exchange, `local` over [b, s, h/C, d], exchange back, in `parts` head parts
    (a tuple of [b, s/C, h/parts, d]); `sinks` [h] (this device's heads before the exchange) are cut to the h/C
    heads it attends after it."""
    if repeat > 1:
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    C = lax.axis_size(axis)
    q, k, v = (to_heads(x, axis, C) for x in (q, k, v))
    seg = None if seg is None else gather_seq(seg, axis, C)
    if sinks is not None:
        sinks = lax.dynamic_slice_in_dim(sinks, lax.axis_index(axis) * q.shape[2], q.shape[2])  # to_heads' chunk
    size, group = q.shape[2] // parts, q.shape[2] // k.shape[2]
    outs = []
    for part in range(parts):
        heads, kv = slice(part * size, (part + 1) * size), _kv_part(part, size, group)
        extra = () if sinks is None else (sinks[heads],)
        out = local(q[:, :, heads], k[:, :, kv], v[:, :, kv], seg, spec, *extra)
        outs.append(to_seq(out, axis, C))
    return tuple(outs)


def _split(mesh: Mesh, axes: tuple[str, ...], manual: set[str]) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh.shape.get(a, 1) > 1 and a not in manual)


def _check(q: jax.Array, k: jax.Array, mesh: Mesh, batch: tuple[str, ...], heads: tuple[str, ...], axis: str) -> None:
    """One SpmdkitError line unless seq splits over the context axis, batch over its axes, heads over heads x
    context and kv heads over the heads axes."""
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    C, T = mesh.shape[axis], size(heads)
    if q.shape[1] % C:
        raise SpmdkitError(f"Ulysses: seq={q.shape[1]} is not divisible by context={C}: change --seq-len")
    if q.shape[0] % size(batch):
        raise SpmdkitError(f"Ulysses: batch={q.shape[0]} does not split over mesh axes {batch}: change the batch")
    if q.shape[2] % (T * C):
        raise SpmdkitError(
            f"Ulysses: heads={q.shape[2]} are not divisible by tensor x context = {T * C}: use --context-parallel "
            "ring, or a smaller context axis"
        )
    if k.shape[2] % T:
        raise SpmdkitError(f"Ulysses: kv_heads={k.shape[2]} do not split over {heads} ({T}): repeat them first")


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    spec: AttentionSpec | None = None,
    *,
    mesh: Mesh,
    layout: UlyssesLayout = UlyssesLayout(),
    local: LocalKernel = blockwise_attention,
    sinks: jax.Array | None = None,
    parts: int = 1,
) -> jax.Array | HeadParts:
    """Attention with the sequence sharded over `layout.axis_name`, by two all-to-alls around `local`.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim] (GQA: heads a multiple of kv_heads);
    segment_ids int32 [batch, seq] or None (0 padding, 1, 2, ...: packed documents); `spec` as every kernel's
    (`AttentionSpec`; None: causal). Sharding: seq over the context axis in natural order (not zigzag), batch over
    `layout.batch_axes`, heads and kv heads over `layout.heads_axes`. Returns [batch, seq, heads, head_dim] in q's
    dtype and layout. `local` runs per device on the whole sequence and heads / (T x C) heads (default: the
    blockwise kernel). The region is manual over every mesh axis not already manual, so a fused kernel (cuDNN)
    inside it is per device; inside a partly manual region it nests there (`spmdkit.parallel.nested_region`).
    Gradients: JAX's transpose of the all-to-alls around `local`'s own. `sinks` [heads] (GPT-OSS; split like the
    heads): `local` then takes its heads' sinks as a sixth argument. `parts` > 1: the output as `HeadParts`, `local`
    run once per part (the module doc).
    """
    check_qkv(q, k, v, "Ulysses attention", segment_ids)
    spec = (spec or AttentionSpec()).resolved(q.shape[3], q.shape[1])
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    axis = layout.axis_name
    if axis not in mesh.shape or axis in manual:
        raise SpmdkitError(f"Ulysses: context axis {axis!r} is not a free axis of the mesh {dict(mesh.shape)}")
    batch, heads = _split(mesh, layout.batch_axes, manual), _split(mesh, layout.heads_axes, manual)
    batch, heads = tuple(a for a in batch if a != axis), tuple(a for a in heads if a != axis)
    _check(q, k, mesh, batch, heads, axis)
    C, T = mesh.shape[axis], math.prod(mesh.shape[a] for a in heads)
    repeat = kv_repeat(k.shape[2] // T, q.shape[2] // T, C)
    if parts > 1 and (reason := part_refusal(*exchanged_heads(q.shape[2], k.shape[2], T, C), parts)):
        raise SpmdkitError(f"Ulysses: {reason}")
    tokens = P(batch or None, axis, heads or None, None)
    outs = tuple([tokens] * parts) if parts > 1 else tokens
    extra = {name: (x, spec) for name, x, spec in (("seg", segment_ids, P(batch or None, axis)),
                                                   ("sinks", sinks, P(heads or None))) if x is not None}  # fmt: skip
    args, specs = (q, k, v, *(x for x, _ in extra.values())), (tokens, tokens, tokens, *(s for _, s in extra.values()))

    def program(q: jax.Array, k: jax.Array, v: jax.Array, *given: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
        named = dict(zip(extra, given, strict=True))
        outs = _local_program(q, k, v, named.get("seg"), named.get("sinks"), axis=axis, repeat=repeat, local=local,
                              spec=spec, parts=parts)  # fmt: skip
        return outs if parts > 1 else outs[0]

    free = {a for a in mesh.axis_names if a not in manual}
    with jax.named_scope("ulysses"):  # names its all-to-alls in the compiled program (`spmdkit compile` reads it)
        if manual:  # inside a partly manual region (accumulation over replica axes): a nested region
            out = nested_region(program, specs, outs, free, *args)
        else:  # check_vma=False: a fused kernel's custom call (cuDNN) does not declare how it varies
            region = jax.shard_map(program, mesh=mesh, in_specs=specs, out_specs=outs, axis_names=free, check_vma=False)
            out = region(*args)
    return HeadParts(out, (T, C)) if parts > 1 else out
