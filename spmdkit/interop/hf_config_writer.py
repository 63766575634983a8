"""`TransformerConfig` -> a Hugging Face `config.json` and `generation_config.json` (pure Python).

A model imported from Hugging Face keeps its config: when the model still computes what that config says, it is
written back as it was (its RoPE block, extra keys and style included), with only the dtype, token ids and
`max_position_embeddings` brought up to date. Otherwise a config of the first family that computes the model is
built (each family's fresh config is read back and compared: `spmdkit.interop.families`). The RoPE block takes the
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
    """The Hugging Face family that computes what `model` does (`preferred` when it can): the first whose fresh
    config, read back, gives `model`'s function. Else one line naming the closest family and what it lacks."""
    target, misses = function_of(model), {}
    for family in ([preferred] if preferred in FAMILIES else []) + list(FAMILIES):
        try:
            back = function_of(from_hf_config(_fresh(model, family, {"rope_parameters"}), family))
        except SpmdkitError:
            continue
        misses[family] = [key for key in target if back[key] != target[key]]
        if not misses[family]:
            return family
    if not misses:
        raise SpmdkitError("no Hugging Face family computes this model: keep it as an spmdkit checkpoint")
    closest = min(misses, key=lambda family: len(misses[family]))
    fields = ", ".join(f"{key}={getattr(model, key)!r}" for key in misses[closest])
    raise SpmdkitError(
        f"no Hugging Face family computes this model: the closest, {closest}, cannot have {fields}; change the "
        "model, or keep it as an spmdkit checkpoint"
    )


def _rope(model: TransformerConfig, places: set[str]) -> dict[str, Any]:
    """The RoPE keys, in the places given: "rope_parameters" (transformers 5), "rope_scaling" and a top-level
    "rope_theta" (transformers 4)."""
    scaling: dict[str, Any] = {"rope_type": model.rope_type}
    if model.rope_fraction != 1.0:
        scaling["partial_rotary_factor"] = model.rope_fraction
    if model.rope_type != "default":
        scaling["factor"] = model.rope_factor
    if model.rope_type == "llama3":
        scaling |= {
            "low_freq_factor": model.rope_low_freq_factor,
            "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_max_positions,
        }
    if model.rope_type == "yarn":
        scaling |= {
            "beta_fast": model.rope_beta_fast, "beta_slow": model.rope_beta_slow, "truncate": model.rope_truncate,
            "original_max_position_embeddings": model.rope_original_max_positions,
        }  # fmt: skip
        if model.rope_attention_factor:
            scaling["attention_factor"] = model.rope_attention_factor
    if model.rope_mscale_all_dim and model.rope_type != "default":  # DeepSeek: the softmax scale's correction
        scaling["mscale_all_dim"] = model.rope_mscale_all_dim
    out: dict[str, Any] = {}
    if "rope_parameters" in places:
        out["rope_parameters"] = {"rope_theta": model.rope_theta, **scaling}
        if model.local_rope_theta:  # per layer type, as Gemma 3 writes it
            local = {"rope_type": "default", "rope_theta": model.local_rope_theta}
            out["rope_parameters"] = {"full_attention": out["rope_parameters"], "sliding_attention": local}
    if model.local_rope_theta and "rope_parameters" not in places:
        out["rope_local_base_freq"] = model.local_rope_theta
    if "rope_scaling" in places:
        out["rope_scaling"] = scaling if model.rope_type != "default" else None
    if "rope_theta" in places:
        out["rope_theta"] = model.rope_theta
    return out


def _fresh(model: TransformerConfig, family: str, places: set[str]) -> dict[str, Any]:
    """A `config.json` of `family` for `model`: the keys every family shares, then the family's own."""
    spec = FAMILIES[family]
    out: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": family,
        "vocab_size": model.vocab_size,
        "hidden_size": model.embed,
        "intermediate_size": model.mlp,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        spec.activation_key: model.activation,
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_dropout": 0.0,
        "use_cache": True,
        **_rope(model, places),
        **dict.fromkeys(TOKEN_KEYS),  # unknown until given: never the family class's ids (Phi-3's pad is 32000)
    }
    return out | spec.write(model)


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
    if FAMILIES[out["model_type"]].mtp_key:  # the MTP layers the weights hold (`tensor_names._mtp_maps`)
        out[FAMILIES[out["model_type"]].mtp_key] = model.mtp_depth
    return out


def generation_config(tokens: dict[str, int | None], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """`generation_config.json`: the imported one (`base`) with the token ids brought up to date, or the ids alone."""
    out = dict(base) if base is not None else {"_from_model_config": True}
    # An id the base leaves out stays out unless there is one to give (transformers treats absent as null).
    return out | {k: v for k, v in tokens.items() if k in TOKEN_KEYS and (k in out or v is not None or base is None)}
