"""`--profile-steps A:B`: why a step is slow, from the run itself (and `--dump-hlo`: the step as XLA runs it).

`StepProfiler` writes a `jax.profiler` trace of steps A to B (1-based, inclusive) into RUN_DIR/profile/
(`plugins/profile/<time>/<host>.xplane.pb`: TensorBoard's profile plugin / xprof read it, and Perfetto through
xprof's trace viewer), every process its own host file. Each step is a `StepTraceAnnotation("train",
step_num=N)` with the phases inside and around it named (`spmdkit.train.health.phases`: `data`, `step`, `wait`, `log`,
`eval`, `checkpoint`). The trace starts before step A's data
and stops after step B's outputs are ready, so it holds those steps' device work and nothing of the others; the
annotations cost nothing measurable while no trace runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from spmdkit.train.config import parse_steps

STEP_NAME = "train"  # the name of every step's StepTraceAnnotation


class StepProfiler:
    """Starts and stops the trace around the configured steps; a no-op without `--profile-steps`."""

    def __init__(self, spec: str | None, run_dir: Path):
        self.steps = parse_steps(spec)
        self.directory = run_dir / "profile"
        self.tracing = False

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """The annotation of `step`, with the trace started first when `step` is the first profiled one."""
        if self.steps and step == self.steps[0] and not self.tracing:
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True
        with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step):
            yield

    def finished(self, step: int, outputs: Any) -> None:
        """After `step`: at the last profiled step, wait for its outputs (the device work) and stop the trace."""
        if self.tracing and self.steps and step >= self.steps[1]:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """Stop a trace still running (the run ended or failed inside the profiled steps)."""
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()
