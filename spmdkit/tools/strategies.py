"""The parallelism strategies that the benchmark runs and the tests check, in one table (no JAX here).

Each is a concrete layout on 8 devices (8 simulated CPU devices, or one GPU node), a `Strategy`
(`spmdkit.sharding.strategy`, the value the presets and the planner take too): a mesh, the ZeRO stage and the
sequence-parallel switch that `spmdkit.sharding.rules.make_rules` takes, and the gradient accumulation steps.
`spmdkit bench` runs the subset in `spmdkit.tools.bench.STRATEGIES`; each test module picks the names it checks.
"""

from __future__ import annotations

from spmdkit.sharding.strategy import Strategy

STRATEGIES: dict[str, Strategy] = {
    "one_device": Strategy("fsdp=1"),  # the baseline: runs on the first device alone
    "dp": Strategy("data=8", zero=0),
    "fsdp": Strategy("fsdp=8"),
    "zero1": Strategy("fsdp=8", zero=1),
    "zero2": Strategy("fsdp=8", zero=2),
    "hsdp": Strategy("data=2,fsdp=4"),
    "tp": Strategy("tensor=8"),
    "tp_sp": Strategy("tensor=8", sequence_parallel=True),
    "data_fsdp_tensor": Strategy("data=2,fsdp=2,tensor=2"),
    "cp": Strategy("context=4,fsdp=2"),  # ring attention on a zigzag-permuted batch
    "pp": Strategy("pipeline=4,data=2"),
    "ep": Strategy("expert=4,data=2"),  # a mixture-of-experts model
    "fsdp_tp": Strategy("fsdp=4,tensor=2"),  # the benchmark's peer configuration's second mesh
    "zero1_accumulated": Strategy("data=2,fsdp=2,tensor=2", zero=1, microbatches=2),  # reduced once over data x fsdp
    "zero3_accumulated": Strategy("data=2,fsdp=2,tensor=2", microbatches=2),  # two automatic axes: XLA's own loop
}
