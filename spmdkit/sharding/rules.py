"""Logical axis names -> mesh axes, and the strategy presets built from them.

The model names the dimensions of every parameter and activation with logical names; this module alone
decides which mesh axes they map onto. Parameter names: `embed, heads, kv_heads, head_dim, mlp, vocab,
experts, layers, norm`. Activation names: `batch`, `seq` (inside attention and MLP), `act_seq` (the
residual/norm regions, where sequence parallelism shards it over `tensor` too), `act_embed` (the residual
stream's width, never sharded: under FSDP the *weights'* `embed` goes to `fsdp`, the activations' doesn't),
and `heads, kv_heads, mlp, vocab` as for the weights.

| strategy | what the rules say |
|---|---|
| DP, HSDP, FSDP | `batch -> (data, fsdp, expert)`; ZeRO-3 also `embed -> fsdp` for parameters |
| ZeRO-1/2 | parameters replicated; optimizer state (and for ZeRO-2 gradients) `embed -> fsdp` |
| TP | `heads, kv_heads, mlp, vocab -> tensor` |
| SP | as TP, plus `act_seq -> tensor` |
| CP | `seq, act_seq -> context` |
| EP | `experts -> expert` (expert weights); tokens are split over `expert` like any batch axis |
| PP | `layers -> pipeline` |

Pure Python (no JAX): the planner reads the same tables. `spmdkit.sharding.logical` applies them to arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh_config import MeshConfig

AxisTable = Mapping[str, tuple[str, ...]]

# Logical names that fall back to replication (with a warning) when the mesh axis doesn't divide them:
# grouped-query attention has fewer KV heads than TP ranks at scale, and Megatron replicates them then.
REPLICATE_IF_INDIVISIBLE = frozenset({"kv_heads"})


@dataclasses.dataclass(frozen=True)
class Rules:
    """Two tables: one for parameters and activations, one for the optimizer state of each parameter.

    `gradients_like_optimizer` is ZeRO-2: gradients take the optimizer's (sharded) layout as soon as they
    are computed, so XLA reduce-scatters them instead of all-reducing.
    """

    params: AxisTable
    optimizer: AxisTable
    gradients_like_optimizer: bool = False
    zero_stage: int = 3
    sequence_parallel: bool = False


def make_rules(zero_stage: int = 3, sequence_parallel: bool = False) -> Rules:
    """The rule tables for a ZeRO stage (0 = plain DP over fsdp too, 1, 2, 3) and optional SP."""
    if zero_stage not in (0, 1, 2, 3):
        raise SpmdkitError(f"ZeRO stage {zero_stage} is not one of 0, 1, 2, 3")
    act_seq = ("context", "tensor") if sequence_parallel else ("context",)
    common = {
        # The batch is split over `expert` too: outside the MoE layers it is one more data-parallel axis.
        "batch": ("data", "fsdp", "expert"),
        "seq": ("context",),
        "act_seq": act_seq,
        "act_embed": (),
        "heads": ("tensor",),
        "kv_heads": ("tensor",),
        "head_dim": (),
        "mlp": ("tensor",),
        "vocab": ("tensor",),
        "experts": ("expert",),
        "layers": ("pipeline",),
        "norm": (),
    }
    sharded_embed = {**common, "embed": ("fsdp",)}
    replicated_embed = {**common, "embed": ()}
    return Rules(
        params=sharded_embed if zero_stage == 3 else replicated_embed,
        optimizer=sharded_embed if zero_stage >= 1 else replicated_embed,
        gradients_like_optimizer=zero_stage == 2,
        zero_stage=zero_stage,
        sequence_parallel=sequence_parallel,
    )


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named strategy: which axis takes the devices, the ZeRO stage and SP."""

    mesh: str
    zero_stage: int = 3
    sequence_parallel: bool = False
    help: str = ""


PRESETS: dict[str, Preset] = {
    "dp": Preset("data=-1", 0, help="data parallel: parameters replicated, gradients all-reduced"),
    "fsdp": Preset("fsdp=-1", 3, help="fully sharded (ZeRO-3): parameters, gradients, optimizer sharded"),
    "zero1": Preset("fsdp=-1", 1, help="ZeRO-1: optimizer state sharded, parameters replicated"),
    "zero2": Preset("fsdp=-1", 2, help="ZeRO-2: optimizer state and gradients sharded"),
    "zero3": Preset("fsdp=-1", 3, help="same as fsdp"),
    "hsdp": Preset("data=2,fsdp=-1", 3, help="FSDP inside a node, replicas across nodes"),
    "tp": Preset("tensor=-1", 3, help="tensor parallel (Megatron column/row)"),
    "sp": Preset("tensor=-1", 3, True, help="tensor + sequence parallel"),
    "cp": Preset("context=-1", 3, help="context parallel (ring attention)"),
    "ep": Preset("expert=-1", 3, help="expert parallel"),
    "pp": Preset("pipeline=-1", 1, help="pipeline parallel (ZeRO-1 partners it)"),
}


def preset(name: str) -> tuple[MeshConfig, Rules]:
    """A preset's mesh config and rules: `preset("zero2")`."""
    if name not in PRESETS:
        raise SpmdkitError(f"unknown strategy preset {name!r}: choose one of {', '.join(PRESETS)}")
    p = PRESETS[name]
    return MeshConfig.parse(p.mesh), make_rules(p.zero_stage, p.sequence_parallel)
