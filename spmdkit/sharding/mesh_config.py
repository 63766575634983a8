"""Mesh shapes as plain data: `MeshConfig`, parsing "data=2,fsdp=2,tensor=2", and the ICI x DCN split.

Axis order, outermost to innermost: data, pipeline, fsdp, context, expert, tensor. The innermost axis gets
adjacent devices (the same NVLink domain); the outermost spans nodes. Every axis is `AxisType.Auto`: the
compiler propagates shardings from the annotations (`jax.make_mesh` would default to Explicit).

Multi-node meshes are hybrid: each axis size is split into an in-node (ICI) factor and an across-node (DCN)
factor, so the in-node axes never cross a node. The granules are hosts (nodes), whether each runs one JAX process
or one per GPU: `--dcn data=2` means 2 nodes (`spmdkit.sharding.mesh` finds which process runs on which host).

Pure Python (no JAX): the planner parses meshes with it too. `spmdkit.sharding.mesh.make_mesh` builds the JAX mesh.
"""

from __future__ import annotations

import dataclasses
import math

from spmdkit.errors import SpmdkitError

AXES: tuple[str, ...] = ("data", "pipeline", "fsdp", "context", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the six mesh axes; at most one may be -1, meaning "all remaining devices".

    `dcn` names the across-node factor of axes, e.g. `(("data", 2),)`: of `data`'s size, 2 spans nodes (hosts,
    however many processes each runs) and the rest stays inside a node. Empty `dcn` with several hosts puts the
    hosts on the outermost axes that can hold them (see `split_ici_dcn`).
    """

    data: int = 1
    pipeline: int = 1
    fsdp: int = -1
    context: int = 1
    expert: int = 1
    tensor: int = 1
    dcn: tuple[tuple[str, int], ...] = ()

    @classmethod
    def parse(cls, text: str, dcn: str | None = None) -> MeshConfig:
        """`"data=2,fsdp=-1,tensor=2"` -> MeshConfig. Axes not named are 1; an empty string is `fsdp=-1`."""
        sizes = _parse_sizes(text, what="--mesh") or {"fsdp": -1}
        factors = tuple(_parse_sizes(dcn or "", what="--dcn").items())
        return cls(**{axis: sizes.get(axis, 1) for axis in AXES}, dcn=factors)

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Axis sizes with the -1 filled in, checked against `num_devices`."""
        sizes = self.sizes()
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise SpmdkitError(f"mesh axis {axis}={size} is invalid: sizes are positive (or -1 for 'the rest')")
        free = [axis for axis, size in sizes.items() if size == -1]
        if len(free) > 1:
            raise SpmdkitError(f"mesh axes {', '.join(free)} are all -1: at most one axis may take 'the rest'")
        known = math.prod(size for size in sizes.values() if size != -1)
        if free:
            if num_devices % known:
                raise SpmdkitError(
                    f"mesh {format_sizes(sizes)} cannot fill {num_devices} devices: the fixed axes multiply to "
                    f"{known}, which does not divide {num_devices}"
                )
            sizes[free[0]] = num_devices // known
        elif known != num_devices:
            raise SpmdkitError(
                f"mesh {format_sizes(sizes)} has {known} devices but {num_devices} are present: make the sizes "
                f"multiply to {num_devices} (or set one axis to -1)"
            )
        for axis, factor in self.dcn:
            if axis not in AXES:
                raise SpmdkitError(f"unknown mesh axis {axis!r} in --dcn: expected one of {', '.join(AXES)}")
            if factor < 1 or sizes[axis] % factor:
                raise SpmdkitError(f"--dcn {axis}={factor} does not divide mesh axis {axis}={sizes[axis]}")
        return sizes


def _parse_sizes(text: str, *, what: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not value.strip():
            raise SpmdkitError(f"{what} part {part!r} is malformed: write axis=size, e.g. 'data=2,tensor=4'")
        if name not in AXES:
            raise SpmdkitError(f"unknown mesh axis {name!r} in {what}: expected one of {', '.join(AXES)}")
        if name in sizes:
            raise SpmdkitError(f"mesh axis {name!r} is given twice in {what}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise SpmdkitError(f"{what} size {value.strip()!r} for axis {name!r} is not an integer") from None
    return sizes


def format_sizes(sizes: dict[str, int]) -> str:
    """{'data': 2, 'fsdp': 4, ...} -> 'data=2,fsdp=4' (axes of size 1 left out)."""
    text = ",".join(f"{axis}={size}" for axis, size in sizes.items() if size != 1)
    return text or "single device"


def split_ici_dcn(
    sizes: dict[str, int], num_granules: int, dcn: dict[str, int] | None = None
) -> tuple[list[int], list[int]]:
    """Split each axis size into (in-node, across-node) factors whose across-node product is `num_granules` (the
    hosts: nodes, not processes).

    With `dcn` given it is used as is. Otherwise granules fill the outermost axes first (data, then pipeline,
    then fsdp, ...), because the outer axes carry the least traffic per step.
    """
    if dcn:
        dcn_shape = [dcn.get(axis, 1) for axis in AXES]
    else:
        dcn_shape, left = [], num_granules
        for axis in AXES:
            factor = math.gcd(sizes[axis], left)
            dcn_shape.append(factor)
            left //= factor
        if left != 1:
            raise SpmdkitError(
                f"mesh {format_sizes(sizes)} cannot be laid over {num_granules} hosts: the outer axes must absorb "
                f"the host (node) count; pass --dcn to say which axes span nodes"
            )
    if math.prod(dcn_shape) != num_granules:
        raise SpmdkitError(
            f"--dcn factors multiply to {math.prod(dcn_shape)} but the processes run on {num_granules} hosts (nodes): "
            "--dcn counts nodes, not processes"
        )
    ici_shape = [sizes[axis] // factor for axis, factor in zip(AXES, dcn_shape, strict=True)]
    return ici_shape, dcn_shape
