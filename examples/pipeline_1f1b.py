"""Pipeline parallelism (PP) with the 1F1B schedule: 8 layers in 4 stages of 2, 8 microbatches, 2 data replicas.

`pipeline_value_and_grad` runs the schedule inside `jax.shard_map`: each tick a stage runs one forward (F) or
one backward (B) of one microbatch and passes its activation to the next stage (and its cotangent to the
previous one) with a collective-permute. 1F1B keeps at most 4 microbatches' stage inputs alive per stage;
the bubble is (P-1)/(M+P-1) = 3/11 of the grid. The model here is a stack of residual tanh layers; the
transformer runs the same program (`spmdkit train --mesh pipeline=4,data=2 --pipeline-schedule 1f1b`).
What it proves, on 8 simulated CPU devices: the only stage-to-stage traffic is collective-permutes of one
microbatch activation; loss and gradients equal plain autodiff on one device. Run: python examples/pipeline_1f1b.py
"""

import common  # noqa: F401  (first: it gives JAX 8 simulated CPU devices)
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.inspect import collective_report
from spmdkit.parallel import make_schedule, pipeline_value_and_grad, to_microbatches
from spmdkit.sharding import make_mesh

LAYERS, WIDTH, BATCH, MICROBATCHES = 8, 64, 32, 8


def stage_fn(chunk: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """One stage's layers (w: [layers/stages, width, width]) applied in order to x [rows, width]."""
    return jax.lax.scan(lambda x, w: (x + jnp.tanh(x @ w), None), x, chunk["w"])[0]


def loss_fn(head: dict[str, jax.Array], y: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean squared error of the linear read-out (head w: [width, 1]) against targets [rows, 1]."""
    return jnp.mean((y @ head["w"] - targets) ** 2)


def main() -> dict:
    mesh = make_mesh("pipeline=4,data=2")
    schedule = make_schedule("1f1b", num_stages=4, num_microbatches=MICROBATCHES)
    rng = np.random.default_rng(0)
    stages = {"w": rng.normal(0, WIDTH**-0.5, (LAYERS, WIDTH, WIDTH)).astype(np.float32)}  # layer dim -> pipeline
    head = {"w": rng.normal(0, WIDTH**-0.5, (WIDTH, 1)).astype(np.float32)}
    x, y = rng.normal(size=(BATCH, WIDTH)).astype(np.float32), rng.normal(size=(BATCH, 1)).astype(np.float32)
    inputs, targets = to_microbatches(x, MICROBATCHES), to_microbatches(y, MICROBATCHES)  # [8, 4, ...]
    rows = NamedSharding(mesh, P(None, "data"))  # each microbatch split over the 2 data replicas
    args = (jax.device_put(stages, NamedSharding(mesh, P("pipeline"))), head, *jax.device_put((inputs, targets), rows))

    def pipelined(stages, head, inputs, targets):
        return pipeline_value_and_grad(stage_fn, loss_fn, stages, head, inputs, targets, mesh=mesh, schedule=schedule)

    compiled = jax.jit(pipelined).lower(*args).compile()
    loss, (stage_grads, _, _) = compiled(*args)
    one_loss, one_grads = jax.jit(jax.value_and_grad(lambda s: loss_fn(head, stage_fn(s, x), y)))(stages)
    report = collective_report(compiled)
    permutes = [c for c in report.collectives if c.opcode == "collective-permute"]
    facts = {
        "collectives": report.by_opcode(),
        "activation_bytes": BATCH // MICROBATCHES // mesh.shape["data"] * WIDTH * 4,  # one microbatch, one replica
        "permute_operand_bytes": sorted({c.operand_bytes for c in permutes}),
        "bubble": schedule.bubble_fraction(),
        "loss": float(loss),
        "one_device_loss": float(one_loss),
        "grad_error": float(np.linalg.norm(stage_grads["w"] - one_grads["w"]) / np.linalg.norm(one_grads["w"])),
    }
    print(schedule.format())
    print(report.table())
    sizes, activation = facts["permute_operand_bytes"], facts["activation_bytes"]
    print(f"collective-permute operand bytes: {sizes} (one microbatch activation per device: {activation})")
    print(f"loss pipelined: {facts['loss']:.6f}  one device: {facts['one_device_loss']:.6f}  "
          f"gradient relative error: {facts['grad_error']:.1e}")  # fmt: skip
    return facts


if __name__ == "__main__":
    main()
