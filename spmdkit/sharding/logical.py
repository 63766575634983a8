"""The JAX half of the rules: logical names -> `PartitionSpec`s over a mesh, and activation hints while tracing.

`logical_to_spec` maps one array's logical names through a rule table (checking that every mesh axis divides its
dimension); `use_rules(rules, mesh)` makes `constrain(x, names)` hint activation layouts with
`with_sharding_constraint` while a model is traced (a no-op without rules, so the model runs unchanged on one
device). Mesh axes of size 1 are dropped from the specs they would appear in: they cost nothing and clutter tables.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdkit.errors import SpmdkitError
from spmdkit.sharding.rules import REPLICATE_IF_INDIVISIBLE, AxisTable, Rules


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int] | None,
    mesh: Mesh,
    table: AxisTable,
    *,
    what: str = "array",
) -> PartitionSpec:
    """Logical names of each dim -> PartitionSpec over `mesh`, checking that every mapped axis divides.

    A mesh axis is used at most once per array (the first dim that asks gets it). With `shape=None` the
    divisibility check is skipped (for callers that only know the names).
    """
    used: set[str] = set()
    entries: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(names):
        if name is None:
            entries.append(None)
            continue
        if name not in table:
            raise SpmdkitError(f"{what}: logical axis {name!r} has no rule; known: {', '.join(sorted(table))}")
        axes = tuple(a for a in table[name] if mesh.shape.get(a, 1) > 1 and a not in used)
        size = math.prod(mesh.shape[a] for a in axes)
        if shape is not None and axes and shape[dim] % size:
            axis_text = "x".join(f"{a}={mesh.shape[a]}" for a in axes)
            if name in REPLICATE_IF_INDIVISIBLE:
                warnings.warn(
                    f"{what} {tuple(shape)}: dim {dim} ({name}={shape[dim]}) is not divisible by {axis_text}; "
                    f"replicating it",
                    stacklevel=2,
                )
                axes = ()
            else:
                raise SpmdkitError(
                    f"{what} of shape {tuple(shape)}: dim {dim} ({name}={shape[dim]}) is not divisible by mesh "
                    f"axis {axis_text}; change the model size or the mesh"
                )
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


# The rules and mesh in force while a model is traced; `constrain` reads them.
_ACTIVE: contextvars.ContextVar[tuple[Rules, Mesh] | None] = contextvars.ContextVar("spmdkit_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: Rules, mesh: Mesh) -> Iterator[None]:
    """Make `constrain` map logical names with `rules` over `mesh` (around tracing a sharded program)."""
    token = _ACTIVE.set((rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def suspend_rules() -> Iterator[None]:
    """Make `constrain` a no-op inside (for tracing a function on per-device shapes outside its shard_map)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> tuple[Rules, Mesh] | None:
    return _ACTIVE.get()


def live_axes(name: str) -> tuple[str, ...]:
    """The mesh axes (size > 1, not manual here) that the rules in force split logical axis `name` over; () without
    rules."""
    active = _ACTIVE.get()
    if active is None:
        return ()
    rules, mesh = active
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return tuple(a for a in rules.params[name] if mesh.shape.get(a, 1) > 1 and a not in manual)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Hint the sharding of activation `x` by the logical names of its dims; a no-op without rules.

    Inside a `shard_map` region the manual axes are already split off, so they are dropped from the hint.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    rules, mesh = active
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    table = {k: tuple(a for a in v if a not in manual) for k, v in rules.params.items()} if manual else rules.params
    spec = logical_to_spec(names, x.shape, mesh, table, what="activation")
    if manual:
        return jax.lax.with_sharding_constraint(x, spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
