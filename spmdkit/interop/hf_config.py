"""A Hugging Face `config.json` -> `TransformerConfig`, strictly (pure Python: no JAX, no transformers).

The families and what each of their keys means are `spmdkit.interop.families.FAMILIES`; this module reads what they
share: sizes, heads, `head_dim`, the norm epsilon, tied embeddings, the activation, and the RoPE block in either
style (transformers 5 `rope_parameters`, possibly per layer type as Gemma 3 writes it, or a top-level `rope_theta`
with the older `rope_scaling`; `rope_type` default, linear, llama3 and yarn (its attention factor given, derived
from `mscale` / `mscale_all_dim`, or left to the factor); `partial_rotary_factor` where the family
rotates part of each head). Every key's type and range is checked first (`spmdkit.interop.hf_keys.KEYS`); a key left
out means what the family's transformers config class defaults it to (`Family.defaults`). Every
key that changes what transformers' modeling code for the family computes is read and implemented, or refused
with one line naming it (`attention_dropout`, custom code `auto_map`, `quantization_config`, other RoPE types, ...).
Keys the family's modeling code never reads (`initializer_range`, `use_cache`, token ids, ...) do not change the
function.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from spmdkit.errors import SpmdkitError
from spmdkit.interop.families import FAMILIES, Family
from spmdkit.interop.hf_keys import Keys, read_json
from spmdkit.models.config import ACTIVATIONS, TransformerConfig

__all__ = ["FAMILIES", "family_of", "from_hf_config", "function_of", "read_hf_config", "read_json", "rope_block"]

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MXFP4 = (
    "holds GPT-OSS's MXFP4-quantised experts, which spmdkit does not read: dequantise them with transformers first "
    "(from_pretrained(DIR, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16), then "
    "save_pretrained) and import that"
)
# TransformerConfig fields that are the run's numerics, not the function a Hugging Face config fixes.
RUN_FIELDS = frozenset({
    "dtype", "param_dtype", "remat", "attention", "attention_block", "ulysses_parts", "loss_chunk", "z_loss",
    "dispatch", "capacity_factor", "load_balance_weight", "router_z_weight", "balance_rate", "max_positions", "fp8",
    "mtp_weight",
})  # fmt: skip


def family_of(hf: dict[str, Any], where: str) -> str:
    """The family (`llama`, `mistral`, `gemma3_text`, ...) of a config, from `model_type` and `architectures`."""
    keys, model_type = Keys(hf, where), hf.get("model_type")
    if model_type not in FAMILIES:
        raise keys.refuse(f"model_type={model_type!r}", f"is not a family spmdkit runs ({', '.join(FAMILIES)})")
    keys.check({"architectures": hf.get("architectures")})
    wanted = FAMILIES[model_type].architecture
    wrong = [a for a in hf.get("architectures") or [wanted] if a != wanted]
    if wrong:
        raise keys.refuse(f"architectures={wrong}", f"is not {wanted}: spmdkit runs causal LMs")
    return model_type


def rope_block(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings as transformers 5 resolves them: a non-empty `rope_scaling` replaces `rope_parameters`;
    `rope_theta` comes from the block, else the top level (where `from_hf_config` fills in the family's default),
    else 10,000; `rope_type` (or the old `type`)."""
    block = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    block.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
    block.setdefault("rope_type", block.get("type", "default"))
    if "partial_rotary_factor" in hf:
        block.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    return block


