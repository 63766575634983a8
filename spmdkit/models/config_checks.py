"""Checks of `TransformerConfig` fields that belong together (pure Python), kept beside the config to keep it short."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from spmdkit.errors import SpmdkitError

if TYPE_CHECKING:
    from spmdkit.models.config import TransformerConfig


def check_latent(config: TransformerConfig) -> None:
    """Multi-head latent attention's shape: its head dims, and what it cannot be combined with."""
    if min(config.kv_lora_rank, config.q_lora_rank, config.qk_rope_head_dim, config.v_head_dim) < 0:
        raise SpmdkitError("kv_lora_rank, q_lora_rank, qk_rope_head_dim and v_head_dim must be >= 0")
    if not config.kv_lora_rank:
        latent = config.q_lora_rank or config.qk_rope_head_dim or config.rope_interleave
        if latent or config.value_head_dim != config.head_dim:
            raise SpmdkitError(
                "q_lora_rank, qk_rope_head_dim, rope_interleave and a v_head_dim other than head_dim describe "
                "latent attention: set kv_lora_rank too, or drop them"
            )
        return
    rope = config.qk_rope_head_dim
    if not (0 < rope <= config.head_dim and rope % 2 == 0) or config.value_head_dim > config.head_dim:
        raise SpmdkitError(
            f"latent attention needs an even qk_rope_head_dim in 2..head_dim={config.head_dim} (got {rope}) and "
            f"v_head_dim <= head_dim (got {config.value_head_dim}): head_dim is qk_nope_head_dim + qk_rope_head_dim"
        )
    if config.kv_heads != config.heads or config.qk_norm or config.rope_fraction != 1.0 or config.fp8:
        raise SpmdkitError(
            "latent attention expands keys and values per query head (kv_heads = heads) and has no qk_norm, "
            "rope_fraction or fp8: drop them"
        )


def check_experts(config: TransformerConfig) -> None:
    """The mixture-of-experts fields: sizes, the router's groups, what the experts cannot be combined with."""
    if config.experts < 0 or not 1 <= config.top_k <= config.experts:
        raise SpmdkitError(f"top_k={config.top_k} must be between 1 and experts={config.experts}")
    if config.moe_every < 1 or not config.moe_layers:
        raise SpmdkitError(f"moe_every={config.moe_every} and dense_layers leave no mixture-of-experts layer")
    if sorted(set(config.dense_layers)) != list(config.dense_layers) or not set(config.dense_layers) <= set(
        range(config.layers)
    ):
        raise SpmdkitError(f"dense_layers={list(config.dense_layers)} must be increasing layers 0..{config.layers - 1}")
    if config.capacity_factor <= 0 or config.expert_mlp < 0 or config.shared_expert_mlp < 0:
        raise SpmdkitError("capacity_factor must be positive, expert_mlp and shared_expert_mlp >= 0")
    if config.mlp_bias or config.activation != "silu":
        raise SpmdkitError("mixture-of-experts models have SwiGLU experts without biases: drop mlp_bias/activation")
    if not (math.isfinite(config.swiglu_limit) and config.swiglu_limit >= 0 and config.swiglu_alpha > 0):
        raise SpmdkitError(f"swiglu_limit={config.swiglu_limit} must be >= 0 and swiglu_alpha > 0")
    groups, top = config.router_groups, config.router_top_groups
    per_group = config.experts // groups if groups > 0 else 0
    if groups < 1 or config.experts % groups or not 1 <= top <= groups or top * per_group < config.top_k:
        raise SpmdkitError(
            f"router_groups={groups} must divide experts={config.experts}, router_top_groups={top} be in 1..groups "
            f"and leave at least top_k={config.top_k} experts"
        )
    if groups > 1 and per_group < 2 or not (math.isfinite(config.routed_scaling) and config.routed_scaling > 0):
        raise SpmdkitError("router groups need 2 experts each (a group scores by its best two); routed_scaling > 0")
    if not (math.isfinite(config.balance_rate) and config.balance_rate >= 0):
        raise SpmdkitError(f"balance_rate={config.balance_rate} must be >= 0 (0: no auxiliary-loss-free balancing)")
    if config.shared_expert_gate and not config.shared_expert:
        raise SpmdkitError("shared_expert_gate gates the shared expert: set shared_expert too")


