"""Per-device temp bytes of GPipe vs 1F1B (no remat) at P=4 on 8 simulated CPU devices; compile only.

Run: python scripts/bench_pipeline_memory.py [--microbatch 64] [--dim 64]
Prints a Markdown table of `compiled.memory_analysis().temp_size_in_bytes` (per device) and the bubble
fractions of the schedule tables. Mesh: pipeline=4 x data=2; toy model as the training job builds it: int
token ids in, an embedding table looked up on stage 0 (`embed_fn`), 8 residual MLP layers, a linear head with
cross-entropy on the last stage, float32. 1F1B's temp should be flat in M, GPipe's grows with M.
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

from spmdkit.parallel.pipeline.program import pipeline_value_and_grad  # noqa: E402
from spmdkit.parallel.pipeline.schedule import make_schedule  # noqa: E402
from spmdkit.sharding.mesh import make_mesh  # noqa: E402

LAYERS, VOCAB, STAGES = 8, 32, 4


def stage_fn(params: dict, x: jax.Array) -> jax.Array:
    """Residual MLP layers, scanned: x `[rows, dim]`."""

    def layer(x, w):
        return x + jnp.tanh(x @ w["w1"]) @ w["w2"], None

    return jax.lax.scan(layer, x, params)[0]


def embed_fn(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """tokens `[rows]` int -> `[rows, dim]`."""
    return jnp.take(table, tokens, axis=0)


def loss_fn(head: dict, y: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(y @ head["w"])
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def temp_bytes(kind: str, microbatches: int, microbatch: int, dim: int) -> tuple[int, float, float]:
    """(temp bytes per device, bubble fraction, compile seconds) for one schedule."""
    mesh = make_mesh(f"pipeline={STAGES},data=2")
    sched = make_schedule(kind, STAGES, microbatches)
    params = {
        "w1": jax.ShapeDtypeStruct((LAYERS, dim, 2 * dim), jnp.float32, sharding=NamedSharding(mesh, P("pipeline"))),
        "w2": jax.ShapeDtypeStruct((LAYERS, 2 * dim, dim), jnp.float32, sharding=NamedSharding(mesh, P("pipeline"))),
    }
    head = {"w": jax.ShapeDtypeStruct((dim, VOCAB), jnp.float32)}
    table = jax.ShapeDtypeStruct((VOCAB, dim), jnp.float32)
    tokens = jax.ShapeDtypeStruct((microbatches, microbatch), jnp.int32)
    targets = jax.ShapeDtypeStruct((microbatches, microbatch), jnp.int32)

    def step(p, h, e, x, t):
        kw = dict(mesh=mesh, schedule=sched, embed_fn=embed_fn, embed_params=e)
        return pipeline_value_and_grad(stage_fn, loss_fn, p, h, x, t, **kw)

    start = time.perf_counter()
    compiled = jax.jit(step).lower(params, head, table, tokens, targets).compile()
    seconds = time.perf_counter() - start
    return compiled.memory_analysis().temp_size_in_bytes, sched.bubble_fraction(), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatch", type=int, default=64, help="rows per microbatch (global)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    args = parser.parse_args()
    print(f"P={STAGES}, pipeline=4 x data=2, microbatch={args.microbatch} rows, dim={args.dim}, {LAYERS} layers")
    print("| M | GPipe temp/device | 1F1B temp/device | bubble GPipe | bubble 1F1B | compile s (GPipe/1F1B) |")
    print("|---|---|---|---|---|---|")
    for m in args.microbatches:
        g_bytes, g_bubble, g_s = temp_bytes("gpipe", m, args.microbatch, args.dim)
        f_bytes, f_bubble, f_s = temp_bytes("1f1b", m, args.microbatch, args.dim)
        print(
            f"| {m} | {g_bytes / 1024:.1f} KiB | {f_bytes / 1024:.1f} KiB | {g_bubble:.3f} | {f_bubble:.3f} "
            f"| {g_s:.1f} / {f_s:.1f} |"
        )


if __name__ == "__main__":
    main()
