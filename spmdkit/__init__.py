"""spmdkit: train Llama-style transformers across many accelerators with JAX's SPMD compiler.

`spmdkit.load_model(path, mesh=None, rules=None, dtype=...)` and `spmdkit.save_hf(model, out_dir, tokenizer=...)`
(from `spmdkit.interop`) load on first use, so that `import spmdkit` stays light (no JAX).
"""

from typing import Any

__all__ = ["load_model", "save_hf"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from spmdkit import interop

        return getattr(interop, name)
    raise AttributeError(f"module 'spmdkit' has no attribute {name!r}")
