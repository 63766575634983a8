"""A per-device function inside a partly manual region, differentiable: `nested_region`.

The trainer runs the model inside a `shard_map` that is manual over some axes already (pipeline stages, gradient
accumulation over replica axes). A kernel that must be per device on the rest (cuDNN's fused attention, Ulysses'
all-to-alls around it) nests a second `shard_map` over those. JAX's transpose of such a nested region fails its own
check (it drops the cotangents' varying axes; with `check_vma=True` Shardy binds the outer axes twice:
docs/jax-limits.md), so the backward is written here: a `custom_vjp` whose backward is one more nested region that
takes the function's vjp per device (recomputing its forward).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["nested_region"]


def _varying(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes `x` varies over (its type's, JAX >= 0.11)."""
    return jax.typeof(x).manual_axis_type.varying


def _varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` typed as varying over the manual axes `like` varies over (a type cast: nothing moves)."""
    missing = tuple(sorted(_varying(like) - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def nested_region(local: Callable[..., Any], specs: tuple, out_spec: Any, free: set[str], *args: jax.Array) -> Any:
    """`local(*args)` per device, manual over the `free` axes too: a `shard_map` nested over the context's abstract
    mesh (`specs`: the args' partition specs over the free axes, `out_spec` the output's: an array's, or a tuple's
    for a tuple of arrays) for the forward, and
    another for the backward, which takes `local`'s vjp per device (its forward recomputed there). Gradients flow
    to the floating-point args; output and cotangents are typed as varying over the manual axes the inputs vary
    over. `local` may hold collectives over the free axes (their transposes run in the backward region)."""
    nested = functools.partial(jax.shard_map, mesh=jax.sharding.get_abstract_mesh(), axis_names=free)
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))

    def local_backward(*inputs: jax.Array) -> tuple[jax.Array, ...]:
        *primals, ct = inputs

        def call(*diff: jax.Array) -> jax.Array:
            full = list(primals)
            for i, a in zip(floats, diff, strict=True):
                full[i] = a
            return local(*full)

        return jax.vjp(call, *(primals[i] for i in floats))[1](ct)

    @jax.custom_vjp
    def typed(*inputs: jax.Array) -> jax.Array:
        out = nested(local, in_specs=specs, out_specs=out_spec, check_vma=False)(*inputs)
        return jax.tree.map(lambda x: _varying_like(x, inputs[floats[0]]), out)

    def forward(*inputs: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return typed(*inputs), inputs

    def backward(inputs: tuple[jax.Array, ...], ct: jax.Array) -> tuple[jax.Array | None, ...]:
        region = nested(local_backward, in_specs=(*specs, out_spec), out_specs=tuple(specs[i] for i in floats))
        grads = dict(zip(floats, region(*inputs, ct), strict=True))
        return tuple(_varying_like(grads[i], a) if i in grads else None for i, a in enumerate(inputs))

    typed.defvjp(forward, backward)
    return typed(*args)
