"""Your own Flax NNX model, sharded by spmdkit: a 2-layer MLP spmdkit never defined, with its own axis names.

The model names the dims of its parameters (`nnx.Param(..., out_sharding=("features", "hidden"))`) and of its
activations (`constrain(h, ("rows", "hidden"))`); a `Rules` table maps those names onto mesh axes. Here:
features -> fsdp (FSDP), hidden -> tensor (Megatron column/row), rows -> (data, fsdp). What it proves, on 8
simulated CPU devices (mesh fsdp=4,tensor=2): `init_sharded` creates every weight in its shards (1/8 per
device), the compiled forward+backward all-gathers weights over fsdp and all-reduces the row-parallel output
over tensor, and loss equals the one-device program's. Run: python examples/bring_your_own_model.py
"""

import common  # noqa: F401  (first: it gives JAX 8 simulated CPU devices)
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmdkit.inspect import collective_report, parameter_rows, parameter_table
from spmdkit.sharding import Rules, constrain, init_sharded, logical_to_spec, make_mesh, state_shardings, use_rules

# Your names -> mesh axes. One table for parameters and activations; the optimizer would use the second one.
TABLE = {"rows": ("data", "fsdp"), "features": ("fsdp",), "hidden": ("tensor",)}
RULES = Rules(params=TABLE, optimizer=TABLE)


class MLP(nnx.Module):
    """x [rows, features] -> [rows, features] through gelu([rows, hidden]); w_in column-, w_out row-parallel."""

    def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (features, hidden)), out_sharding=("features", "hidden"))
        self.w_out = nnx.Param(init(rngs.params(), (hidden, features)), out_sharding=("hidden", "features"))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(jax.nn.gelu(x @ self.w_in[...]), ("rows", "hidden"))  # a no-op without active rules
        return constrain(h @ self.w_out[...], ("rows", None))


def loss(params: nnx.State, graphdef: nnx.GraphDef, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error of the MLP on x, y [rows, features]."""
    return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)


def main() -> dict:
    mesh = make_mesh("fsdp=4,tensor=2")
    model = init_sharded(lambda: MLP(256, 1024, rngs=nnx.Rngs(0)), mesh, RULES)
    graphdef, params = nnx.split(model)
    shardings = state_shardings(params, mesh, RULES.params)
    x, y = (np.random.default_rng(i).normal(size=(64, 256)).astype(np.float32) for i in (1, 2))
    rows = NamedSharding(mesh, logical_to_spec(("rows", None), None, mesh, RULES.params))

    def step(params, x, y):
        with use_rules(RULES, mesh):  # activations follow the table while tracing
            return jax.value_and_grad(loss)(params, graphdef, x, y)

    replicated = NamedSharding(mesh, PartitionSpec())
    compiled = (
        jax.jit(step, out_shardings=(replicated, shardings)).lower(params, *jax.device_put((x, y), rows)).compile()
    )
    value, _ = compiled(params, *jax.device_put((x, y), rows))
    one = jax.devices()[0]
    one_device_value = jax.jit(loss, static_argnums=1)(jax.device_put(params, one), graphdef, x, y)
    report = collective_report(compiled)
    param_rows = parameter_rows(params, shardings)
    facts = {
        "specs": {r.path: r.spec for r in param_rows},
        "collectives": report.by_opcode(),
        "param_bytes_total": sum(r.bytes_total for r in param_rows),
        "param_bytes_per_device": sum(r.bytes_per_device for r in param_rows),
        "loss": float(value),
        "one_device_loss": float(one_device_value),
    }
    print(parameter_table(params, shardings))
    print(report.table())
    print(f"loss on fsdp=4,tensor=2: {facts['loss']:.6f}   on one device: {facts['one_device_loss']:.6f}")
    return facts


if __name__ == "__main__":
    main()
