"""Pipeline parallelism in `jax.shard_map`: loss and gradients of a layer stack cut into stages over `pipeline`.

The program follows a `Schedule` table (see `pipeline_schedule`): one rolled `lax.fori_loop` over ticks; each
tick a stage reads its row `table[t, axis_index(pipeline)]`, stores the messages that arrived into their slots,
runs `lax.switch` over idle / forward / backward (/ backward of the last chunk, which adds the loss) on the
branch `Schedule.branch_table()` gives it (under the named scope `TICK_SCOPE`, where the FLOPs count finds it), then
sends its activation to the next stage and its cotangent to the previous one with two `ppermute`s that are
outside the branches (every stage sends every tick; idle ticks send zeros).

Where the ends of the model live, and why:
- The embedding (`embed_fn`, optional) runs on stage 0 inside global chunk 0: its forward tick embeds the raw
  microbatch (e.g. int token ids), and its backward recomputes the lookup and accumulates d `embed_params`.
  So the only M-sized values are the raw `inputs` (small, and arguments rather than temporaries), and the
  embedding's gradient is a table-sized accumulator instead of an `[M, microbatch/D, ...]` d loss / d inputs
  buffer that would grow with M. Without `embed_fn`, `inputs` are chunk 0's activations and their gradient
  is returned, which needs that M-sized accumulator.
- The head (`loss_fn`) runs on the last stage, fused into the last chunk: its backward tick evaluates chunk,
  head and loss under one `jax.vjp`, so the loss cotangent starts there and nothing else is kept for it.
- `embed_params` and `head_params` are replicated over `pipeline` (only stage 0 / the last stage use them);
  their gradients are psum-ed over all manual axes after the loop, so every stage sees the same values.

Schedules:
- "1f1b" / "interleaved": the backward is run by hand. A backward recomputes its chunk's forward from the
  stashed stage input with `jax.vjp` and applies the cotangent that arrived (or, for the last chunk, the loss
  cotangent; the last chunk's forward tick is then skipped at run time, as nothing consumes its output).
  Memory: `num_stash_slots` stage inputs (<= P for 1f1b), `num_grad_slots` cotangents and one chunk's
  activations, plus constant-size gradient accumulators: flat in M with `embed_fn`. Without it add the
  d loss / d inputs accumulator (as large as `inputs`, the one M-sized buffer).
- "gpipe": `jax.value_and_grad` through a forward loop over the forward ticks of the table; autodiff keeps
  every tick's activations (all M microbatches), or only the stage inputs with `remat=True`.

Layouts (P = pipeline size, v = virtual stages, L layers, C = P*v chunks of Lc = L/C layers):
- `stage_params` leaves are `[L, ...]`, the layer dim sharded over `pipeline`, so stage s holds the layer rows
  `[s*L/P, (s+1)*L/P)`. Inside them local chunk j is rows `[j*Lc, (j+1)*Lc)` and runs as global chunk j*P+s.
  With v=1 this is the model's layer order; with v>1 put the model-order stack through `interleave_layers`
  first (stage s then holds model chunks s, s+P, ..., s+(v-1)P) and bring gradients back with
  `deinterleave_layers`.
- `inputs` `[M, microbatch, ...]` (raw inputs of `embed_fn`, e.g. token ids; without it the activations
  entering chunk 0), replicated over `pipeline`, the microbatch dim sharded over `batch_axes` (manual inside
  the shard_map, so data parallelism is real); `targets` `[M, microbatch, ...]` likewise. Other mesh axes
  (e.g. `tensor`) stay automatic inside the shard_map (`axis_names=`): arrays sharded over them keep that
  sharding and GSPMD partitions `stage_fn` (e.g. MLP weights sharded over `tensor` give Megatron-style
  all-reduces inside the stages).
- Outputs: loss replicated; stage grads sharded like `stage_params`; head grads and embed grads replicated
  (psum over pipeline and batch axes); without `embed_fn` input grads like `inputs` (psum over pipeline:
  only stage 0 has them).
- Loss = mean over microbatches and batch shards of `loss_fn` = the full-batch mean when all microbatches and
  shards are equal-sized. Gradients are reduced once after the loop: a psum over `batch_axes` (parameters
  are made varying over them before the loop, so `jax.vjp` inserts no per-tick all-reduce).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmdkit.errors import SpmdkitError
from spmdkit.parallel.pipeline import schedule as ps
from spmdkit.parallel.pipeline.schedule import Schedule, check_layers

PyTree = Any
StageFn = Callable[[PyTree, jax.Array], jax.Array]
LossFn = Callable[[PyTree, jax.Array, PyTree], jax.Array]
EmbedFn = Callable[[PyTree, jax.Array], jax.Array]


def layer_permutation(num_layers: int, num_stages: int, virtual_stages: int) -> np.ndarray:
    """`perm[k]` = model-order layer stored at row k of the interleaved stack.

    Row k = s*(v*Lc) + j*Lc + i (stage s, local chunk j, layer i of the chunk) holds model layer (j*P+s)*Lc + i.
    """
    lc = check_layers(num_layers, num_stages, virtual_stages)
    s, j, i = np.meshgrid(np.arange(num_stages), np.arange(virtual_stages), np.arange(lc), indexing="ij")
    return ((j * num_stages + s) * lc + i).reshape(-1)


def interleave_layers(tree: PyTree, num_stages: int, virtual_stages: int) -> PyTree:
    """Model-order `[L, ...]` leaves -> the stage-major layout `pipeline_value_and_grad` expects.

    A gather over the layer dim: apply it once (at init or checkpoint load) and keep parameters and optimizer
    state in this layout, not in every step.
    """
    return jax.tree.map(lambda a: a[layer_permutation(a.shape[0], num_stages, virtual_stages)], tree)


def deinterleave_layers(tree: PyTree, num_stages: int, virtual_stages: int) -> PyTree:
    """Inverse of `interleave_layers` (e.g. for gradients or checkpoints in model order)."""
    return jax.tree.map(lambda a: a[np.argsort(layer_permutation(a.shape[0], num_stages, virtual_stages))], tree)


def to_microbatches(x: jax.Array, num_microbatches: int) -> jax.Array:
    """`[batch, ...]` -> `[M, batch/M, ...]`, microbatch m = rows m, m+M, ... .

    A batch dim sharded over the data axes stays sharded (no traffic): each shard's contiguous rows split into
    every microbatch.
    """
    if x.shape[0] % num_microbatches:
        raise SpmdkitError(
            f"batch of {x.shape[0]} rows does not split into {num_microbatches} microbatches: make the batch "
            f"a multiple of the microbatch count"
        )
    x = x.reshape(x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def from_microbatches(x: jax.Array) -> jax.Array:
    """Inverse of `to_microbatches`: `[M, batch/M, ...]` -> `[batch, ...]`."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def pipeline_value_and_grad(
    stage_fn: StageFn,
    loss_fn: LossFn,
    stage_params: PyTree,
    head_params: PyTree,
    inputs: jax.Array,
    targets: PyTree,
    *,
    mesh: Mesh,
    schedule: Schedule,
    axis_name: str = "pipeline",
    batch_axes: Sequence[str] = ("data", "fsdp"),
    remat: bool = False,
    embed_fn: EmbedFn | None = None,
    embed_params: PyTree = None,
) -> tuple[jax.Array, tuple[PyTree, PyTree, PyTree]]:
    """Mean loss and `(stage_grads, head_grads, embed_grads or input_grads)` of a pipelined layer stack.

    stage_fn(chunk_params, x) -> y: applies one chunk (leaves `[Lc, ...]`) to x `[microbatch/D, ...]`;
      y must have x's shape and dtype (D = product of the `batch_axes` sizes).
    loss_fn(head_params, y, targets_mb) -> scalar mean loss of one microbatch (runs on the last stage).
    embed_fn(embed_params, raw) -> x (optional): embeds one microbatch of `inputs` `[microbatch/D, ...]` into
      chunk 0's input x; runs on stage 0 (see the module docstring for why).
    stage_params: leaves `[L, ...]`, layer dim sharded over `axis_name` (layout in the module docstring).
    inputs: `[M, microbatch, ...]`, microbatch dim sharded over `batch_axes`. targets: `[M, microbatch, ...]`.
    Returns loss (scalar), stage_grads (as stage_params), head_grads and, with `embed_fn`, embed_grads (as
    embed_params, replicated), else input_grads (d loss / d inputs, as inputs). `remat` applies
    `jax.checkpoint` to `stage_fn` (gpipe only; 1f1b/interleaved always recompute). Call it inside `jax.jit`.
    """
    batch_axes = tuple(a for a in batch_axes if a in mesh.shape)
    if embed_fn is None and embed_params is not None:
        raise SpmdkitError("embed_params given without embed_fn: pass the embedding function as embed_fn=")
    embed_params = () if embed_params is None else embed_params  # an empty tree for shard_map
    ctx = _context(
        stage_fn, embed_fn, stage_params, embed_params, inputs, targets, mesh, schedule, axis_name, batch_axes
    )
    batch_spec = P(None, batch_axes or None)
    body = _gpipe_body if schedule.kind == "gpipe" else _manual_body
    fn = jax.shard_map(
        lambda *args: body(stage_fn, loss_fn, embed_fn, ctx, remat, *args),
        mesh=mesh,
        in_specs=(P(axis_name), P(), P(), batch_spec, batch_spec),
        out_specs=(P(), (P(axis_name), P(), batch_spec if embed_fn is None else P())),
        axis_names={axis_name, *batch_axes},
        check_vma=True,
    )
    return fn(stage_params, head_params, embed_params, inputs, targets)


