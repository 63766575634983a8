"""Plain Flax NNX models: they name logical axes, never mesh axes.

`Transformer` is loaded on first use, so that reading configs (`spmdkit plan`, the CLI) doesn't import Flax.
"""

from typing import Any

from spmdkit.models.config import PRESETS, TransformerConfig, model_preset

__all__ = ["PRESETS", "Transformer", "TransformerConfig", "model_preset"]


def __getattr__(name: str) -> Any:
    if name == "Transformer":
        from spmdkit.models.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'spmdkit.models' has no attribute {name!r}")
