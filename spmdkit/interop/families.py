"""The Hugging Face families spmdkit runs, one table: for each `model_type`, what its config keys mean as
`TransformerConfig` fields (`read`), the keys a fresh `config.json` of the family gets (`write`), what its config
class assumes for a key left out (`defaults`), and how its tensors are laid out (`experts`, `fused`). Pure Python.

`read` returns only the family's own fields; the keys every family shares (sizes, heads, norm epsilon, RoPE, the
activation, tied embeddings) are read by `spmdkit.interop.hf_config`. What each family computes (transformers 5):

- llama, mistral, qwen2, qwen3, granite, smollm3: pre-norm blocks, SwiGLU; biases per `attention_bias` /
  `mlp_bias` (qwen2: q/k/v always); a sliding window on every layer (mistral, phi3, mixtral, qwen3_moe) or on
  the layers `layer_types` names (qwen2, qwen3, qwen2_moe, smollm3, gemma2, gemma3_text); per-head q/k norms
  (qwen3, qwen3_moe, gemma3_text); SmolLM3's layers without RoPE (`no_rope_layers`); Granite's multipliers.
- gemma, gemma2, gemma3_text: RMSNorm as (1 + w), the embedding times sqrt(hidden), tanh-GELU; gemma2/3 add norms
  after attention and the MLP, `query_pre_attn_scalar`, soft-capping (gemma2) and local RoPE bases (gemma3).
- olmo2: norms after attention and the MLP only, q/k norms over the whole projection.
- phi3: fused qkv and gate-up tensors, partial RoPE.
- mixtral, qwen3_moe, qwen2_moe: routed experts (dropless dispatch: transformers drops nothing), a gated shared
  expert (qwen2_moe), dense layers by `decoder_sparse_step` / `mlp_only_layers`.
- gpt_oss: attention sinks, q/k/v/o biases, sliding and full layers by `layer_types`, YaRN RoPE; routed experts
  with biases, a router with a bias, the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`), their gate and up
  interleaved in one `gate_up_proj` [experts, embed, 2 x mlp] (`experts` "gpt_oss").
- deepseek_v3: multi-head latent attention (low-rank q and kv, a RoPE key shared by the heads, interleaved RoPE,
  YaRN's mscale^2 on the softmax scale), sigmoid routing with a correction bias within groups of experts, shared
  experts, the first k layers dense; its multi-token-prediction layers (`mtp_key`) are the model's `mtp_depth`
  modules (`spmdkit.models.mtp`), as many as the files hold (`spmdkit.interop.sources.source_model`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from spmdkit.interop.hf_keys import Keys, shortest_period
from spmdkit.models.config import TransformerConfig

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Family:
    """One `model_type`: its class, readers and writers, and its tensor layout (`experts`: "mixtral" or "qwen"
    names of expert tensors, one per expert, "deepseek": qwen's with DeepSeek's router and shared experts, or
    "gpt_oss": one tensor of all; `fused`: Phi-3's qkv_proj / gate_up_proj; `mtp_key`: the key counting the
    multi-token-prediction layers stored after the last layer, spmdkit's `mtp_depth`)."""

    architecture: str
    read: Callable[[Keys, int], dict[str, Any]]
    write: Callable[[TransformerConfig], dict[str, Any]]
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    activation_key: str = "hidden_act"
    partial_rope: bool = False
    experts: str = ""
    fused: bool = False
    mtp_key: str = ""


def _types(model: TransformerConfig) -> list[str]:
    return [SLIDING if model.window_of(i) else FULL for i in range(model.layers)]


def _biases(keys: Keys, layers: int = 0, *, mlp: bool = True) -> dict[str, Any]:
    """`attention_bias` (q, k, v and o) and `mlp_bias` (with `mlp`); Llama's whole reader."""
    bias = bool(keys.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(keys.get("mlp_bias", False)) and mlp}


def _write_biases(model: TransformerConfig) -> dict[str, Any]:
    return {"attention_bias": model.qkv_bias, "mlp_bias": model.mlp_bias}


def _mistral(keys: Keys, layers: int) -> dict[str, Any]:
    return keys.window(None)


def _write_window_everywhere(model: TransformerConfig) -> dict[str, Any]:
    return {"sliding_window": model.sliding_window or None}


def _qwen_window(keys: Keys, layers: int) -> dict[str, Any]:
    """Qwen2/Qwen3: with `use_sliding_window`, the layers from `max_window_layers` on (or `layer_types`)."""
    if not keys.get("use_sliding_window"):
        return {}
    first = keys.integer("max_window_layers") if not keys.get("layer_types") else 0
    return keys.window(keys.layer_types(layers, [SLIDING if i >= first else FULL for i in range(layers)]))


def _write_qwen_window(model: TransformerConfig) -> dict[str, Any]:
    window = model.sliding_window
    return {"use_sliding_window": bool(window), "sliding_window": window or None, "max_window_layers": model.layers,
            "layer_types": _types(model)}  # fmt: skip


def _write_qwen3(model: TransformerConfig) -> dict[str, Any]:
    return {**_write_qwen_window(model), "attention_bias": model.qkv_bias}


def _qwen2(keys: Keys, layers: int) -> dict[str, Any]:
    return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, **_qwen_window(keys, layers)}


