"""The shard_map collective matmuls equal the plain sharded matmuls on 8 CPU devices, values and gradients.

`all_gather_matmul` (the column-parallel projection of a sequence-sharded stream) and `matmul_reduce_scatter` (the
row-parallel projection back to it), on `tensor=8` and on `fsdp=4,tensor=2` (batch over fsdp), in float32 against
`x @ w` under automatic sharding. Small shapes: one compile per case.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter

MESHES = {"tensor=8": (1, 8), "fsdp=4,tensor=2": (4, 2)}


def _mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(shape), ("fsdp", "tensor"))


def _data(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (4, 32, 16), jnp.float32)  # [batch, seq, embed]
    w_up = jax.random.normal(keys[1], (16, 24), jnp.float32) / 4  # [embed, mlp]
    w_down = jax.random.normal(keys[2], (24, 16), jnp.float32) / 4  # [mlp, embed]
    return x, w_up, w_down


def _ring(mesh: jax.sharding.Mesh):
    """x -> down(up(x)) with both projections as collective matmuls over `tensor`."""
    seq, up_w, down_w, mlp = P("fsdp", "tensor", None), P(None, "tensor"), P("tensor", None), P("fsdp", None, "tensor")

    def block(x, w_up, w_down):
        hidden = jax.shard_map(
            lambda x, w: all_gather_matmul(x, w, "tensor"), mesh=mesh, in_specs=(seq, up_w), out_specs=mlp
        )(x, w_up)
        return jax.shard_map(
            lambda h, w: matmul_reduce_scatter(h, w, "tensor"), mesh=mesh, in_specs=(mlp, down_w), out_specs=seq
        )(jnp.tanh(hidden), w_down)

    return block


def _plain(x, w_up, w_down):
    return jnp.tanh(x @ w_up) @ w_down


@pytest.mark.parametrize("name", MESHES)
def test_collective_matmuls_equal_the_plain_matmuls(name):
    mesh = _mesh(MESHES[name])
    x, w_up, w_down = _data()
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(x, P("fsdp", "tensor", None)), put(w_up, P(None, "tensor")), put(w_down, P("tensor", None)))
    ring = _ring(mesh)
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    got, grads = jax.jit(jax.value_and_grad(loss(ring), argnums=(0, 1, 2)))(*args)
    want, want_grads = jax.value_and_grad(loss(_plain), argnums=(0, 1, 2))(x, w_up, w_down)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    forward = jax.jit(ring)(*args)
    assert forward.sharding.spec == P("fsdp", "tensor", None)
    np.testing.assert_allclose(np.asarray(forward), np.asarray(_plain(x, w_up, w_down)), rtol=1e-5, atol=1e-5)
