"""Reading the keys of a Hugging Face `config.json` strictly (pure Python): each wrong key is one line naming it.

`Keys` wraps one config (the family's defaults under it) and answers typed questions: an integer, a positive
number, an optional number that means "off" when null or 0, a layer pattern from `layer_types`. Patterns are
returned compressed to their shortest period (`LLLLLG` for Gemma 3's 26 or 48 layers), as `TransformerConfig`'s
`window_pattern` and `rope_pattern` repeat theirs over the layers.
"""

from __future__ import annotations

import dataclasses
import json
import math
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


@dataclasses.dataclass(frozen=True)
class Keys:
    """One config (`hf`, with the family's defaults filled in) and where it came from (`where`, for errors)."""

    hf: dict[str, Any]
    where: str

    def refuse(self, key: str, why: str) -> SpmdkitError:
        return SpmdkitError(f"{self.where}: {key} {why}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.hf.get(key, default)

    def integer(self, key: str, default: Any = None) -> int:
        value = self.hf.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.refuse(key, f"must be an integer, got {value!r}")
        return value

    def number(self, key: str, default: Any = None) -> float:
        value = self.hf.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise self.refuse(f"{key}={value!r}", "must be a positive number")
        return float(value)

    def off_or_number(self, key: str) -> float:
        """A number where null (or 0) means off: 0.0 then."""
        return 0.0 if not self.hf.get(key) else self.number(key)

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
        """`sliding_window` on the layers `types` calls sliding (None: every layer), as TransformerConfig fields."""
        window = self.hf.get("sliding_window")
        if not window or (types is not None and "sliding_attention" not in types):
            return {}
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise self.refuse(f"sliding_window={window!r}", "must be a positive integer")
        if types is None:
            return {"sliding_window": window}
        pattern = shortest_period("".join("L" if t == "sliding_attention" else "G" for t in types))
        return {"sliding_window": window, "window_pattern": "" if pattern == "L" else pattern}