def check_dense(config: TransformerConfig) -> None:
    """A dense model (experts 0) sets none of the mixture-of-experts fields that change what a layer computes."""
    routing = config.router_score != "softmax" or config.router_correction_bias or config.router_groups != 1
    if config.dense_layers or config.router_bias or config.expert_bias or config.swiglu_limit or routing:
        raise SpmdkitError(
            "dense_layers, router_bias, expert_bias, swiglu_limit, router_score, router_correction_bias and "
            "router_groups describe mixture-of-experts layers: set experts, or drop them"
        )
    if config.balance_rate:
        raise SpmdkitError(
            f"balance_rate={config.balance_rate} balances the experts of a mixture-of-experts model; this one is "
            "dense (experts 0): set experts, or drop balance_rate"
        )


def check_mtp(config: TransformerConfig) -> None:
    """Multi-token prediction: a depth >= 0, a finite weight >= 0, and no FP8 blocks (their scales are untested)."""
    if config.mtp_depth < 0 or not (math.isfinite(config.mtp_weight) and config.mtp_weight >= 0):
        raise SpmdkitError(f"mtp_depth={config.mtp_depth} and mtp_weight={config.mtp_weight} must be >= 0")
    if config.mtp_depth and config.fp8:
        raise SpmdkitError("--model.mtp-depth with --model.fp8: the MTP blocks have no FP8 path yet; drop one")


def check_rope(config: TransformerConfig) -> None:
    """RoPE's factors, patterns and windows are in range."""
    if not (math.isfinite(config.rope_factor) and config.rope_factor > 0):
        raise SpmdkitError(f"rope_factor={config.rope_factor} must be positive")
    if config.rope_type == "llama3" and not 0 < config.rope_low_freq_factor < config.rope_high_freq_factor:
        raise SpmdkitError(
            f"llama3 RoPE needs 0 < rope_low_freq_factor ({config.rope_low_freq_factor}) < rope_high_freq_factor "
            f"({config.rope_high_freq_factor})"
        )
    if config.rope_type == "yarn" and not (config.rope_beta_fast > 0 and config.rope_beta_slow > 0):
        raise SpmdkitError("yarn RoPE needs positive rope_beta_fast and rope_beta_slow")
    if not (math.isfinite(config.rope_attention_factor) and config.rope_attention_factor >= 0):
        raise SpmdkitError(f"rope_attention_factor={config.rope_attention_factor} must be >= 0 (0: derived)")
    if config.rope_original_max_positions < 1 or config.max_positions < 0:
        raise SpmdkitError("rope_original_max_positions must be positive and max_positions >= 0")
    rotated = config.rotary_dims
    if not 0 < config.rope_fraction <= 1 or rotated < 2 or rotated % 2:
        raise SpmdkitError(f"rope_fraction={config.rope_fraction} must rotate an even number of head_dim's dims")
    for name, letters in (("rope_pattern", "RN"), ("window_pattern", "LG")):
        pattern = getattr(config, name)
        if set(pattern) - set(letters):
            raise SpmdkitError(f"{name}={pattern!r} may hold only the letters {' and '.join(letters)}")
    if config.sliding_window < 0 or not (math.isfinite(config.local_rope_theta) and config.local_rope_theta >= 0):
        raise SpmdkitError(f"sliding_window={config.sliding_window} and local_rope_theta must be >= 0")
    if not config.sliding_window and (config.window_pattern or config.local_rope_theta):
        raise SpmdkitError("window_pattern and local_rope_theta describe local layers: set sliding_window too")


def check_scales(config: TransformerConfig) -> None:
    """Attention and logit scales and caps are finite and in range."""
    for name in ("attention_scale", "attention_softcap", "logit_softcap"):
        if not (math.isfinite(getattr(config, name)) and getattr(config, name) >= 0):
            raise SpmdkitError(f"{name}={getattr(config, name)} must be a number >= 0 (0: off)")
    for name in ("logit_divisor", "embed_scale", "residual_scale"):
        if not (math.isfinite(getattr(config, name)) and getattr(config, name) > 0):
            raise SpmdkitError(f"{name}={getattr(config, name)} must be a positive number")
