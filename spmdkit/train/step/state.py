"""The train state: model parameters and optimizer state, born sharded, each under its own table.

Parameters follow `rules.params`; the optimizer's moments follow `rules.optimizer` (ZeRO-1/2 shard them over
`fsdp` while parameters stay replicated); scalars (step counts) are replicated. With `--optimizer.offload` the
moments live in pinned host memory (the JAX memory kind `pinned_host`) between steps: the optimizer brings them to
the device for its update and back (`spmdkit.train.step.optimizer.host_offloaded`), the train step's out_shardings keep
them there.
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
from spmdkit.models.lora import add_adapters, trained_variables
from spmdkit.models.lora_config import LoraConfig
from spmdkit.sharding.partition import abstract_state, state_shardings
from spmdkit.sharding.rules import Rules

HOST = "pinned_host"  # the memory kind of offloaded optimizer state (`--optimizer.offload`)


@dataclasses.dataclass
class TrainState:
    """`state` is the pure pytree of (model, optimizer); `graphdef` rebuilds the modules from it."""

    graphdef: nnx.GraphDef
    state: nnx.State
    shardings: Any  # tree of NamedSharding matching `state` (memory kind `pinned_host` for offloaded moments)
    grad_shardings: Any  # tree of NamedSharding matching the parameters' gradients


def train_state_maker(
    config: TransformerConfig, tx: optax.GradientTransformation, seed: int = 0, lora: LoraConfig | None = None
) -> Callable[[], tuple[Transformer, nnx.Optimizer]]:
    """A function that builds (model, optimizer): what `abstract_state` traces and `create_train_state` runs. With
    `lora` enabled the model carries qwix's adapters (`spmdkit.models.lora`) and the optimizer holds state for them
    only: the base parameters are frozen (no gradients, no moments)."""

    def make() -> tuple[Transformer, nnx.Optimizer]:
        model = Transformer(config, rngs=nnx.Rngs(seed))
        if lora is not None and lora.enabled:
            model = add_adapters(model, lora, nnx.Rngs(seed + 1))
        return model, nnx.Optimizer(model, tx, wrt=trained_variables(model))

    return make


def train_state_shardings(abstract: nnx.State, mesh: Mesh, rules: Rules, offload: bool = False) -> Any:
    """Model part under the parameter table, optimizer part under the optimizer table; with `offload`, the
    optimizer's arrays (the AdamW moments; not its scalars, the step counts) in pinned host memory."""
    shardings = state_shardings(abstract, mesh, lambda path: rules.params if path[0].key == 0 else rules.optimizer)
    if not offload:
        return shardings
    place = lambda sharding, host: sharding.with_memory_kind(HOST) if host else sharding  # noqa: E731
    return jax.tree.map(place, shardings, offloaded(abstract))


def offloaded(abstract: nnx.State) -> Any:
    """A tree like `abstract` (the train state) with True for the arrays `--optimizer.offload` keeps on the host:
    the optimizer's arrays of rank >= 1 (the AdamW moments); its scalars (step counts) stay on the device."""

    def host(path: tuple[Any, ...], variable: Any) -> bool:
        return path[0].key == 1 and len(variable.shape) > 0

    return jax.tree_util.tree_map_with_path(host, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_train_state(
    config: TransformerConfig,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    seed: int = 0,
    offload: bool = False,
    lora: LoraConfig | None = None,
) -> tuple[nnx.GraphDef, nnx.State, Any]:
    """(graphdef, abstract state, shardings) of model + optimizer on `mesh` (the moments on the host with
    `offload`); nothing is allocated."""
    graphdef, abstract = abstract_state(train_state_maker(config, tx, seed, lora))
    return graphdef, abstract, train_state_shardings(abstract, mesh, rules, offload)


def gradient_shardings(graphdef: nnx.GraphDef, abstract: nnx.State, mesh: Mesh, rules: Rules) -> Any:
    """Shardings of the trained parameters' gradients (every parameter's, or the LoRA adapters'): the optimizer's
    table under ZeRO-2 (reduce-scattered), else the parameters'."""
    model = nnx.merge(graphdef, abstract)[0]
    param_abstract = nnx.state(model, trained_variables(model))
    grad_table = rules.optimizer if rules.gradients_like_optimizer else rules.params
    return state_shardings(param_abstract, mesh, grad_table)


def create_train_state(
    config: TransformerConfig,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    seed: int = 0,
    offload: bool = False,
    lora: LoraConfig | None = None,
) -> TrainState:
    """Initialise model + optimizer inside `jax.jit` with sharded outputs (no full copy on any device; with
    `offload` the moments are written to pinned host memory; with `lora`, qwix's adapters on the model)."""
    make = train_state_maker(config, tx, seed, lora)
    graphdef, abstract, shardings = abstract_train_state(config, tx, mesh, rules, seed, offload, lora)
    grad_shardings = gradient_shardings(graphdef, abstract, mesh, rules)

    def create() -> nnx.State:
        with nnx.use_eager_sharding(False):
            return nnx.state(make())

    with jax.set_mesh(mesh):
        state = jax.jit(create, out_shardings=shardings)()
    return TrainState(graphdef, state, shardings, grad_shardings)
