"""The optimizer: optax AdamW with warmup + cosine decay, global-norm clipping, a decay mask, NaN skipping.

All of it is optax: `warmup_cosine_decay_schedule`, `clip_by_global_norm`, `adamw(mask=...)`, and
`apply_if_finite`, which leaves parameters and moments unchanged on a step whose gradients hold NaN or Inf
and counts consecutive bad steps (the loop stops the run after `max_bad_steps` of them).

With `offload` the optimizer's arrays (the AdamW moments, sharded as `rules.optimizer` says) live in pinned host
memory between steps (`spmdkit.train.step.state`); `host_offloaded` moves them to the device for the update and back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from spmdkit.errors import SpmdkitError
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
    tx = optax.apply_if_finite(tx, max_consecutive_errors=2**30)
    return host_offloaded(tx) if config.offload else tx


def host_offloaded(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` (an AdamW chain: its state holds the moments as `mu` and `nu` trees like the parameters) with those
    moments in host memory outside its `update` (inside `jax.jit`), streamed one parameter at a time: parameter
    j's moments are copied to the device once parameter j - 1's new moments exist (an optimization barrier orders
    the copy; the first waits for the gradients, so none is on the device during the forward and backward), updated
    there and copied back: about two parameters' moments are on the device at once, instead of all of them.

    Each parameter's update runs `tx.update` on the whole tree with the other moments zero and keeps only that
    parameter's results (XLA drops the rest): right for optimizers whose update of one parameter reads no other
    parameter's moments (AdamW; clipping and the finite check read the gradients only)."""

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        mu, treedef = jax.tree.flatten(optax.tree_utils.tree_get(state, "mu"))
        nu = jax.tree.leaves(optax.tree_utils.tree_get(state, "nu"))
        if sum(jnp.ndim(x) > 0 for x in jax.tree.leaves(state)) != len(mu) + len(nu):  # all of them on the host
            raise SpmdkitError("--optimizer.offload moves AdamW's two moments only: this optimizer holds other arrays")
        zeros = [jnp.zeros(x.shape, x.dtype) for x in mu]  # on the device; what the other parameters' moments read
        done, parts = grads, []  # what the next copy waits for; (update, mu, nu) per parameter
        for j in range(len(mu)):
            (m, v), _ = jax.lax.optimization_barrier(((mu[j], nu[j]), done))
            m, v = jax.device_put((m, v), jax.memory.Space.Device)
            view = {
                key: jax.tree.unflatten(treedef, [*zeros[:j], x, *zeros[j + 1 :]]) for key, x in (("mu", m), ("nu", v))
            }
            updates, new = tx.update(grads, optax.tree_utils.tree_set(state, **view), params)
            done = tuple(jax.tree.leaves(optax.tree_utils.tree_get(new, key))[j] for key in ("mu", "nu"))
            parts.append((jax.tree.leaves(updates)[j], *jax.device_put(done, jax.memory.Space.Host)))
        updates_tree = jax.tree.unflatten(jax.tree.structure(grads), [u for u, _, _ in parts])
        moments = {key: jax.tree.unflatten(treedef, [p[i] for p in parts]) for i, key in ((1, "mu"), (2, "nu"))}
        return updates_tree, optax.tree_utils.tree_set(new, **moments)

    return optax.GradientTransformation(tx.init, update)
