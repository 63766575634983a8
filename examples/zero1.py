"""ZeRO-1: parameters replicated, the AdamW moments split 8 ways over `fsdp`.

ZeRO-1 is one table change: the parameters follow `rules.params` (`embed` replicated) and the optimizer state
follows `rules.optimizer` (`embed -> fsdp`). Each device updates only the 1/8 of the parameters whose moments
it holds, so XLA reduce-scatters the gradients (each device needs only its slice) and all-gathers the updated
slices. What it proves, on 8 simulated CPU devices: every device holds all parameters but 1/8 of the optimizer
state; the compiled step reduce-scatters the gradients and all-gathers 1/8 of the parameter bytes per device;
the losses of two AdamW steps equal the one-device program's. (`spmdkit train --zero 1` runs this layout with
the full train step, which keeps gradients whole, all-reducing them; `--zero 2` shards them.)
Run: python examples/zero1.py
"""

import common  # noqa: F401  (first: it gives JAX 8 simulated CPU devices)
import jax
import optax
from common import KEY, cross_entropy_of, tokens
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmdkit.inspect import collective_report, parameter_rows
from spmdkit.models import Transformer, model_preset
from spmdkit.sharding import init_sharded, make_mesh, make_rules, state_shardings
from spmdkit.train.step.train_step import batch_shardings

CONFIG = model_preset("tiny").replace(dtype="float32", layers=2)  # float32: sharded == one device to 1e-5


def adamw_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, rules=None, mesh=None):
    """(params, opt_state, batch) -> (new params, new opt_state, loss): one AdamW step."""

    def step(params: nnx.State, opt_state: optax.OptState, batch: dict[str, jax.Array]):
        loss, grads = jax.value_and_grad(cross_entropy_of(graphdef, rules, mesh))(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def main() -> dict:
    mesh, rules = make_mesh("fsdp=8"), make_rules(zero_stage=1)
    tx = optax.adamw(1e-2)
    model = init_sharded(lambda: Transformer(CONFIG, rngs=nnx.Rngs(KEY)), mesh, rules)
    graphdef, params = nnx.split(model)
    param_shardings = state_shardings(params, mesh, rules.params)  # replicated (ZeRO-1 keeps `embed` whole)
    # The moments carry their parameter's logical names; the optimizer table sends `embed` to fsdp.
    opt_shardings = state_shardings(jax.eval_shape(tx.init, params), mesh, rules.optimizer)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)  # born sharded
    batch = jax.device_put(tokens(), batch_shardings(mesh, rules))
    replicated = NamedSharding(mesh, PartitionSpec())
    step = jax.jit(adamw_step(graphdef, tx, rules, mesh), out_shardings=(param_shardings, opt_shardings, replicated))
    compiled = step.lower(params, opt_state, batch).compile()
    one = jax.devices()[0]
    one_params, one_opt_state = jax.device_put((params, opt_state), one)  # the same start, on one device, no rules
    one_step = jax.jit(adamw_step(graphdef, tx))
    losses, one_device_losses = [], []
    for _ in range(2):
        params, opt_state, loss = compiled(params, opt_state, batch)
        one_params, one_opt_state, one_loss = one_step(one_params, one_opt_state, tokens())
        losses.append(float(loss))
        one_device_losses.append(float(one_loss))
    param_bytes = sum(r.bytes_per_device for r in parameter_rows(params, param_shardings))
    opt_rows = parameter_rows(opt_state, opt_shardings)
    report = collective_report(compiled)
    facts = {
        "collectives": report.by_opcode(),
        "gradient_bytes": CONFIG.num_params() * 4,
        "param_bytes_per_device": param_bytes,
        "optimizer_bytes_per_device": sum(r.bytes_per_device for r in opt_rows),
        "one_device_optimizer_bytes": sum(r.bytes_total for r in opt_rows),
        "losses": losses,
        "one_device_losses": one_device_losses,
    }
    print(report.table())
    opt_bytes, opt_total = facts["optimizer_bytes_per_device"], facts["one_device_optimizer_bytes"]
    print(f"per device: parameters {param_bytes:,} bytes (all), optimizer state {opt_bytes:,} bytes (of {opt_total:,})")
    print(f"losses on fsdp=8: {losses}   on one device: {one_device_losses}")
    return facts


if __name__ == "__main__":
    main()
