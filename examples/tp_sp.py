"""Tensor parallelism (TP, Megatron column/row) and sequence parallelism (SP) over 8 devices.

TP splits heads and the MLP hidden dim over `tensor`: q/k/v and gate/up are column-parallel, o and down are
row-parallel, so each attention and MLP block ends in one all-reduce of the [batch, seq, embed] activations.
SP additionally splits the residual stream's sequence over `tensor` between blocks: each all-reduce becomes a
reduce-scatter (into the sequence shards) and an all-gather (before the next block), the same bytes, but the
norms and residuals run on 1/8 of the tokens. What it proves, on 8 simulated CPU devices: the compiled forward
has 2 all-reduces per layer under TP and none of them under SP (reduce-scatters and all-gathers instead), and
both losses equal the one-device program's. Run: python examples/tp_sp.py
"""

import common  # noqa: F401  (first: it gives JAX 8 simulated CPU devices)
import jax
from common import KEY, cross_entropy_of, one_device_loss, tokens
from flax import nnx

from spmdkit.inspect import collective_report, parameter_rows, parameter_table
from spmdkit.models import Transformer, model_preset
from spmdkit.sharding import init_sharded, make_mesh, make_rules, state_shardings
from spmdkit.train.step.train_step import batch_shardings

CONFIG = model_preset("tiny").replace(dtype="float32", layers=2, kv_heads=8)  # 8 KV heads: one per TP rank


def compile_forward(graphdef: nnx.GraphDef, params: nnx.State, mesh, rules) -> tuple[float, dict]:
    """Loss of the sharded forward, and its collectives {opcode: {instructions, executions, operand_bytes}}."""
    batch = jax.device_put(tokens(), batch_shardings(mesh, rules))
    compiled = jax.jit(cross_entropy_of(graphdef, rules, mesh)).lower(params, batch).compile()
    return float(compiled(params, batch)), collective_report(compiled)


def main() -> dict:
    mesh, tp_rules = make_mesh("tensor=8"), make_rules(zero_stage=3)
    sp_rules = make_rules(zero_stage=3, sequence_parallel=True)  # same parameter layout, act_seq -> tensor
    model = init_sharded(lambda: Transformer(CONFIG, rngs=nnx.Rngs(KEY)), mesh, tp_rules)
    graphdef, params = nnx.split(model)
    shardings = state_shardings(params, mesh, tp_rules.params)  # heads, kv_heads, mlp, vocab -> tensor
    tp_loss, tp_report = compile_forward(graphdef, params, mesh, tp_rules)
    sp_loss, sp_report = compile_forward(graphdef, params, mesh, sp_rules)
    rows = parameter_rows(params, shardings)
    facts = {
        "layers": CONFIG.layers,
        "tp_collectives": tp_report.by_opcode(),
        "sp_collectives": sp_report.by_opcode(),
        "param_bytes_total": sum(r.bytes_total for r in rows),
        "param_bytes_per_device": sum(r.bytes_per_device for r in rows),
        "tp_loss": tp_loss,
        "sp_loss": sp_loss,
        "one_device_loss": one_device_loss(graphdef, params, tokens()),
    }
    print(parameter_table(params, shardings))
    print(f"TP forward ({CONFIG.layers} layers, scanned: runs/step counts each layer):\n{tp_report.table()}")
    print(f"TP + SP forward:\n{sp_report.table()}")
    print(f"loss with TP: {tp_loss:.6f}  TP+SP: {sp_loss:.6f}  one device: {facts['one_device_loss']:.6f}")
    return facts


if __name__ == "__main__":
    main()
