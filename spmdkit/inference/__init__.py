"""Generation and evaluation of trained models: a KV cache, prefill and a compiled decode loop, sampling, sharded for
latency (`tensor`) and throughput (`data`).

- `cache`: the `KVCache` [layers, batch, max_len, kv_heads, head_dim], one buffer per layer (batch over data,
  kv_heads over tensor); latent attention's holds the latent and the rope key instead (replicated over tensor).
- `attention`: `cache_attention`, new queries against the cache, grouped-query heads without repeating K/V.
- `latent`: `absorbed_attention`, latent attention's decode against the latent cache with kv_b absorbed.
- `forward`: `prefill` and `decode`, the model's own modules walked block by block around the cache.
- `sampling`: `Sampling` (greedy, temperature, top-k, top-p, stop tokens, max new tokens, seed) and `sample`.
- `engine`: `Generator`, the compiled programs per shape bucket and the loop; `Completion`, one prompt's result.
- `layerwise`: the model's block stacks split into one buffer per layer (what a decode step reads in place).
- `loading`: the inference mesh and rules (fsdp refused), placing a module on it.
- `sources`: a run/checkpoint or Hugging Face directory: its model, parameters only onto the mesh, its tokenizer.
- `api`: `TextGenerator` (a generator and its tokenizer) and `generate` (`spmdkit.generate`).
- `evaluate`: loss, perplexity and bits per byte of a model on held-out data (`spmdkit eval`).

Names load on first use (PEP 562), so `import spmdkit.inference` does not start JAX.
"""

from __future__ import annotations

from spmdkit._lazy import lazy_exports

_EXPORTS = {
    "KVCache": "spmdkit.inference.cache",
    "cache_attention": "spmdkit.inference.attention",
    "prefill": "spmdkit.inference.forward",
    "decode": "spmdkit.inference.forward",
    "Sampling": "spmdkit.inference.sampling",
    "sample": "spmdkit.inference.sampling",
    "Completion": "spmdkit.inference.engine",
    "Generator": "spmdkit.inference.engine",
    "inference_mesh": "spmdkit.inference.loading",
    "inference_rules": "spmdkit.inference.loading",
    "place_model": "spmdkit.inference.loading",
    "ModelSource": "spmdkit.inference.sources",
    "open_source": "spmdkit.inference.sources",
    "model_tokenizer": "spmdkit.inference.sources",
    "TextGenerator": "spmdkit.inference.api",
    "generate": "spmdkit.inference.api",
    "evaluate": "spmdkit.inference.evaluate",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
