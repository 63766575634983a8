"""Auxiliary-loss-free load balancing of a mixture-of-experts model (DeepSeek-V3, after Wang et al. 2024).

Each MoE layer's router chooses its experts by score + b, b [experts] the correction bias
(`spmdkit.models.moe.RoutingBias`; the weights stay the unbiased scores). After each optimizer step, outside the
gradient, with `balance_rate` = r > 0:

    b_i <- b_i + r x sign(mean_j load_j - load_i)

load_i is the layer's share of the step's token->expert assignments that chose expert i, over the whole global batch
(the router runs outside the experts' shard_map, so it is global on any mesh; with gradient accumulation it is the
mean over the equal microbatches, which is the batch's share). An overloaded expert's bias falls by r, an
underloaded one's rises by r, one exactly at the mean keeps it: the choice moves toward balance with no loss term
pulling against the language model (the Switch loss's gradient does). A step whose update is skipped (non-finite
gradients) leaves the bias too. The bias is part of the model state, so checkpoints hold it.

The imbalance metric `expert_load_max_over_mean` is max_i load_i / mean_j load_j of the worst MoE layer (1:
balanced; experts: every assignment on one expert), reported for every MoE model, balanced or not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit.models.moe import RoutingBias

LAYER_LOADS = "layer_expert_load"  # the objective's metric of each MoE layer's loads [moe_layers, experts]
RATIO = "expert_load_max_over_mean"  # the imbalance metric that replaces it in the step's metrics


def balanced_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """The rule above: bias, load [moe_layers, experts] (load: shares; any scale) -> the new bias (bias's dtype)."""
    mean = jnp.mean(load, axis=-1, keepdims=True)
    step = rate * jnp.sign(mean - load.astype(jnp.float32))
    return (bias.astype(jnp.float32) + step).astype(bias.dtype)


def max_over_mean(load: jax.Array) -> jax.Array:
    """float32 scalar: the largest max_i load_i / mean_j load_j over the layers of `load` [moe_layers, experts]."""
    load = load.astype(jnp.float32)
    return jnp.max(jnp.max(load, axis=-1) / jnp.mean(load, axis=-1))


def balance_experts(model: nnx.Module, metrics: dict[str, jax.Array], finite: jax.Array) -> dict[str, jax.Array]:
    """`metrics` with the per-layer loads (`LAYER_LOADS`) replaced by their `RATIO`; when the model's
    `balance_rate` > 0, its correction biases moved by the rule above (not when `finite` is False: the step's
    update was skipped). Called inside the jitted step, after the optimizer's update."""
    metrics = dict(metrics)
    load = metrics.pop(LAYER_LOADS)
    metrics[RATIO] = max_over_mean(load)
    rate = model.config.balance_rate
    if rate:  # the main MoE stack's bias, one leaf [moe_layers, experts]; MTP blocks' keep theirs (not measured)
        old = nnx.state(model.moe_blocks, RoutingBias)
        new = jax.tree.map(lambda b: jnp.where(finite, balanced_bias(b, load, rate), b), old)
        nnx.update(model.moe_blocks, new)
    return metrics