def _qwen3(keys: Keys, layers: int) -> dict[str, Any]:
    return {**_biases(keys, mlp=False), "qk_norm": True, **_qwen_window(keys, layers)}


def _gemma_common(keys: Keys) -> dict[str, Any]:
    if keys.get("use_bidirectional_attention"):
        raise keys.refuse("use_bidirectional_attention", "is not implemented: spmdkit runs causal LMs")
    embed = keys.integer("hidden_size")
    return {**_biases(keys, mlp=False), "norm_plus_one": True, "embed_scale": math.sqrt(embed)}


def _gemma(keys: Keys, layers: int) -> dict[str, Any]:
    activation = keys.get("hidden_act")
    return {**_gemma_common(keys), "activation": "gelu_pytorch_tanh" if activation == "gelu" else activation}


def _gemma2(keys: Keys, layers: int, pattern: int = 2) -> dict[str, Any]:
    default = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    return {
        **_gemma_common(keys),
        "post_norm": True,
        "attention_scale": keys.number("query_pre_attn_scalar") ** -0.5,
        "attention_softcap": keys.off_or_number("attn_logit_softcapping"),
        "logit_softcap": keys.off_or_number("final_logit_softcapping"),
        **keys.window(keys.layer_types(layers, default)),
    }


def _gemma3(keys: Keys, layers: int) -> dict[str, Any]:
    period = keys.get("sliding_window_pattern", keys.get("_sliding_window_pattern", 6))
    return {**_gemma2(keys, layers, period), "qk_norm": True}


def _write_gemma(model: TransformerConfig) -> dict[str, Any]:
    return {"hidden_act": model.activation, "attention_bias": model.qkv_bias}


def _write_gemma2(model: TransformerConfig) -> dict[str, Any]:
    scalar = round(model.attention_scale**-2, 9) if model.attention_scale else model.head_dim
    return {
        "hidden_activation": model.activation, "attention_bias": model.qkv_bias,
        "query_pre_attn_scalar": int(scalar) if scalar == int(scalar) else scalar,
        "attn_logit_softcapping": model.attention_softcap or None,
        "final_logit_softcapping": model.logit_softcap or None,
        "sliding_window": model.sliding_window or None, "layer_types": _types(model),
    }  # fmt: skip


def _olmo2(keys: Keys, layers: int) -> dict[str, Any]:
    return {**_biases(keys, mlp=False), "pre_norm": False, "post_norm": True, "qk_norm": True,
            "qk_norm_scope": "layer"}  # fmt: skip


def _phi3(keys: Keys, layers: int) -> dict[str, Any]:
    keys.zero("resid_pdrop", "embd_pdrop")
    return keys.window(None)


def _granite(keys: Keys, layers: int) -> dict[str, Any]:
    return {
        **_biases(keys),
        "embed_scale": keys.number("embedding_multiplier"),
        "residual_scale": keys.number("residual_multiplier"),
        "attention_scale": keys.number("attention_multiplier"),
        "logit_divisor": keys.number("logits_scaling"),
    }


def _write_granite(model: TransformerConfig) -> dict[str, Any]:
    return {**_write_biases(model), "embedding_multiplier": model.embed_scale,
            "residual_multiplier": model.residual_scale,
            "attention_multiplier": model.attention_scale or model.head_dim**-0.5,
            "logits_scaling": model.logit_divisor}  # fmt: skip


