"""One optimizer step, jitted with the state's shardings and donated: loss, gradients, update, metrics.

Gradient accumulation runs inside the step: the global batch [batch, seq] is viewed as `grad_accum`
microbatches (row i*A + a goes to microbatch a, so every device already holds its share of each microbatch
and nothing moves) and a `lax.scan` sums their float32 gradients; the optimizer runs once. ZeRO-2 constrains
the gradients to the optimizer's sharded layout, so XLA reduce-scatters them instead of all-reducing.

The loss is the mean over the batch's scored tokens (all targets, or those its `loss_mask` keeps), however the
batch is cut: a piece (a microbatch, one replica's rows, a pipeline microbatch) sums its tokens' losses and
divides by N / pieces, N the whole batch's scored-token count, so the mean over pieces is sum / N exactly. (A
mean of per-piece means would weight a token of a piece with little text more than one of a full piece.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdkit.data.bits import bits_per_byte, target_bytes
from spmdkit.errors import SpmdkitError
from spmdkit.models.fp8 import Fp8Meta
from spmdkit.models.lora import trained_variables
from spmdkit.parallel.pipeline.schedule import Schedule
from spmdkit.sharding.logical import logical_to_spec, use_rules
from spmdkit.sharding.rules import Rules
from spmdkit.train.step.balance import LAYER_LOADS, balance_experts
from spmdkit.train.step.state import TrainState

# inputs, targets, positions: int32 [batch, seq]; optional segment_ids (int32, documents packed in a row, 0 padding)
# and loss_mask (0/1 weights of the tokens the loss counts), both [batch, seq]
Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "positions")  # what windows of tokens give; packed documents add the two above
Trainable = tuple[nnx.State, nnx.State]  # (parameters, FP8 scales and amax histories), or their gradients
StepFn = Callable[[nnx.State, Batch], tuple[nnx.State, dict[str, jax.Array]]]


def batch_shardings(mesh: Mesh, rules: Rules, keys: tuple[str, ...] = BATCH_KEYS) -> dict[str, NamedSharding]:
    """The batch's [batch, seq] arrays named by `keys`: batch over (data, fsdp, expert), seq over context."""
    spec = logical_to_spec(("batch", "seq"), None, mesh, rules.params)
    return {k: NamedSharding(mesh, spec) for k in keys}


def scored_tokens(batch: Batch) -> jax.Array:
    """float32 scalar: how many targets the loss scores (the sum of `loss_mask`; every target without one)."""
    mask = batch.get("loss_mask")
    return jnp.asarray(batch["targets"].size, jnp.float32) if mask is None else jnp.sum(mask, dtype=jnp.float32)


def _microbatches(batch: Batch, grad_accum: int) -> Batch:
    """[batch, seq] -> [grad_accum, batch / grad_accum, seq], row i*A + a -> microbatch a (no data movement)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1), batch)


def replica_axes(mesh: Mesh, rules: Rules) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that split the batch while the parameters are whole on each of them: `data`, and
    `fsdp` below ZeRO-3. Gradients are summed over these once per optimizer step."""
    axes = ("data",) if rules.zero_stage == 3 else ("data", "fsdp")
    return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)


def _manual_accumulation(model: nnx.Module, mesh: Mesh, axes: tuple[str, ...]) -> bool:
    """Whether the microbatch loop can run manual over the replica `axes` (see `loss_and_grads`)."""
    config = getattr(model, "config", None)
    automatic = [a for a, size in mesh.shape.items() if size > 1 and a not in axes]
    return not (config and config.experts) and "context" not in automatic and len(automatic) < 2


