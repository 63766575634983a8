"""Attention kernels: softmax(q k^T / sqrt(head_dim)) v with grouped-query heads, and which one runs.

Every kernel also takes the options of the 2026 model families, with one meaning everywhere: `window` W > 0
(sliding-window attention: a query at position i sees keys i - W < j <= i, W keys including itself; 0: unlimited),
`scale` (the multiplier of q k^T; None: 1/sqrt(head_dim)) and `softcap` c > 0 (Gemma 2's logit soft cap: scores s
become c tanh(s / c) before masking and softmax; 0: off). cuDNN has no soft cap: `choose_attention` never picks it
then.

All kernels take q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim] (heads = kv_heads x
group; K/V are never repeated) and optional `segment_ids` int32 [batch, seq] (0: padding, 1, 2, ...: the documents
packed in a row; a query sees keys of its own document only, padding sees nothing and gets output 0). They return
[batch, seq, heads, head_dim] in q's dtype, with scores and softmax statistics in float32.

- `dot_attention`: the reference; materialises the scores [batch, kv_heads, group, seq, seq].
- `blockwise_attention` (`spmdkit.kernels.blockwise_attention`): online softmax over key blocks with a
  recomputing custom VJP; O(seq) memory per head, causal blocks above the diagonal skipped.
- `cudnn_attention`: cuDNN's fused kernel, `jax.nn.dot_product_attention(implementation="cudnn")`, run per device
  inside a `shard_map` over the batch and head axes of the active rules (its partitioner refuses a sharded
  sequence or head dim). Segment ids become a dense [seq, seq] mask there (cuDNN's public API has no packed
  documents): O(seq^2) bytes per sequence, where `blockwise` keeps O(seq).
- `context_attention`: ring attention (`spmdkit.parallel.context`) over the `context` mesh axis of the active
  rules, in the zigzag layout (the data path permutes every per-token array of a batch once, `zigzag_batch`, and
  RoPE positions travel with their tokens; the token-mean loss does not depend on token order).

`attend(q, k, v, kind, segment_ids)` runs the kernel `spmdkit.models.attention_choice.choose_attention` picks for
the model's `attention` setting (auto, dot, blockwise, cudnn, ring) on the mesh and platform in force.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from spmdkit.errors import SpmdkitError
from spmdkit.kernels.attention_block import check_attention_options, grouped_scores, grouped_values, visible
from spmdkit.kernels.blockwise_attention import BLOCK_Q, blockwise_attention
from spmdkit.models.attention_choice import choose_attention
from spmdkit.models.cpu_layout import mesh_device
from spmdkit.models.device_facts import compute_capability, device_platform
from spmdkit.parallel.context.ring_attention import ring_attention
from spmdkit.sharding.logical import active_rules

__all__ = [
    "attend", "blockwise_attention", "context_attention", "cudnn_attention", "device_platform", "dot_attention",
    "platform",
]  # fmt: skip

KEY_TILE = 512  # keys per tile inside a ring chunk pair: bounds attention scratch at long context


def _document_mask(segment_ids: jax.Array, causal: bool, window: int = 0) -> jax.Array:
    """bool [batch, seq, seq]: query i sees key j (same document, not padding; causal: j <= i; window: j > i - W)."""
    pos = jnp.arange(segment_ids.shape[1])
    return visible(pos, pos, causal=causal, window=window, q_seg=segment_ids, k_seg=segment_ids)


def dot_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    *,
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
) -> jax.Array:
    """softmax(q k^T * scale) v with grouped-query heads, K/V never repeated.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim]; heads = kv_heads x group.
    Scores and softmax in float32. Returns [batch, seq, heads, head_dim] in q's dtype. With `segment_ids`
    [batch, seq], rows that see no key (padding) give 0 and pass no gradient. `window`, `scale`, `softcap`: the
    module doc (window needs causal).
    """
    scale = check_attention_options(window, scale, softcap, causal, q.shape[3], "dot attention")
    scores = grouped_scores(q, k, scale, softcap)
    if segment_ids is None:
        if causal:
            pos = jnp.arange(q.shape[1])
            scores = jnp.where(visible(pos, pos, causal=True, window=window), scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:
        mask = _document_mask(segment_ids, causal, window)[:, None, None]
        scores = jnp.where(mask, scores, -jnp.inf)
        top = jax.lax.stop_gradient(scores.max(-1, keepdims=True))
        weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))  # masked: exp(-inf) = 0
        total = weights.sum(-1, keepdims=True)
        probs = (weights / jnp.where(total > 0, total, 1.0)).astype(v.dtype)
    return grouped_values(probs, v)


def platform() -> str:
    """Where the model runs: the platform (`device_platform`) of the mesh in force, else of JAX's first device."""
    return device_platform(mesh_device())


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
    *,
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
) -> jax.Array:
    """Causal ring attention over `context`, with batch and head axes taken from the active rules.

    seq is sharded over `context` in the zigzag layout (segment ids too); `window` counts true token positions.
    Requires `use_rules` to be active with a context axis > 1.
    """
    rules, mesh = active_rules()
    heads = _free_axes(rules.params["heads"], mesh)
    chunk = q.shape[1] // (2 * mesh.shape["context"])
    tile = KEY_TILE if chunk % KEY_TILE == 0 and chunk > KEY_TILE else None
    return ring_attention(
        q,
        k,
        v,
        mesh=mesh,
        axis_name="context",
        causal=True,
        load_balance="zigzag",
        batch_axes=_free_axes(rules.params["batch"], mesh),
        heads_axis=heads[0] if heads else None,
        key_tile=tile,
        segment_ids=segment_ids,
        window=window,
        scale=scale,
        softcap=softcap,
    )


