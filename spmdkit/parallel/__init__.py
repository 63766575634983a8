"""The hand-written `jax.shard_map` programs: what the compiler cannot schedule well on its own.

- Context parallelism (`spmdkit.parallel.context`): `ring_attention`, load-balanced by the zigzag layout
  (`to_zigzag`, `from_zigzag`, `zigzag_indices`, `zigzag_batch`), with a ring backward pass.
- Pipeline parallelism (`spmdkit.parallel.pipeline`): schedules as data (`make_schedule`, `Schedule`: GPipe,
  1F1B, interleaved) and the tick-loop program `pipeline_value_and_grad`, with the layouts it expects
  (`to_microbatches`, `from_microbatches`, `interleave_layers`, `deinterleave_layers`).
- Expert parallelism (`spmdkit.parallel.experts`): `expert_ffn` sends routed tokens to their experts with
  all-to-alls (`ExpertWeights`, the slot count `capacity`, the dense reference `dense_moe`).
- Tensor parallelism (`spmdkit.parallel.collective_matmul`): `all_gather_matmul` and `matmul_reduce_scatter`,
  the ring (collective matmul) that overlaps TP's all-gather / reduce-scatter with the GEMMs.

Names load on first use (PEP 562): `from spmdkit.parallel.pipeline.schedule import make_schedule` stays JAX-free.
"""

from __future__ import annotations

from spmdkit._lazy import lazy_exports

_EXPORTS = {
    "ExpertWeights": "spmdkit.parallel.experts",
    "dense_moe": "spmdkit.parallel.experts",
    "expert_ffn": "spmdkit.parallel.experts",
    "capacity": "spmdkit.parallel.capacity",
    "all_gather_matmul": "spmdkit.parallel.collective_matmul",
    "matmul_reduce_scatter": "spmdkit.parallel.collective_matmul",
    "ring_attention": "spmdkit.parallel.context.ring_attention",
    "from_zigzag": "spmdkit.parallel.context.zigzag",
    "to_zigzag": "spmdkit.parallel.context.zigzag",
    "zigzag_batch": "spmdkit.parallel.context.zigzag",
    "zigzag_indices": "spmdkit.parallel.context.zigzag",
    "deinterleave_layers": "spmdkit.parallel.pipeline.program",
    "from_microbatches": "spmdkit.parallel.pipeline.program",
    "interleave_layers": "spmdkit.parallel.pipeline.program",
    "pipeline_value_and_grad": "spmdkit.parallel.pipeline.program",
    "to_microbatches": "spmdkit.parallel.pipeline.program",
    "Schedule": "spmdkit.parallel.pipeline.schedule",
    "make_schedule": "spmdkit.parallel.pipeline.schedule",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
