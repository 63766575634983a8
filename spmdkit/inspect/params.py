"""A readable table of every parameter: logical names, mesh spec, global shape and per-device bytes."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding


@dataclasses.dataclass(frozen=True)
class ParamRow:
    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...]
    spec: str
    bytes_per_device: int
    bytes_total: int


def parameter_rows(state: Any, shardings: Any) -> list[ParamRow]:
    """One row per variable of `state` (abstract or concrete) laid out by the matching `shardings` tree."""
    rows = []
    variables = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for (path, variable), sharding in zip(variables, jax.tree.leaves(shardings), strict=True):
        value = variable.get_value() if isinstance(variable, nnx.Variable) else variable
        shape = tuple(value.shape)
        itemsize = np.dtype(value.dtype).itemsize
        local = sharding.shard_shape(shape) if isinstance(sharding, NamedSharding) else shape
        rows.append(
            ParamRow(
                path=jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value"),
                shape=shape,
                dtype=str(np.dtype(value.dtype)),
                logical=tuple(getattr(variable, "out_sharding", None) or ()),
                spec=str(tuple(sharding.spec)) if isinstance(sharding, NamedSharding) else "()",
                bytes_per_device=math.prod(local) * itemsize,
                bytes_total=math.prod(shape) * itemsize,
            )
        )
    return rows


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, one decimal; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parameter_table(state: Any, shardings: Any) -> str:
    """Text table of `parameter_rows`, with a total line (parameters and per-device bytes)."""
    rows = parameter_rows(state, shardings)
    header = ("parameter", "shape", "logical axes", "mesh spec", "per device")
    shapes = ["x".join(map(str, r.shape)) or "scalar" for r in rows]
    body = [
        (r.path, shape, ",".join(map(str, r.logical)), r.spec, human_bytes(r.bytes_per_device))
        for r, shape in zip(rows, shapes, strict=True)
    ]
    count = sum(math.prod(r.shape) for r in rows)
    body.append(("total", f"{count:,} values", "", "", human_bytes(sum(r.bytes_per_device for r in rows))))
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