def _fused_local(q, k, v, segment_ids, *, causal: bool, implementation: str, window: int, scale) -> jax.Array:
    """`jax.nn.dot_product_attention` on one device's shard; segment ids become a [batch, 1, seq, seq] mask.
    Its `local_window_size=(left, right)` lets query i see keys i - left <= j <= i + right: our window W is
    (W - 1, 0), which cuDNN runs as its causal `sliding_window_length` W (keys in (i - W, i])."""
    mask = None if segment_ids is None else _document_mask(segment_ids, False)[:, None]
    local = (window - 1, 0) if window > 0 else None
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=causal, local_window_size=local, implementation=implementation
    )
    if segment_ids is not None:  # a fully masked row is a uniform average there: padding gives 0, no gradient
        out = jnp.where((segment_ids != 0)[..., None, None], out, jnp.zeros((), out.dtype))
    return out


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    implementation: str = "cudnn",
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
) -> jax.Array:
    """cuDNN's fused attention, per device: a `shard_map` over every mesh axis not already manual, the batch split
    over the batch axes of the active rules and the heads over their head axes, whole on the rest.

    Shapes as `dot_attention`. The sequence is whole on every device (context parallelism runs ring attention);
    when the kv heads do not split over the head axes (kv_heads < tensor), K/V are repeated to the query heads
    first. The region spans all free axes, size-1 ones included: cuDNN's custom partitioner fails inside a
    `shard_map` that leaves some mesh axes automatic (`get_num_ways_dim_sharded` AssertionError in XLA:GPU's SPMD
    partitioner). Inside a partly manual region (pipeline stages, accumulation over replica axes) that region nests
    in it (`_nested_cudnn`). `implementation="xla"` runs the same wrapper with JAX's XLA attention (CPU tests).
    `window` and `scale` as the module doc; cuDNN has no logit soft cap, so `softcap` > 0 raises SpmdkitError.
    """
    if softcap:
        raise SpmdkitError(f"cuDNN attention has no logit soft-capping (softcap={softcap}): use the blockwise kernel")
    scale = check_attention_options(window, scale, softcap, causal, q.shape[3], "cuDNN attention")
    window = window if window < q.shape[1] else 0
    kernel = functools.partial(_fused_local, causal=causal, implementation=implementation, window=window, scale=scale)
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
    if k.shape[2] % math.prod(mesh.shape[a] for a in heads):
        group = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    tokens = PartitionSpec(batch or None, None, heads or None, None)
    args, specs = (q, k, v), (tokens, tokens, tokens)
    if segment_ids is not None:
        args, specs = (*args, segment_ids), (*specs, PartitionSpec(batch or None, None))

    def local(q: jax.Array, k: jax.Array, v: jax.Array, *segments: jax.Array) -> jax.Array:
        return kernel(q, k, v, segments[0] if segments else None)

    if manual:  # a partly manual region (pipeline stages, accumulation over replica axes): nested regions
        return _nested_cudnn(local, specs, tokens, set(free), *args)
    # check_vma=False: no collective runs inside, and the cuDNN custom call does not declare how it varies.
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=tokens, axis_names=set(free), check_vma=False)(
        *args
    )


