"""`TransformerConfig` -> a Hugging Face `config.json` and `generation_config.json` (pure Python).

A model imported from Hugging Face keeps its config: when the model still computes what that config says, it is
written back as it was (its RoPE block, extra keys and style included), with only the dtype, token ids and
`max_position_embeddings` brought up to date. Otherwise a config of the family the model fits is built: `llama`
when q/k/v and o biases go together (`attention_bias`), `qwen2` for q/k/v biases alone, `qwen3` for q/k norms
(`qk_norm`, with or without q/k/v/o biases, no MLP biases). The RoPE block takes the
style of the transformers installed (5: `rope_parameters`; 4: `rope_theta` + `rope_scaling`), or both styles
when transformers is not installed, which either version reads the same way.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from spmdkit.errors import SpmdkitError
from spmdkit.interop.hf_config import FAMILIES, family_of, from_hf_config, function_of
from spmdkit.models.config import TransformerConfig

TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def transformers_major() -> int | None:
    """The major version of the installed transformers (read from its metadata, not imported), or None."""
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def family_for(model: TransformerConfig, preferred: str | None = None) -> str:
    """The Hugging Face family that computes what `model` does (`preferred` when both can)."""
    if model.experts:
        raise SpmdkitError("a mixture-of-experts model has no Llama/Qwen Hugging Face layout: export a dense model")
    fits = {
        "llama": model.qkv_bias == model.o_bias and not model.qk_norm,
        "qwen2": model.qkv_bias and not model.o_bias and not model.mlp_bias and not model.qk_norm,
        "qwen3": model.qkv_bias == model.o_bias and not model.mlp_bias and model.qk_norm,
    }
    if preferred in fits and fits[preferred]:
        return preferred
    for family, ok in fits.items():
        if ok:
            return family
    if model.qk_norm:
        raise SpmdkitError(
            "q/k norms fit only Hugging Face Qwen3, which has no MLP biases and biases on all of q, k, v and o or "
            "none (attention_bias): change qk_norm/qkv_bias/o_bias/mlp_bias"
        )
    raise SpmdkitError(
        "q/k/v biases without an output bias, together with MLP biases, fit neither Hugging Face Llama "
        "(attention_bias covers q, k, v and o) nor Qwen2 (no MLP biases): change qkv_bias/o_bias/mlp_bias"
    )


def _rope(model: TransformerConfig, places: set[str]) -> dict[str, Any]:
    """The RoPE keys, in the places given: "rope_parameters" (transformers 5), "rope_scaling" and a top-level
    "rope_theta" (transformers 4)."""
    scaling: dict[str, Any] = {"rope_type": model.rope_type}
    if model.rope_type != "default":
        scaling["factor"] = model.rope_factor
    if model.rope_type == "llama3":
        scaling |= {
            "low_freq_factor": model.rope_low_freq_factor,
            "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_max_positions,
        }
    out: dict[str, Any] = {}
    if "rope_parameters" in places:
        out["rope_parameters"] = {"rope_theta": model.rope_theta, **scaling}
    if "rope_scaling" in places:
        out["rope_scaling"] = scaling if model.rope_type != "default" else None
    if "rope_theta" in places:
        out["rope_theta"] = model.rope_theta
    return out


def _fresh(model: TransformerConfig, family: str, places: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": [FAMILIES[family]],
        "model_type": family,
        "vocab_size": model.vocab_size,
        "hidden_size": model.embed,
        "intermediate_size": model.mlp,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": model.activation,
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_dropout": 0.0,
        "use_cache": True,
        **_rope(model, places),
    }
    if family == "llama":
        out |= {"attention_bias": model.qkv_bias, "mlp_bias": model.mlp_bias}
    else:
        out |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": model.layers}
        out["layer_types"] = ["full_attention"] * model.layers
    if family == "qwen3":
        out["attention_bias"] = model.qkv_bias
    return out


def hf_config(
    model: TransformerConfig,
    *,
    dtype: str,
    max_positions: int,
    tokens: dict[str, int | None],
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `config.json` of `model`: stored `dtype`, `max_position_embeddings`, token ids (`tokens`: bos/eos/pad
    `*_token_id` -> id; a key left out keeps the base's value), and `base` (the config it was imported with)."""
    major = transformers_major()
    if base is not None and function_of(from_hf_config(base, "the imported config")) == function_of(model):
        out = dict(base)  # the model computes what its own config says: keep it, style and all
    else:
        preferred = family_of(base, "the imported config") if base is not None else None
        family = family_for(model, preferred)
        if base is not None:
            places = {key for key in ("rope_parameters", "rope_scaling", "rope_theta") if key in base}
        else:
            places = {"rope_parameters"} if major and major >= 5 else {"rope_theta", "rope_scaling"}
            places |= {"rope_parameters"} if major is None else set()
        kept = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        out = kept | _fresh(model, family, places or {"rope_parameters"})
    dtype_keys = [k for k in ("dtype", "torch_dtype") if k in out] or (
        ["dtype"] if major and major >= 5 else ["torch_dtype"] if major else ["dtype", "torch_dtype"]
    )
    out |= {key: dtype for key in dtype_keys}
    out |= {key: value for key, value in tokens.items() if key in TOKEN_KEYS}
    out["max_position_embeddings"] = max_positions
    return out


def generation_config(tokens: dict[str, int | None], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """`generation_config.json`: the imported one (`base`) with the token ids brought up to date, or the ids alone."""
    out = dict(base) if base is not None else {"_from_model_config": True}
    # An id the base leaves out stays out unless there is one to give (transformers treats absent as null).
    return out | {k: v for k, v in tokens.items() if k in TOKEN_KEYS and (k in out or v is not None or base is None)}
