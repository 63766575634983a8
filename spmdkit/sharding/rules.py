"""Logical axis names -> mesh axes, and the strategy presets built from them.

The model names the dimensions of every parameter and activation with logical names; this module alone
decides which mesh axes they map onto. Parameter names: `embed, heads, kv_heads, head_dim, mlp, vocab,
experts, layers, norm`. Activation names: `batch`, `seq` (inside attention and MLP), `act_seq` (the
residual/norm regions, where sequence parallelism shards it over `tensor` too), `act_embed` (the residual
stream's width, never sharded: under FSDP the *weights'* `embed` goes to `fsdp`, the activations' doesn't),
and `heads, kv_heads, mlp, vocab` as for the weights.

| strategy | what the rules say |
|---|---|
| DP, HSDP, FSDP | `batch -> (data, fsdp, expert)`; ZeRO-3 also `embed -> (fsdp, context, expert)` for parameters |
| ZeRO-1/2 | parameters replicated; optimizer state (and for ZeRO-2 gradients) `embed -> (fsdp, context, expert)` |
| TP | `heads, kv_heads, mlp, vocab -> tensor` |
| SP | as TP, plus `act_seq -> tensor` |
| CP | `seq, act_seq -> context`; the state is sharded over `context` with `fsdp` (ZeRO over both) |
| EP | `experts -> expert` (expert weights); tokens and the other weights' state are split over `expert` too |
| PP | `layers -> pipeline` |

Your own model's names: `make_rules(extra={"patch": None, "channels": "tensor"})` adds (or overrides) names,
each mapped to a mesh axis, a tuple of them, or None (replicated), the values Flax's `logical_axis_rules` takes.
`Rules.to_flax()` gives that sequence of `(logical_name, mesh_axes)` pairs (for `nnx.logical_axis_rules`), and
`Rules.from_flax(pairs)` takes a whole table in that form. A mesh axis that is not one of `AXES` is refused.

Pure Python (no JAX): the planner reads the same tables. `spmdkit.sharding.logical` applies them to arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh_config import AXES, MeshConfig
from spmdkit.sharding.strategy import Strategy

AxisTable = Mapping[str, tuple[str, ...]]
# One rule's right-hand side as Flax writes it: a mesh axis, a tuple of them, or None (replicated).
FlaxAxes = str | tuple[str, ...] | None

# Logical names that fall back to replication (with a warning) when the mesh axis doesn't divide them:
# grouped-query attention has fewer KV heads than TP ranks at scale, and Megatron replicates them then.
REPLICATE_IF_INDIVISIBLE = frozenset({"kv_heads", "latent"})


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
    overlap_tp: bool = False  # SP's projections as collective matmuls (`spmdkit.parallel.collective_matmul`)
    ulysses: int = 1  # 2D context parallelism: the Ulysses factor of the context axis under the ring
    ring_layout: str = "zigzag"  # the ring's sequence layout (`spmdkit.parallel.context.chunks.ring_balance`)

    def to_flax(self, table: str = "params") -> tuple[tuple[str, FlaxAxes], ...]:
        """The `params` (or `"optimizer"`) table as Flax's logical axis rules: `(("batch", ("data", "fsdp",
        "expert")), ("embed", "fsdp"), ("norm", None), ...)`, for `nnx.logical_axis_rules` / `get_partition_spec`."""
        if table not in ("params", "optimizer"):
            raise SpmdkitError(f"Rules.to_flax: table {table!r} is not 'params' or 'optimizer'")
        return tuple((name, _to_flax_axes(axes)) for name, axes in getattr(self, table).items())

    @classmethod
    def from_flax(
        cls, pairs: Iterable[tuple[str, FlaxAxes]], optimizer: Iterable[tuple[str, FlaxAxes]] | None = None
    ) -> Rules:
        """Rules from Flax-style `(logical_name, mesh_axes)` pairs (a mesh axis, a tuple of them, or None); the
        optimizer state uses the same table unless `optimizer` gives its own. Each name appears once (spmdkit has no
        fallback rules: an axis already taken by an earlier dim of an array is simply left out)."""
        params = _axis_table(pairs, "Rules.from_flax")
        return cls(params=params, optimizer=params if optimizer is None else _axis_table(optimizer, "Rules.from_flax"))


def _to_flax_axes(axes: tuple[str, ...]) -> FlaxAxes:
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _mesh_axes(name: object, axes: object, where: str) -> tuple[str, ...]:
    """One rule's mesh axes as a tuple, refusing anything but `AXES` names (one line naming the rule)."""
    if not isinstance(name, str) or not name:
        raise SpmdkitError(f"{where}: logical axis name {name!r} is not a non-empty string")
    found = () if axes is None else (axes,) if isinstance(axes, str) else axes
    if not isinstance(found, (tuple, list)) or not all(isinstance(a, str) for a in found):
        raise SpmdkitError(f"{where}: logical axis {name!r} -> {axes!r}: give a mesh axis, a tuple of them, or None")
    if unknown := [a for a in found if a not in AXES]:
        raise SpmdkitError(
            f"{where}: logical axis {name!r} -> unknown mesh axis {unknown[0]!r}; mesh axes: {', '.join(AXES)}"
        )
    if len(set(found)) < len(found):
        raise SpmdkitError(f"{where}: logical axis {name!r} -> {tuple(found)} names a mesh axis twice")
    return tuple(found)


def _axis_table(
    pairs: Mapping[str, FlaxAxes] | Iterable[tuple[str, FlaxAxes]], where: str
) -> dict[str, tuple[str, ...]]:
    """A checked axis table from a mapping or from Flax's sequence of pairs (each name once)."""
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    table: dict[str, tuple[str, ...]] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise SpmdkitError(f"{where}: {item!r} is not a (logical_name, mesh_axes) pair")
        name, axes = item
        if name in table:
            raise SpmdkitError(
                f"{where}: logical axis {name!r} has two rules; give each name one (a tuple of mesh axes)"
            )
        table[name] = _mesh_axes(name, axes, where)
    return table


def make_rules(
    zero_stage: int = 3,
    sequence_parallel: bool = False,
    *,
    extra: Mapping[str, FlaxAxes] | Iterable[tuple[str, FlaxAxes]] | None = None,
    overlap_tp: bool = False,
    ulysses: int = 1,
    ring_layout: str = "zigzag",
) -> Rules:
    """The rule tables for a ZeRO stage (0 = plain DP over fsdp too, 1, 2, 3) and optional SP; `overlap_tp`: under
    SP, the projections run as collective matmuls (`--overlap-tp`); `ulysses`: the Ulysses factor of 2D context
    parallelism (`--context-parallel 2d --ulysses U`; 1: none); `ring_layout`: the sequence's layout over the ring
    ("zigzag", or "contiguous" for a model windowed everywhere).

    `extra` adds your own logical names, or overrides spmdkit's, in both tables: a mapping or Flax-style pairs,
    each name -> a mesh axis, a tuple of them, or None (replicated): `extra={"patch": None, "channels": "tensor"}`.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise SpmdkitError(f"ZeRO stage {zero_stage} is not one of 0, 1, 2, 3")
    own = _axis_table(extra or {}, "make_rules(extra=...)")
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
    # The state is sharded over context and expert too: their devices hold different tokens (they reduce gradients
    # like fsdp's), so a context- or expert-heavy mesh holds what an FSDP mesh of the same size holds (MaxText's ZeRO
    # over all three). An expert weight's `experts` dim takes `expert` first, so its `embed` shards over the rest.
    # Latent attention's low-rank dims (q_lora_rank, kv_lora_rank: q_b's and kv_b's inputs) are whole in compute
    # and sharded like `embed` in the state (replicated where they do not divide: a bias of kv_lora_rank + rope).
    state = ("fsdp", "context", "expert")
    sharded_embed = {**common, "embed": state, "latent": state, **own}
    replicated_embed = {**common, "embed": (), "latent": (), **own}
    return Rules(
        params=sharded_embed if zero_stage == 3 else replicated_embed,
        optimizer=sharded_embed if zero_stage >= 1 else replicated_embed,
        gradients_like_optimizer=zero_stage == 2,
        zero_stage=zero_stage,
        sequence_parallel=sequence_parallel,
        overlap_tp=overlap_tp,
        ulysses=ulysses,
        ring_layout=ring_layout,
    )


Preset = Strategy  # a preset's value before it was the one `Strategy`, kept for one release
PRESETS: dict[str, Strategy] = {
    "dp": Strategy("data=-1", 0),  # data parallel: parameters replicated, gradients all-reduced
    "fsdp": Strategy("fsdp=-1", 3),  # fully sharded (ZeRO-3): parameters, gradients, optimizer sharded
    "zero1": Strategy("fsdp=-1", 1),  # ZeRO-1: optimizer state sharded, parameters replicated
    "zero2": Strategy("fsdp=-1", 2),  # ZeRO-2: optimizer state and gradients sharded
    "zero3": Strategy("fsdp=-1", 3),  # same as fsdp
    "hsdp": Strategy("data=2,fsdp=-1", 3),  # FSDP inside a node, replicas across nodes
    "tp": Strategy("tensor=-1", 3),  # tensor parallel (Megatron column/row)
    "sp": Strategy("tensor=-1", 3, True),  # tensor + sequence parallel
    "cp": Strategy("context=-1", 3),  # context parallel (ring attention)
    "ep": Strategy("expert=-1", 3),  # expert parallel
    "pp": Strategy("pipeline=-1", 1),  # pipeline parallel (ZeRO-1 partners it)
}


def preset(name: str) -> tuple[MeshConfig, Rules]:
    """A preset's mesh config and rules: `preset("zero2")`."""
    if name not in PRESETS:
        raise SpmdkitError(f"unknown strategy preset {name!r}: choose one of {', '.join(PRESETS)}")
    p = PRESETS[name]
    return MeshConfig.parse(p.mesh), make_rules(p.zero, p.sequence_parallel)
