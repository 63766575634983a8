"""Meshes and logical sharding rules: what GSPMD needs, and what you import into your own JAX code.

- Mesh: `MeshConfig`, `make_mesh` (6 named axes `AXES`, all `AxisType.Auto`), `describe_parallelism`.
- Rules: `make_rules` / `preset` / `PRESETS` give a `Rules` (logical name -> mesh axes; your own names with
  `make_rules(extra={"patch": None, "channels": "tensor"})`, Flax's `logical_axis_rules` pairs with
  `Rules.to_flax()` / `Rules.from_flax(pairs)`); `logical_to_spec` turns names into a `PartitionSpec`;
  `use_rules(rules, mesh)` makes `constrain(x, names)` hint activation layouts while tracing.
- Whole pytrees: `state_shardings` (a `NamedSharding` per variable), `abstract_state`, `init_sharded`
  (any NNX module born in its shards).

The hand-written `shard_map` programs (ring attention, the pipeline, expert dispatch) are in `spmdkit.parallel`;
reading collectives and per-device bytes out of a compiled program is `spmdkit.inspect` (the names this package
once re-exported from them are gone: import them from there).

Names load on first use (PEP 562), so `from spmdkit.sharding.rules import make_rules` and the planner do not
start JAX; `from spmdkit.sharding import *` gives every name below.
"""

from __future__ import annotations

from spmdkit._lazy import lazy_exports

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
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
