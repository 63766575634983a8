"""Meshes and logical sharding rules: what GSPMD needs, and what you import into your own JAX code.

- Mesh: `MeshConfig`, `make_mesh` (6 named axes `AXES`, all `AxisType.Auto`), `describe_parallelism`.
- Rules: `make_rules` / `preset` / `PRESETS` give a `Rules` (logical name -> mesh axes); `logical_to_spec`
  turns names into a `PartitionSpec`; `use_rules` + `constrain` hint activation layouts while tracing.
- Whole pytrees: `state_shardings` (a `NamedSharding` per variable), `abstract_state`, `init_sharded`
  (any NNX module born in its shards).

The hand-written `shard_map` programs (ring attention, the pipeline, expert dispatch) are in `spmdkit.parallel`;
reading collectives and per-device bytes out of a compiled program is `spmdkit.inspect`.

Names load on first use (PEP 562), so `from spmdkit.sharding.rules import make_rules` and the planner do not
start JAX; `from spmdkit.sharding import *` gives every name below.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    "AXES": "spmdkit.sharding.mesh_config",
    "MeshConfig": "spmdkit.sharding.mesh_config",
    "describe_parallelism": "spmdkit.sharding.mesh",
    "make_mesh": "spmdkit.sharding.mesh",
    "PRESETS": "spmdkit.sharding.rules",
    "Rules": "spmdkit.sharding.rules",
    "make_rules": "spmdkit.sharding.rules",
    "preset": "spmdkit.sharding.rules",
    "constrain": "spmdkit.sharding.logical",
    "logical_to_spec": "spmdkit.sharding.logical",
    "use_rules": "spmdkit.sharding.logical",
    "abstract_state": "spmdkit.sharding.partition",
    "init_sharded": "spmdkit.sharding.partition",
    "state_shardings": "spmdkit.sharding.partition",
}
# Names this package exported before the shard_map programs and the HLO report moved out: still resolved, with a
# DeprecationWarning naming the new home.
_MOVED = {
    **dict.fromkeys(["ExpertWeights", "capacity", "dense_moe", "expert_ffn"], "spmdkit.parallel"),
    **dict.fromkeys(["from_zigzag", "ring_attention", "to_zigzag", "zigzag_indices"], "spmdkit.parallel"),
    **dict.fromkeys(["Schedule", "make_schedule", "pipeline_value_and_grad"], "spmdkit.parallel"),
    **dict.fromkeys(
        ["deinterleave_layers", "interleave_layers", "from_microbatches", "to_microbatches"], "spmdkit.parallel"
    ),
    **dict.fromkeys(["CollectiveReport", "collective_report", "parameter_rows", "parameter_table"], "spmdkit.inspect"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(f"spmdkit.sharding.{name} moved to {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spmdkit.sharding' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
