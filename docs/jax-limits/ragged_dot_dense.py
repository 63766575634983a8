"""`jax.lax.ragged_dot` (a grouped matmul: rows sorted by group, one weight per group) compiled for one H100 without
a GPU: how XLA:GPU lowers it, forward and backward. A grouped GEMM costs 2 x rows x in x out; a dense lowering
multiplies every row with every group's weight, `groups` times that. Run: python THIS_FILE."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.inspect.levers import expert_gemms
from spmdkit.targets import target_devices

rows, d, f, groups = 4096, 512, 1024, 8
mesh = jax.sharding.Mesh(target_devices("h100", 1, 1), ("x",))
spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
loss = lambda x, w, sizes: jnp.sum(jax.lax.ragged_dot(x, w, sizes).astype(jnp.float32) ** 2)  # noqa: E731
step = jax.jit(jax.grad(loss, argnums=(0, 1)))
text = step.lower(spec((rows, d), jnp.bfloat16), spec((groups, d, f), jnp.bfloat16), spec((groups,), jnp.int32))
found = expert_gemms(text.compile().as_text(), ("ragged_dot",))
grouped = 3 * 2 * rows * d * f  # forward and the two gradients, as grouped GEMMs
print(f"grouped-GEMM instructions {found['grouped']}, dense dots {found['dense']}, "
      f"{found['flops'] / grouped:.1f} x a grouped GEMM's FLOPs ({groups} groups); jax {jax.__version__}")  # fmt: skip
