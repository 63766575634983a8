"""Memory of ring attention vs dense attention on 8 simulated CPU devices (compile only, nothing runs).

For each sequence length it compiles the gradient (value_and_grad of the sum of the outputs, w.r.t. q, k, v)
of causal attention with batch 1, 8 heads over 2 KV heads, head_dim 64, float32, and reads the per-device
`compiled.memory_analysis().temp_size_in_bytes`:

- ring: `spmdkit.parallel.context.ring_attention` (zigzag, custom-VJP ring backward, key tiles), seq over 8 devices;
- dense, GSPMD: `jax.nn.dot_product_attention` under jit with the sequence sharded over the same 8 devices;
- dense, 1 device: the same program on one device.

Then the causal work balance (computed chunk pairs per device) of zigzag vs contiguous layouts at N=8.
Prints Markdown. Usage: python scripts/bench_ring_attention.py [--quick] [--max-seq 65536]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from spmdkit.kernels.attention_spec import AttentionSpec  # noqa: E402
from spmdkit.parallel.context.ring_attention import causal_work_balance, ring_attention  # noqa: E402
from spmdkit.sharding.mesh import make_mesh  # noqa: E402

N = 8
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
MIB = 2**20


def _grad_of_sum(attention):
    return jax.value_and_grad(lambda q, k, v: attention(q, k, v).sum(), argnums=(0, 1, 2))


def _compiled_temp(fn, mesh, seq: int, spec: P) -> tuple[float, float]:
    """(per-device temp MiB, compile seconds) of jit(fn) for q/k/v of length `seq` sharded as `spec`."""
    sharding = NamedSharding(mesh, spec)
    q = jax.ShapeDtypeStruct((1, seq, HEADS, HEAD_DIM), jnp.float32, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, seq, KV_HEADS, HEAD_DIM), jnp.float32, sharding=sharding)
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(q, kv, kv).compile()
    seconds = time.perf_counter() - start
    return compiled.memory_analysis().temp_size_in_bytes / MIB, seconds


def measure(seq: int, key_tile: int) -> dict[str, float]:
    mesh = make_mesh(f"context={N}")
    tile = min(key_tile, seq // (2 * N))
    ring = _grad_of_sum(lambda q, k, v: ring_attention(q, k, v, None, AttentionSpec(key_tile=tile), mesh=mesh))
    dense = _grad_of_sum(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    ring_mib, ring_s = _compiled_temp(ring, mesh, seq, P(None, "context"))
    dense_mib, _ = _compiled_temp(dense, mesh, seq, P(None, "context"))
    one = make_mesh("fsdp=1", devices=jax.devices()[:1])
    single_mib, _ = _compiled_temp(dense, one, seq, P())
    return {"tile": tile, "ring": ring_mib, "ring_s": ring_s, "dense": dense_mib, "single": single_mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sequence lengths 1k and 2k only")
    parser.add_argument("--max-seq", type=int, default=16384, help="largest sequence length (powers of 2 from 4k)")
    parser.add_argument("--key-tile", type=int, default=256, help="ring key tile (capped at the chunk length)")
    args = parser.parse_args()
    seqs = [1024, 2048] if args.quick else [s for s in (4096, 8192, 16384, 32768, 65536) if s <= args.max_seq]

    print(
        f"## Gradient temp memory per device (MiB), N={N}, batch 1, {HEADS} heads / {KV_HEADS} KV heads, "
        f"head_dim {HEAD_DIM}, float32, causal\n"
    )
    print("| seq | ring, custom VJP (key tile) | dense, GSPMD over 8 | dense, 1 device | dense/ring | ring compile s |")
    print("|---|---|---|---|---|---|")
    for seq in seqs:
        m = measure(seq, args.key_tile)
        print(
            f"| {seq} | {m['ring']:.1f} ({m['tile']}) | {m['dense']:.1f} | {m['single']:.1f} | "
            f"{m['dense'] / m['ring']:.0f}x | {m['ring_s']:.1f} |",
            flush=True,
        )

    print(f"\n## Causal work per device (computed chunk pairs), N={N}\n")
    print("| layout | per device | max/mean |")
    print("|---|---|---|")
    for layout in ("zigzag", "none"):
        per_device, ratio = causal_work_balance(N, layout)
        print(f"| {'contiguous' if layout == 'none' else layout} | {per_device} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
