"""Plain Flax NNX models: they name logical axes, never mesh axes."""

from spmdkit.models.config import PRESETS, TransformerConfig, model_preset
from spmdkit.models.transformer import Transformer

__all__ = ["PRESETS", "Transformer", "TransformerConfig", "model_preset"]
