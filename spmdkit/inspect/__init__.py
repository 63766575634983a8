"""Reading a compiled program and a model state: the proofs behind every strategy.

- `collective_report(compiled)` -> `CollectiveReport`: the collectives in the optimized HLO, how often they run
  per step and the bytes each device contributes (`spmdkit.inspect.hlo`).
- `parameter_rows` / `parameter_table`: every parameter's logical axes, mesh spec, shape and bytes per device
  (`spmdkit.inspect.params`).
"""

from spmdkit.inspect.hlo import CollectiveReport, collective_report
from spmdkit.inspect.params import parameter_rows, parameter_table

__all__ = ["CollectiveReport", "collective_report", "parameter_rows", "parameter_table"]