def _smollm3(keys: Keys, layers: int) -> dict[str, Any]:
    interval = keys.integer("no_rope_layer_interval")
    uses = keys.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(uses, list) or len(uses) != layers or set(uses) - {0, 1}:
        raise keys.refuse("no_rope_layers", f"must list 0 or 1 for each of the {layers} layers, got {uses!r}")
    pattern = shortest_period("".join("R" if use else "N" for use in uses))
    fields = {**_biases(keys), "rope_pattern": "" if pattern == "R" else pattern}
    if keys.get("use_sliding_window") and keys.get("sliding_window") is not None:
        default = [SLIDING if not use else FULL for use in uses]
        fields |= keys.window(keys.layer_types(layers, default))
    return fields


def _write_smollm3(model: TransformerConfig) -> dict[str, Any]:
    return {**_write_biases(model), "no_rope_layers": [int(model.rope_of(i)) for i in range(model.layers)],
            "use_sliding_window": bool(model.sliding_window), "sliding_window": model.sliding_window or None,
            "layer_types": _types(model)}  # fmt: skip


def _routed(keys: Keys, experts_key: str, renormalize: bool) -> dict[str, Any]:
    experts = keys.integer(experts_key if experts_key in keys.hf else "num_local_experts")
    top_k = keys.integer("num_experts_per_tok")
    if top_k == 1 and renormalize:
        raise keys.refuse("num_experts_per_tok=1", "with renormalised weights (each 1) is not implemented")
    return {"experts": experts, "top_k": top_k, "router_renormalize": renormalize, "dispatch": "dropless"}


def _mixtral(keys: Keys, layers: int) -> dict[str, Any]:
    keys.zero("router_jitter_noise")
    return {**_routed(keys, "num_local_experts", True), **keys.window(None)}


def _write_mixtral(model: TransformerConfig) -> dict[str, Any]:
    return {"num_local_experts": model.experts, "num_experts_per_tok": model.top_k, "router_jitter_noise": 0.0,
            "sliding_window": model.sliding_window or None}  # fmt: skip


def _qwen_moe(keys: Keys, layers: int) -> dict[str, Any]:
    dense = keys.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
        raise keys.refuse(f"mlp_only_layers={dense!r}", f"must list layers 0..{layers - 1}")
    return {
        **_routed(keys, "num_experts", bool(keys.get("norm_topk_prob"))),
        "expert_mlp": keys.integer("moe_intermediate_size"),
        "moe_every": keys.integer("decoder_sparse_step"),
        "dense_layers": tuple(sorted(set(dense))),
    }


def _qwen3_moe(keys: Keys, layers: int) -> dict[str, Any]:
    window = keys.window(None) if keys.get("use_sliding_window") else {}
    return {**_biases(keys, mlp=False), "qk_norm": True, **_qwen_moe(keys, layers), **window}


def _qwen2_moe(keys: Keys, layers: int) -> dict[str, Any]:
    shared = keys.integer("shared_expert_intermediate_size")
    fields = {"qkv_bias": bool(keys.get("qkv_bias", True)), "o_bias": False, "mlp_bias": False}
    fields |= {**_qwen_moe(keys, layers), "shared_expert": shared > 0, "shared_expert_gate": shared > 0}
    if shared:
        fields["shared_expert_mlp"] = shared
    if keys.get("use_sliding_window"):
        first = keys.integer("max_window_layers")
        default = [SLIDING if (i + 1) % 2 and i < first else FULL for i in range(layers)]
        fields |= keys.window(keys.layer_types(layers, default))
    return fields


def _write_qwen_moe(model: TransformerConfig) -> dict[str, Any]:
    return {
        "num_experts": model.experts, "num_experts_per_tok": model.top_k, "norm_topk_prob": model.router_renormalize,
        "moe_intermediate_size": model.routed_mlp, "decoder_sparse_step": model.moe_every,
        "mlp_only_layers": list(model.dense_layers), "use_sliding_window": bool(model.sliding_window),
        "sliding_window": model.sliding_window or None,
    }  # fmt: skip


def _write_qwen3_moe(model: TransformerConfig) -> dict[str, Any]:
    return {**_write_qwen_moe(model), "attention_bias": model.qkv_bias}


def _write_qwen2_moe(model: TransformerConfig) -> dict[str, Any]:
    shared = (model.shared_expert_mlp or model.mlp) if model.shared_expert else 0
    return {**_write_qwen_moe(model), "qkv_bias": model.qkv_bias, "shared_expert_intermediate_size": shared,
            "max_window_layers": model.layers, "layer_types": _types(model)}  # fmt: skip


