"""Loss and gradients of the transformer through the pipeline program (`spmdkit.parallel.pipeline.program`).

The forward pass is cut in three: the embedding runs on stage 0 as the pipeline's `embed_fn` (the pipeline is
fed the int token ids, microbatch by microbatch), the scanned block stack is split into stages over the
`pipeline` axis, and the final norm + LM head + loss run on the last stage. Embedding inside the pipeline keeps
1F1B's memory flat in the number of microbatches: the table's gradient is accumulated on stage 0 tick by tick,
where embedding outside would need d loss / d embeddings for the whole batch (`[M, microbatch, seq, embed]`).
Gradients are reassembled into the parameters' tree, so the optimizer update is the same as without PP.

Interleaved schedules (v > 1) want stage s to hold model chunks s, s+P, ...: the stack is permuted into that
layout inside the step and the gradients permuted back, so parameters, checkpoints and evaluation keep the
model's layer order. That permutation moves the block parameters between stages once per step.

Packed documents: every stage needs its microbatch's `positions` and `segment_ids` (attention stays inside a
document, RoPE restarts at each document). They ride along with the activation, as two float32 channels appended
to the stage boundary `[microbatch, seq, embed + 2]` (integers below 2^24 are exact in float32): embed_fn adds
them, every stage splits them off, runs its blocks and puts them back, so each stage reads them at the tick it runs
that microbatch without the program knowing (2/embed more boundary bytes; their gradients are dropped). The loss
mask travels with the targets to the last stage, and each microbatch's summed loss is divided by the batch's
scored-token count over the number of pieces (`spmdkit.train.step.train_step`), so the loss is the batch's token mean.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig
from spmdkit.models.layer_plan import uniform
from spmdkit.models.loss import lm_loss
from spmdkit.models.transformer import Transformer, apply_blocks, default_positions, embed_tokens
from spmdkit.parallel.pipeline.program import (
    deinterleave_layers,
    interleave_layers,
    pipeline_value_and_grad,
    to_microbatches,
)
from spmdkit.parallel.pipeline.schedule import Schedule, check_layers, check_pipelinable, make_schedule
from spmdkit.sharding.logical import suspend_rules
from spmdkit.sharding.rules import Rules
from spmdkit.train.step.train_step import scored_tokens

# Activations cross stage boundaries in float32. XLA's CPU compiler aborts ("Invalid binary instruction opcode
# copy") on the bfloat16 form of the pipeline loop in jax 0.10.2; float32 costs 2x the (small) ppermute bytes.
BOUNDARY_DTYPE = jnp.float32


def pipeline_schedule(kind: str, mesh: Mesh, microbatches: int, virtual_stages: int, layers: int) -> Schedule:
    """The schedule for the mesh's `pipeline` axis, checked against the model's layer count."""
    stages = mesh.shape["pipeline"]
    check_layers(layers, stages, virtual_stages)
    return make_schedule(kind, stages, microbatches or 2 * stages, virtual_stages)


def _per_device(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """`fn` with the sharding rules suspended when traced outside the pipeline's shard_map.

    The pipeline traces `stage_fn` / `embed_fn` on per-device shapes before its shard_map (its shape check);
    the rules' hints (e.g. the attention kernel's shape check) would then compare local shapes with the mesh.
    """

    def wrapped(*args: Any) -> jax.Array:
        if "pipeline" in jax.sharding.get_abstract_mesh().manual_axes:
            return fn(*args)
        with suspend_rules():
            return fn(*args)

    return wrapped


def _assemble(params: nnx.State, pieces: dict[str, Any]) -> nnx.State:
    """A gradient tree shaped like `params` from the pipeline's pieces (blocks, head, embedding)."""
    blocks = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(pieces["blocks"])}

    def pick(path: tuple[Any, ...], _: jax.Array) -> jax.Array:
        top = path[0].key
        if top == "blocks":
            return blocks[jax.tree_util.keystr(path[1:])]
        return pieces[top]

    return jax.tree_util.tree_map_with_path(pick, params)


def _check_model(config: TransformerConfig, mesh: Mesh) -> None:
    """SpmdkitError for a model the pipeline cannot run: MoE, context parallelism, layers that differ."""
    check_pipelinable(config.moe_layers, mesh.shape["context"])
    if not uniform(config):
        raise SpmdkitError(
            "pipelining a model whose layers differ (window_pattern, rope_pattern) is not supported yet: drop "
            "pipeline= from the mesh"
        )


