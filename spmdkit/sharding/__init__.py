"""Meshes, logical sharding rules, and the shard_map programs: what you import into your own JAX code."""

from spmdkit.sharding.hlo import CollectiveReport, collective_report
from spmdkit.sharding.mesh import AXES, MeshConfig, describe_parallelism, make_mesh
from spmdkit.sharding.partition import abstract_state, init_sharded, state_shardings
from spmdkit.sharding.ring_attention import from_zigzag, ring_attention, to_zigzag, zigzag_indices
from spmdkit.sharding.rules import PRESETS, Rules, constrain, logical_to_spec, make_rules, preset, use_rules
from spmdkit.sharding.summary import parameter_rows, parameter_table

__all__ = [
    "AXES",
    "PRESETS",
    "CollectiveReport",
    "MeshConfig",
    "Rules",
    "abstract_state",
    "collective_report",
    "constrain",
    "describe_parallelism",
    "from_zigzag",
    "init_sharded",
    "logical_to_spec",
    "make_mesh",
    "make_rules",
    "parameter_rows",
    "parameter_table",
    "preset",
    "ring_attention",
    "state_shardings",
    "to_zigzag",
    "use_rules",
    "zigzag_indices",
]
