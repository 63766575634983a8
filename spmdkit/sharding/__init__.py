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

# the public names of each module
_MODULES = {
    "mesh_config": ("AXES", "MeshConfig"),
    "mesh": ("describe_parallelism", "make_mesh"),
    "rules": ("PRESETS", "Rules", "make_rules", "preset"),
    "logical": ("constrain", "logical_to_spec", "use_rules"),
    "partition": ("abstract_state", "init_sharded", "state_shardings"),
}
_EXPORTS = {name: f"spmdkit.sharding.{module}" for module, names in _MODULES.items() for name in names}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
