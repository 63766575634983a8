"""What the examples share: 8 simulated CPU devices, a seeded key, random tokens, a model's loss, its compiled
sharded step and its one-device reference.

Import it as an example's first import, before JAX computes anything: it runs JAX on 8 simulated CPU devices
(`jax_num_cpu_devices`) unless the backend already started (then the examples use the devices it has).
"""

import contextlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmdkit.models.transformer import cross_entropy
from spmdkit.sharding import use_rules

with contextlib.suppress(RuntimeError):  # RuntimeError: the backend is already running (e.g. in a test session)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

KEY = jax.random.key(0, impl="rbg")  # XLA compiles an rbg-seeded init ~3x faster than threefry on CPU


def tokens(rows: int = 8, seq: int = 32, vocab_size: int = 264) -> dict[str, np.ndarray]:
    """Random tokens (seed 0): inputs, targets, positions, each int32 [rows, seq]."""
    ids = np.random.default_rng(0).integers(0, vocab_size, (rows, seq + 1)).astype(np.int32)
    positions = np.tile(np.arange(seq, dtype=np.int32), (rows, 1))
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "positions": positions}


def cross_entropy_of(graphdef: nnx.GraphDef, rules=None, mesh=None):
    """(params, batch) -> mean next-token cross-entropy; with rules, activations follow their logical names."""

    def loss(params: nnx.State, batch: dict[str, jax.Array]) -> jax.Array:
        with use_rules(rules, mesh) if rules else contextlib.nullcontext():
            logits = nnx.merge(graphdef, params)(batch["inputs"], batch["positions"])
        return cross_entropy(logits, batch["targets"])

    return loss


def compile_loss_and_grads(graphdef: nnx.GraphDef, params: nnx.State, batch: dict, mesh, rules, shardings):
    """The sharded forward+backward, compiled: (loss, grads) with the gradients leaving sharded like the
    parameters (`shardings`), so XLA picks the reduction each strategy implies (all-reduce, reduce-scatter)."""
    step = jax.jit(
        jax.value_and_grad(cross_entropy_of(graphdef, rules, mesh)),
        out_shardings=(NamedSharding(mesh, PartitionSpec()), shardings),
    )
    return step.lower(params, batch).compile()


def one_device_loss(graphdef: nnx.GraphDef, params: nnx.State, batch: dict[str, np.ndarray]) -> float:
    """The reference: the same weights and tokens on one device, no rules; forward only (the loss is the claim)."""
    one = jax.devices()[0]
    return float(jax.jit(cross_entropy_of(graphdef))(jax.device_put(params, one), jax.device_put(batch, one)))
