"""The optimizer: optax AdamW (or Muon) with warmup + cosine decay, global-norm clipping, a decay mask, NaN skipping.

All of it is optax: `warmup_cosine_decay_schedule`, `clip_by_global_norm`, `adamw(mask=...)`, and
`apply_if_finite`, which leaves parameters and moments unchanged on a step whose gradients hold NaN or Inf
and counts consecutive bad steps (the loop stops the run after `max_bad_steps` of them).

Muon (`--optimizer.name muon`) partitions the parameters (`optax.partition`): the hidden matrices
(`spmdkit.models.matrices.matrix_axes`: attention, MLP, expert and router weights, each matrix of a `layers` /
`experts` stack alone) get `optax.contrib.scale_by_muon`'s Nesterov momentum orthogonalised by Newton-Schulz, on
whole matrices one device each (`spmdkit.train.step.muon`: all-to-alls per step, no collective per iteration),
scaled to a shape-independent RMS, decayed and scaled by the lr, as `optax.contrib.muon` chains them; the
embedding, head, norm scales and biases get the same AdamW as an AdamW run (its decay mask included). One momentum
per matrix: the state is the parameters' shape, sharded as they are between steps (`nnx.Optimizer` gives the
moments the parameters' axis names).

With `offload` the optimizer's arrays (the AdamW moments, sharded as `rules.optimizer` says) live in pinned host
memory between steps (`spmdkit.train.step.state`); `host_offloaded` moves them to the device for the update and back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from spmdkit.errors import SpmdkitError
from spmdkit.models import Transformer, TransformerConfig
from spmdkit.models.matrices import matrix_axes
from spmdkit.train.config import OptimizerConfig
from spmdkit.train.optimizer_config import MUON_LR_SCALE
from spmdkit.train.step.muon import Matrices, scale_by_muon


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


def make_optimizer(
    config: OptimizerConfig, total_steps: int, model: TransformerConfig | None = None
) -> optax.GradientTransformation:
    """clip -> AdamW(schedule, masked decay) (or Muon for `model`'s hidden matrices and that AdamW for the rest),
    wrapped so non-finite gradients skip the update."""
    config = config.for_run()
    lr = schedule(config, total_steps)
    adamw = optax.adamw(
        lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay, mask=decay_mask
    )
    if config.name == "muon":
        if model is None:
            raise SpmdkitError("make_optimizer: Muon needs the model (which weights are matrices): pass model=")
        tx_params = muon(config, lr, matrix_dimensions(model), adamw)
    else:
        tx_params = adamw
    tx = optax.chain(
        optax.identity() if config.clip_norm is None else optax.clip_by_global_norm(config.clip_norm), tx_params
    )
    # The loop, not optax, decides when too many bad steps end the run: never let apply_if_finite give up.
    tx = optax.apply_if_finite(tx, max_consecutive_errors=2**30)
    return host_offloaded(tx) if config.offload else tx


Dimensions = dict[tuple[str, ...], Matrices | None]  # parameter path -> its matrices' axes (None: AdamW)
_is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731


def _key(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def matrix_dimensions(model: TransformerConfig) -> Dimensions:
    """Each parameter of `model` (by its path in the state) -> the input and output axes of the matrices Muon
    orthogonalises in it and its logical axis names, or None for AdamW's; read from an abstract model (nothing is
    allocated)."""
    params = nnx.state(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))), nnx.Param)
    out: Dimensions = {}
    for path, variable in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_variable):
        names = variable.get_metadata().get("out_sharding") or (None,) * len(variable.shape)
        axes = matrix_axes(".".join(_key(path)), names)
        out[_key(path)] = None if axes is None else Matrices(MuonDimensionNumbers(*axes), tuple(names))
    return out


def muon(
    config: OptimizerConfig, lr: optax.Schedule, dims: Dimensions, adamw: optax.GradientTransformation
) -> optax.GradientTransformation:
    """Muon for the matrices `dims` names, `adamw` for the rest (`optax.contrib.muon`'s chain for the former, with
    its own lr, `muon_lr` (unset: MUON_LR_SCALE x lr) on lr's schedule, and the decay applied to every matrix)."""
    scale = MUON_LR_SCALE if config.muon_lr is None else config.muon_lr / config.lr
    muon_lr = lambda step: lr(step) * scale  # noqa: E731

    def on(tree: Any, leaf: Callable[[Any], Any]) -> Any:  # a tree of `leaf(dims[path])`; skips MaskedNodes
        return jax.tree_util.tree_map_with_path(lambda p, _: leaf(dims[_key(p)]), tree, is_leaf=_is_variable)

    def stacks(tree: Any) -> Any:
        return on(tree, lambda d: d)

    matrices = optax.chain(
        scale_by_muon(stacks, ns_steps=config.muon_ns_steps, beta=config.muon_beta, nesterov=config.muon_nesterov),
        _scale_by_shape(stacks, config.muon_rms),
        optax.add_decayed_weights(config.weight_decay),
        optax.scale_by_learning_rate(muon_lr),
    )  # fmt: skip
    labels = lambda tree: on(tree, lambda d: "adamw" if d is None else "muon")  # noqa: E731
    return optax.partition({"muon": matrices, "adamw": adamw}, labels)


def _scale_by_shape(stacks: Callable[[Any], Any], rms: float | None) -> optax.GradientTransformation:
    """Each orthogonalised update (singular values ~1) times sqrt(max(fan_in, fan_out)) x `rms` (an RMS of about
    `rms` whatever the shape: Moonlight's match to AdamW), or with `rms` None sqrt(max(1, fan_out / fan_in))
    (Keller Jordan's); as optax.contrib.muon's `consistent_rms`."""

    def scale(update: jax.Array, matrices: Matrices) -> jax.Array:
        fan_in, fan_out = (math.prod(update.shape[i] for i in axes) for axes in matrices.dims)
        return update * (
            math.sqrt(max(fan_in, fan_out)) * rms if rms is not None else math.sqrt(max(1, fan_out / fan_in))
        )

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return jax.tree.map(scale, updates, stacks(updates)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


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
