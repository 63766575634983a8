"""The collective parser against a shard_map program whose collectives are known by construction."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.inspect.hlo import collective_report, type_bytes
from spmdkit.sharding.mesh import make_mesh


def test_type_bytes():
    assert type_bytes("f32[8,16]{1,0}") == 512
    assert type_bytes("(bf16[4], s32[2,2])") == 8 + 16
    assert type_bytes("f32[]") == 4


def test_counts_bytes_and_loop_trips():
    mesh = make_mesh("fsdp=8")
    block = 128 * 64 * 4  # one device's (128, 64) float32 block

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    def program(x):
        total = jax.lax.psum(x, "fsdp")
        gathered = jax.lax.all_gather(x, "fsdp", tiled=True)
        scattered = jax.lax.psum_scatter(gathered, "fsdp", tiled=True)
        shifted = jax.lax.ppermute(x, "fsdp", [(j, (j + 1) % 8) for j in range(8)])
        looped, _ = jax.lax.scan(lambda c, _: (jax.lax.psum(c, "fsdp") * 0.5 + c, None), x, None, length=5)
        return total + scattered + shifted + looped

    report = collective_report(program.lower(jnp.ones((1024, 64))).compile())
    assert report.count("all-gather") == 1 and report.bytes("all-gather") == block
    assert report.count("reduce-scatter") == 1 and report.bytes("reduce-scatter") == 8 * block
    assert report.count("collective-permute") == 1 and report.bytes("collective-permute") == block
    assert report.count("all-reduce") == 2  # one outside the loop, one in its body
    assert report.count("all-reduce", executed=True) == 6  # the body runs 5 times
    assert report.bytes("all-reduce") == 6 * block
    assert all(c.group_size == 8 for c in report.collectives if c.opcode != "collective-permute")
    assert "reduce-scatter" in report.table()


def test_gspmd_reduce_scatter_is_recognised():
    """A sharded matmul output summed over the contracting axis: GSPMD's reduce-scatter (on CPU: all-reduce
    followed by a dynamic-slice keeping 1/8) is reported as one reduce-scatter of the full buffer."""
    mesh = make_mesh("tensor=8")
    x = jax.device_put(jnp.ones((64, 128)), NamedSharding(mesh, P(None, "tensor")))
    w = jax.device_put(jnp.ones((128, 32)), NamedSharding(mesh, P("tensor")))
    f = jax.jit(lambda x, w: jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("tensor"))))
    report = collective_report(f.lower(x, w).compile())
    assert report.count("all-reduce") == 0
    assert report.count("reduce-scatter") == 1 and report.bytes("reduce-scatter") == 64 * 32 * 4


def test_replica_groups_with_a_device_order():
    """On data=2 x fsdp=4, summing a dim sharded over `fsdp` reduces over the inner axis across a transposed
    device order; XLA writes those groups as `mesh[...], device_ids=([2,4]T(1,0)) {...}`: 4 devices each."""
    mesh = make_mesh("data=2,fsdp=4")
    x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("fsdp", "data")))
    f = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))
    compiled = f.lower(x).compile()
    assert "device_ids=" in compiled.as_text()
    report = collective_report(compiled)
    assert [(c.opcode, c.group_size) for c in report.collectives] == [("all-reduce", 4), ("all-gather", 2)]


def test_flops_multiply_loop_bodies_by_their_trip_counts():
    """A scanned matmul: 7 iterations of [32, 64] x [64, 48], plus one [32, 48] x [48, 16] outside the loop; XLA's
    own cost_analysis counts the loop body once."""
    from spmdkit.inspect.flops import hlo_flops

    @jax.jit
    def program(x, w, v):
        y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w) @ w.T, None), x, None, length=7)
        return (y @ w) @ v

    compiled = program.lower(jnp.ones((32, 64)), jnp.ones((64, 48)), jnp.ones((48, 16))).compile()
    per_iteration = 2 * (2 * 32 * 64 * 48)  # c @ w, then [32, 48] @ [48, 64]
    outside = 2 * 32 * 64 * 48 + 2 * 32 * 48 * 16
    assert hlo_flops(compiled)["matmul"] == 7 * per_iteration + outside
