"""The JAX side of `spmdkit.models.remat`: the `jax.checkpoint` policy of a `--model.remat` value, and `named`, which
marks an activation with one of `ACTIVATION_NAMES` (`jax.ad_checkpoint.checkpoint_name`) for the policies to find.

Names are set only while a named policy is in force (`naming`, around the blocks' scan): without remat a named
value is a second variable beside the unnamed one, and autodiff keeps both where both are read (attention's
output: the kernel's backward reads the one, the output projection's the other), a copy of [b, s, H, d] per layer.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from spmdkit.models.remat import ACTIVATION_NAMES, RematPolicy

# Primitives whose results `none` recomputes in the backward instead of keeping: elementwise arithmetic and casts,
# data movement (broadcasts, reshapes, slices, transposes), row reductions (a norm's mean of squares) and sharding
# annotations. Cheap to redo from the kept GEMM and attention outputs, and not worth a stacked [layers, b, s, ...]
# buffer each: autodiff without remat keeps every intermediate (a SwiGLU's gate, up, silu(gate), sigmoid(gate), its
# product and their casts, the norms in float32), which the layer scan writes to stacked buffers it zero-fills first.
ELEMENTWISE = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "clamp", "concatenate", "convert_element_type", "copy", "copy_p", "cos",
    "div", "eq", "erf", "exp", "exp2", "expand_dims", "ge", "gt", "integer_pow", "le", "log", "log1p", "logistic", "lt",
    "max", "min", "mul", "ne", "neg", "not", "or", "pow", "reduce_max", "reduce_sum", "reshape", "reshard", "rsqrt",
    "select_n", "sharding_constraint", "sign", "sin", "slice", "sqrt", "square", "squeeze", "stop_gradient", "sub",
    "tanh", "transpose",
})  # fmt: skip


def all_but_elementwise_saveable(prim: Any, *args: Any, **params: Any) -> bool:
    """`none`'s policy: keep the result of every primitive but the cheap ones of `ELEMENTWISE` (GEMMs, attention
    kernels, collectives, gathers, random bits: whatever costs FLOPs or communication is never recomputed), and
    every narrowing cast of float32 (the weights' compute-dtype casts: recomputed in the backward they would sit
    between the weight and its FSDP all-gather, which XLA then no longer overlaps with the previous layer)."""
    if prim.name == "convert_element_type" and args[0].dtype == jnp.float32:
        return jnp.dtype(params["new_dtype"]).itemsize < 4
    return prim.name not in ELEMENTWISE


def checkpoint_policy(policy: RematPolicy) -> Any:
    """The `jax.checkpoint` policy of a parsed `--model.remat` (None: recompute everything, `full`). `none` recomputes
    no GEMM, attention or collective, only the elementwise ops between them (`all_but_elementwise_saveable`)."""
    if not policy.named:
        return {
            "none": all_but_elementwise_saveable,
            "full": None,
            "dots_saveable": jax.checkpoint_policies.dots_saveable,
            "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        }[policy.kind]
    if not policy.offloaded:
        return jax.checkpoint_policies.save_only_these_names(*sorted(policy.saved))
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=sorted(policy.saved),
        names_which_can_be_offloaded=sorted(policy.offloaded),
        offload_src="device",
        offload_dst="pinned_host",
    )


_NAMING = contextvars.ContextVar("spmdkit_remat_naming", default=False)


@contextlib.contextmanager
def naming(policy: RematPolicy) -> Iterator[None]:
    """`named` names activations inside this block when `policy` is a named policy (and only then)."""
    token = _NAMING.set(policy.named)
    try:
        yield
    finally:
        _NAMING.reset(token)


def named(x: Any, label: str) -> Any:
    """x (an array of any shape), named `label` (one of `ACTIVATION_NAMES`) for the remat policies while `naming`
    says so; else x itself."""
    if label not in ACTIVATION_NAMES:
        raise ValueError(f"{label!r} is not one of ACTIVATION_NAMES")
    return checkpoint_name(x, label) if _NAMING.get() else x
