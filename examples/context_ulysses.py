"""Ulysses context parallelism: the sequence split over 4 devices, attention over the whole sequence per device.

Each device holds a quarter of the sequence (natural order, no zigzag). Per layer an all-to-all over `context`
turns its q, k, v [batch, seq/4, heads, head_dim] into [batch, seq, heads/4, head_dim]: the whole sequence for a
quarter of the heads; any kernel attends there (cuDNN's fused kernel on a GPU, the blockwise kernel here), and a
second all-to-all brings the output back to the sequence split. The backward is the same exchanges transposed.
What it proves, on 8 simulated CPU devices (mesh context=4,fsdp=2): the compiled forward+backward moves
activations only by all-to-all, 4 per layer forward and 4 backward, each one device's [batch, seq/4, heads,
head_dim] (kv heads repeated until 4 devices split them), no ring (no collective-permute), and the loss equals
the one-device program's. `spmdkit train --context-parallel ulysses` runs this; on an NVIDIA GPU `auto` picks it.
Run: python examples/context_ulysses.py
"""

import common  # noqa: F401  (first: it gives JAX 8 simulated CPU devices)
from common import KEY, compile_loss_and_grads, one_device_loss, tokens
from flax import nnx

from spmdkit.inspect import collective_report
from spmdkit.models import Transformer, model_preset
from spmdkit.sharding import init_sharded, make_mesh, make_rules, state_shardings
from spmdkit.train.step.train_step import batch_shardings

# float32: == one device to 1e-5. "ulysses_blockwise": Ulysses around the blockwise kernel (on a GPU: ulysses_cudnn)
CONFIG = model_preset("tiny").replace(dtype="float32", layers=2, attention="ulysses_blockwise")
ROWS, SEQ = 8, 32


def main() -> dict:
    import jax

    mesh, rules = make_mesh("context=4,fsdp=2"), make_rules(zero_stage=3)
    model = init_sharded(lambda: Transformer(CONFIG, rngs=nnx.Rngs(KEY)), mesh, rules)
    graphdef, params = nnx.split(model)
    # the same model with the one-device kernel (a Ulysses choice needs a context axis): the reference
    reference = nnx.split(nnx.eval_shape(lambda: Transformer(CONFIG.replace(attention="auto"), rngs=nnx.Rngs(KEY))))[0]
    shardings = state_shardings(params, mesh, rules.params)
    batch = jax.device_put(tokens(ROWS, SEQ), batch_shardings(mesh, rules))  # batch over fsdp, seq over context
    compiled = compile_loss_and_grads(graphdef, params, batch, mesh, rules, shardings)
    loss, _ = compiled(params, batch)
    report = collective_report(compiled)
    exchanges = [c for c in report.collectives if c.opcode == "all-to-all"]
    # one device's q (8 heads) or k, v (4 kv heads, each a whole head per device: no repeat) or out, float32
    facts = {
        "collectives": report.by_opcode(),
        "all_to_all_operand_bytes": sorted({c.operand_bytes for c in exchanges}),
        "q_bytes": ROWS // 2 * SEQ // 4 * CONFIG.heads * CONFIG.head_dim * 4,
        "kv_bytes": ROWS // 2 * SEQ // 4 * CONFIG.kv_heads * CONFIG.head_dim * 4,
        "loss": float(loss),
        "one_device_loss": one_device_loss(reference, params, tokens(ROWS, SEQ)),
    }
    print(report.table())
    print(
        f"all-to-alls per step: {report.count('all-to-all', executed=True)} for {CONFIG.layers} layers "
        f"(q, k, v in and the output back, forward and backward); operand bytes per device "
        f"{facts['all_to_all_operand_bytes']} (q and out {facts['q_bytes']:,}, k and v {facts['kv_bytes']:,})"
    )
    print(f"loss on context=4,fsdp=2: {facts['loss']:.6f}   on one device: {facts['one_device_loss']:.6f}")
    return facts


if __name__ == "__main__":
    main()
