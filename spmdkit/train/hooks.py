"""What runs after every training step, and how the loop closes what it opened.

`MetricsHook` writes the logged steps' records (metrics.jsonl, TensorBoard, the progress bar) with their speed and
eval figures; `closing` turns a `close()` into an `ExitStack` callback that never hides the first failure.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmdkit.train.metrics import MetricsWriter, peak_flops, throughput
from spmdkit.train.report import Progress

if TYPE_CHECKING:
    from spmdkit.train.loop import Trainer, TrainResult


class MetricsHook:
    """After each step: at the logged ones (every `log_every`, the first and the last) the record of the step, its
    metrics fetched, its speed over the steps since the previous record and, when due, the eval figures; written
    (metrics.jsonl, TensorBoard), shown (the progress bar) and kept (the result's losses)."""

    def __init__(self, trainer: Trainer, writer: MetricsWriter, progress: Progress, result: TrainResult):
        run = trainer.config.run
        self.trainer, self.writer, self.progress, self.result = trainer, writer, progress, result
        self.flops_per_token = trainer.model_config.flops_per_token(run.seq_len)
        fp8_share = trainer.model_config.fp8_flops_per_token() / self.flops_per_token
        self.peak = peak_flops(override_tflops=run.peak_tflops, fp8_share=fp8_share)
        self.tokens_per_step = run.batch_size * run.seq_len
        self.window_start, self.window_step = time.perf_counter(), trainer.start_step

    def __call__(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """The record of `step` (metrics still on device), if it is a logged step."""
        trainer, run = self.trainer, self.trainer.config.run
        if not (step % run.log_every == 0 or step in (trainer.start_step + 1, run.steps)):
            return
        clock = trainer.clock
        with clock.phase("wait", step):  # the step's results: the host waits for the devices
            fetched = jax.device_get(metrics)
        seconds, steps = time.perf_counter() - self.window_start, step - self.window_step
        speed = throughput(self.tokens_per_step, seconds / steps, self.flops_per_token, jax.device_count(), self.peak)
        record = {"step": step, **{k: _plain(v) for k, v in fetched.items()}}
        record.update(step_time_s=seconds / steps, **speed)
        with clock.phase("log", step):
            record.update(trainer.stragglers.window(seconds, steps))  # a small collective on every process
        trainer.goodput.window(seconds)
        if run.eval_every and (step % run.eval_every == 0 or step == run.steps):
            with clock.phase("eval", step):
                record.update(trainer.evaluate())
            self.result.eval_losses[step] = record["eval_loss"]
        record.update(trainer.goodput.record())
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
