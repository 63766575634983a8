"""XLA:GPU's windowed einsum (collective matmul, `--overlap-tp`'s flags) compiled for 8 x H100 without a GPU: an
all-gather over tensor feeding a matmul becomes a loop of collective-permutes and partial matmuls. Where each hop
sits, and whether it is asynchronous (a start/done pair with work between) or made synchronous ("is_sync": XLA
found nothing to run beside it). Run: python THIS_FILE."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.inspect.hlo import collective_report
from spmdkit.inspect.levers import windowed_einsums
from spmdkit.targets import target_devices
from spmdkit.targets.flags import gpu_compiler_options, run_flags

mesh = jax.sharding.Mesh(target_devices("h100", 8, 8), ("tensor",))
x = jax.ShapeDtypeStruct((8, 2048, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tensor")))
w = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tensor")))
out = NamedSharding(mesh, P(None, None, "tensor"))
matmul = jax.jit(lambda x, w: jax.lax.with_sharding_constraint(x @ w, out))  # x gathered over its sequence
options = {**gpu_compiler_options(run_flags(overlap_tp=True)), "xla_gpu_threshold_for_windowed_einsum_mib": 0}
for streams in (False, True):
    text = matmul.lower(x, w).compile({**options, "xla_gpu_multi_streamed_windowed_einsum": streams}).as_text()
    hops, permutes = windowed_einsums(text), collective_report(text).by_opcode().get("collective-permute", {})
    print(f"multi-streamed {streams}: {hops['loops']} loop(s), {hops['collective_permutes']} hop(s), "
          f"{hops['asynchronous']} async; all permutes {permutes}")  # fmt: skip
print(f"jax {jax.__version__}")