def pipeline_loss_and_grads(
    model: Transformer, batch: dict[str, jax.Array], *, mesh: Mesh, rules: Rules, schedule: Schedule
) -> tuple[jax.Array, nnx.State]:
    """Mean loss over the batch and gradients w.r.t. every `nnx.Param`, computed by the pipeline schedule.

    batch: inputs / targets [batch, seq] (and positions, segment_ids, loss_mask of packed documents); the batch
    splits into `schedule.num_microbatches` microbatches (row m, m+M, ... go to microbatch m), each sharded over
    the batch axes.
    """
    config = model.config
    _check_model(config, mesh)
    stages, virtual = schedule.num_stages, schedule.virtual_stages
    blocks_def, blocks = nnx.split(model.blocks)

    packed = "segment_ids" in batch
    microbatches = functools.partial(to_microbatches, num_microbatches=schedule.num_microbatches)

    @_per_device
    def embed_fn(table: jax.Array, raw: jax.Array) -> jax.Array:
        if not packed:
            return embed_tokens(table, raw, config.dtype, config.embed_scale).astype(BOUNDARY_DTYPE)
        x = embed_tokens(table, raw[..., 0], config.dtype, config.embed_scale).astype(BOUNDARY_DTYPE)
        return jnp.concatenate([x, raw[..., 1:].astype(BOUNDARY_DTYPE)], axis=-1)  # + positions, segment ids

    @_per_device
    def stage_fn(chunk: nnx.State, x: jax.Array) -> jax.Array:
        blocks = nnx.merge(blocks_def, chunk)
        if not packed:
            y = apply_blocks(blocks, x.astype(config.dtype), default_positions(x.shape[:2]), config.remat_policy)
            return y.astype(BOUNDARY_DTYPE)
        x, side = x[..., :-2], lax.stop_gradient(x[..., -2:])
        positions, segment_ids = side[..., 0].astype(jnp.int32), side[..., 1].astype(jnp.int32)
        y = apply_blocks(blocks, x.astype(config.dtype), positions, config.remat_policy, segment_ids)
        return jnp.concatenate([y.astype(BOUNDARY_DTYPE), side], axis=-1)

    pieces = schedule.num_microbatches * math.prod(mesh.shape[a] for a in rules.params["batch"] if a in mesh.shape)

    def loss_fn(head: dict[str, jax.Array], y: jax.Array, targets: dict[str, jax.Array]) -> jax.Array:
        y = y[..., :-2] if packed else y
        # One piece of `pieces`: its summed loss over the batch's scored tokens / pieces (a mean with no mask).
        denominator = targets["scored"][0] / pieces if "loss_mask" in targets else None
        ce, z_loss = lm_loss(  # chunked over the sequence
            y, head["norm"], head["lm_head"], targets["targets"], config, targets.get("loss_mask"), denominator
        )
        return ce + config.z_loss * z_loss if config.z_loss else ce

    raw = batch["inputs"]
    if packed:  # [batch, seq, 3]: token ids, positions, segment ids (see the module docstring)
        raw = jnp.stack([raw, batch["positions"], batch["segment_ids"]], axis=-1)
    targets = {"targets": batch["targets"]}
    if "loss_mask" in batch:
        targets["loss_mask"] = batch["loss_mask"]
        # the batch's scored-token count, one copy per row (the targets tree is split by rows)
        targets["scored"] = jnp.broadcast_to(scored_tokens(batch), batch["targets"].shape[:1])

    stage_params = blocks if virtual == 1 else interleave_layers(blocks, stages, virtual)
    head = {"norm": model.final_norm.scale[...], "lm_head": model.lm_head_weight()}
    loss, (d_stages, d_head, d_table) = pipeline_value_and_grad(
        stage_fn, loss_fn, stage_params, head, microbatches(raw), jax.tree.map(microbatches, targets), mesh=mesh,
        schedule=schedule, batch_axes=rules.params["batch"], remat=config.remat_policy.recomputes, embed_fn=embed_fn,
        embed_params=model.embedding[...],
    )  # fmt: skip
    d_stages = d_stages if virtual == 1 else deinterleave_layers(d_stages, stages, virtual)
    if config.tie_embeddings:  # one parameter used twice: the lookup's gradient plus the head's, transposed
        d_table = d_table + d_head["lm_head"].T
    pieces = {"blocks": d_stages, "final_norm": d_head["norm"], "lm_head": d_head["lm_head"], "embedding": d_table}
    return loss, _assemble(nnx.state(model, nnx.Param), pieces)
