"""The optimizer: optax AdamW with warmup + cosine decay, global-norm clipping, a decay mask, NaN skipping.

All of it is optax: `warmup_cosine_decay_schedule`, `clip_by_global_norm`, `adamw(mask=...)`, and
`apply_if_finite`, which leaves parameters and moments unchanged on a step whose gradients hold NaN or Inf
and counts consecutive bad steps (the loop stops the run after `max_bad_steps` of them).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from spmdkit.train.config import OptimizerConfig


def schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to the peak lr, then cosine decay (an unset lr or warmup: the from-scratch defaults)."""
    config = config.for_run()
    decay = max(config.decay_steps or total_steps, config.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if config.warmup_steps else config.lr,
        peak_value=config.lr,
        warmup_steps=config.warmup_steps,
        decay_steps=decay,
        end_value=config.lr * config.final_lr_fraction,
    )


def decay_mask(params: Any) -> Any:
    """True for weights that decay: everything but norm scales and biases (paths containing 'norm' or 'bias')."""

    def decays(path: tuple[Any, ...], _: Any) -> bool:
        return not any(word in jax.tree_util.keystr(path) for word in ("norm", "bias"))

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """clip -> AdamW(schedule, masked decay), wrapped so non-finite gradients skip the update."""
    config = config.for_run()
    tx = optax.chain(
        optax.identity() if config.clip_norm is None else optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            schedule(config, total_steps),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=decay_mask,
        ),
    )
    # The loop, not optax, decides when too many bad steps end the run: never let apply_if_finite give up.
    return optax.apply_if_finite(tx, max_consecutive_errors=2**30)
