"""`Strategy`: how a training step is laid out on the devices, whatever the model (pure Python, no JAX).

One value for every place that names a layout: the sharding presets (`spmdkit.sharding.rules.PRESETS`), the
strategies the benchmark runs and the tests check (`spmdkit.tools.strategies`), the planner (`spmdkit.plan`: a
`Layout` is a strategy on a resolved mesh with a model and a batch) and the trainer (`train.program.layout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

Schedule = Literal["gpipe", "1f1b", "interleaved"]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The mesh (axis sizes, "data=2,fsdp=-1": -1 takes the remaining devices), the ZeRO stage over fsdp, sequence
    parallelism over tensor, the microbatches of a step (gradient accumulation, or a pipeline's microbatches when
    pipeline > 1; None: 1, or the planner's and the trainer's default for a pipeline), the pipeline schedule and its
    virtual stages, the optimizer state kept in host memory between steps, the algorithm over a context axis
    ("auto", "ring", "ulysses", "2d" with `ulysses` devices per group: `spmdkit.models.attention_choice`), and
    whether the optimizer is Muon (one moment for the hidden matrices) rather than AdamW (two for every weight)."""

    mesh: str = "fsdp=-1"
    zero: int = 3
    sequence_parallel: bool = False
    microbatches: int | None = None
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    offload: bool = False
    context_parallel: str = "auto"
    ulysses: int = 1  # 2D context parallelism (context_parallel "2d"): devices per Ulysses group
    muon: bool = False  # --optimizer.name muon

    def flags(self) -> str:
        """The `spmdkit train` flags of this strategy: the mesh, the ZeRO stage, and what differs from the defaults
        (the microbatches are `--microbatches` with a pipeline axis, else `--grad-accum`)."""
        pipelined = any(p.startswith("pipeline=") and p != "pipeline=1" for p in self.mesh.split(","))
        out = [f"--mesh {self.mesh} --zero {self.zero}"] + ["--sequence-parallel"] * self.sequence_parallel
        if self.microbatches:
            out.append(f"{'--microbatches' if pipelined else '--grad-accum'} {self.microbatches}")
        out += [f"--pipeline-schedule {self.schedule}"] * (self.schedule != "1f1b")
        out += [f"--virtual-stages {self.virtual_stages}"] * (self.virtual_stages != 1)
        out += [f"--context-parallel {self.context_parallel}"] * (self.context_parallel != "auto")
        out += [f"--ulysses {self.ulysses}"] * (self.ulysses > 1)
        return " ".join(out + ["--optimizer.offload"] * self.offload + ["--optimizer.name muon"] * self.muon)


def mesh_text(sizes: Mapping[str, int]) -> str:
    """{'data': 2, 'fsdp': 4} -> 'data=2,fsdp=4': mesh axis sizes as a `Strategy` spells them."""
    return ",".join(f"{axis}={size}" for axis, size in sizes.items())
