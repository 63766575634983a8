"""Hugging Face interchange: strict import (Llama, Qwen2, Qwen3; sharded or single safetensors; both RoPE config
styles), complete export, and the Python API to load a model from any source and save one as a Hugging Face directory.

- `load_model(path, mesh=None, rules=None, dtype=...)`: the `Transformer` of a Hugging Face directory, an spmdkit
  checkpoint or a run directory; sharded over `mesh` when given (each device reads only its slices).
- `save_hf(model, out_dir, tokenizer=...)`: a directory `AutoModelForCausalLM.from_pretrained` loads.
- `find_tokenizer_dir(path)`: the tokenizer files that came with a model, a checkpoint or a run.
- `from_hf_config` / `hf_config`: the config mapping, both ways.

The names load on first use, so that `import spmdkit.interop` (and the CLI's parsing) does not import JAX.
"""

from spmdkit._lazy import lazy_exports

_EXPORTS = {
    "load_model": "spmdkit.interop.loading",
    "load_params": "spmdkit.interop.loading",
    "save_hf": "spmdkit.interop.writing",
    "find_tokenizer_dir": "spmdkit.interop.hf_files",
    "from_hf_config": "spmdkit.interop.hf_config",
    "hf_config": "spmdkit.interop.hf_config_writer",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
