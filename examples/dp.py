"""Data parallelism (DP): every device holds the whole model and 1/8 of the batch.

What it proves, on 8 simulated CPU devices: the compiled forward+backward has one all-reduce of exactly the
gradient bytes (plus the loss, a few bytes) and no other collective; every device holds every parameter; the
loss equals the one-device program's. Run: python examples/dp.py
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
    mesh, rules = make_mesh("data=8"), make_rules(zero_stage=0)  # ZeRO-0: only the batch is split
    model = init_sharded(lambda: Transformer(CONFIG, rngs=nnx.Rngs(KEY)), mesh, rules)
    graphdef, params = nnx.split(model)
    shardings = state_shardings(params, mesh, rules.params)  # all replicated: P()
    batch = jax.device_put(tokens(), batch_shardings(mesh, rules))  # [8, 32]: one sequence per device
    compiled = compile_loss_and_grads(graphdef, params, batch, mesh, rules, shardings)
    loss, _ = compiled(params, batch)
    rows = parameter_rows(params, shardings)
    report = collective_report(compiled)
    facts = {
        "collectives": report.by_opcode(),
        "gradient_bytes": sum(r.bytes_total for r in rows),
        "all_reduce_bytes": report.bytes("all-reduce"),
        "param_bytes_per_device": sum(r.bytes_per_device for r in rows),
        "argument_bytes_per_device": compiled.memory_analysis().argument_size_in_bytes,
        "loss": float(loss),
        "one_device_loss": one_device_loss(graphdef, params, tokens()),
    }
    print(report.table())
    print(f"all-reduce bytes: {facts['all_reduce_bytes']:,} (gradients: {facts['gradient_bytes']:,} + the loss)")
    print(f"parameter bytes per device: {facts['param_bytes_per_device']:,} (all of them)")
    print(f"compiled.memory_analysis() arguments per device: {facts['argument_bytes_per_device']:,} (+ 1/8 batch)")
    print(f"loss on data=8: {facts['loss']:.6f}   on one device: {facts['one_device_loss']:.6f}")
    return facts


if __name__ == "__main__":
    main()
