"""Meshes, logical sharding rules, and the shard_map programs: what you import into your own JAX code.

- Mesh: `MeshConfig`, `make_mesh` (6 named axes `AXES`, all `AxisType.Auto`), `describe_parallelism`.
- Rules: `make_rules` / `preset` / `PRESETS` give a `Rules` (logical name -> mesh axes); `logical_to_spec`
  turns names into a `PartitionSpec`; `use_rules` + `constrain` hint activation layouts while tracing.
- Whole pytrees: `state_shardings` (a `NamedSharding` per variable), `abstract_state`, `init_sharded`
  (any NNX module born in its shards), `parameter_table` / `parameter_rows` (per-device bytes).
- Proof: `collective_report` reads the collectives out of a compiled program (`CollectiveReport`).
- shard_map programs: `ring_attention` (context parallelism; zigzag layout helpers),
  `pipeline_value_and_grad` with `make_schedule` (GPipe, 1F1B, interleaved) and its layout helpers, and
  `expert_ffn` (expert parallelism: all-to-all token dispatch over `expert`) with `ExpertWeights`,
  `capacity` and the dense reference `dense_moe`.

Names load on first use (PEP 562), so `from spmdkit.sharding.mesh import MeshConfig` and the planner do not
start JAX; `from spmdkit.sharding import *` gives every name below.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    "ExpertWeights": "experts",
    "capacity": "experts",
    "dense_moe": "experts",
    "expert_ffn": "experts",
    "CollectiveReport": "hlo",
    "collective_report": "hlo",
    "AXES": "mesh",
    "MeshConfig": "mesh",
    "describe_parallelism": "mesh",
    "make_mesh": "mesh",
    "abstract_state": "partition",
    "init_sharded": "partition",
    "state_shardings": "partition",
    "deinterleave_layers": "pipeline",
    "from_microbatches": "pipeline",
    "interleave_layers": "pipeline",
    "pipeline_value_and_grad": "pipeline",
    "to_microbatches": "pipeline",
    "Schedule": "pipeline_schedule",
    "make_schedule": "pipeline_schedule",
    "from_zigzag": "ring_attention",
    "ring_attention": "ring_attention",
    "to_zigzag": "ring_attention",
    "zigzag_indices": "ring_attention",
    "PRESETS": "rules",
    "Rules": "rules",
    "constrain": "rules",
    "logical_to_spec": "rules",
    "make_rules": "rules",
    "preset": "rules",
    "use_rules": "rules",
    "parameter_rows": "summary",
    "parameter_table": "summary",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spmdkit.sharding' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"spmdkit.sharding.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
