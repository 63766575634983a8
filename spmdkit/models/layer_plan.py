"""What each layer of a model is, statically: dense or mixture of experts, global or local attention (its window),
with or without RoPE; and how the layers run as scans over the two block stacks.

Parameters live in two stacks (`blocks`: the dense blocks, `moe_blocks`: the MoE blocks; a leading `layers` dim
each), in layer order within each stack. A layer's *kind* is what its parameters do not say: the kernels
specialise on it (a local layer's blockwise kernel skips the key blocks outside its window), so it is a Python
value, not an array. Consecutive layers of one kind in one stack run as one `scan` (a *run*): a uniform model is
one run; Gemma 3's five local layers then one global make two runs per six layers.
"""

from __future__ import annotations

import dataclasses
import functools

from spmdkit.models.config import TransformerConfig

STACKS = ("blocks", "moe_blocks")


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """The static part of one layer: `moe` (an MoE block), `window` (its sliding window, 0: global), `rope`
    (whether it rotates q and k) and `local_rope` (it rotates by the local layers' RoPE base)."""

    moe: bool = False
    window: int = 0
    rope: bool = True
    local_rope: bool = False


@dataclasses.dataclass(frozen=True)
class Run:
    """Layers [start, stop) of stack `stack` (indices within the stack), all of kind `kind`, in layer order."""

    kind: LayerKind
    stack: str
    start: int
    stop: int


def layer_kind(config: TransformerConfig, layer: int) -> LayerKind:
    """The kind of layer `layer` (0-based)."""
    window = config.window_of(layer)
    local_rope = bool(window and config.local_rope_theta)
    return LayerKind(config.is_moe_layer(layer), window, config.rope_of(layer), local_rope)


@functools.cache
def layer_kinds(config: TransformerConfig) -> tuple[LayerKind, ...]:
    """Every layer's kind, in order."""
    return tuple(layer_kind(config, i) for i in range(config.layers))


def uniform(config: TransformerConfig) -> bool:
    """Every layer alike apart from dense/MoE (what a pipeline stage, which runs a slice of one stack, needs)."""
    return len({dataclasses.replace(k, moe=False) for k in layer_kinds(config)}) == 1


def layer_order(config: TransformerConfig) -> list[tuple[str, int]]:
    """(stack, index within the stack) of every layer, in layer order."""
    seen = {name: 0 for name in STACKS}
    order = []
    for kind in layer_kinds(config):
        stack = STACKS[kind.moe]
        order.append((stack, seen[stack]))
        seen[stack] += 1
    return order


def stack_sizes(config: TransformerConfig) -> dict[str, int]:
    """Blocks in each stack (a stack of 0 blocks is not built)."""
    return {"blocks": config.layers - config.moe_layers, "moe_blocks": config.moe_layers}


@functools.cache
def layer_runs(config: TransformerConfig) -> tuple[Run, ...]:
    """The layers as runs: maximal sequences of consecutive layers of one kind (hence one stack)."""
    runs: list[Run] = []
    for kind, (stack, index) in zip(layer_kinds(config), layer_order(config), strict=True):
        if runs and runs[-1].kind == kind:
            runs[-1] = dataclasses.replace(runs[-1], stop=index + 1)
        else:
            runs.append(Run(kind, stack, index, index + 1))
    return tuple(runs)
