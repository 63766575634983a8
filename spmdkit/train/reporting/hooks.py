"""What runs after every training step, and how the loop closes what it opened.

`Hooks` is the registry: the loop calls each registered hook, in order, with the step (1-based) and its metrics
(still on device); a hook is handed what it needs when it is made, never the Trainer. `MetricsHook` writes the
logged steps' records (metrics.jsonl, TensorBoard, the progress bar) with their speed, job-health and eval figures;
`closing` turns a `close()` into an `ExitStack` callback that never hides the first failure.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmdkit.models.config import TransformerConfig
from spmdkit.train.config import RunSettings
from spmdkit.train.health.goodput import Goodput
from spmdkit.train.health.phases import PhaseClock
from spmdkit.train.health.stragglers import StragglerWatch
from spmdkit.train.reporting.metrics import MetricsWriter, peak_flops, throughput
from spmdkit.train.reporting.report import Progress

if TYPE_CHECKING:
    from spmdkit.train.loop import TrainResult

StepHook = Callable[[int, dict[str, jax.Array]], None]  # (step, its metrics on device) -> None


class Hooks(list[StepHook]):
    """The hooks run after each step, in the order they were registered (`append`)."""

    def __call__(self, step: int, metrics: dict[str, jax.Array]) -> None:
        for hook in self:
            hook(step, metrics)


class MetricsHook:
    """At the logged steps (every `log_every`, the first and the last) the record of the step, its metrics fetched,
    its speed over the steps since the previous record, the stragglers and goodput fields and, when due, the eval
    figures (`evaluate()`); written (metrics.jsonl, TensorBoard), shown (the progress bar) and kept (the result's
    losses). The phases it waits in are `clock`'s."""

    def __init__(
        self, run: RunSettings, model: TransformerConfig, start_step: int, clock: PhaseClock,
        stragglers: StragglerWatch, goodput: Goodput, evaluate: Callable[[], dict[str, float]],
        writer: MetricsWriter, progress: Progress, result: TrainResult,
    ):  # fmt: skip
        self.run, self.start_step, self.clock, self.evaluate = run, start_step, clock, evaluate
        self.stragglers, self.goodput, self.writer, self.progress, self.result = (
            stragglers, goodput, writer, progress, result
        )  # fmt: skip
        self.flops_per_token = model.flops_per_token(run.seq_len)
        fp8_share = model.fp8_flops_per_token() / self.flops_per_token
        self.peak = peak_flops(override_tflops=run.peak_tflops, fp8_share=fp8_share)
        self.tokens_per_step = run.batch_size * run.seq_len
        self.window_start, self.window_step = time.perf_counter(), start_step

    def __call__(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """The record of `step` (metrics still on device), if it is a logged step."""
        run, clock = self.run, self.clock
        if not (step % run.log_every == 0 or step in (self.start_step + 1, run.steps)):
            return
        with clock.phase("wait", step):  # the step's results: the host waits for the devices
            fetched = jax.device_get(metrics)
        seconds, steps = time.perf_counter() - self.window_start, step - self.window_step
        speed = throughput(self.tokens_per_step, seconds / steps, self.flops_per_token, jax.device_count(), self.peak)
        record = {"step": step, **{k: _plain(v) for k, v in fetched.items()}}
        record.update(step_time_s=seconds / steps, **speed)
        with clock.phase("log", step):
            record.update(self.stragglers.window(seconds, steps))  # a small collective on every process
        self.goodput.window(seconds)
        if run.eval_every and (step % run.eval_every == 0 or step == run.steps):
            with clock.phase("eval", step):
                record.update(self.evaluate())
            self.result.eval_losses[step] = record["eval_loss"]
        record.update(self.goodput.record())
        self.result.losses[step] = record["loss"]
        self.writer.write(record)
        self.progress.update(record, step)
        self.window_start, self.window_step = time.perf_counter(), step


def closing(close: Callable[[], object]) -> Callable[..., bool]:
    """`close` as an `ExitStack` exit callback. On a clean exit a failure to close propagates (the callbacks after it
    then see it in flight); while an exception propagates, a failure to close is swallowed, so that the first
    failure is the one reported."""

    def exit_callback(exc_type: type[BaseException] | None, exc: BaseException | None, traceback: Any) -> bool:
        with contextlib.suppress(Exception) if exc_type is not None else contextlib.nullcontext():
            close()
        return False

    return exit_callback


def _plain(value: np.ndarray) -> float | list[float]:
    """A fetched metric as JSON: a float, or a list (e.g. `expert_load`, one share per expert)."""
    return float(value) if np.ndim(value) == 0 else [round(float(v), 6) for v in np.ravel(value)]
