"""Expert parallelism (EP): 8 experts split over expert=4 (2 per device), tokens over expert x data.

What it proves, on 8 simulated CPU devices: the compiled forward of the `tiny-moe` model moves tokens with
exactly two all-to-alls per MoE layer (to the experts' devices and back; four with the backward), each device
holds 2 of the 8 experts' weights, and the loss, the load-balancing loss and the expert load equal the dense
reference (every expert on every token) on one device. Run: python examples/expert_parallel.py
"""

import common  # noqa: F401  (first: it gives JAX 8 simulated CPU devices)
import jax
import numpy as np
from common import KEY, tokens
from flax import nnx

from spmdkit.inspect import collective_report, parameter_rows
from spmdkit.models import Transformer, model_preset
from spmdkit.models.transformer import cross_entropy
from spmdkit.sharding import abstract_state, init_sharded, make_mesh, make_rules, use_rules

# tiny-moe: 4 blocks, every 2nd an MoE of 8 experts (top-2). A capacity factor of 8 (= experts) drops nothing.
CONFIG = model_preset("tiny-moe").replace(dtype="float32", capacity_factor=8.0)


def forward(graphdef: nnx.GraphDef, rules=None, mesh=None):
    """(state, batch) -> (cross-entropy, aux): aux holds each MoE layer's load-balancing loss and expert load."""

    def run(state: nnx.State, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        model = nnx.merge(graphdef, state)
        if rules is None:
            logits, aux = model.forward(batch["inputs"], batch["positions"])
        else:
            with use_rules(rules, mesh):
                logits, aux = model.forward(batch["inputs"], batch["positions"])
        return cross_entropy(logits, batch["targets"]), aux

    return run


def main() -> dict:
    mesh, rules = make_mesh("expert=4,data=2"), make_rules(zero_stage=3)
    model = init_sharded(lambda: Transformer(CONFIG, rngs=nnx.Rngs(KEY)), mesh, rules)
    graphdef, state = nnx.split(model)
    compiled = jax.jit(forward(graphdef, rules, mesh)).lower(state, tokens()).compile()
    loss, aux = compiled(state, tokens())

    # The reference: the same weights on one device, every expert run on every token.
    dense, _ = abstract_state(lambda: Transformer(CONFIG.replace(dispatch="dense"), rngs=nnx.Rngs(0)))
    one = jax.devices()[0]
    ref_loss, ref_aux = jax.jit(forward(dense))(jax.device_put(state, one), jax.device_put(tokens(), one))

    report = collective_report(compiled)
    rows = {r.path: r for r in parameter_rows(state, jax.tree.map(lambda a: a.sharding, state))}
    gate = next(r for path, r in rows.items() if path.endswith("moe_blocks/mlp/gate"))
    facts = {
        "moe_layers": CONFIG.moe_layers,
        "all_to_all": report.count("all-to-all", executed=True),
        "expert_weight_fraction_per_device": gate.bytes_per_device / gate.bytes_total,
        "loss": float(loss),
        "dense_loss": float(ref_loss),
        "load_balance_loss": float(np.mean(aux["load_balance_loss"])),
        "dense_load_balance_loss": float(np.mean(ref_aux["load_balance_loss"])),
        "expert_load": [round(float(v), 4) for v in np.asarray(aux["expert_load"]).mean(0)],
    }
    print(report.table())
    print(f"all-to-alls per forward: {facts['all_to_all']} for {facts['moe_layers']} MoE layers (2 each)")
    print(f"expert weights per device: {facts['expert_weight_fraction_per_device']:.3f} of them (2 of 8 experts)")
    print(f"loss on expert=4 x data=2: {facts['loss']:.6f}   dense reference on one device: {facts['dense_loss']:.6f}")
    print(f"load-balancing loss: {facts['load_balance_loss']:.6f} (reference {facts['dense_load_balance_loss']:.6f})")
    print(f"expert load (share of assignments): {facts['expert_load']}")
    return facts


if __name__ == "__main__":
    main()
