"""Attention kernels: softmax(q k^T * scale) v with grouped-query heads, one table of them, and `attend`.

Every kernel is `kernel(q, k, v, segment_ids, spec)`: q [batch, seq, heads, head_dim] and k, v [batch, seq,
kv_heads, head_dim] (heads = kv_heads x group; K/V are never repeated), `segment_ids` int32 [batch, seq] or None
(0: padding, 1, 2, ...: the documents packed in a row; a query sees keys of its own document only, padding sees
nothing and gets output 0) and `spec` (`spmdkit.kernels.attention_spec.AttentionSpec`: causal, window, scale,
softcap, block sizes; None: causal, the defaults). They return [batch, seq, heads, head_dim] in q's dtype, with
scores and softmax statistics in float32, and give the same numbers. `dot`, `blockwise`, `ring` and Ulysses around
dot or blockwise also take `sinks` [heads] (GPT-OSS: a logit per head in every softmax denominator); cuDNN cannot,
and `choose_attention` keeps a model with sinks off it.

- `dot_attention`: the reference; materialises the scores [batch, kv_heads, group, seq, seq].
- `blockwise_attention` (`spmdkit.kernels.blockwise_attention`): online softmax over key blocks with a
  recomputing custom VJP; O(seq) memory per head, causal blocks above the diagonal skipped.
- `cudnn_attention`: cuDNN's fused kernel, `jax.nn.dot_product_attention(implementation="cudnn")`, run per device
  inside a `shard_map` over the batch and head axes of the active rules (its partitioner refuses a sharded
  sequence or head dim). Segment ids become a dense [seq, seq] mask there (cuDNN's public API has no packed
  documents): O(seq^2) bytes per sequence, where `blockwise` keeps O(seq). No soft cap.
- `context_attention`: ring attention (`spmdkit.parallel.context`) over the `context` mesh axis of the active
  rules, seq sharded over it in the zigzag layout (the data path permutes every per-token array of a batch once,
  `zigzag_batch`, and RoPE positions travel with their tokens; the token-mean loss does not depend on token order).

- `ulysses_<kernel>`: Ulysses context parallelism (`spmdkit.parallel.context.ulysses`): all-to-alls over the
  `context` axis turn the sequence split (natural order) into a head split, and `<kernel>` (dot, blockwise, or
  cuDNN's fused kernel) attends the whole sequence per device. With `parts` > 1 it returns the output as
  `HeadParts`, exchanged part by part, for `spmdkit.models.layers.Attention.out` to project part by part.

`KERNEL_TABLE` maps each kind (dot, blockwise, cudnn, ring, ulysses_*) to its kernel. `attend(q, k, v, kind,
segment_ids, spec)` runs the kernel the model config names: `spmdkit.train.step.program.build_program` has
resolved it for the run's devices (`spmdkit.models.attention_choice.choose_attention`). Nothing here reads the
platform: a model
traced with "auto" outside a program runs the choice the mesh in force alone makes (ring under a context axis,
else blockwise), the same program on every platform.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from spmdkit.errors import SpmdkitError
from spmdkit.kernels.attention_block import grouped_scores, grouped_values, visible, with_sinks
from spmdkit.kernels.attention_spec import AttentionSpec, ring_key_tile
from spmdkit.kernels.blockwise_attention import blockwise_attention
from spmdkit.models.attention_choice import ULYSSES, choose_attention
from spmdkit.parallel.context.ring_attention import RingLayout, ring_attention
from spmdkit.parallel.context.ulysses import HeadParts, UlyssesLayout, ulysses_attention
from spmdkit.parallel.nested_region import nested_region
from spmdkit.sharding.logical import active_rules

__all__ = [
    "KERNEL_TABLE", "AttentionSpec", "attend", "blockwise_attention", "context_attention", "cudnn_attention",
    "dot_attention",
]  # fmt: skip


def _document_mask(segment_ids: jax.Array, causal: bool, window: int = 0) -> jax.Array:
    """bool [batch, seq, seq]: query i sees key j (same document, not padding; causal: j <= i; window: j > i - W)."""
    pos = jnp.arange(segment_ids.shape[1])
    return visible(pos, pos, causal=causal, window=window, q_seg=segment_ids, k_seg=segment_ids)


def dot_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T * scale) v with grouped-query heads, K/V never repeated, every score held.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim]; heads = kv_heads x group; any
    sharding of batch and heads (the compiler's). Scores and softmax in float32. Returns [batch, seq, heads,
    head_dim] in q's dtype. With `segment_ids` [batch, seq], rows that see no key (padding) give 0 and pass no
    gradient. `spec`: the module doc. `sinks` [heads] float32: a logit per head joins each row's denominator.
    """
    spec = (spec or AttentionSpec()).resolved(q.shape[3], q.shape[1])
    scores = grouped_scores(q, k, spec.scale, spec.softcap)
    if segment_ids is not None:
        scores = jnp.where(_document_mask(segment_ids, spec.causal, spec.window)[:, None, None], scores, -jnp.inf)
    elif spec.causal:
        pos = jnp.arange(q.shape[1])
        scores = jnp.where(visible(pos, pos, causal=True, window=spec.window), scores, -jnp.inf)
    if sinks is not None:  # every row sees its sink: no row is empty
        probs = jax.nn.softmax(with_sinks(scores, sinks), axis=-1)[..., :-1].astype(v.dtype)
    elif segment_ids is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:
        top = jax.lax.stop_gradient(scores.max(-1, keepdims=True))
        weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))  # masked: exp(-inf) = 0
        total = weights.sum(-1, keepdims=True)
        probs = (weights / jnp.where(total > 0, total, 1.0)).astype(v.dtype)
    return grouped_values(probs, v)


