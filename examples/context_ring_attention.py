"""Context parallelism (CP): the sequence split over 4 devices, attention computed by ring attention.

Each device holds 2 of the 8 sequence chunks in the zigzag layout (chunks i and 7-i, so causal work is even);
keys and values travel the ring by collective-permute while every device attends its queries to them. RoPE
positions travel with their tokens, and the token-mean loss does not care about order. What it proves, on 8
simulated CPU devices (mesh context=4,fsdp=2): the compiled forward+backward moves K/V (and their gradients)
only by collective-permute, never gathers the sequence (every all-gather is ZeRO-3's parameter gather over
fsdp x context: the state is sharded over both, groups of 8), and the loss equals the one-device program's on
the unpermuted batch. Run: python examples/context_ring_attention.py
"""

import common  # noqa: F401  (first: it gives JAX 8 simulated CPU devices)
import jax
from common import KEY, compile_loss_and_grads, one_device_loss, tokens
from flax import nnx

from spmdkit.inspect import collective_report, parameter_rows
from spmdkit.models import Transformer, model_preset
from spmdkit.parallel import to_zigzag
from spmdkit.sharding import init_sharded, make_mesh, make_rules, state_shardings
from spmdkit.train.step.train_step import batch_shardings

# float32: == one device to 1e-5. attention "auto": ring attention on context=4, the blockwise kernel on one device
CONFIG = model_preset("tiny").replace(dtype="float32", layers=2)


def main() -> dict:
    mesh, rules = make_mesh("context=4,fsdp=2"), make_rules(zero_stage=3)
    model = init_sharded(lambda: Transformer(CONFIG, rngs=nnx.Rngs(KEY)), mesh, rules)
    graphdef, params = nnx.split(model)
    shardings = state_shardings(params, mesh, rules.params)
    # Every [batch, seq] array goes into the zigzag layout once, on the host; seq is then split over context.
    zigzag = {name: to_zigzag(x, axis=1, n=mesh.shape["context"]) for name, x in tokens().items()}
    batch = jax.device_put(zigzag, batch_shardings(mesh, rules))  # [8, 32]: batch over fsdp, seq over context
    compiled = compile_loss_and_grads(graphdef, params, batch, mesh, rules, shardings)
    loss, _ = compiled(params, batch)
    report = collective_report(compiled)
    facts = {
        "collectives": report.by_opcode(),
        "all_gather_group_sizes": sorted({c.group_size for c in report.collectives if c.opcode == "all-gather"}),
        "param_bytes_per_device": sum(r.bytes_per_device for r in parameter_rows(params, shardings)),
        "argument_bytes_per_device": compiled.memory_analysis().argument_size_in_bytes,
        "loss": float(loss),
        "one_device_loss": one_device_loss(graphdef, params, tokens()),
    }
    print(report.table())
    print(
        f"collective-permutes per step: {report.count('collective-permute', executed=True)} "
        f"({report.bytes('collective-permute'):,} bytes per device); all-gather group sizes: "
        f"{facts['all_gather_group_sizes']} (parameters over fsdp x context: the sequence is never gathered)"
    )
    print(f"per device: {facts['param_bytes_per_device']:,} parameter bytes (1/8: fsdp x context); memory_analysis() "
          f"arguments {facts['argument_bytes_per_device']:,} (+ 1/2 of the rows x 1/4 of the tokens)")  # fmt: skip
    print(f"loss on context=4,fsdp=2: {facts['loss']:.6f}   on one device: {facts['one_device_loss']:.6f}")
    return facts


if __name__ == "__main__":
    main()
