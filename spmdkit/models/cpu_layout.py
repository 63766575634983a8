"""What XLA:CPU needs to run a sharded model fast, where the devices of a simulated mesh share the machine's cores.

Two facts of XLA:CPU (jaxlib 0.10-0.12) that GPU-shaped code pays for there:
- A bfloat16 matrix product runs in YNNPACK only as A [M, K] . B [K, N], both row-major. The two products of a
  matmul's backward, dX = dY . W^T and dW = X^T . dY, each have a transposed operand; XLA folds the transpose
  into the dot's dimension numbers and then runs the product in float32 on converted copies of both operands,
  2.6x slower (8 simulated devices, [2048, 4000] . [4000, 256]: 235 ms against 89 ms). `dense` copies the
  transposed operand into row-major order first (`row_major_t`).
- The collectives are memory copies made by the same cores that compute, so nothing hides them: the layout that
  moves fewer bytes is the faster one (`on_cpu` gates the layouts chosen for that: the embedding lookup in
  `layers.embed_tokens`, the vocab-parallel head in `loss`). On a GPU the weight gathers of FSDP are prefetched
  under the compute while activation collectives wait on the critical path, so the textbook layouts stay.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from spmdkit.models.device_facts import device_platform
from spmdkit.sharding.logical import active_rules, live_axes

__all__ = ["dense", "mesh_device", "on_cpu", "row_major_t", "token_groups"]


def mesh_device() -> jax.Device:
    """The first device of the mesh in force, else JAX's first device."""
    active = active_rules()
    return active[1].devices.flat[0] if active else jax.devices()[0]


def on_cpu() -> bool:
    """Whether the program being traced runs on XLA:CPU (the mesh in force, else JAX's first device)."""
    return device_platform(mesh_device()) == "cpu"


def token_groups() -> int | None:
    """How many device groups split the tokens [batch, seq] of an activation, batch-major (None when the sequence is
    split too: its groups are then not contiguous in the flattened tokens)."""
    if live_axes("seq"):
        return None
    active = active_rules()
    return math.prod(active[1].shape[a] for a in live_axes("batch")) if active else 1


def row_major_t(a: jax.Array) -> jax.Array:
    """a [..., n, m] -> [..., m, n] stored in that order. XLA folds a plain transpose into the consumer as a layout
    change; a reshape through one flat dim (held by an optimization barrier) pins the order. The leading dims keep
    their sharding (the flat dim merges only the last two)."""
    *lead, n, m = a.shape
    flat = lax.optimization_barrier(jnp.swapaxes(a, -1, -2).reshape(*lead, m * n))
    return flat.reshape(*lead, m, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense(x: jax.Array, w: jax.Array, groups: int) -> jax.Array:
    """x [..., K] . w [K, N] -> [..., N] in x's dtype (w is cast to it), the backward's two products as row-major
    A . B (module docstring); w's gradient comes in w's dtype, its sum over the groups in float32.

    `groups` (`token_groups`): the device groups that split x's leading (token) dims, batch-major; the weight's
    gradient is a product per group ([groups, K, N], each on its own devices) summed after, as the gradient's
    reduction over those devices would be.
    """
    return jnp.einsum("...k,kn->...n", x, w.astype(x.dtype))


def _dense_fwd(x: jax.Array, w: jax.Array, groups: int):
    return dense(x, w, groups), (x, w)


def _dense_bwd(groups: int, residuals, g: jax.Array):
    x, w = residuals
    g = g.astype(x.dtype)
    dx = jnp.einsum("...n,nk->...k", g, row_major_t(w.astype(x.dtype)))
    k, n = w.shape
    xt = row_major_t(x.reshape(groups, -1, k))  # [groups, K, tokens / groups]
    dw = jnp.einsum("gkt,gtn->gkn", xt, g.reshape(groups, -1, n)).astype(jnp.float32).sum(0)
    return dx, dw.astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)