def _rope_fields(keys: Keys, max_positions: int, family: Family) -> dict[str, Any]:
    hf, block = keys.hf, rope_block(keys.hf)
    fields: dict[str, Any] = {}
    if {"full_attention", "sliding_attention"} <= set(block):  # per layer type (Gemma 3): local layers unscaled
        local = block["sliding_attention"]
        if not isinstance(local, dict) or local.get("rope_type", "default") != "default":
            raise keys.refuse("rope_parameters['sliding_attention']", "must be plain (rope_type default)")
        fields["local_rope_theta"] = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))
        block = {"rope_theta": hf.get("rope_theta", 10_000.0), **block["full_attention"]}
        block.setdefault("rope_type", block.get("type", "default"))
    elif "rope_local_base_freq" in hf:
        fields["local_rope_theta"] = float(hf["rope_local_base_freq"])
    nested = [k for k, v in block.items() if isinstance(v, dict)]
    if nested:
        raise keys.refuse(f"rope_parameters[{nested[0]!r}]", "(RoPE per layer type) is not implemented")
    rope_type = block["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise keys.refuse(f"rope_type={rope_type!r}", f"is not implemented: spmdkit has {', '.join(ROPE_TYPES)}")
    fraction = block.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if fraction != 1.0 and not family.partial_rope:
        raise keys.refuse(f"partial_rotary_factor={fraction}", "is not implemented for this family")
    fields |= {"rope_theta": float(block["rope_theta"]), "rope_type": rope_type, "rope_fraction": float(fraction)}
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
    for key in needed.get(rope_type, ()):
        if not isinstance(block.get(key), (int, float)):
            raise keys.refuse(f"rope {rope_type} scaling", f"needs a number for {key}, got {block.get(key)!r}")
        fields[f"rope_{key}"] = float(block[key])
    if rope_type in ("llama3", "yarn"):
        fields["rope_original_max_positions"] = int(block.get("original_max_position_embeddings") or max_positions)
    if rope_type == "yarn":
        fields |= _yarn_fields(block, fields["rope_factor"])
    return fields


def _yarn_fields(block: dict[str, Any], factor: float) -> dict[str, Any]:
    """YaRN's knobs as transformers reads them (`_compute_yarn_parameters`): beta_fast / beta_slow (null or 0:
    32 / 1), truncate (default true) and the attention factor: given, else the ratio of `mscale` and
    `mscale_all_dim`'s corrections when both are set, else 0 (derived from the factor: 0.1 ln(factor) + 1)."""

    def correction(scale: float, mscale: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = block.get("attention_factor")
    if attention is None and block.get("mscale") and block.get("mscale_all_dim"):
        attention = correction(factor, block["mscale"]) / correction(factor, block["mscale_all_dim"])
    return {
        "rope_beta_fast": float(block.get("beta_fast") or 32.0), "rope_beta_slow": float(block.get("beta_slow") or 1.0),
        "rope_truncate": bool(block.get("truncate", True)), "rope_attention_factor": float(attention or 0.0),
    }  # fmt: skip


def from_hf_config(hf: dict[str, Any], where: str = "config.json") -> TransformerConfig:
    """The `TransformerConfig` a Hugging Face config describes (shape and function; numerics stay the defaults).

    `where` names the file in errors. Raises SpmdkitError, one line naming the key, for anything not implemented.
    """
    family = FAMILIES[family_of(hf, where)]
    keys = Keys(family.defaults | hf, where)
    keys.check()
    quantization = keys.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4":
        raise keys.refuse("quantization_config (quant_method mxfp4)", MXFP4)
    for key in ("auto_map", "quantization_config"):
        if keys.get(key):
            raise keys.refuse(key, "is not supported: spmdkit loads plain (unquantised) transformers models")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        keys.integer(key)
    activation = keys.get(family.activation_key)
    keys.zero("attention_dropout")
    heads, embed, layers = keys.get("num_attention_heads"), keys.get("hidden_size"), keys.get("num_hidden_layers")
    max_positions = keys.get("max_position_embeddings") or 0
    fields = {"activation": activation, **family.read(keys, layers)}
    if fields["activation"] not in ACTIVATIONS:
        raise keys.refuse(
            f"{family.activation_key}={activation!r}", f"is not implemented: choose one of {', '.join(ACTIVATIONS)}"
        )
    rope = _rope_fields(keys, int(max_positions), family)
    if not fields.get("sliding_window"):
        rope.pop("local_rope_theta", None)  # a local base with no local layer changes nothing
    shared = dict(
        vocab_size=keys.get("vocab_size"),
        embed=embed,
        layers=layers,
        heads=heads,
        kv_heads=keys.get("num_key_value_heads") or heads,
        head_dim=keys.get("head_dim") or embed // heads,
        mlp=keys.get("intermediate_size"),
        norm_eps=keys.number("rms_norm_eps"),
        tie_embeddings=bool(keys.get("tie_word_embeddings")),
        max_positions=int(max_positions),
    )
    try:  # a family's own reading of a shared key wins (DeepSeek's head_dim is qk_nope_head_dim + qk_rope_head_dim)
        return TransformerConfig(**(shared | fields | rope))
    except SpmdkitError as error:
        raise SpmdkitError(f"{where}: {error}") from None


def read_hf_config(path: str | Path) -> tuple[dict[str, Any], TransformerConfig]:
    """(the raw config, its `TransformerConfig`) of a `config.json`."""
    path = Path(path)
    hf = read_json(path, "a Hugging Face model directory holds its config.json")
    return hf, from_hf_config(hf, str(path))


def function_of(model: TransformerConfig) -> dict[str, Any]:
    """What `model` computes as a Hugging Face config fixes it (every field but the run's numerics and the
    multi-token-prediction depth, which the files' tensors decide: `spmdkit.interop.sources.source_model`), its
    layer patterns spelled out per layer, for comparisons."""
    # Not `mtp_depth`: the multi-token-prediction modules do not change the logits (transformers ignores them)
    skip = RUN_FIELDS | {"mtp_depth"}
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.name not in skip}
    fields["window_pattern"] = tuple(model.window_of(i) for i in range(model.layers))
    fields["rope_pattern"] = tuple(model.rope_of(i) for i in range(model.layers))
    if not any(fields["window_pattern"]):
        fields["local_rope_theta"] = 0.0
    fields["attention_scale"] = model.attention_scale or model.head_dim**-0.5
    fields["expert_mlp"] = model.routed_mlp if model.experts else 0
    fields["shared_expert_mlp"] = (model.shared_expert_mlp or model.mlp) if model.shared_expert else 0
    fields["dense_layers"] = tuple(i for i in range(model.layers) if not model.is_moe_layer(i))
    return fields