def objective(
    model: nnx.Module, batch: Batch, denominator: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The training objective of one batch and its metrics.

    objective = cross-entropy (+ z_loss x the LM head's z-loss) + load_balance_weight x load-balancing loss +
    router_z_weight x router z-loss (the aux terms are means over the MoE layers; a dense model has none)
    + mtp_weight x the multi-token-prediction modules' mean cross-entropy (`mtp_depth` > 0, `Transformer.mtp_loss`;
    their MoE blocks' aux losses join with the same weights). The cross-entropy is the chunked one
    (`Transformer.loss`: the full logits never exist), a mean over the tokens the batch's `loss_mask` weights (all
    without one), or their sum over `denominator` when the batch is one of several pieces (see the module
    docstring). metrics: `loss` (the main cross-entropy alone, comparable with eval loss), `z_loss` when weighted,
    `mtp_loss` with MTP, and, for MoE, the aux losses, `dropped` (share of token->expert assignments over
    capacity) and `expert_load` [experts] (share of assignments per expert), averaged over the main MoE layers.
    """
    x, aux = model.hidden(batch["inputs"], batch["positions"], batch.get("segment_ids"))
    loss, z_loss = model.loss(x, batch["targets"], batch.get("loss_mask"), denominator)
    c = model.config
    metrics, total = {"loss": loss}, loss
    if c.z_loss:
        metrics["z_loss"], total = z_loss, total + c.z_loss * z_loss
    if c.mtp_depth:
        keys = ("inputs", "targets", "positions", "segment_ids", "loss_mask")
        mtp_loss, mtp_aux = model.mtp_loss(x, *(batch.get(k) for k in keys), denominator)
        metrics["mtp_loss"], total = mtp_loss, total + c.mtp_weight * mtp_loss
        if mtp_aux:
            total += c.load_balance_weight * jnp.mean(mtp_aux["load_balance_loss"])
            total += c.router_z_weight * jnp.mean(mtp_aux["router_z_loss"])
    if not aux:
        return total, metrics
    metrics.update({name: jnp.mean(value, axis=0) for name, value in aux.items()})
    metrics[LAYER_LOADS] = aux["expert_load"]  # [moe_layers, experts]: the train step's balancing reads them
    total += c.load_balance_weight * metrics["load_balance_loss"] + c.router_z_weight * metrics["router_z_loss"]
    return total, metrics


def _accumulate(
    grad_fn: Callable, trainable: Trainable, batch: Batch, grad_accum: int, denominator: jax.Array
) -> tuple[dict, Trainable]:
    """Mean of `grad_fn` (-> ((objective, metrics), (grads, fp8 meta))) over the microbatches of `batch`: a
    `lax.scan` that sums the gradients in its carry and stacks each microbatch's metrics, averaged after the loop.
    The FP8 scales and amax histories (`spmdkit.models.fp8`: their "gradients" are their new values) keep the
    elementwise max over the microbatches: the newest amax is the whole batch's. `denominator`: the scored tokens
    per microbatch on average (see the module docstring)."""

    def step(total: Trainable, mb: Batch) -> tuple[Trainable, dict[str, jax.Array]]:
        (_, metrics), (grads, meta) = grad_fn(trainable, mb, denominator)
        return (jax.tree.map(jnp.add, total[0], grads), jax.tree.map(jnp.maximum, total[1], meta)), metrics

    (grads, meta), metrics = jax.lax.scan(
        step, jax.tree.map(jnp.zeros_like, trainable), _microbatches(batch, grad_accum)
    )
    return jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics), (jax.tree.map(lambda g: g / grad_accum, grads), meta)


def loss_and_grads(
    model: nnx.Module, batch: Batch, grad_accum: int = 1, mesh: Mesh | None = None, rules: Rules | None = None
) -> tuple[dict[str, jax.Array], nnx.State]:
    """Metrics of the batch (`loss`: mean cross-entropy; see `objective`) and the float32 gradients of the
    objective w.r.t. the model's `nnx.Param`s, with an FP8 model's new scales and amax histories (`Fp8Meta`, the
    values the train step writes over the old ones) merged in.

    With `grad_accum` > 1 on a mesh with replica axes, the microbatch loop runs inside a `shard_map` that is
    manual over those axes: each device sums its own microbatch gradients (the parameters are made varying
    there, so autodiff inserts no per-microbatch all-reduce) and one `psum` after the loop reduces them. The
    other axes (tensor, context, fsdp under ZeRO-3) stay automatic.
    """
    # The trained parameters: every `nnx.Param`, or only the LoRA adapters (the frozen base goes with `rest`).
    graphdef, params, meta, rest = nnx.split(model, trained_variables(model), Fp8Meta, ...)

    def objective_of(trainable: Trainable, mb: Batch, denominator: jax.Array) -> tuple[jax.Array, dict]:
        # `rest`'s Variables are rebuilt here, in this trace: the frozen LoRA base enters the blocks' `nnx.scan`,
        # which refuses a Variable made at the outer (jit) trace level.
        return objective(nnx.merge(graphdef, *trainable, jax.tree.map(lambda x: x, rest)), mb, denominator)

    grad_fn = jax.value_and_grad(objective_of, has_aux=True)
    total = scored_tokens(batch)  # of the whole batch: every piece divides by its share of it
    axes = replica_axes(mesh, rules) if mesh is not None and rules is not None else ()
    if grad_accum == 1:
        (_, metrics), (grads, meta) = grad_fn((params, meta), batch, None)
    # Under automatic sharding (a reduction per microbatch): a mixture-of-experts model and context parallelism
    # (their own shard_maps over the batch axes cannot nest in this one), and two or more automatic axes beside
    # the manual ones (XLA's SPMD partitioner aborts on that partially manual program: "partition_group_list"
    # check, jaxlib 0.11.2 and 0.12.0.1, e.g. data=2,fsdp=2,tensor=2 under ZeRO-3).
    elif not axes or not _manual_accumulation(model, mesh, axes):
        metrics, (grads, meta) = _accumulate(grad_fn, (params, meta), batch, grad_accum, total / grad_accum)
    else:
        replicas = math.prod(mesh.shape[a] for a in axes)

        def local(trainable: Trainable, batch: Batch, total: jax.Array) -> tuple[dict[str, jax.Array], Trainable]:
            trainable = jax.tree.map(lambda p: jax.lax.pcast(p, axes, to="varying"), trainable)
            metrics, (grads, meta) = _accumulate(grad_fn, trainable, batch, grad_accum, total / (grad_accum * replicas))
            mean = lambda x: jax.lax.psum(x, axes) / replicas  # noqa: E731
            largest = lambda x: jax.lax.pmax(x, axes)  # noqa: E731  (FP8 meta: the whole batch's amax)
            return jax.tree.map(mean, metrics), (jax.tree.map(mean, grads), jax.tree.map(largest, meta))

        rows = PartitionSpec(axes)
        metrics, (grads, meta) = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(PartitionSpec(), {k: rows for k in batch}, PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec()),
            axis_names=set(axes),
        )((params, meta), batch, total)
    return metrics, nnx.merge_state(grads, meta)


def _guarded(grads: nnx.State, loss: jax.Array, opt_step: jax.Array, fail_steps: tuple[int, ...]) -> nnx.State:
    """`grads`, made NaN (so that `apply_if_finite` skips the update) when the loss is not finite (the loop then
    stops the run) or `opt_step` is one of `fail_steps` (the test hook for the skip path)."""
    poison = jnp.where(jnp.isfinite(loss), 1.0, jnp.nan)
    if fail_steps:
        poison = jnp.where(jnp.isin(opt_step, jnp.asarray(fail_steps)), jnp.nan, poison)
    return jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)


def _overwrite_fp8_meta(model: nnx.Module, new: nnx.State, finite: jax.Array) -> None:
    """An FP8 model's scales and amax histories take their new values (`spmdkit.models.fp8`), except on a step
    whose update is skipped (non-finite gradients): that step's amaxes would poison the history."""
    old = nnx.state(model, Fp8Meta)
    nnx.update(model, jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old))


