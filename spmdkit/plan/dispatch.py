"""`--moe-dispatch auto`: the planner's count of the expert FLOPs each dispatch executes, and the choice it makes.

Routed FLOPs are each token through its top_k experts (top_k x S rows per sequence). What each dispatch of
`spmdkit.parallel.experts` executes, per sequence of S tokens with E experts (C = the capacity,
`spmdkit.parallel.capacity`):

    capacity                E x C rows        E C / (k S) x routed   (1.25 x at the default factor, drops overflow)
    dropless, batch split   E x S rows        E / k x routed         (the capacity program with C = S)
    dropless, one shard     k x S rows        1 x routed             where `jax.lax.ragged_dot` compiles grouped,
                                              E x routed             where it compiles to a masked dense matmul
    dense (the reference)   E x S rows        E / k x routed

`auto` takes dropless (exact) where it executes no more than capacity, else capacity. Where `ragged_dot` is
grouped is a fact about the compiler, measured (`GROUPED_RAGGED_DOT`): on jaxlib 0.12.0.1 neither XLA:GPU (H100
target, deviceless, cuDNN 9.24 declared, `xla_gpu_experimental_use_ragged_dot_grouped_gemm` and
`xla_gpu_cudnn_gemm_fusion_level=3` tried) nor XLA:CPU emits a grouped GEMM: both lower it to dense dots.
Pure arithmetic (no JAX).
"""

from __future__ import annotations

from typing import NamedTuple

from spmdkit.models.config import TransformerConfig
from spmdkit.parallel.capacity import capacity

# Platforms (as `spmdkit.targets.device_facts.device_platform` names them: "cuda", "cpu", "tpu", ...) whose compiler
# turns `jax.lax.ragged_dot` into a grouped GEMM, forward and backward. None measured yet (the module docstring);
# TPU is untested here.
GROUPED_RAGGED_DOT: frozenset[str] = frozenset()


class DispatchChoice(NamedTuple):
    """The dispatch that runs, why (one line for the reports), and the planner's FLOPs ratio of each candidate."""

    dispatch: str
    reason: str
    ratios: dict[str, float]


def expert_flops_ratio(m: TransformerConfig, dispatch: str, seq_len: int, batch_split: bool, platform: str) -> float:
    """Executed expert FLOPs / routed ones of `dispatch` (the table above); `batch_split`: the experts run in
    `expert_ffn`'s shard_map (some batch axis > 1), `platform` the devices' (`cuda`, `cpu`, ...)."""
    e, k = m.experts, m.top_k
    if dispatch == "capacity":
        return e * capacity(seq_len, k, e, m.capacity_factor) / (k * seq_len)
    if dispatch == "dropless" and not batch_split:
        return 1.0 if platform in GROUPED_RAGGED_DOT else float(e)
    return e / k  # dense, or dropless with C = S slots per expert


def choose_dispatch(m: TransformerConfig, seq_len: int, batch_split: bool, platform: str) -> DispatchChoice:
    """`auto` for this model, sequence length, batch split and platform: dropless where it costs no more expert
    FLOPs than capacity (exact at no price), else capacity."""
    ratios = {d: expert_flops_ratio(m, d, seq_len, batch_split, platform) for d in ("dropless", "capacity")}
    if ratios["dropless"] <= ratios["capacity"]:
        return DispatchChoice("dropless", f"dropless: exact at {ratios['dropless']:.2f} x the routed FLOPs", ratios)
    why = "pads each expert to whole sequences" if batch_split else "compiles ragged_dot dense"
    return DispatchChoice(
        "capacity",
        f"capacity {m.capacity_factor}: {ratios['capacity']:.2f} x the routed FLOPs; dropless {why} here, "
        f"{ratios['dropless']:.2f} x",
        ratios,
    )


def resolve_dispatch(m: TransformerConfig, seq_len: int, batch_split: bool, platform: str) -> TransformerConfig:
    """`m` with `dispatch` "auto" replaced by `choose_dispatch`'s (any other dispatch unchanged)."""
    if m.dispatch != "auto" or not m.moe_layers:
        return m
    return m.replace(dispatch=choose_dispatch(m, seq_len, batch_split, platform).dispatch)
