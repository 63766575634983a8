"""Generation speed: prefill tokens/s, decode tokens/s at batch 1, 8 and 64, and decode's achieved memory bandwidth
against this machine's measured copy bandwidth (on a GPU: against the card's HBM bandwidth from the device table).

The model: a Llama-shaped decoder of about 100M parameters (embed 768, 8 layers, 12 query heads over 4 KV heads
of 64, SwiGLU 3072, vocab 32,000), random weights, on one device (the first), XLA's optimised code. Compute and
weights in `--dtype` (float32 on a CPU: its bf16 matmuls are emulated; bfloat16 on a GPU).

- prefill: `--prompt-len` tokens x batch 8, the compiled prefill program, tokens / second (best of 3);
- decode: `Generator.generate` with `--new-tokens` new tokens per prompt (prompts of `--prompt-len`), decode
  tokens/s = batch x the per-row rate `Completion.decode_tokens_per_s` (the `while_loop` program, 16 tokens per call);
- bytes a decode step reads: every weight but the embedding table (one row per token) + the KV cache bucket
  (the kernel reads all S slots of it, masked: 2 x layers x batch x S x kv_heads x head_dim x bytes);
  achieved bandwidth = bytes per step x steps per second;
- copy bandwidth: a 1 GiB numpy copy (bytes read + bytes written per second, best of 5) and the same copy as a jitted
  JAX program; the decode ratio is against the larger.

Usage: python scripts/bench_generate.py [--quick] [--dtype float32]; prints Markdown.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmdkit.inference.engine import Generator
from spmdkit.inference.loading import inference_mesh, inference_rules, place_model
from spmdkit.inference.sampling import Sampling, sampling_arrays
from spmdkit.models import TransformerConfig
from spmdkit.models.transformer import Transformer
from spmdkit.plan.devices import device_for_kind

GIB = 2**30


def model_config(dtype: str, quick: bool) -> TransformerConfig:
    layers = 2 if quick else 8
    return TransformerConfig(
        vocab_size=32_000, embed=768, layers=layers, heads=12, kv_heads=4, head_dim=64, mlp=3072,
        dtype=dtype, param_dtype=dtype,
    )  # fmt: skip


def copy_bandwidth(size: int = GIB) -> dict[str, float]:
    """Bytes moved (read + written) per second by a large copy: numpy, and a jitted JAX copy on the device."""
    src = np.ones(size // 4, np.float32)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    x = jnp.ones(size // 4, jnp.float32)
    double = jax.jit(lambda a: a * 2)  # one read and one write of every element
    double(x).block_until_ready()
    best_jax = min(_timed(lambda: double(x).block_until_ready()) for _ in range(5))
    return {"numpy_copy": 2 * size / best, "jax_copy": 2 * size / best_jax}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prefill_tokens_per_s(gen: Generator, batch: int, prompt: int) -> float:
    program = gen.prefill_program(batch, prompt, gen.max_len)
    rows = gen._rows(batch)
    tokens = jax.device_put(np.random.default_rng(0).integers(0, 32_000, (batch, prompt), np.int32), rows)
    lengths = jax.device_put(np.full(batch, prompt, np.int32), rows)
    budget = jax.device_put(np.full(batch, 1, np.int32), rows)
    settings = jax.device_put(sampling_arrays(Sampling(), gen.vocab_limit), gen._settings_shardings())
    jax.block_until_ready(program(gen.params, tokens, lengths, budget, settings))
    best = min(
        _timed(lambda: jax.block_until_ready(program(gen.params, tokens, lengths, budget, settings))) for _ in "abc"
    )
    return batch * prompt / best


def step_bytes(config: TransformerConfig, params: int, batch: int, cache_len: int) -> float:
    """Bytes one decode step reads: the weights (the embedding table: one row per token) and the KV cache bucket."""
    itemsize = jnp.dtype(config.dtype).itemsize
    weights = (params - config.vocab_size * config.embed + batch * config.embed) * itemsize
    kv = 2 * config.layers * batch * cache_len * config.kv_heads * config.head_dim * itemsize
    return weights + kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, shorter runs (a smoke test)")
    parser.add_argument("--dtype", default=None, help="compute and weight dtype (default: float32 on CPU, else bf16)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    device = jax.devices()[0]
    dtype = args.dtype or ("float32" if device.platform == "cpu" else "bfloat16")
    config = model_config(dtype, args.quick)
    with nnx.use_eager_sharding(False):
        model = Transformer(config, rngs=nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    mesh, rules = inference_mesh(None), inference_rules()
    new_tokens = 16 if args.quick else args.new_tokens
    gen = Generator(place_model(model, mesh, rules), mesh, rules, max_len=args.prompt_len + new_tokens)

    bandwidth = copy_bandwidth(GIB // 4 if args.quick else GIB)
    table = device_for_kind(device.device_kind) if device.platform != "cpu" else None
    reference = table.hbm_bw if table and table.hbm_bw else max(bandwidth.values())
    print(f"## Generation on {device.device_kind} ({device.platform}), {params / 1e6:.0f}M parameters, {dtype}\n")
    print(f"copy bandwidth: numpy {bandwidth['numpy_copy'] / 1e9:.1f} GB/s, JAX {bandwidth['jax_copy'] / 1e9:.1f} GB/s"
          + (f"; {table.name} HBM {table.hbm_bw / 1e12:.2f} TB/s (table)" if table else ""))  # fmt: skip
    print(f"prefill: {prefill_tokens_per_s(gen, 8, args.prompt_len):,.0f} tokens/s (8 x {args.prompt_len} tokens)\n")
    print("| batch | decode tokens/s | ms/step | bytes/step (MB) | achieved GB/s | vs copy bandwidth |")
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(1)
    for batch in (1, 8, 64):
        prompts = [list(rng.integers(0, 32_000, args.prompt_len)) for _ in range(batch)]
        sampling = Sampling(new_tokens)
        gen.generate(prompts, sampling)  # compile this bucket, warm up
        results = [gen.generate(prompts, sampling) for _ in range(2)]
        per_row = max(np.mean([c.decode_tokens_per_s for c in r]) for r in results)
        _, _, cache_len = gen.buckets([args.prompt_len] * batch, [new_tokens] * batch)
        moved = step_bytes(config, params, batch, cache_len)
        achieved = moved * per_row
        print(
            f"| {batch} | {batch * per_row:,.0f} | {1e3 / per_row:.1f} | {moved / 1e6:,.0f} | {achieved / 1e9:.1f} | "
            f"{achieved / reference:.2f} |"
        )


if __name__ == "__main__":
    main()
