"""The all-to-alls of Ulysses: a sequence split traded for a head split over (groups of) the context axis.

Per device, inside a `shard_map` manual over `axis` (C devices), with U devices per group (U = C: one group, plain
Ulysses; U < C: groups of U consecutive devices, the Ulysses factor of 2D context parallelism, whose groups are
the ring's positions):

    to_heads   [b, s/C, h, d]  ->  [b, s*U/C, h/U, d]     (gather the group's sequence, keep 1/U of the heads)
    to_seq     [b, s*U/C, h/U, d]  ->  [b, s/C, h, d]     (its inverse)

The sequence gathered is the group's pieces in device order, so a layout contiguous over the devices stays one
over the groups. `kv_repeat` says how often each device repeats its kv heads so that U devices split them;
`fold_repeats` sums the gradients of the copies back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from spmdkit.errors import SpmdkitError

__all__ = ["fold_repeats", "gather_seq", "kv_repeat", "to_heads", "to_seq"]


def _groups(axis_size: int, group: int) -> list[list[int]] | None:
    """Consecutive groups of `group` devices over the axis, or None (the whole axis is one group)."""
    if group == axis_size:
        return None
    return [list(range(start, start + group)) for start in range(0, axis_size, group)]


def to_heads(x: jax.Array, axis: str, group: int, seq_axis: int = 1, heads_axis: int = 2) -> jax.Array:
    """[.., s/C, .., h, ..] -> [.., s U/C, .., h/U, ..] over groups of `group` devices of `axis`."""
    groups = _groups(lax.axis_size(axis), group)
    return lax.all_to_all(x, axis, heads_axis, seq_axis, tiled=True, axis_index_groups=groups)


def to_seq(x: jax.Array, axis: str, group: int, seq_axis: int = 1, heads_axis: int = 2) -> jax.Array:
    """The inverse of `to_heads`: [.., s U/C, .., h/U, ..] -> [.., s/C, .., h, ..]."""
    groups = _groups(lax.axis_size(axis), group)
    return lax.all_to_all(x, axis, seq_axis, heads_axis, tiled=True, axis_index_groups=groups)


def gather_seq(x: jax.Array, axis: str, group: int) -> jax.Array:
    """[b, s/C] (segment ids) -> [b, s U/C]: the group's sequence, on every device of the group (an all-to-all of
    U copies: all-gather has no groups inside a `shard_map`)."""
    copies = jnp.broadcast_to(x[:, None], (x.shape[0], group, x.shape[1]))
    return to_heads(copies, axis, group, seq_axis=2, heads_axis=1)[:, 0]


def kv_repeat(kv_heads: int, heads: int, degree: int) -> int:
    """How many times each device repeats its `kv_heads` so that `degree` devices split them: U / gcd(kv, U),
    1 when they split already. `heads`: the device's query heads (divisible by `degree`, so the repeat divides
    the group heads / kv_heads)."""
    repeat = degree // math.gcd(kv_heads, degree)
    if heads % degree or (heads // kv_heads) % repeat:
        raise SpmdkitError(f"Ulysses: {heads} heads per device do not split over {degree} devices")
    return repeat


def fold_repeats(dkv: jax.Array, repeat: int) -> jax.Array:
    """[b, s, kv x repeat, d] gradients of repeated kv heads -> [b, s, kv, d], the copies summed."""
    if repeat == 1:
        return dkv
    b, s, heads, d = dkv.shape
    return dkv.reshape(b, s, heads // repeat, repeat, d).sum(3)