def context_size() -> int:
    """Size of the `context` axis of the mesh in force (1 without rules)."""
    active = active_rules()
    return 1 if active is None else active[1].shape.get("context", 1)


def _free_axes(axes: tuple[str, ...], mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """The mesh axes of `axes` that split something: size > 1 and not already manual (inside a shard_map)."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return tuple(a for a in axes if mesh.shape.get(a, 1) > 1 and a not in manual)


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal ring attention over `context`, with batch and head axes taken from the active rules.

    seq is sharded over `context` in the rules' ring layout (zigzag, or contiguous for a model windowed everywhere;
    segment ids too); the window counts true token positions;
    keys are scanned in tiles of `ring_key_tile(chunk)`. Requires `use_rules` to be active with a context axis > 1.
    The rules' `ulysses` factor U > 1 makes it 2D: a ring of context / U positions, Ulysses inside each.
    `sinks` [heads] join the ring's final log-sum-exp: out x exp(lse) / (exp(lse) + exp(sink)) = out x
    sigmoid(lse - sink), differentiated through the ring's out and lse.
    """
    rules, mesh = active_rules()
    heads = _free_axes(rules.params["heads"], mesh)
    tile = ring_key_tile(q.shape[1] // (2 * mesh.shape["context"] // rules.ulysses))
    spec = dataclasses.replace(spec or AttentionSpec(), key_tile=tile)
    batch = _free_axes(rules.params["batch"], mesh)
    layout = RingLayout("context", rules.ring_layout, batch, heads[0] if heads else None, rules.ulysses)
    if sinks is None:
        return ring_attention(q, k, v, segment_ids, spec, mesh=mesh, layout=layout)
    out, lse = ring_attention(q, k, v, segment_ids, spec, mesh=mesh, layout=layout, return_lse=True)
    kept = jax.nn.sigmoid(lse - sinks.astype(jnp.float32)[:, None])  # [batch, heads, seq]: rows seeing no key: 0
    return (out.astype(jnp.float32) * jnp.swapaxes(kept, 1, 2)[..., None]).astype(q.dtype)


def _split_kv_heads(
    q: jax.Array, k: jax.Array, v: jax.Array, heads: tuple[str, ...], mesh: jax.sharding.Mesh
) -> tuple[jax.Array, jax.Array]:
    """k, v as a region splitting heads over the `heads` axes takes them: as they are when their kv heads split,
    else (kv heads fewer than the axes, replicated by the rules) repeated to the query heads."""
    if k.shape[2] % math.prod(mesh.shape[a] for a in heads) == 0:
        return k, v
    group = q.shape[2] // k.shape[2]
    return jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)


def _fused_local(q, k, v, segment_ids, *, spec: AttentionSpec, implementation: str) -> jax.Array:
    """`jax.nn.dot_product_attention` on one device's shard; segment ids become a [batch, 1, seq, seq] mask.
    Its `local_window_size=(left, right)` lets query i see keys i - left <= j <= i + right: our window W is
    (W - 1, 0), which cuDNN runs as its causal `sliding_window_length` W (keys in (i - W, i])."""
    mask = None if segment_ids is None else _document_mask(segment_ids, False)[:, None]
    local = (spec.window - 1, 0) if spec.window > 0 else None
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=spec.scale, is_causal=spec.causal, local_window_size=local,
        implementation=implementation,
    )  # fmt: skip
    if segment_ids is not None:  # a fully masked row is a uniform average there: padding gives 0, no gradient
        out = jnp.where((segment_ids != 0)[..., None, None], out, jnp.zeros((), out.dtype))
    return out


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    spec: AttentionSpec | None = None,
    *,
    implementation: str = "cudnn",
) -> jax.Array:
    """cuDNN's fused attention, per device: a `shard_map` over every mesh axis not already manual, the batch split
    over the batch axes of the active rules and the heads over their head axes, whole on the rest.

    Shapes as `dot_attention`. The sequence is whole on every device (context parallelism runs ring attention);
    when the kv heads do not split over the head axes (kv_heads < tensor), K/V are repeated to the query heads
    first. The region spans all free axes, size-1 ones included: cuDNN's custom partitioner fails inside a
    `shard_map` that leaves some mesh axes automatic (`get_num_ways_dim_sharded` AssertionError in XLA:GPU's SPMD
    partitioner). Inside a partly manual region (pipeline stages, accumulation over replica axes) that region nests
    in it (`spmdkit.parallel.nested_region`). `implementation="xla"` runs the same wrapper with JAX's XLA attention
    (CPU tests).
    `spec` as the module doc; cuDNN has no logit soft cap, so a spec's `softcap` > 0 raises SpmdkitError.
    """
    spec = (spec or AttentionSpec()).resolved(q.shape[3], q.shape[1])
    if spec.softcap:
        raise SpmdkitError(f"cuDNN attention has no logit soft-capping (softcap={spec.softcap}): use blockwise")
    kernel = functools.partial(_fused_local, spec=spec, implementation=implementation)
    active = active_rules()
    if active is None:
        return kernel(q, k, v, segment_ids)
    rules, mesh = active
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    free = tuple(a for a in mesh.axis_names if a not in manual)
    if not free:  # already per device (inside a shard_map over every axis)
        return kernel(q, k, v, segment_ids)
    batch, heads = _free_axes(rules.params["batch"], mesh), _free_axes(rules.params["heads"], mesh)
    for what, size, axes in (("batch", q.shape[0], batch), ("heads", q.shape[2], heads)):
        if size % math.prod(mesh.shape[a] for a in axes):
            raise SpmdkitError(f"cuDNN attention: {what}={size} does not split over mesh axes {axes}: change it")
    k, v = _split_kv_heads(q, k, v, heads, mesh)
    tokens = PartitionSpec(batch or None, None, heads or None, None)
    args, specs = (q, k, v), (tokens, tokens, tokens)
    if segment_ids is not None:
        args, specs = (*args, segment_ids), (*specs, PartitionSpec(batch or None, None))

    def local(q: jax.Array, k: jax.Array, v: jax.Array, *segments: jax.Array) -> jax.Array:
        return kernel(q, k, v, segments[0] if segments else None)

    if manual:  # a partly manual region (pipeline stages, accumulation over replica axes): nested regions
        return nested_region(local, specs, tokens, set(free), *args)
    # check_vma=False: no collective runs inside, and the cuDNN custom call does not declare how it varies.
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=tokens, axis_names=set(free), check_vma=False)(
        *args
    )


