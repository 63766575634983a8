"""Mesh construction, parsing and its errors."""

import jax
import pytest
from jax.sharding import AxisType

from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh import AXES, MeshConfig, describe_parallelism, make_mesh, split_ici_dcn


def test_axis_order_and_types():
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    assert mesh.axis_names == AXES == ("data", "pipeline", "fsdp", "context", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 2, "pipeline": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    # tensor is innermost: its two devices are neighbours in device order
    grid = mesh.devices.reshape(2, 2, 2)
    assert abs(grid[0, 0, 0].id - grid[0, 0, 1].id) == 1


def test_minus_one_takes_the_rest_and_default_is_fsdp():
    assert make_mesh("tensor=2,data=-1").shape["data"] == 4
    assert make_mesh("").shape["fsdp"] == 8
    assert MeshConfig.parse("context=4").resolve(4)["context"] == 4


def test_subset_of_devices():
    mesh = make_mesh("fsdp=4", jax.devices()[:4])
    assert mesh.devices.size == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("data=3", "has 3 devices but 8 are present"),
        ("foo=2", "unknown mesh axis 'foo'"),
        ("data=-1,fsdp=-1", "at most one axis may take 'the rest'"),
        ("data=0", "data=0 is invalid"),
        ("tensor=-2", "tensor=-2 is invalid"),
        ("data", "'data' is malformed"),
        ("data=x", "size 'x' for axis 'data' is not an integer"),
        ("data=2,data=4", "given twice"),
        ("fsdp=3,data=-1", "does not divide 8"),
    ],
)
def test_bad_mesh_strings(text, message):
    with pytest.raises(SpmdkitError, match=message):
        make_mesh(text)


def test_hybrid_split_puts_nodes_on_outer_axes():
    sizes = {"data": 2, "pipeline": 1, "fsdp": 8, "context": 1, "expert": 1, "tensor": 4}
    ici, dcn = split_ici_dcn(sizes, num_granules=4)
    assert dcn == [2, 1, 2, 1, 1, 1]  # data=2 spans nodes, then fsdp takes the other factor 2
    assert ici == [1, 1, 4, 1, 1, 4]  # tensor never crosses a node
    ici, dcn = split_ici_dcn(sizes, 2, dcn={"fsdp": 2})
    assert dcn == [1, 1, 2, 1, 1, 1] and ici == [2, 1, 4, 1, 1, 4]
    with pytest.raises(SpmdkitError, match="cannot be laid over 3"):
        split_ici_dcn(sizes, 3)


def test_describe_parallelism():
    assert describe_parallelism(make_mesh("fsdp=4,tensor=2")) == "FSDP over 4 devices x TP over 2"
    assert "single device" in describe_parallelism(make_mesh("fsdp=1", jax.devices()[:1]))
