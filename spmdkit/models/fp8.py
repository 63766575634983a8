"""FP8 matmuls with delayed per-tensor scaling (Hopper's float8 GEMMs), built on Flax's own FP8 ops.

A projection y = x W runs as y = (q(x / s_x) . q(W / s_w)) s_x s_w: x and W are quantized to float8_e4m3fn
(largest value 448), the product is accumulated in higher precision and scaled back; in the backward pass the
output gradient g is quantized to float8_e5m2 (largest 57344, more range, less precision) with its own scale s_g,
and dx = q(g / s_g) . q(W / s_w)^T s_g s_w, dW = q(x / s_x)^T . q(g / s_g) s_x s_g run in FP8 as well.

The scales are per tensor and *delayed* (Transformer Engine's recipe, `flax.linen.fp8_ops`): each tensor keeps the
max |value| of its last `HISTORY` steps (its amax history); a step quantizes with s = max(history) / fp8_max, so
the largest value seen lately just fits, and pushes its own amax into the history. The first step, with an empty
history, runs at s = 1. The forward amaxes are known in the forward pass, the gradient's only in the backward
pass, so Flax's custom VJPs hand each step's *new* scale and history back as the "gradient" of the old ones: the
train step overwrites every `Fp8Meta` variable with its gradient (`spmdkit.train.step.train_step`), the
optimizer never sees them, and they are saved and restored with the train state like the parameters.

XLA:GPU on Hopper compiles a dot of two f8 operands into an FP8 GEMM (cuBLASLt `__cublas$lt$matmul$f8`, or a
Triton GEMM fusion on f8 operands): `spmdkit compile` counts them (`fp8_gemms`). On CPU the same program runs
with the f8 values upcast, so its numerics are checked here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

HISTORY = 1024  # steps of amax history per tensor: Transformer Engine's and MaxText's default length
SCALES_SUFFIX = "_fp8"  # a projection's `Fp8Scales` attribute is its weight's name + this: `q_fp8`, `down_fp8`


def is_fp8_state(name: str) -> bool:
    """Whether a `/`-joined state path (`model/blocks/mlp/up_fp8/input_scale`) is FP8 scaling state, which a
    checkpoint holds beside the parameters and a reader of the parameters leaves out."""
    return any(part.endswith(SCALES_SUFFIX) for part in name.split("/"))


class Fp8Meta(nnx.Variable):
    """A scale ([1]) or an amax history ([HISTORY]) of one FP8 matmul operand, float32: train state, not a
    parameter (no optimizer, no weight decay); each step overwrites it with its gradient (the module doc)."""


class Fp8Scales(nnx.Module):
    """The delayed scales of one projection: input, kernel and output-gradient scale [1] (initially 1) and amax
    history [HISTORY] (initially 0); replicated on every device (a few KB per projection)."""

    def __init__(self, history: int = HISTORY):
        def meta(shape: tuple[int, ...], init) -> Fp8Meta:
            return Fp8Meta(init(shape, jnp.float32), out_sharding=(None,))

        self.input_scale, self.kernel_scale, self.grad_scale = (meta((1,), jnp.ones) for _ in range(3))
        self.input_history, self.kernel_history, self.grad_history = (meta((history,), jnp.zeros) for _ in range(3))

    def dot_general(self, compute_dtype: jnp.dtype) -> functools.partial:
        """`lax.dot_general`'s signature, run as Flax's scaled FP8 dot with this projection's scales."""
        return functools.partial(
            fp8_ops.fp8_scaled_dot_general,
            lhs_scale=self.input_scale[...], rhs_scale=self.kernel_scale[...], grad_scale=self.grad_scale[...],
            lhs_amax_history=self.input_history[...], rhs_amax_history=self.kernel_history[...],
            grad_amax_history=self.grad_history[...], quantize_compute_type=compute_dtype,
        )  # fmt: skip


def project(
    equation: str,
    x: jax.Array,
    w: jax.Array | nnx.Variable,
    scales: Fp8Scales | None = None,
    *,
    dtype: str | None = None,
) -> jax.Array:
    """`jnp.einsum(equation, x, w)` for a projection that contracts x's trailing dims with w's leading ones and
    keeps the rest in order (`bse,ehd->bshd`, `bshd,hde->bse`, `bse,em->bsm`, ...); with `scales`, in FP8.

    x: [..., contracted] in the compute dtype; w: [contracted, ...] already cast to it, or the weight's
    `nnx.Param` itself, read and cast to `dtype` here. The model passes the parameter: what an interceptor of this
    function (qwix's LoRA, `spmdkit.models.lora`) needs to know which weight a projection reads. The FP8 form is
    one `dot_general` whose result is x's free dims then w's (the einsum's order, checked)."""
    if isinstance(w, nnx.Variable):
        w = w[...].astype(dtype or w.dtype)
    if scales is None:
        return jnp.einsum(equation, x, w)
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    contracted = len([d for d in rhs if d not in out])
    if lhs[len(lhs) - contracted :] != rhs[:contracted] or out != lhs[: len(lhs) - contracted] + rhs[contracted:]:
        raise ValueError(f"{equation!r} is not a projection over x's trailing dims")
    dims = ((tuple(range(x.ndim - contracted, x.ndim)), tuple(range(contracted))), ((), ()))
    return scales.dot_general(x.dtype)(x, w, dims, preferred_element_type=x.dtype)