def _ulysses(local: Any) -> Any:
    """The kernel that runs `local` per device under Ulysses over `context` (`spmdkit.parallel.context.ulysses`),
    batch and head axes taken from the active rules; seq sharded over `context` in natural order."""

    def kernel(
        q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Any = None, spec: Any = None, sinks: Any = None,
        parts: int = 1,
    ) -> jax.Array | HeadParts:  # fmt: skip
        rules, mesh = active_rules()
        batch, heads = _free_axes(rules.params["batch"], mesh), _free_axes(rules.params["heads"], mesh)
        k, v = _split_kv_heads(q, k, v, heads, mesh)
        layout = UlyssesLayout("context", batch, heads)
        return ulysses_attention(
            q, k, v, segment_ids, spec, mesh=mesh, layout=layout, local=local, sinks=sinks, parts=parts
        )

    return kernel


KERNEL_TABLE = {
    "dot": dot_attention,
    "blockwise": blockwise_attention,
    "cudnn": cudnn_attention,
    "ring": context_attention,
    "ulysses_dot": _ulysses(dot_attention),
    "ulysses_blockwise": _ulysses(blockwise_attention),
    "ulysses_cudnn": _ulysses(lambda q, k, v, seg, spec: _fused_local(q, k, v, seg, spec=spec, implementation="cudnn")),
}


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kind: str,
    segment_ids: jax.Array | None = None,
    spec: AttentionSpec | None = None,
    sinks: jax.Array | None = None,
    parts: int = 1,
) -> jax.Array | HeadParts:
    """The kernel `kind` names (`KERNEL_TABLE`) on q, k, v, segment ids, spec and sinks (the module doc). "auto"
    runs ring attention under a context axis > 1 in the mesh in force, else blockwise; a kind that cannot split the
    sequence as the mesh does, or take the sinks, raises SpmdkitError (`choose_attention`, no platform known).
    `parts` > 1 (Ulysses kinds only): the output as Ulysses' `HeadParts`, for a projection part by part."""
    softcap = spec.softcap if spec else 0.0
    kernel = choose_attention(
        kind, context=context_size(), platform=None, dtype=q.dtype.name, head_dim=q.shape[3], softcap=softcap,
        sinks=sinks is not None,
    )  # fmt: skip
    if parts > 1:
        if kernel not in ULYSSES:
            raise SpmdkitError(f"attention output parts ({parts}) need a Ulysses kernel, not {kernel}: set parts 1")
        return KERNEL_TABLE[kernel](q, k, v, segment_ids, spec, sinks, parts=parts)
    if sinks is None:
        return KERNEL_TABLE[kernel](q, k, v, segment_ids, spec)
    return KERNEL_TABLE[kernel](q, k, v, segment_ids, spec, sinks)
