"""Plain Flax NNX models: they name logical axes, never mesh axes.

`Transformer` is loaded on first use, so that reading configs (`spmdkit plan`, the CLI) doesn't import Flax.
"""

from spmdkit._lazy import lazy_exports
from spmdkit.models.config import TransformerConfig
from spmdkit.models.presets import PRESETS, model_preset

__all__ = ["PRESETS", "Transformer", "TransformerConfig", "model_preset"]
__getattr__, __dir__, _ = lazy_exports(__name__, {"Transformer": "spmdkit.models.transformer"})
