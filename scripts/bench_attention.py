"""Benchmark the attention kernels and the chunked loss on this machine: memory, FLOPs, and training-step speed.

1. Scratch memory (`memory_analysis().temp_size_in_bytes`) of forward + backward of one attention layer (batch 1,
   8 query heads over 2 KV heads, head_dim 64, float32) for dot and blockwise attention at growing lengths.
2. Causal block skipping: the compiled blockwise kernel's FLOPs (`cost_analysis`), causal over non-causal.
3. The chunked loss against the whole-logits loss at Llama 3's vocabulary (128,256), seq 4096: temp bytes.
4. Training-step time of the `tiny` model (float32, one device) with `--attention dot` and `blockwise`, at seq 256
   (batch 16) and seq 4096 (batch 1): the median of `--steps` timed steps after one warm-up step.

    python scripts/bench_attention.py [--steps 5] [--max-seq 16384]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.models.attention import blockwise_attention, dot_attention
from spmdkit.models.config import TransformerConfig
from spmdkit.models.loss import lm_loss
from spmdkit.models.presets import model_preset
from spmdkit.models.transformer import cross_entropy, head_logits
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.train.step.optimizer import OptimizerConfig, make_optimizer
from spmdkit.train.step.state import create_train_state
from spmdkit.train.step.train_step import make_train_step

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
MB = 2**20


def layer(attention, seq: int, causal: bool = True):
    """Forward + backward of one attention layer, compiled (never run)."""
    q = jax.ShapeDtypeStruct((1, seq, HEADS, HEAD_DIM), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, KV_HEADS, HEAD_DIM), jnp.float32)

    def forward_backward(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, None, AttentionSpec(causal)), q, k, v)
        return out, *vjp(dout)

    return jax.jit(forward_backward).lower(q, kv, kv, q).compile()


def memory(max_seq: int) -> None:
    print("| seq | dot temp MB | blockwise temp MB |\n|---|---|---|")
    seq = 1024
    while seq <= max_seq:
        dot = layer(dot_attention, seq).memory_analysis().temp_size_in_bytes / MB if seq <= 4096 else None
        block = layer(blockwise_attention, seq).memory_analysis().temp_size_in_bytes / MB
        print(f"| {seq} | {'not compiled' if dot is None else f'{dot:,.0f}'} | {block:,.1f} |")
        seq *= 2


def causal_flops() -> None:
    causal = layer(blockwise_attention, 4096, True).cost_analysis()["flops"]
    full = layer(blockwise_attention, 4096, False).cost_analysis()["flops"]
    print(f"\nblockwise FLOPs at seq 4096: causal {causal:.3g}, non-causal {full:.3g}, ratio {causal / full:.2f}")


def loss_memory() -> None:
    config = TransformerConfig(dtype="float32", vocab_size=128_256, embed=64)
    x = jax.ShapeDtypeStruct((1, 4096, 64), jnp.float32)
    scale, head = jax.ShapeDtypeStruct((64,), jnp.float32), jax.ShapeDtypeStruct((64, 128_256), jnp.float32)
    targets = jax.ShapeDtypeStruct((1, 4096), jnp.int32)

    def temp(loss):
        grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        return grads.lower(x, scale, head, targets).compile().memory_analysis().temp_size_in_bytes / MB

    chunked = temp(lambda x, s, h, t: lm_loss(x, s, h, t, config)[0])
    whole = temp(lambda x, s, h, t: cross_entropy(head_logits(x, s, h, config), t))
    print(f"loss at vocab 128,256, seq 4096: chunked {chunked:,.0f} MB, whole logits {whole:,.0f} MB, "
          f"ratio {chunked / whole:.3f}")  # fmt: skip


def step_time(attention: str, seq: int, batch: int, steps: int) -> float:
    mesh, rules = make_mesh("fsdp=1", jax.devices()[:1]), make_rules(3)
    config = model_preset("tiny").replace(dtype="float32", attention=attention)
    state = create_train_state(config, make_optimizer(OptimizerConfig(), steps + 1), mesh, rules)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq + 1)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    batch_arrays = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions}
    step = make_train_step(state, mesh, rules)
    current, _ = step(state.state, batch_arrays)  # compile and warm up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        current, metrics = step(current, batch_arrays)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def speed(steps: int) -> None:
    print("\n| seq x batch | dot s/step | blockwise s/step | blockwise / dot |\n|---|---|---|---|")
    for seq, batch in ((256, 16), (4096, 1)):
        dot, block = (step_time(kind, seq, batch, steps) for kind in ("dot", "blockwise"))
        print(f"| {seq} x {batch} | {dot:.3f} | {block:.3f} | {block / dot:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per training-step measurement")
    parser.add_argument("--max-seq", type=int, default=16384, help="longest sequence of the memory table")
    args = parser.parse_args()
    memory(args.max_seq)
    causal_flops()
    loss_memory()
    speed(args.steps)


if __name__ == "__main__":
    main()
