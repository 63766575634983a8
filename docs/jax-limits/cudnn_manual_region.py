"""cuDNN attention in a partly manual shard_map (a pipeline stage: manual over pipeline and data, tensor automatic),
compiled for 8 x H100 without a GPU. Called directly, its custom partitioner fails; nested in a second shard_map
over the axes still automatic (spmdkit's way, spmdkit.models.attention) it compiles. Run: python THIS_FILE."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.targets import target_devices

auto = (jax.sharding.AxisType.Auto,) * 3
mesh = jax.make_mesh((2, 2, 2), ("pipeline", "data", "tensor"), devices=target_devices("h100", 8, 8), axis_types=auto)
attention = lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn")  # noqa: E731
heads = P(None, None, "tensor")  # [batch, seq, heads, head_dim]
nested = lambda q: jax.shard_map(  # noqa: E731
    attention, mesh=jax.sharding.get_abstract_mesh(), in_specs=heads, out_specs=heads, axis_names={"tensor"},
    check_vma=False,
)(q)  # fmt: skip
q = jax.ShapeDtypeStruct((16, 256, 4, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P(("pipeline", "data"))))
for name, kernel in (("direct", attention), ("nested", nested)):
    stage = jax.shard_map(kernel, mesh=mesh, in_specs=P(("pipeline", "data")), out_specs=P(("pipeline", "data")),
                          axis_names={"pipeline", "data"})  # fmt: skip
    loss = lambda q, stage=stage: jnp.sum(stage(q).astype(jnp.float32))  # noqa: E731
    try:
        text = jax.jit(jax.grad(loss)).lower(q).compile().as_text()
        print(f"{name}: compiles, cuDNN {'in' if '__cudnn$fmha' in text else 'NOT in'} the program")
    except Exception as error:  # the limit: the innermost error XLA's or JAX's message names
        lines = [line.strip() for line in str(error).splitlines() if "Error" in line] or [str(error)]
        print(f"{name}: fails: {type(error).__name__}: {lines[-1][:120]}")
print(f"jax {jax.__version__}")