class _Ctx:
    """Static facts of one call: schedule, axes, chunking, loss scale, chunk 0's input `x` (per device)."""

    def __init__(
        self, schedule: Schedule, axis: str, batch_axes: tuple[str, ...], shards: int, x: jax.ShapeDtypeStruct
    ) -> None:
        self.schedule, self.axis, self.batch_axes, self.x = schedule, axis, batch_axes, x
        self.all_axes = (axis, *batch_axes)
        self.v = schedule.virtual_stages
        self.scale = 1.0 / (schedule.num_microbatches * shards)  # loss = sum over shards and microbatches
        ring = schedule.virtual_stages > 1 or schedule.num_stages == 1
        n = schedule.num_stages
        self.fwd_perm = [(i, (i + 1) % n) for i in range(n if ring else n - 1)]
        self.bwd_perm = [((i + 1) % n, i) for i in range(n if ring else n - 1)]


def _context(stage_fn, embed_fn, stage_params, embed_params, inputs, targets, mesh, schedule, axis, batch_axes) -> _Ctx:
    """Check shapes against the mesh and schedule; raise SpmdkitError on mismatch."""
    if axis not in mesh.shape:
        raise SpmdkitError(f"mesh has no axis {axis!r}: pass axis_name= one of {', '.join(mesh.axis_names)}")
    if mesh.shape[axis] != schedule.num_stages:
        raise SpmdkitError(
            f"schedule has {schedule.num_stages} stages but mesh axis {axis}={mesh.shape[axis]}: build the "
            f"schedule with num_stages={mesh.shape[axis]}"
        )
    layers = {a.shape[0] for a in jax.tree.leaves(stage_params)}
    if len(layers) != 1:
        raise SpmdkitError(f"stage_params leaves have different layer counts {sorted(layers)}: stack all layers")
    lc = check_layers(layers.pop(), schedule.num_stages, schedule.virtual_stages)
    for name, tree in (("inputs", inputs), ("targets", targets)):
        if any(a.shape[0] != schedule.num_microbatches for a in jax.tree.leaves(tree)):
            raise SpmdkitError(
                f"{name} must be [microbatches={schedule.num_microbatches}, microbatch, ...]: use "
                f"to_microbatches(x, {schedule.num_microbatches})"
            )
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    if inputs.shape[1] % shards:
        raise SpmdkitError(
            f"microbatch of {inputs.shape[1]} rows does not split over {'x'.join(batch_axes)}={shards} "
            f"devices: make the microbatch a multiple of {shards}"
        )
    x = jax.ShapeDtypeStruct((inputs.shape[1] // shards, *inputs.shape[2:]), inputs.dtype)
    if embed_fn is not None:
        raw, x = x, jax.eval_shape(embed_fn, embed_params, x)
        if not isinstance(x, jax.ShapeDtypeStruct):
            raise SpmdkitError(f"embed_fn must map raw inputs {raw.dtype}{list(raw.shape)} to one array, got {x}")
    chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct((lc, *a.shape[1:]), a.dtype), stage_params)
    y = jax.eval_shape(stage_fn, chunk, x)
    if not isinstance(y, jax.ShapeDtypeStruct) or (y.shape, y.dtype) != (x.shape, x.dtype):
        raise SpmdkitError(
            f"stage_fn must map an activation {x.dtype}{list(x.shape)} to the same shape and dtype, got {y}: "
            f"keep the residual stream shape between stages"
        )
    return _Ctx(schedule, axis, batch_axes, shards, jax.ShapeDtypeStruct(x.shape, x.dtype))


def _vary(tree: PyTree, axes: tuple[str, ...]) -> PyTree:
    """pcast every leaf to varying over those of `axes` it is not yet varying over."""

    def one(a):
        missing = tuple(ax for ax in axes if ax not in jax.typeof(a).mat.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(one, tree)


def _prepare(ctx: _Ctx, stage_params, head, embed, inputs, targets):
    """Local `[L/P, ...]` -> `[v, Lc, ...]`; make everything varying over all manual axes."""
    chunks = jax.tree.map(lambda a: a.reshape(ctx.v, a.shape[0] // ctx.v, *a.shape[1:]), stage_params)
    return _vary((chunks, head, embed, inputs, targets), ctx.all_axes)


def _take(tree: PyTree, index: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def _put(buffer: jax.Array, index: jax.Array, value: jax.Array, when: jax.Array) -> jax.Array:
    """buffer[index] = value where `when` (index clipped to >= 0; a masked write otherwise)."""
    index = jnp.maximum(index, 0)
    old = lax.dynamic_index_in_dim(buffer, index, keepdims=False)
    return lax.dynamic_update_index_in_dim(buffer, jnp.where(when, value, old), index, 0)


def _stage_input(embed_fn, embed, inputs, row: jax.Array, other: jax.Array) -> jax.Array:
    """The op's stage input `[microbatch/D, ...]`.

    Chunk 0 reads microbatch `row[MB]` of `inputs` (through `embed_fn` if given), other chunks `other` (their
    stash slot, or what arrived this tick).
    """
    raw = lax.dynamic_index_in_dim(inputs, row[ps.MB], keepdims=False)
    if embed_fn is None:
        return jnp.where(row[ps.FIRST] == 1, raw, other)
    # A cond, not a where: only stage 0's chunk-0 ticks pay for the lookup (and, under autodiff, its transpose).
    return lax.cond(row[ps.FIRST] == 1, lambda: embed_fn(embed, raw), lambda: other)


def _first_grad(embed_fn, embed, inputs, row: jax.Array, dx: jax.Array, acc: PyTree) -> PyTree:
    """Chunk 0's backward: fold d loss / d x into `acc`, d embed (recomputing the lookup) or d inputs[mb]."""
    first = row[ps.FIRST] == 1
    if embed_fn is None:
        return _put(acc, row[ps.MB], dx, first)
    raw = lax.dynamic_index_in_dim(inputs, row[ps.MB], keepdims=False)

    def add() -> PyTree:
        _, vjp = jax.vjp(lambda e: embed_fn(e, raw), embed)
        return jax.tree.map(jnp.add, acc, vjp(dx)[0])

    return lax.cond(first, add, lambda: acc)


def _zeros(like: PyTree, ctx: _Ctx, lead: tuple[int, ...] = ()) -> PyTree:
    """Zeros (optionally with leading dims) varying over all manual axes: loop carries must be varying."""
    return _vary(jax.tree.map(lambda a: jnp.zeros(lead + a.shape, a.dtype), like), ctx.all_axes)


def _manual_body(stage_fn, loss_fn, embed_fn, ctx: _Ctx, remat, stage_params, head, embed, inputs, targets):
    """1F1B / interleaved inside the shard_map: hand-run backward, stash of stage inputs."""
    del remat  # the backward recomputes each chunk anyway
    sched = ctx.schedule
    chunks, head, embed, inputs, targets = _prepare(ctx, stage_params, head, embed, inputs, targets)
    table, branch_table = jnp.asarray(sched.table), jnp.asarray(sched.branch_table())
    stage = lax.axis_index(ctx.axis)
    zero_x = _zeros(ctx.x, ctx)

    def last_objective(p, h, x, tgt):
        return loss_fn(h, stage_fn(p, x), tgt) * ctx.scale

    def stage_input(row, stash):
        stashed = lax.dynamic_index_in_dim(stash, jnp.maximum(row[ps.SLOT], 0), keepdims=False)
        return _stage_input(embed_fn, embed, inputs, row, stashed)

    def idle(row, stash, gbuf, acc):
        return zero_x, zero_x, acc

    def forward(row, stash, gbuf, acc):
        return stage_fn(_take(chunks, row[ps.CHUNK]), stage_input(row, stash)), zero_x, acc

    def backward(row, stash, gbuf, acc, *, last):
        p, x = _take(chunks, row[ps.CHUNK]), stage_input(row, stash)
        dstage, dhead, dfirst, loss = acc
        if last:
            tgt = _take(targets, row[ps.MB])
            value, vjp = jax.vjp(lambda p, h, x: last_objective(p, h, x, tgt), p, head, x)
            dp, dh, dx = vjp(jnp.ones_like(value))
            dhead = jax.tree.map(jnp.add, dhead, dh)
            loss = loss + value.astype(jnp.float32)
        else:
            _, vjp = jax.vjp(stage_fn, p, x)
            dp, dx = vjp(lax.dynamic_index_in_dim(gbuf, jnp.maximum(row[ps.GRAD_SLOT], 0), keepdims=False))
        j = row[ps.CHUNK]
        dstage = jax.tree.map(lambda a, d: _put(a, j, _take(a, j) + d, True), dstage, dp)
        dfirst = _first_grad(embed_fn, embed, inputs, row, dx, dfirst)
        # Chunk 0 has no previous chunk: its cotangent went into dfirst, send zeros.
        send_g = jnp.where(row[ps.FIRST] == 1, zero_x, dx)
        return zero_x, send_g, (dstage, dhead, dfirst, loss)

    branches = [idle, forward, lambda *a: backward(*a, last=False), lambda *a: backward(*a, last=True)]

    def tick(t, carry):
        x_in, g_in, stash, gbuf, acc = carry
        row = table[t, stage]
        stash = _put(stash, row[ps.RECV_X], x_in, row[ps.RECV_X] >= 0)
        gbuf = _put(gbuf, row[ps.RECV_G], g_in, row[ps.RECV_G] >= 0)
        with jax.named_scope(ps.TICK_SCOPE):
            send_x, send_g, acc = lax.switch(branch_table[t, stage], branches, row, stash, gbuf, acc)
        x_in = lax.ppermute(send_x, ctx.axis, ctx.fwd_perm)
        g_in = lax.ppermute(send_g, ctx.axis, ctx.bwd_perm)
        return x_in, g_in, stash, gbuf, acc

    # d embed (table-sized) with embed_fn; else d inputs, `[M, microbatch/D, ...]`, the one M-sized buffer.
    dfirst = _zeros(inputs if embed_fn is None else embed, ctx)
    acc = (_zeros(chunks, ctx), _zeros(head, ctx), dfirst, _zeros(jnp.float32(0), ctx))
    stash = _zeros(ctx.x, ctx, (sched.num_stash_slots,))
    carry = (zero_x, zero_x, stash, _zeros(ctx.x, ctx, (sched.num_grad_slots,)), acc)
    *_, (dstage, dhead, dfirst, loss) = lax.fori_loop(0, sched.num_ticks, tick, carry)
    return _reduce(ctx, embed_fn is not None, stage_params, loss, dstage, dhead, dfirst)


def _gpipe_body(stage_fn, loss_fn, embed_fn, ctx: _Ctx, remat, stage_params, head, embed, inputs, targets):
    """GPipe inside the shard_map: autodiff through the forward ticks (all M microbatches' activations live)."""
    sched = ctx.schedule
    chunks, head, embed, inputs, targets = _prepare(ctx, stage_params, head, embed, inputs, targets)
    table, branch_table = jnp.asarray(sched.table), jnp.asarray(sched.branch_table())
    stage = lax.axis_index(ctx.axis)
    fn = jax.checkpoint(stage_fn) if remat else stage_fn
    zero_loss = _zeros(jnp.float32(0), ctx)

    def objective(chunks, head, first):
        # `first` is what chunk 0's gradient is taken for: embed_params with embed_fn, else the inputs.
        embed_, inputs_ = (first, inputs) if embed_fn is not None else (embed, first)

        def idle(row, x):
            return jnp.zeros_like(x), zero_loss

        def forward(row, x):
            return fn(_take(chunks, row[ps.CHUNK]), x), zero_loss

        def forward_last(row, x):
            y = fn(_take(chunks, row[ps.CHUNK]), x)
            return y, (loss_fn(head, y, _take(targets, row[ps.MB])) * ctx.scale).astype(jnp.float32)

        def tick(t, carry):
            x_in, loss = carry
            row = table[t, stage]
            x = _stage_input(embed_fn, embed_, inputs_, row, x_in)
            with jax.named_scope(ps.TICK_SCOPE):
                y, value = lax.switch(branch_table[t, stage], [idle, forward, forward_last], row, x)
            return lax.ppermute(y, ctx.axis, ctx.fwd_perm), loss + value

        _, loss = lax.fori_loop(0, sched.forward_ticks(), tick, (_zeros(ctx.x, ctx), zero_loss))
        return loss

    first = embed if embed_fn is not None else inputs
    loss, grads = jax.value_and_grad(objective, argnums=(0, 1, 2))(chunks, head, first)
    return _reduce(ctx, embed_fn is not None, stage_params, loss, *grads)


def _reduce(ctx: _Ctx, embedded: bool, stage_params, loss, dstage, dhead, dfirst):
    """The one reduction after the loop: loss, head, embed over all axes, stages over batch, inputs over stages."""
    dstage = jax.tree.map(lambda d, a: d.reshape(a.shape), dstage, stage_params)
    loss = lax.psum(loss, ctx.all_axes)
    dstage = lax.psum(dstage, ctx.batch_axes) if ctx.batch_axes else dstage
    dhead = lax.psum(dhead, ctx.all_axes)
    dfirst = lax.psum(dfirst, ctx.all_axes if embedded else ctx.axis)
    return loss, (dstage, dhead, dfirst)
