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
"""

from spmdkit.sharding.experts import ExpertWeights, capacity, dense_moe, expert_ffn
from spmdkit.sharding.hlo import CollectiveReport, collective_report
from spmdkit.sharding.mesh import AXES, MeshConfig, describe_parallelism, make_mesh
from spmdkit.sharding.partition import abstract_state, init_sharded, state_shardings
from spmdkit.sharding.pipeline import (
    deinterleave_layers,
    from_microbatches,
    interleave_layers,
    pipeline_value_and_grad,
    to_microbatches,
)
from spmdkit.sharding.pipeline_schedule import Schedule, make_schedule
from spmdkit.sharding.ring_attention import from_zigzag, ring_attention, to_zigzag, zigzag_indices
from spmdkit.sharding.rules import PRESETS, Rules, constrain, logical_to_spec, make_rules, preset, use_rules
from spmdkit.sharding.summary import parameter_rows, parameter_table

__all__ = [
    "AXES",
    "PRESETS",
    "CollectiveReport",
    "ExpertWeights",
    "MeshConfig",
    "Rules",
    "Schedule",
    "abstract_state",
    "capacity",
    "collective_report",
    "constrain",
    "deinterleave_layers",
    "dense_moe",
    "describe_parallelism",
    "expert_ffn",
    "from_microbatches",
    "from_zigzag",
    "init_sharded",
    "interleave_layers",
    "logical_to_spec",
    "make_mesh",
    "make_rules",
    "make_schedule",
    "parameter_rows",
    "parameter_table",
    "pipeline_value_and_grad",
    "preset",
    "ring_attention",
    "state_shardings",
    "to_microbatches",
    "to_zigzag",
    "use_rules",
    "zigzag_indices",
]