def check_bad_steps(
    metrics: dict[str, jax.Array], step: int, limit: int, newest: Callable[[], str], vocab_size: int
) -> None:
    """Stop the run (SpmdkitError) at a non-finite loss of `step` (its update was skipped), or once `limit`
    consecutive steps up to `step` had NaN/Inf gradients. `newest()` names the newest checkpoint."""
    bad, loss = int(metrics["bad_steps"]), float(metrics["loss"])
    if not math.isfinite(loss):
        raise SpmdkitError(
            f"the loss of step {step} is {loss}: its update was skipped and nothing of it saved (newest "
            f"checkpoint: {newest()}); check the data (token ids must be below the vocab_size {vocab_size}), or "
            "lower --lr"
        )
    if bad >= limit:
        raise SpmdkitError(
            f"the gradients were NaN or Inf for {bad} consecutive steps (steps {step - bad + 1}-{step}); the "
            f"parameters are those of step {step - bad}: lower --lr, check the data, or raise max_bad_steps"
        )


def _metrics_and_grads(
    model: nnx.Module, batch: Batch, grad_accum: int, mesh: Mesh, rules: Rules, pipeline: Schedule | None
) -> tuple[dict[str, jax.Array], nnx.State]:
    """`loss_and_grads`, or with a `pipeline` schedule the pipeline program's loss and gradients."""
    if pipeline is None:
        return loss_and_grads(model, batch, grad_accum, mesh, rules)
    from spmdkit.train.step.pipeline import pipeline_loss_and_grads

    loss, grads = pipeline_loss_and_grads(model, batch, mesh=mesh, rules=rules, schedule=pipeline)
    return {"loss": loss}, grads