def _gpt_oss(keys: Keys, layers: int) -> dict[str, Any]:
    default = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    return {
        **_biases(keys, mlp=False), **_routed(keys, "num_local_experts", True), "attention_sinks": True,
        "router_bias": True, "expert_bias": True, "swiglu_limit": keys.number("swiglu_limit"),
        "swiglu_alpha": keys.number("swiglu_alpha"), **keys.window(keys.layer_types(layers, default)),
    }  # fmt: skip


def _write_gpt_oss(model: TransformerConfig) -> dict[str, Any]:
    return {"attention_bias": model.qkv_bias, "num_local_experts": model.experts, "num_experts_per_tok": model.top_k,
            "swiglu_limit": model.swiglu_limit, "swiglu_alpha": model.swiglu_alpha,
            "sliding_window": model.sliding_window or None, "layer_types": _types(model)}  # fmt: skip


def _deepseek_v3(keys: Keys, layers: int) -> dict[str, Any]:
    """DeepSeek-V3: latent attention (q_lora_rank null: a plain q_proj), sigmoid routing with a correction bias
    within groups, shared experts of n_shared_experts x moe_intermediate_size, the first k layers dense. Its
    multi-token-prediction layers (`num_nextn_predict_layers`) are counted from the files, not read here
    (transformers' default writes 1 with none stored): `spmdkit.interop.sources.source_model`."""
    heads, kv_heads = (
        keys.integer("num_attention_heads"),
        keys.get("num_key_value_heads") or keys.hf["num_attention_heads"],
    )
    if kv_heads != heads:
        raise keys.refuse(
            f"num_key_value_heads={kv_heads}", f"must equal num_attention_heads={heads} (latent attention)"
        )
    rope, nope = keys.integer("qk_rope_head_dim"), keys.integer("qk_nope_head_dim")
    block = keys.get("rope_scaling") or keys.get("rope_parameters") or {}
    scaled = block.get("rope_type", block.get("type", "default")) != "default"
    shared, dense = keys.integer("n_shared_experts"), keys.integer("first_k_dense_replace")
    routed = keys.integer("moe_intermediate_size")
    return {
        **_biases(keys, mlp=False), "kv_lora_rank": keys.integer("kv_lora_rank"),
        "q_lora_rank": keys.get("q_lora_rank") or 0, "qk_rope_head_dim": rope, "head_dim": nope + rope,
        "v_head_dim": keys.integer("v_head_dim"), "kv_heads": heads,
        "rope_interleave": bool(keys.get("rope_interleave")),
        "rope_mscale_all_dim": float(block.get("mscale_all_dim") or 0.0) if scaled else 0.0,
        **_routed(keys, "n_routed_experts", bool(keys.get("norm_topk_prob"))), "router_score": "sigmoid",
        "router_correction_bias": True, "router_groups": keys.integer("n_group"),
        "router_top_groups": keys.integer("topk_group"), "routed_scaling": keys.number("routed_scaling_factor"),
        "expert_mlp": routed, "shared_expert": shared > 0, "shared_expert_mlp": shared * routed,
        "dense_layers": tuple(range(min(dense, layers))),
    }  # fmt: skip


def _write_deepseek_v3(model: TransformerConfig) -> dict[str, Any]:
    shared = (model.shared_expert_mlp or model.mlp) // model.routed_mlp if model.shared_expert and model.experts else 0
    dense = len(model.dense_layers) if model.dense_layers == tuple(range(len(model.dense_layers))) else -1
    return {
        "attention_bias": model.qkv_bias, "q_lora_rank": model.q_lora_rank or None,
        "kv_lora_rank": model.kv_lora_rank, "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim, "head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.value_head_dim, "rope_interleave": model.rope_interleave,
        "n_routed_experts": model.experts, "num_experts_per_tok": model.top_k,
        "norm_topk_prob": model.router_renormalize, "n_group": model.router_groups,
        "topk_group": model.router_top_groups, "routed_scaling_factor": model.routed_scaling,
        "moe_intermediate_size": model.routed_mlp, "n_shared_experts": shared, "first_k_dense_replace": dense,
        "num_nextn_predict_layers": model.mtp_depth,
    }  # fmt: skip


# What each family's transformers config class (transformers 5) assumes for a key left out; a key it derives
# from others (num_key_value_heads: the heads; head_dim: hidden / heads; layer_types) is derived by the readers.
_LLAMA = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
          "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
          "tie_word_embeddings": False, "hidden_act": "silu"}  # fmt: skip
