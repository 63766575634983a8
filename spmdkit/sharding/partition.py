"""Apply the rules to whole pytrees: shardings for an NNX state, and modules born sharded.

`state_shardings(state, mesh, table)` reads each variable's logical names (the `out_sharding` metadata the
model gave it) and returns a matching tree of `NamedSharding`s. `init_sharded(make, mesh, rules)` builds any
NNX module inside `jax.jit` with those shardings as `out_shardings`, so every parameter is created directly
in its shards: no device ever holds a full copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdkit.sharding.logical import logical_to_spec
from spmdkit.sharding.rules import AxisTable, Rules


def _path_text(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def state_shardings(state: Any, mesh: Mesh, table: AxisTable | Callable[[tuple[Any, ...]], AxisTable]) -> Any:
    """A tree like `state` (an `nnx.State`, abstract or concrete) with a `NamedSharding` per leaf.

    `table` is one axis table, or a function of the leaf's key path returning the table for that leaf.
    Variables without logical names are replicated. Errors name the parameter path, shape and mesh axis.
    """

    def one(path: tuple[Any, ...], variable: Any) -> NamedSharding:
        names = getattr(variable, "out_sharding", None) if isinstance(variable, nnx.Variable) else None
        value = variable.get_value() if isinstance(variable, nnx.Variable) else variable
        if not names:
            return NamedSharding(mesh, PartitionSpec())
        leaf_table = table(path) if callable(table) else table
        return NamedSharding(mesh, logical_to_spec(names, value.shape, mesh, leaf_table, what=_path_text(path)))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_state(make: Callable[[], Any]) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and the abstract state (ShapeDtypeStructs with metadata) of `make()`; no allocation."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(make)
    return nnx.split(abstract)


def init_sharded[M](make: Callable[[], M], mesh: Mesh, rules: Rules, table: AxisTable | None = None) -> M:
    """Build `make()` (any NNX module, or a tuple of them) with every array born in its shards.

    `table` defaults to the parameter table; pass `rules.optimizer` for optimizer state.
    """
    graphdef, abstract = abstract_state(make)
    shardings = state_shardings(abstract, mesh, table or rules.params)

    @jax.jit
    def create() -> nnx.State:
        with nnx.use_eager_sharding(False):
            state = nnx.state(make())
        return jax.lax.with_sharding_constraint(state, shardings)

    with jax.set_mesh(mesh):
        state = jax.jit(create, out_shardings=shardings)()
    return nnx.merge(graphdef, state)
