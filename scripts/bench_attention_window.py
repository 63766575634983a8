"""Sliding-window attention in the blockwise kernel: compiled FLOPs and scratch relative to full causal attention.

For seq 8192 (batch 1, 8 query heads over 2 KV heads, head_dim 64, float32, blocks of 512) and windows
512 / 1024 / 2048 / 4096 / none, one attention layer is compiled (never run) and read:

- FLOPs (`cost_analysis()["flops"]`) of the forward pass, and of forward + backward;
- the scores the kernel's schedule computes (`BlockPlan.steps`), in block pairs' worth (partially visible pairs
  are split into sub-blocks, so the count may be fractional);
- the widest step of the schedule (`BlockPlan.widest_step()`, the scores held at once: the scratch the planner
  budgets) in float32 bytes of its 3 score arrays (P, dP, dS) per layer;
- the compiled program's temporary bytes (`memory_analysis().temp_size_in_bytes`) of forward + backward.

Each as a fraction of the same kernel with no window. A window splits the pairs it sees in part (the diagonal's and
its edge's) down to 1/8 of a block, so a window W costs about (W + block / 8) / (seq / 2) of full causal.

    python scripts/bench_attention_window.py [--seq 8192] [--block 512]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.kernels.block_plan import BlockPlan
from spmdkit.kernels.blockwise_attention import blockwise_attention

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compiled(seq: int, block: int, window: int, backward: bool):
    """The compiled forward (or forward + backward) of one blockwise attention layer on abstract inputs."""
    q = jax.ShapeDtypeStruct((1, seq, HEADS, HEAD_DIM), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, KV_HEADS, HEAD_DIM), jnp.float32)

    def attention(q, k, v):
        return blockwise_attention(q, k, v, None, AttentionSpec(window=window, block_q=block, block_k=block))

    def forward_backward(q, k, v, dout):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, *vjp(dout)

    if backward:
        return jax.jit(forward_backward).lower(q, kv, kv, q).compile(compiler_options=FAST)
    return jax.jit(attention).lower(q, kv, kv).compile(compiler_options=FAST)


def measure(seq: int, block: int, window: int) -> dict[str, float]:
    """FLOPs forward, FLOPs forward + backward, widest-step score bytes, compiled temp bytes."""
    plan = BlockPlan(seq, AttentionSpec(window=window, block_q=block, block_k=block).resolved(HEAD_DIM, seq))
    both = compiled(seq, block, window, backward=True)
    return {
        "flops_fwd": compiled(seq, block, window, backward=False).cost_analysis()["flops"],
        "flops_fwd_bwd": both.cost_analysis()["flops"],
        "scratch": 3 * 4 * plan.widest_step() * HEADS,
        "temp": both.memory_analysis().temp_size_in_bytes,
        "pairs": sum(map(plan.scores, plan.steps)) / (block * block),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--block", type=int, default=512)
    args = parser.parse_args()
    windows = [w for w in (512, 1024, 2048, 4096) if w < args.seq]
    full = measure(args.seq, args.block, 0)
    print(f"blockwise attention, seq {args.seq}, block {args.block}, batch 1, {HEADS} heads / {KV_HEADS} KV heads, ")
    print(f"head_dim {HEAD_DIM}, float32; each figure relative to full causal (window none)")
    print()
    print("| window | block pairs | FLOPs fwd | FLOPs fwd+bwd | widest-step scratch | compiled temp |")
    print("|---|---|---|---|---|---|")
    for window in [*windows, 0]:
        got = full if window == 0 else measure(args.seq, args.block, window)
        ratios = [got[key] / full[key] for key in ("flops_fwd", "flops_fwd_bwd", "scratch", "temp")]
        cells = " | ".join(f"{r:.3f}" for r in ratios)
        print(f"| {window or 'none'} | {got['pairs']:g} / {full['pairs']:g} | {cells} |")
    print()
    print(
        f"full causal: {full['flops_fwd'] / 1e9:.2f} GFLOP forward, {full['flops_fwd_bwd'] / 1e9:.2f} GFLOP forward "
        f"+ backward, widest step {full['scratch'] / 2**20:.0f} MiB of scores, {full['temp'] / 2**20:.0f} MiB temp"
    )


if __name__ == "__main__":
    main()
