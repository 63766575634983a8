"""The model with its block stacks split into one set of arrays per layer: what generation holds and walks.

Training stacks the blocks' parameters on a leading `layers` dim and scans over it (flat compile time in depth). A
decode step is the other extreme: it reads every weight once per token and is bound by memory bandwidth, and XLA
copies the slice of a stacked array that a matmul reads (a `dynamic-slice` in the scan body; a static slice when
unrolled) before reading it: every weight would be read, written and read again per token. With one buffer per
layer (and a KV cache buffer per layer, `spmdkit.inference.cache`) the matmuls read the weights where they lie;
the walk over layers is unrolled (compile time grows with depth, once per shape bucket).

`split_layers(model)` -> (`LayerwiseDef`, params): the static part (graph definitions, the layer order) and the
arrays: the model without its stacks (embedding, final norm, LM head: what `embed` and `head` use) and one state
per layer, each keeping its sharding minus the `layers` dim. `merge_layers(definition, params)` -> `Layerwise`,
the modules to call (inside `jit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmdkit.models.layer_plan import STACKS, layer_order
from spmdkit.models.transformer import Block, Transformer


@dataclasses.dataclass(frozen=True)
class LayerwiseDef:
    """The static part: the graph of the model without its stacks, each stack's block graph, and which block of
    which stack every layer is, in layer order."""

    rest: nnx.GraphDef
    stacks: tuple[tuple[str, nnx.GraphDef], ...]
    order: tuple[tuple[str, int], ...]


class Layerwise(NamedTuple):
    """The modules a step calls: `model` (embed and head; its block stacks removed) and `blocks` in layer order."""

    model: Transformer
    blocks: tuple[Block, ...]


def _layer_sharding(array: jax.Array) -> Any:
    sharding = array.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return sharding


@jax.jit
def _take(array: jax.Array, index: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(array, index, axis=0, keepdims=False)


def _slice_layer(array: jax.Array, index: int) -> jax.Array:
    """array[index] as its own buffer, sharded as the stack was (minus the `layers` dim); for an abstract array
    (`ShapeDtypeStruct`: compiling without weights, `spmdkit compile --decode`) its abstract slice."""
    if isinstance(array, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(array.shape[1:], array.dtype, sharding=_layer_sharding(array))
    return jax.device_put(_take(array, index), _layer_sharding(array))


def split_layers(model: Transformer) -> tuple[LayerwiseDef, tuple[nnx.State, tuple[nnx.State, ...]]]:
    """(definition, (the model's other parameters, one state per layer)); `model` is left as it was."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)  # a second module over the same arrays, to take the stacks off
    stacks: dict[str, tuple[nnx.GraphDef, nnx.State]] = {}
    for name in STACKS:
        if hasattr(copy, name):
            stacks[name] = nnx.split(getattr(copy, name))
            delattr(copy, name)
    rest_graphdef, rest = nnx.split(copy)
    order = layer_order(model.config)
    layers = tuple(jax.tree.map(lambda a, i=i: _slice_layer(a, i), stacks[name][1]) for name, i in order)
    definition = LayerwiseDef(rest_graphdef, tuple((n, g) for n, (g, _) in stacks.items()), tuple(order))
    return definition, (rest, layers)


def merge_layers(definition: LayerwiseDef, params: tuple[nnx.State, tuple[nnx.State, ...]]) -> Layerwise:
    """The modules of `split_layers`' output (call inside the traced function that uses them)."""
    rest, layers = params
    graphs = dict(definition.stacks)
    blocks = tuple(nnx.merge(graphs[name], state) for (name, _), state in zip(definition.order, layers, strict=True))
    return Layerwise(nnx.merge(definition.rest, rest), blocks)


def shardings_of(params: Any) -> Any:
    """The sharding of every array of `params` (for `jit`'s in_shardings)."""
    return jax.tree.map(lambda a: a.sharding, params)
