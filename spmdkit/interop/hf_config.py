"""A Hugging Face `config.json` -> `TransformerConfig`, strictly (pure Python: no JAX, no transformers).

Families: `llama` (Llama 2/3, SmolLM, ...: `attention_bias` puts biases on q, k, v and o; `mlp_bias` on gate, up
and down), `qwen2` (q/k/v biases always, no o or MLP bias) and `qwen3` (per-head q/k RMSNorms, `attention_bias` on
q, k, v and o, no MLP bias; `head_dim` defaults to 128). A key a config leaves out means what the family's
transformers config class defaults it to (Qwen: a 4096-token `sliding_window`, 32768 positions, 32 kv heads).
Every key that changes what transformers' modeling code for the family computes is read and implemented, or refused
with one line naming it: `hidden_act`, the RoPE block in either style (transformers 5 `rope_parameters`, or a
top-level `rope_theta` with the older `rope_scaling`; `rope_type` default, linear and llama3),
`partial_rotary_factor`, a sliding window (`use_sliding_window`) shorter than `max_position_embeddings` on any
layer it applies to, `attention_dropout`, custom code (`auto_map`) and `quantization_config`. Keys the family's
modeling code never reads (`initializer_range`, `use_cache`, token ids, ...) do not change the function.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import ACTIVATIONS, TransformerConfig

FAMILIES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_QWEN = {"sliding_window": 4096, "max_window_layers": 28, "max_position_embeddings": 32768, "num_key_value_heads": 32}
# What transformers' config class of a family assumes for a key config.json leaves out (where it matters here).
DEFAULTS: dict[str, dict[str, Any]] = {"qwen2": _QWEN, "qwen3": _QWEN | {"head_dim": 128}}
ROPE_TYPES = ("default", "linear", "llama3")
# TransformerConfig fields a Hugging Face config fixes: the parameters' shapes and the function they compute.
FUNCTION_FIELDS = (
    "vocab_size", "embed", "layers", "heads", "kv_heads", "head_dim", "mlp", "rope_theta", "norm_eps", "qkv_bias",
    "o_bias", "mlp_bias", "tie_embeddings", "activation", "rope_type", "rope_factor", "rope_low_freq_factor",
    "rope_high_freq_factor", "rope_original_max_positions", "qk_norm",
)  # fmt: skip


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`; SpmdkitError (one line) when it is missing or not a JSON object."""
    if not path.is_file():
        raise SpmdkitError(f"{path} does not exist: {what}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SpmdkitError(f"{path} is not valid JSON ({error}): {what}") from None
    if not isinstance(value, dict):
        raise SpmdkitError(f"{path} holds a JSON {type(value).__name__}, not an object: {what}")
    return value


def _refuse(where: str, key: str, why: str) -> SpmdkitError:
    return SpmdkitError(f"{where}: {key} {why}")


def family_of(hf: dict[str, Any], where: str) -> str:
    """The family (`llama`, `qwen2` or `qwen3`) of a config, from `model_type` and `architectures`."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise _refuse(where, f"model_type={model_type!r}", f"is not a family spmdkit runs ({', '.join(FAMILIES)})")
    architectures = hf.get("architectures") or [FAMILIES[model_type]]
    wrong = [a for a in architectures if a != FAMILIES[model_type]]
    if wrong:
        raise _refuse(where, f"architectures={wrong}", f"is not {FAMILIES[model_type]}: spmdkit runs causal LMs")
    return model_type


def rope_block(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings as transformers 5 resolves them: a non-empty `rope_scaling` replaces `rope_parameters`;
    `rope_theta` comes from the block, else the top level, else 10,000; `rope_type` (or the old `type`)."""
    block = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    block.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
    block.setdefault("rope_type", block.get("type", "default"))
    if "partial_rotary_factor" in hf:
        block.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    return block


def _rope_fields(hf: dict[str, Any], max_positions: int, where: str) -> dict[str, Any]:
    block = rope_block(hf)
    nested = [k for k, v in block.items() if isinstance(v, dict)]
    if nested:
        raise _refuse(where, f"rope_parameters[{nested[0]!r}]", "(RoPE per layer type) is not implemented")
    rope_type = block["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise _refuse(where, f"rope_type={rope_type!r}", f"is not implemented: spmdkit has {', '.join(ROPE_TYPES)}")
    if block.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(where, f"partial_rotary_factor={block['partial_rotary_factor']}", "is not implemented")
    fields: dict[str, Any] = {"rope_theta": float(block["rope_theta"]), "rope_type": rope_type}
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    for key in needed.get(rope_type, ()):
        if not isinstance(block.get(key), (int, float)):
            raise _refuse(where, f"rope {rope_type} scaling", f"needs a number for {key}, got {block.get(key)!r}")
    if rope_type != "default":
        fields["rope_factor"] = float(block["factor"])
    if rope_type == "llama3":
        fields["rope_low_freq_factor"] = float(block["low_freq_factor"])
        fields["rope_high_freq_factor"] = float(block["high_freq_factor"])
        fields["rope_original_max_positions"] = int(block.get("original_max_position_embeddings") or max_positions)
    return fields


def _check_sliding_window(hf: dict[str, Any], layers: int, max_positions: int, where: str) -> None:
    """Qwen2/Qwen3 attend within `sliding_window` tokens on their "sliding_attention" layers (`layer_types`, else
    the layers from `max_window_layers` on) when `use_sliding_window`; a window at least as long as the model's
    positions changes nothing, a shorter one (or one next to unknown positions) is refused."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is None:
        return
    first = hf.get("max_window_layers")
    if not hf.get("layer_types") and not isinstance(first, int):
        raise _refuse(where, f"max_window_layers={first!r}", "must be an integer when use_sliding_window is true")
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if "sliding_attention" not in types:
        return
    if not isinstance(window, int) or isinstance(window, bool):
        raise _refuse(where, f"sliding_window={window!r}", "must be an integer when use_sliding_window is true")
    if not max_positions or window < max_positions:
        raise _refuse(
            where,
            f"sliding_window={window}",
            f"is shorter than max_position_embeddings={max_positions}: sliding-window attention is not implemented",
        )


def _family_fields(hf: dict[str, Any], family: str, layers: int, max_positions: int, where: str) -> dict[str, Any]:
    """The biases and q/k norms of the family's attention and MLP (Qwen: after the sliding-window check)."""
    if family.startswith("qwen"):
        _check_sliding_window(hf, layers, max_positions, where)
    attention_bias = bool(hf.get("attention_bias", False))
    if family == "qwen2":
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False}
    if family == "qwen3":
        return {"qkv_bias": attention_bias, "o_bias": attention_bias, "mlp_bias": False, "qk_norm": True}
    return {"qkv_bias": attention_bias, "o_bias": attention_bias, "mlp_bias": bool(hf.get("mlp_bias", False))}


def from_hf_config(hf: dict[str, Any], where: str = "config.json") -> TransformerConfig:
    """The `TransformerConfig` a Hugging Face config describes (shape and function; numerics stay the defaults).

    `where` names the file in errors. Raises SpmdkitError, one line naming the key, for anything not implemented.
    """
    family = family_of(hf, where)
    hf = DEFAULTS.get(family, {}) | hf
    for key in ("auto_map", "quantization_config"):
        if hf.get(key):
            raise _refuse(where, key, "is not supported: spmdkit loads plain (unquantised) transformers models")
    needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    for key in needed:
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool):
            raise _refuse(where, key, f"must be an integer, got {hf.get(key)!r}")
    activation = hf.get("hidden_act", "silu")
    if activation not in ACTIVATIONS:
        raise _refuse(
            where, f"hidden_act={activation!r}", f"is not implemented: choose one of {', '.join(ACTIVATIONS)}"
        )
    if hf.get("attention_dropout"):
        raise _refuse(where, f"attention_dropout={hf['attention_dropout']}", "is not implemented (no dropout)")
    heads, embed, layers = hf["num_attention_heads"], hf["hidden_size"], hf["num_hidden_layers"]
    max_positions = hf.get("max_position_embeddings") or 0
    biases = _family_fields(hf, family, layers, max_positions, where)
    eps = hf.get("rms_norm_eps", 1e-6)
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise _refuse(where, f"rms_norm_eps={eps!r}", "must be a positive number")
    try:
        return TransformerConfig(
            vocab_size=hf["vocab_size"],
            embed=embed,
            layers=layers,
            heads=heads,
            kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or embed // heads,
            mlp=hf["intermediate_size"],
            norm_eps=float(eps),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            activation=activation,
            max_positions=int(max_positions),
            **biases,
            **_rope_fields(hf, int(max_positions), where),
        )
    except SpmdkitError as error:
        raise SpmdkitError(f"{where}: {error}") from None


def read_hf_config(path: str | Path) -> tuple[dict[str, Any], TransformerConfig]:
    """(the raw config, its `TransformerConfig`) of a `config.json`."""
    path = Path(path)
    hf = read_json(path, "a Hugging Face model directory holds its config.json")
    return hf, from_hf_config(hf, str(path))


def function_of(model: TransformerConfig) -> dict[str, Any]:
    """The fields of `model` that a Hugging Face config fixes (shape and function), for comparisons."""
    return {name: getattr(model, name) for name in FUNCTION_FIELDS}
