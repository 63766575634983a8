"""Named device meshes: `make_mesh` lays the six axes of a `MeshConfig` over the devices.

Axis order, outermost to innermost: data, pipeline, fsdp, context, expert, tensor. The innermost axis gets
adjacent devices (the same NVLink domain); the outermost spans nodes. Every axis is `AxisType.Auto`: the
compiler propagates shardings from the annotations (`jax.make_mesh` would default to Explicit). Multi-node meshes
are hybrid (in-node ICI x across-node DCN factors, see `spmdkit.sharding.mesh_config.split_ici_dcn`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh_config import AXES, MeshConfig, format_sizes, split_ici_dcn

__all__ = ["AXES", "MeshConfig", "describe_parallelism", "format_sizes", "make_mesh"]

# How each axis reads in words, for `describe_parallelism`.
_AXIS_WORDS = {
    "data": "DP",
    "pipeline": "PP",
    "fsdp": "FSDP",
    "context": "CP",
    "expert": "EP",
    "tensor": "TP",
}


def make_mesh(config: MeshConfig | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the 6-axis mesh (all `AxisType.Auto`) over `devices` (default: every device of every process)."""
    if isinstance(config, str):
        config = MeshConfig.parse(config)
    devices = list(jax.devices() if devices is None else devices)
    sizes = config.resolve(len(devices))
    shape = [sizes[axis] for axis in AXES]
    num_granules = len({d.process_index for d in devices})
    if num_granules == 1 and any(factor > 1 for _, factor in config.dcn):
        raise SpmdkitError(
            f"--dcn {format_sizes(dict(config.dcn))} says axes span nodes, but this run has one process: drop --dcn, "
            "or start one process per node (spmdkit launch, srun)"
        )
    if num_granules > 1:
        ici_shape, dcn_shape = split_ici_dcn(sizes, num_granules, dict(config.dcn))
        grid = mesh_utils.create_hybrid_device_mesh(
            ici_shape, dcn_shape, devices, process_is_granule=True, allow_split_physical_axes=True
        )
    elif devices == jax.devices():
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        # A subset (e.g. 4 of 8 devices): keep the caller's order.
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def describe_parallelism(mesh: Mesh) -> str:
    """'FSDP over 4 devices x TP over 2' for the axes of size > 1."""
    parts = [f"{_AXIS_WORDS[a]} over {mesh.shape[a]}" for a in AXES if mesh.shape.get(a, 1) > 1]
    if not parts:
        return "a single device (no parallelism)"
    parts[0] += " devices"
    return " x ".join(parts)