_MISTRAL = _LLAMA | {"intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072}
_QWEN = _LLAMA | {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32, "sliding_window": 4096,
                  "max_window_layers": 28, "max_position_embeddings": 32768}  # fmt: skip
_GEMMA = _LLAMA | {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
                   "tie_word_embeddings": True, "sliding_window": 4096, "query_pre_attn_scalar": 256,
                   "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
_GEMMA2 = _GEMMA | {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_GEMMA1 = _GEMMA | {"hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "hidden_act": "gelu_pytorch_tanh"}  # fmt: skip
_GEMMA3 = _GEMMA | {"vocab_size": 262208, "max_position_embeddings": 131072, "rope_theta": 1e6,
                    "rope_local_base_freq": 10_000.0}  # fmt: skip
_MOE = {"hidden_size": 2048, "num_hidden_layers": 24, "decoder_sparse_step": 1, "norm_topk_prob": False,
        "mlp_only_layers": []}  # fmt: skip
_QWEN3_MOE = _QWEN | _MOE | {"intermediate_size": 6144, "num_key_value_heads": 4, "head_dim": 128,
                             "num_local_experts": 128, "num_experts_per_tok": 8,
                             "moe_intermediate_size": 768}  # fmt: skip
_QWEN2_MOE = _QWEN | _MOE | {"intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 16,
                             "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                             "shared_expert_intermediate_size": 5632}  # fmt: skip
_SMOLLM3 = _LLAMA | {"vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
                     "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 2e6,
                     "tie_word_embeddings": True, "no_rope_layer_interval": 4}  # fmt: skip
_MIXTRAL = _MISTRAL | {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2}
_OLMO2 = _LLAMA | {"vocab_size": 50304, "rms_norm_eps": 1e-5}
_PHI3 = _LLAMA | {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 4096,
                  "rms_norm_eps": 1e-5}  # fmt: skip
_GRANITE = _LLAMA | dict.fromkeys(("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                   "logits_scaling"), 1.0)  # fmt: skip
_GPT_OSS = _LLAMA | {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150_000.0,
                     "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                     "attention_bias": True, "rope_parameters": {
                         "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096}}  # fmt: skip
_DEEPSEEK_V3 = _LLAMA | {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
                         "num_attention_heads": 128, "num_key_value_heads": 128, "max_position_embeddings": 4096,
                         "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 256,
                         "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
                         "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
                         "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                         "rope_interleave": True}  # fmt: skip

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", _biases, _write_biases, _LLAMA),
    "mistral": Family("MistralForCausalLM", _mistral, _write_window_everywhere, _MISTRAL | {"sliding_window": 4096}),
    "qwen2": Family("Qwen2ForCausalLM", _qwen2, _write_qwen_window, _QWEN),
    "qwen3": Family("Qwen3ForCausalLM", _qwen3, _write_qwen3, _QWEN | {"head_dim": 128}),
    "gemma": Family("GemmaForCausalLM", _gemma, _write_gemma, _GEMMA1),
    "gemma2": Family("Gemma2ForCausalLM", _gemma2, _write_gemma2, _GEMMA2, activation_key="hidden_activation"),
    "gemma3_text": Family("Gemma3ForCausalLM", _gemma3, _write_gemma2, _GEMMA3, activation_key="hidden_activation"),
    "olmo2": Family("Olmo2ForCausalLM", _olmo2, lambda m: {"attention_bias": m.qkv_bias}, _OLMO2),
    "phi3": Family("Phi3ForCausalLM", _phi3, _write_window_everywhere, _PHI3, partial_rope=True, fused=True),
    "granite": Family("GraniteForCausalLM", _granite, _write_granite, _GRANITE),
    "smollm3": Family("SmolLM3ForCausalLM", _smollm3, _write_smollm3, _SMOLLM3),
    "mixtral": Family("MixtralForCausalLM", _mixtral, _write_mixtral, _MIXTRAL, experts="mixtral"),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", _qwen3_moe, _write_qwen3_moe, _QWEN3_MOE, experts="qwen"),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", _qwen2_moe, _write_qwen2_moe, _QWEN2_MOE, experts="qwen"),
    "gpt_oss": Family("GptOssForCausalLM", _gpt_oss, _write_gpt_oss, _GPT_OSS, experts="gpt_oss"),
    "deepseek_v3": Family(
        "DeepseekV3ForCausalLM",
        _deepseek_v3,
        _write_deepseek_v3,
        _DEEPSEEK_V3,
        experts="deepseek",
        mtp_key="num_nextn_predict_layers",
    ),
}
