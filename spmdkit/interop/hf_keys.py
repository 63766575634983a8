"""Reading the keys of a Hugging Face `config.json` strictly (pure Python): each wrong key is one line naming it.

`KEYS` is every key a family reads with the kind of value it must hold (`KINDS`: its type and range); `Keys.check`
refuses a wrong one in one line before any is used, inside the RoPE blocks too. `Keys` wraps one config (the
family's defaults under it) and answers typed questions: an integer, a number, an optional number that means "off"
when null or 0, a layer pattern from `layer_types`. Patterns are
returned compressed to their shortest period (`LLLLLG` for Gemma 3's 26 or 48 layers), as `TransformerConfig`'s
`window_pattern` and `rope_pattern` repeat theirs over the layers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spmdkit.errors import SpmdkitError


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


def shortest_period(pattern: str) -> str:
    """The shortest p such that `pattern` is p repeated (the last repeat may be cut short)."""
    for size in range(1, len(pattern) + 1):
        if all(pattern[i] == pattern[i % size] for i in range(len(pattern))):
            return pattern[:size]
    return pattern


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "count": (lambda v: _int(v) and v > 0, "a positive integer"),
    "size": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "window": (lambda v: _int(v) and v >= 0, "a positive integer (0 or null: no window)"),
    "positive": (lambda v: _num(v) and v > 0, "a positive number"),
    "rate": (lambda v: _num(v) and v >= 0, "a number >= 0"),
    "fraction": (lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "text": (lambda v: isinstance(v, str), "a string"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "block": (lambda v: isinstance(v, dict), "a JSON object"),
}
_KINDS_OF = {
    "count": "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_local_experts "
    "num_experts num_experts_per_tok moe_intermediate_size decoder_sparse_step sliding_window_pattern "
    "_sliding_window_pattern no_rope_layer_interval kv_lora_rank qk_rope_head_dim v_head_dim n_routed_experts n_group "
    "topk_group",
    "count?": "num_key_value_heads head_dim max_position_embeddings original_max_position_embeddings q_lora_rank",
    "size": "max_window_layers shared_expert_intermediate_size qk_nope_head_dim n_shared_experts first_k_dense_replace "
    "num_nextn_predict_layers",
    "window?": "sliding_window",
    "positive": "rms_norm_eps rope_theta rope_local_base_freq factor low_freq_factor high_freq_factor "
    "query_pre_attn_scalar embedding_multiplier residual_multiplier attention_multiplier logits_scaling "
    "swiglu_limit swiglu_alpha beta_fast beta_slow routed_scaling_factor",
    "rate": "attention_dropout resid_pdrop embd_pdrop router_jitter_noise",
    "rate?": "attn_logit_softcapping final_logit_softcapping attention_factor mscale mscale_all_dim",
    "fraction": "partial_rotary_factor",
    "flag": "attention_bias mlp_bias qkv_bias tie_word_embeddings use_sliding_window norm_topk_prob truncate "
    "rope_interleave",
    "flag?": "use_bidirectional_attention",
    "text": "hidden_act hidden_activation rope_type type",
    "list?": "architectures layer_types no_rope_layers mlp_only_layers",
    "block?": "rope_scaling rope_parameters full_attention sliding_attention",
}
# Every key a family reads -> its kind; "?" after it: null is allowed (transformers' default, or off).
KEYS: dict[str, str] = {key: kind for kind, names in _KINDS_OF.items() for key in names.split()}


@dataclasses.dataclass(frozen=True)
class Keys:
    """One config (`hf`, with the family's defaults filled in) and where it came from (`where`, for errors)."""

    hf: dict[str, Any]
    where: str

    def refuse(self, key: str, why: str) -> SpmdkitError:
        return SpmdkitError(f"{self.where}: {key} {why}")

    def check(self, values: dict[str, Any] | None = None, prefix: str = "") -> None:
        """Refuse (one line) the first key of `values` (default: the whole config) whose value is not of its kind
        in `KEYS`; the JSON objects among them (the RoPE blocks) are checked key by key too."""
        for key, value in (self.hf if values is None else values).items():
            name = f"{prefix}[{key!r}]" if prefix else key
            kind = KEYS.get(key)
            if kind is None or (value is None and kind.endswith("?")):
                continue
            self._check(name, value, kind.rstrip("?"))
            if isinstance(value, dict):
                self.check(value, name)

    def _check(self, name: str, value: Any, kind: str) -> None:
        test, what = KINDS[kind]
        if not test(value):
            fix = "correct it in config.json, or delete it for transformers' default"
            raise self.refuse(f"{name}={value!r}", f"must be {what}: {fix}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.hf.get(key, default)

    def integer(self, key: str) -> int:
        """A key that must be set (`KEYS` says its range; null refused)."""
        value = self.hf.get(key)
        self._check(key, value, KEYS.get(key, "size").rstrip("?"))
        return value

    def number(self, key: str) -> float:
        """A positive number that must be set."""
        value = self.hf.get(key)
        self._check(key, value, "positive")
        return float(value)

    def off_or_number(self, key: str) -> float:
        """A number where null (or 0) means off: 0.0 then (`check` has refused anything else but a number)."""
        return float(self.hf.get(key) or 0.0)

    def zero(self, *keys: str) -> None:
        """Refuse any of `keys` (dropouts, jitter noise: training randomness spmdkit does not implement) set."""
        for key in keys:
            if self.hf.get(key):
                raise self.refuse(f"{key}={self.hf[key]}", "is not implemented (no dropout or noise): set it to 0")

    def layer_types(self, layers: int, default: list[str]) -> list[str]:
        """`layer_types` ("full_attention" / "sliding_attention" per layer), or `default` when absent."""
        types = self.hf.get("layer_types") or default
        if not isinstance(types, list) or len(types) != layers:
            raise self.refuse("layer_types", f"must list one type per layer ({layers}), got {types!r}")
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            raise self.refuse(f"layer_types {unknown}", "is not implemented: full_attention and sliding_attention")
        return types

    def window(self, types: list[str] | None) -> dict[str, Any]:
        """`sliding_window` (`check` has refused one that is not an integer >= 0) on the layers `types` calls sliding
        (None: every layer), as TransformerConfig fields."""
        window = self.hf.get("sliding_window")
        if not window or (types is not None and "sliding_attention" not in types):
            return {}
        if types is None:
            return {"sliding_window": window}
        pattern = shortest_period("".join("L" if t == "sliding_attention" else "G" for t in types))
        return {"sliding_window": window, "window_pattern": "" if pattern == "L" else pattern}
