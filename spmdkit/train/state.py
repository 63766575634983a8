"""The train state: model parameters and optimizer state, born sharded, each under its own table.

Parameters follow `rules.params`; the optimizer's moments follow `rules.optimizer` (ZeRO-1/2 shard them over
`fsdp` while parameters stay replicated); scalars (step counts) are replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from spmdkit.models import Transformer, TransformerConfig
from spmdkit.sharding.partition import abstract_state, state_shardings
from spmdkit.sharding.rules import Rules


@dataclasses.dataclass
class TrainState:
    """`state` is the pure pytree of (model, optimizer); `graphdef` rebuilds the modules from it."""

    graphdef: nnx.GraphDef
    state: nnx.State
    shardings: Any  # tree of NamedSharding matching `state`
    grad_shardings: Any  # tree of NamedSharding matching the parameters' gradients

    @property
    def model(self) -> Transformer:
        return nnx.merge(self.graphdef, self.state)[0]

    def params(self) -> nnx.State:
        return nnx.state(self.model, nnx.Param)


def train_state_maker(
    config: TransformerConfig, tx: optax.GradientTransformation, seed: int = 0
) -> Callable[[], tuple[Transformer, nnx.Optimizer]]:
    """A function that builds (model, optimizer): what `abstract_state` traces and `create_train_state` runs."""

    def make() -> tuple[Transformer, nnx.Optimizer]:
        model = Transformer(config, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return make


def train_state_shardings(abstract: nnx.State, mesh: Mesh, rules: Rules) -> Any:
    """Model part under the parameter table, optimizer part under the optimizer table."""
    return state_shardings(abstract, mesh, lambda path: rules.params if path[0].key == 0 else rules.optimizer)


def abstract_train_state(
    config: TransformerConfig, tx: optax.GradientTransformation, mesh: Mesh, rules: Rules, seed: int = 0
) -> tuple[nnx.GraphDef, nnx.State, Any]:
    """(graphdef, abstract state, shardings) of model + optimizer on `mesh`; nothing is allocated."""
    graphdef, abstract = abstract_state(train_state_maker(config, tx, seed))
    return graphdef, abstract, train_state_shardings(abstract, mesh, rules)


def gradient_shardings(graphdef: nnx.GraphDef, abstract: nnx.State, mesh: Mesh, rules: Rules) -> Any:
    """Shardings of the parameters' gradients: the optimizer's table under ZeRO-2 (reduce-scattered), else the
    parameters'."""
    param_abstract = nnx.state(nnx.merge(graphdef, abstract)[0], nnx.Param)
    grad_table = rules.optimizer if rules.gradients_like_optimizer else rules.params
    return state_shardings(param_abstract, mesh, grad_table)


def create_train_state(
    config: TransformerConfig, tx: optax.GradientTransformation, mesh: Mesh, rules: Rules, seed: int = 0
) -> TrainState:
    """Initialise model + optimizer inside `jax.jit` with sharded outputs (no full copy on any device)."""
    make = train_state_maker(config, tx, seed)
    graphdef, abstract, shardings = abstract_train_state(config, tx, mesh, rules, seed)
    grad_shardings = gradient_shardings(graphdef, abstract, mesh, rules)

    def create() -> nnx.State:
        with nnx.use_eager_sharding(False):
            return nnx.state(make())

    with jax.set_mesh(mesh):
        state = jax.jit(create, out_shardings=shardings)()
    return TrainState(graphdef, state, shardings, grad_shardings)
