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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from spmdkit.models.transformer import (
    Transformer,
    apply_blocks,
    cross_entropy,
    default_positions,
    embed_tokens,
    head_logits,
)
from spmdkit.parallel.pipeline.program import (
    deinterleave_layers,
    interleave_layers,
    pipeline_value_and_grad,
    to_microbatches,
)
from spmdkit.parallel.pipeline.schedule import Schedule, check_layers, check_pipelinable, make_schedule
from spmdkit.sharding.logical import suspend_rules
from spmdkit.sharding.rules import Rules

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


def pipeline_loss_and_grads(
    model: Transformer, batch: dict[str, jax.Array], *, mesh: Mesh, rules: Rules, schedule: Schedule
) -> tuple[jax.Array, nnx.State]:
    """Mean loss over the batch and gradients w.r.t. every `nnx.Param`, computed by the pipeline schedule.

    batch: inputs / targets [batch, seq]; the batch splits into `schedule.num_microbatches` microbatches
    (row m, m+M, ... go to microbatch m), each sharded over the batch axes.
    """
    config = model.config
    check_pipelinable(config.moe_layers, mesh.shape["context"] if config.attention == "ring" else 1)
    stages, virtual = schedule.num_stages, schedule.virtual_stages
    blocks_def, blocks = nnx.split(model.blocks)
    params = nnx.state(model, nnx.Param)

    @_per_device
    def embed_fn(table: jax.Array, tokens: jax.Array) -> jax.Array:
        return embed_tokens(table, tokens, config.dtype).astype(BOUNDARY_DTYPE)

    @_per_device
    def stage_fn(chunk: nnx.State, x: jax.Array) -> jax.Array:
        blocks = nnx.merge(blocks_def, chunk)
        y = apply_blocks(blocks, x.astype(config.dtype), default_positions(x.shape[:2]), config.remat)
        return y.astype(BOUNDARY_DTYPE)

    def loss_fn(head: dict[str, jax.Array], y: jax.Array, targets: jax.Array) -> jax.Array:
        return cross_entropy(head_logits(y, head["norm"], head["lm_head"], config), targets)

    stage_params = blocks if virtual == 1 else interleave_layers(blocks, stages, virtual)
    head = {"norm": model.final_norm.scale[...], "lm_head": model.lm_head_weight()}
    loss, (d_stages, d_head, d_table) = pipeline_value_and_grad(
        stage_fn,
        loss_fn,
        stage_params,
        head,
        to_microbatches(batch["inputs"], schedule.num_microbatches),
        to_microbatches(batch["targets"], schedule.num_microbatches),
        mesh=mesh,
        schedule=schedule,
        batch_axes=rules.params["batch"],
        remat=config.remat != "none",
        embed_fn=embed_fn,
        embed_params=model.embedding[...],
    )
    if virtual > 1:
        d_stages = deinterleave_layers(d_stages, stages, virtual)
    if config.tie_embeddings:  # one parameter used twice: the lookup's gradient plus the head's, transposed
        d_table = d_table + d_head["lm_head"].T
    pieces = {"blocks": d_stages, "final_norm": d_head["norm"], "lm_head": d_head["lm_head"], "embedding": d_table}
    return loss, _assemble(params, pieces)
