"""spmdkit: train Llama-style transformers across many accelerators with JAX's SPMD compiler.

`spmdkit.load_model(path, mesh=None, rules=None, dtype=...)` and `spmdkit.save_hf(model, out_dir, tokenizer=...)`
(from `spmdkit.interop`) and `spmdkit.generate(model, prompts, ...)` (from `spmdkit.inference`) load on first use,
so that `import spmdkit` stays light (no JAX).
"""

import importlib
from typing import Any

_LAZY = {  # public name -> the module that defines it
    "generate": "spmdkit.inference.api",
    "load_model": "spmdkit.interop",
    "save_hf": "spmdkit.interop",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spmdkit' has no attribute {name!r}")
