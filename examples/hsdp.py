"""Hybrid sharded data parallelism (HSDP): FSDP inside groups of 4 devices, 2 replicas of each group.

On a cluster the fsdp group is a node (fast links) and the replicas span nodes (slow links). What it proves, on
8 simulated CPU devices (mesh data=2,fsdp=4): each device holds 1/4 of the parameters (twice FSDP's 1/8, the
price of keeping the big traffic inside a group); the weights are all-gathered (each device contributes its
1/4 shard) inside a group; the gradients are reduce-scattered inside a group (4 devices) and only the 1/4
shards are all-reduced across the replicas (groups of 2: a quarter of the reduce-scatter's bytes); the norm
scales are all-reduced over all 8; the loss equals the one-device program's.
Run: python examples/hsdp.py
"""

import common  # noqa: F401  (first: it gives JAX 8 simulated CPU devices)
import jax
from common import KEY, compile_loss_and_grads, one_device_loss, tokens
from flax import nnx

from spmdkit.inspect import collective_report, parameter_rows
from spmdkit.models import Transformer, model_preset
from spmdkit.sharding import init_sharded, make_mesh, make_rules, state_shardings
from spmdkit.train.step.train_step import batch_shardings

CONFIG = model_preset("tiny").replace(dtype="float32", layers=2)  # float32: sharded == one device to 1e-5


def main() -> dict:
    mesh, rules = make_mesh("data=2,fsdp=4"), make_rules(zero_stage=3)  # the `hsdp` preset on 8 devices
    model = init_sharded(lambda: Transformer(CONFIG, rngs=nnx.Rngs(KEY)), mesh, rules)
    graphdef, params = nnx.split(model)
    shardings = state_shardings(params, mesh, rules.params)  # embed -> fsdp; replicated over data
    batch = jax.device_put(tokens(), batch_shardings(mesh, rules))  # batch over (data, fsdp): one sequence per device
    compiled = compile_loss_and_grads(graphdef, params, batch, mesh, rules, shardings)
    loss, _ = compiled(params, batch)
    rows = parameter_rows(params, shardings)
    report = collective_report(compiled)
    facts = {
        "collectives": report.by_opcode(),
        # bytes per step by (opcode, devices in a group): where each kind of traffic stays
        "bytes_by_group": {
            f"{op} x{size}": sum(
                c.operand_bytes * c.executions for c in report.collectives if (c.opcode, c.group_size) == (op, size)
            )
            for op, size in sorted({(c.opcode, c.group_size) for c in report.collectives})
        },
        "param_bytes_total": sum(r.bytes_total for r in rows),
        "param_bytes_per_device": sum(r.bytes_per_device for r in rows),
        "loss": float(loss),
        "one_device_loss": one_device_loss(graphdef, params, tokens()),
    }
    print(report.table())
    print("bytes per step by collective and group size:", facts["bytes_by_group"])
    print(f"parameter bytes: {facts['param_bytes_total']:,} in all, {facts['param_bytes_per_device']:,} per device")
    print(f"loss on data=2,fsdp=4: {facts['loss']:.6f}   on one device: {facts['one_device_loss']:.6f}")
    return facts


if __name__ == "__main__":
    main()
