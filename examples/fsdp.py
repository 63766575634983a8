"""Fully sharded data parallelism (FSDP, ZeRO-3): parameters, gradients and optimizer state split 8 ways.

What it proves, on 8 simulated CPU devices: each device holds 1/8 of every weight (the `embed` dim goes to the
`fsdp` axis); the compiled forward+backward all-gathers the weights before use and reduce-scatters the
gradients (on CPU the reduce-scatter is spelled all-reduce + dynamic-slice; the report names it
reduce-scatter); and the loss equals the one-device program's. Run: python examples/fsdp.py
"""

import common  # noqa: F401  (first: it gives JAX 8 simulated CPU devices)
import jax
from common import KEY, compile_loss_and_grads, one_device_loss, tokens
from flax import nnx

from spmdkit.inspect import collective_report, parameter_rows, parameter_table
from spmdkit.models import Transformer, model_preset
from spmdkit.sharding import init_sharded, make_mesh, make_rules, state_shardings
from spmdkit.train.step.train_step import batch_shardings

CONFIG = model_preset("tiny").replace(dtype="float32", layers=2)  # float32: sharded == one device to 1e-5


def main() -> dict:
    mesh, rules = make_mesh("fsdp=8"), make_rules(zero_stage=3)
    model = init_sharded(lambda: Transformer(CONFIG, rngs=nnx.Rngs(KEY)), mesh, rules)  # born in its shards
    graphdef, params = nnx.split(model)
    shardings = state_shardings(params, mesh, rules.params)
    batch = jax.device_put(tokens(), batch_shardings(mesh, rules))  # [8, 32]: one sequence per device
    # Gradients leave the step sharded like the parameters: XLA reduce-scatters instead of all-reducing.
    compiled = compile_loss_and_grads(graphdef, params, batch, mesh, rules, shardings)
    loss, _ = compiled(params, batch)
    rows = parameter_rows(params, shardings)
    report = collective_report(compiled)
    facts = {
        "collectives": report.by_opcode(),
        "param_bytes_total": sum(r.bytes_total for r in rows),
        "param_bytes_per_device": sum(r.bytes_per_device for r in rows),
        "argument_bytes_per_device": compiled.memory_analysis().argument_size_in_bytes,
        "loss": float(loss),
        "one_device_loss": one_device_loss(graphdef, params, tokens()),
    }
    print(parameter_table(params, shardings))
    print(report.table())
    print(f"parameter bytes: {facts['param_bytes_total']:,} in all, {facts['param_bytes_per_device']:,} per device")
    print(f"compiled.memory_analysis() arguments per device: {facts['argument_bytes_per_device']:,} (+ 1/8 batch)")
    print(f"loss on fsdp=8: {facts['loss']:.6f}   on one device: {facts['one_device_loss']:.6f}")
    return facts


if __name__ == "__main__":
    main()
