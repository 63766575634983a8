"""Logical names -> PartitionSpecs, presets, and the divisibility errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from spmdkit.errors import SpmdkitError
from spmdkit.models import Transformer, TransformerConfig
from spmdkit.sharding.logical import constrain, logical_to_spec
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.partition import init_sharded
from spmdkit.sharding.rules import PRESETS, make_rules, preset


def test_zero_stages_shard_what_they_should():
    mesh = make_mesh("fsdp=4,tensor=2")
    names, shape = ("embed", "mlp"), (64, 256)
    for stage, param, opt in [
        (0, P(None, "tensor"), P(None, "tensor")),
        (1, P(None, "tensor"), P("fsdp", "tensor")),
        (2, P(None, "tensor"), P("fsdp", "tensor")),
        (3, P("fsdp", "tensor"), P("fsdp", "tensor")),
    ]:
        rules = make_rules(stage)
        assert logical_to_spec(names, shape, mesh, rules.params) == param
        assert logical_to_spec(names, shape, mesh, rules.optimizer) == opt
    assert make_rules(2).gradients_like_optimizer and not make_rules(1).gradients_like_optimizer


def test_sequence_parallel_shards_residual_sequence_only():
    mesh = make_mesh("tensor=8")
    sp, tp = make_rules(3, sequence_parallel=True), make_rules(3)
    assert logical_to_spec(("batch", "act_seq", "act_embed"), (8, 16, 64), mesh, sp.params) == P(None, "tensor")
    assert logical_to_spec(("batch", "act_seq", "act_embed"), (8, 16, 64), mesh, tp.params) == P()
    assert logical_to_spec(("batch", "seq", "heads", None), (8, 16, 8, 4), mesh, sp.params) == P(None, None, "tensor")


def test_indivisible_dimension_names_parameter_shape_and_axis():
    mesh = make_mesh("fsdp=8")
    with pytest.raises(SpmdkitError, match=r"blocks/mlp/up of shape \(60, 256\): dim 0 \(embed=60\).*fsdp=8"):
        logical_to_spec(("embed", "mlp"), (60, 256), mesh, make_rules(3).params, what="blocks/mlp/up")


def test_kv_heads_fall_back_to_replication_with_warning():
    mesh = make_mesh("tensor=8")
    with pytest.warns(UserWarning, match="kv_heads=4.*replicating"):
        spec = logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 4, 8), mesh, make_rules(3).params)
    assert spec == P()


def test_presets_and_unknown_preset():
    mesh_config, rules = preset("zero1")
    assert mesh_config.fsdp == -1 and rules.zero_stage == 1
    assert preset("sp")[1].sequence_parallel
    assert set(PRESETS) >= {"dp", "fsdp", "zero1", "zero2", "zero3", "hsdp", "tp", "sp"}
    with pytest.raises(SpmdkitError, match="unknown strategy preset 'zero4'"):
        preset("zero4")


def test_constrain_is_identity_without_rules():
    x = jnp.ones((2, 3))
    assert constrain(x, ("batch", "act_embed")) is x


def test_init_sharded_parameters_are_born_sharded():
    mesh = make_mesh("fsdp=4,tensor=2")
    model = init_sharded(lambda: Transformer(TransformerConfig(), rngs=nnx.Rngs(0)), mesh, make_rules(3))
    up = model.blocks.mlp.up[...]
    assert up.sharding.spec == P(None, "fsdp", "tensor")
    assert up.addressable_shards[0].data.shape == (TransformerConfig().layers, 16, 128)
    # same values as an unsharded build with the same seed
    with nnx.use_eager_sharding(False):
        plain = Transformer(TransformerConfig(), rngs=nnx.Rngs(0))
    assert jnp.allclose(jax.device_get(up), plain.blocks.mlp.up[...])


def test_parameter_table_lists_every_parameter_with_per_device_bytes():
    from spmdkit.inspect import parameter_rows, parameter_table
    from spmdkit.sharding import abstract_state, state_shardings

    mesh = make_mesh("fsdp=4,tensor=2")
    graphdef, abstract = abstract_state(lambda: Transformer(TransformerConfig(), rngs=nnx.Rngs(0)))
    shardings = state_shardings(abstract, mesh, make_rules(3).params)
    rows = {r.path: r for r in parameter_rows(abstract, shardings)}
    up = rows["blocks/mlp/up"]
    layers = TransformerConfig().layers
    assert up.shape == (layers, 64, 256) and up.logical == ("layers", "embed", "mlp")
    assert up.bytes_total == layers * 64 * 256 * 4 and up.bytes_per_device == up.bytes_total // 8
    assert rows["final_norm/scale"].bytes_per_device == 64 * 4  # replicated
    assert sum(r.bytes_total for r in rows.values()) == TransformerConfig().num_params() * 4
    table = parameter_table(abstract, shardings)
    assert "blocks/mlp/up" in table and "('fsdp', 'tensor')" in table.replace("None, ", "")
    assert f"{TransformerConfig().num_params():,} values" in table


# Your own model with names spmdkit never defined: a ViT-style patch MLP, x [batch, patch, embed].
OWN = {"patch": None, "channels": "tensor"}


class PatchMLP(nnx.Module):
    """Two layers over image patches: w_in [embed, channels] column-parallel, w_out [channels, embed] row-parallel."""

    def __init__(self, embed: int, channels: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (embed, channels)), out_sharding=("embed", "channels"))
        self.w_out = nnx.Param(init(rngs.params(), (channels, embed)), out_sharding=("channels", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(jax.nn.gelu(x @ self.w_in[...]), ("batch", "patch", "channels"))
        return constrain(h @ self.w_out[...], ("batch", "patch", "act_embed"))


def _own_loss_and_grads(mesh, rules):
    from spmdkit.sharding.logical import use_rules

    model = init_sharded(lambda: PatchMLP(32, 64, rngs=nnx.Rngs(0)), mesh, rules)
    graphdef, params = nnx.split(model)
    x = jax.random.normal(jax.random.key(1), (8, 16, 32))

    @jax.jit
    def step(params, x):
        with use_rules(rules, mesh):
            return jax.value_and_grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2))(params)

    with jax.set_mesh(mesh):
        loss, grads = step(params, x)
    return model, loss, grads


def test_own_module_with_extra_names_matches_one_device():
    rules = make_rules(3, extra=OWN)
    assert rules.params["channels"] == ("tensor",) and rules.optimizer["patch"] == ()
    model, loss, grads = _own_loss_and_grads(make_mesh("fsdp=4,tensor=2"), rules)
    assert model.w_in[...].sharding.spec == P("fsdp", "tensor")
    assert model.w_in[...].addressable_shards[0].data.shape == (8, 32)
    one = make_mesh("data=1", devices=jax.devices()[:1])
    _, one_loss, one_grads = _own_loss_and_grads(one, rules)
    assert np.allclose(jax.device_get(loss), jax.device_get(one_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(one_grads), strict=True):
        assert np.allclose(jax.device_get(got), jax.device_get(want), rtol=1e-5, atol=1e-7)


def test_flax_rules_round_trip_and_agree_with_flax_partition_specs():
    from spmdkit.sharding import Rules, abstract_state, state_shardings

    rules = make_rules(2, extra=OWN)
    pairs = rules.to_flax()
    assert ("channels", "tensor") in pairs and ("patch", None) in pairs
    assert ("batch", ("data", "fsdp", "expert")) in pairs and ("embed", None) in pairs
    back = Rules.from_flax(pairs, optimizer=rules.to_flax("optimizer"))
    assert back.params == rules.params and back.optimizer == rules.optimizer
    assert Rules.from_flax([("patch", None), ("channels", ["fsdp", "tensor"])]).params["channels"] == ("fsdp", "tensor")
    # Flax's own reading of the same pairs lays the parameters out as spmdkit does.
    mesh = make_mesh("fsdp=4,tensor=2")
    _, abstract = abstract_state(lambda: PatchMLP(32, 64, rngs=nnx.Rngs(0)))
    ours = state_shardings(abstract, mesh, rules.optimizer)
    with nnx.logical_axis_rules(rules.to_flax("optimizer")):
        flax_specs = nnx.get_partition_spec(abstract)
    for name in ("w_in", "w_out"):
        theirs = jax.sharding.NamedSharding(mesh, flax_specs[name].get_value())
        assert ours[name].is_equivalent_to(theirs, 2), (name, ours[name].spec, theirs.spec)


def test_unknown_mesh_axis_and_bad_rules_are_refused_in_one_line():
    from spmdkit.sharding import Rules

    with pytest.raises(SpmdkitError, match=r"logical axis 'channels' -> unknown mesh axis 'model'; mesh axes: data,"):
        make_rules(extra={"channels": "model"})
    with pytest.raises(SpmdkitError, match=r"Rules.from_flax: logical axis 'patch' -> unknown mesh axis 'sequence'"):
        Rules.from_flax([("patch", ("data", "sequence"))])
    with pytest.raises(SpmdkitError, match="logical axis 'batch' has two rules"):
        Rules.from_flax([("batch", "data"), ("batch", "fsdp")])
    with pytest.raises(SpmdkitError, match="give a mesh axis, a tuple of them, or None"):
        make_rules(extra={"channels": 2})
    with pytest.raises(SpmdkitError, match="'patch' has no rule"):
        logical_to_spec(("patch",), (4,), make_mesh("fsdp=8"), make_rules().params)