def _varying(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes `x` varies over (its type's, JAX >= 0.11)."""
    return jax.typeof(x).manual_axis_type.varying


def _varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` typed as varying over the manual axes `like` varies over (a type cast: nothing moves)."""
    missing = tuple(sorted(_varying(like) - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _nested_cudnn(local: Any, specs: tuple, out_spec: PartitionSpec, free: set[str], *args: jax.Array) -> jax.Array:
    """`local(*args)` inside a partly manual region, manual over the `free` axes too: a `shard_map` nested over
    the context's abstract mesh for the forward, and another for the backward, which takes the kernel's vjp per
    device (JAX's transpose of a nested check_vma=False region drops the cotangents' varying axes and fails its
    own check, `docs/jax-limits.md`); the backward recomputes the forward kernel for its statistics. Output and
    cotangents are typed as varying over the manual axes the inputs vary over."""
    nested = functools.partial(jax.shard_map, mesh=jax.sharding.get_abstract_mesh(), axis_names=free)
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))

    def local_backward(*inputs: jax.Array) -> tuple[jax.Array, ...]:
        *primals, ct = inputs

        def call(*diff: jax.Array) -> jax.Array:
            full = list(primals)
            for i, a in zip(floats, diff, strict=True):
                full[i] = a
            return local(*full)

        return jax.vjp(call, *(primals[i] for i in floats))[1](ct)

    @jax.custom_vjp
    def typed(*inputs: jax.Array) -> jax.Array:
        out = nested(local, in_specs=specs, out_specs=out_spec, check_vma=False)(*inputs)
        return _varying_like(out, inputs[floats[0]])

    def forward(*inputs: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return typed(*inputs), inputs

    def backward(inputs: tuple[jax.Array, ...], ct: jax.Array) -> tuple[jax.Array | None, ...]:
        region = nested(local_backward, in_specs=(*specs, out_spec), out_specs=tuple(specs[i] for i in floats))
        grads = dict(zip(floats, region(*inputs, ct), strict=True))
        return tuple(_varying_like(grads[i], a) if i in grads else None for i, a in enumerate(inputs))

    typed.defvjp(forward, backward)
    return typed(*args)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kind: str,
    segment_ids: jax.Array | None = None,
    *,
    block: int = BLOCK_Q,
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
) -> jax.Array:
    """Causal attention with the kernel `choose_attention` picks for the setting `kind` here (mesh, platform,
    dtype, head_dim, soft cap); an explicit kind that cannot run raises SpmdkitError. `block`: the blockwise
    kernel's query and key block size. `window` (0: unlimited), `scale` (None: 1/sqrt(head_dim)), `softcap`
    (0: off): the module doc; every kernel gives the same numbers."""
    device = mesh_device()
    # A kernel a program chose, traced with no mesh in force (a pipeline's per-device shape check before its
    # shard_map), runs on the program's devices, not on JAX's first: its platform is not checked again there.
    platform = device_platform(device) if kind == "auto" or active_rules() is not None else None
    kernel = choose_attention(
        kind, context=context_size(), platform=platform, dtype=q.dtype.name, head_dim=q.shape[3],
        compute_capability=compute_capability(device), softcap=softcap,
    )  # fmt: skip
    options = {"window": window, "scale": scale, "softcap": softcap}
    if kernel == "ring":
        return context_attention(q, k, v, segment_ids, **options)
    if kernel == "cudnn":
        return cudnn_attention(q, k, v, segment_ids=segment_ids, **options)
    if kernel == "blockwise":
        return blockwise_attention(q, k, v, segment_ids=segment_ids, block_q=block, block_k=block, **options)
    return dot_attention(q, k, v, segment_ids=segment_ids, **options)