def make_train_step(
    train_state: TrainState,
    mesh: Mesh,
    rules: Rules,
    grad_accum: int = 1,
    lr_schedule: optax.Schedule | None = None,
    fail_steps: tuple[int, ...] = (),
    pipeline: Schedule | None = None,
    keys: tuple[str, ...] = BATCH_KEYS,
    token_bytes: np.ndarray | None = None,
) -> StepFn:
    """The jitted `step(state, batch) -> (state, metrics)`; `state` is donated; the batch holds the arrays `keys`
    names (`spmdkit.data.stream.DataStream.keys`).

    metrics: loss (cross-entropy), grad_norm, lr, skipped (1.0 when the gradients were not finite and the
    update was skipped), bad_steps (consecutive skipped steps so far); with `token_bytes` (int32 [vocab], UTF-8
    bytes per token id) `bits_per_byte`; MoE models add their router metrics (see `objective`) and
    `expert_load_max_over_mean`, and with `balance_rate` move their correction biases after the update
    (`spmdkit.train.step.balance`). `fail_steps` (0-based optimizer steps) get NaN gradients: the test hook for
    the skip path. With a `pipeline` schedule the loss and gradients come from the pipeline program
    (`spmdkit.train.step.pipeline`) instead of autodiff of the whole model.
    """
    graphdef, grad_shardings = train_state.graphdef, train_state.grad_shardings

    def step(state: nnx.State, batch: Batch) -> tuple[nnx.State, dict[str, jax.Array]]:
        with use_rules(rules, mesh):
            model, optimizer = nnx.merge(graphdef, state)
            model_metrics, grads = _metrics_and_grads(model, batch, grad_accum, mesh, rules, pipeline)
            grads, fp8_meta = nnx.split_state(grads, nnx.Param, Fp8Meta)
            opt_step = optimizer.step[...]
            grads = _guarded(grads, model_metrics["loss"], opt_step, fail_steps)
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
            grad_norm = optax.tree.norm(grads)
            optimizer.update(model, grads)
            _overwrite_fp8_meta(model, fp8_meta, jnp.isfinite(grad_norm))
            if LAYER_LOADS in model_metrics:  # mixture of experts: the imbalance metric, the bias update
                model_metrics = balance_experts(model, model_metrics, jnp.isfinite(grad_norm))
            new_state = nnx.state((model, optimizer))
        bad = new_state[1]["opt_state"]["notfinite_count"][...]
        if token_bytes is not None:  # (`spmdkit.data.bits`): mean loss x scored tokens / their UTF-8 bytes / ln 2
            text_bytes = target_bytes(batch["targets"], jnp.asarray(token_bytes), batch.get("loss_mask"))
            model_metrics["bits_per_byte"] = bits_per_byte(model_metrics["loss"], scored_tokens(batch), text_bytes)
        metrics = {
            **model_metrics,
            "grad_norm": grad_norm,
            "lr": lr_schedule(opt_step) if lr_schedule else jnp.zeros(()),
            "skipped": (~jnp.isfinite(grad_norm)).astype(jnp.float32),
            "bad_steps": bad.astype(jnp.int32),
        }
        return new_state, metrics

    return jax.jit(
        step,
        in_shardings=(train_state.shardings, batch_shardings(mesh, rules, keys)),
        out_shardings=(train_state.shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )


def make_eval_step(
    train_state: TrainState,
    mesh: Mesh,
    rules: Rules,
    keys: tuple[str, ...] = BATCH_KEYS,
    token_bytes: np.ndarray | None = None,
) -> Callable[[nnx.State, Batch], dict[str, jax.Array]]:
    """The jitted forward-only `eval(state, batch) -> {loss_sum, tokens[, bytes]}`: the summed cross-entropy of
    the scored tokens (chunked, as in training), their count and, with `token_bytes`, the UTF-8 bytes of text
    they stand for. Sums, so that batches with different numbers of scored tokens combine exactly."""
    graphdef = train_state.graphdef

    def evaluate(state: nnx.State, batch: Batch) -> dict[str, jax.Array]:
        with use_rules(rules, mesh):
            model = nnx.merge(graphdef, state)[0]
            x, _ = model.hidden(batch["inputs"], batch["positions"], batch.get("segment_ids"))
            out = {"loss_sum": model.loss(x, batch["targets"], batch.get("loss_mask"), 1.0)[0]}
        out["tokens"] = scored_tokens(batch)
        if token_bytes is not None:
            out["bytes"] = target_bytes(batch["targets"], jnp.asarray(token_bytes), batch.get("loss_mask"))
        return out

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        evaluate, in_shardings=(train_state.shardings, batch_shardings(mesh, rules, keys)), out_shardings=replicated
    )
