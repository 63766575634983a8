"""The training loop: set up mesh, state and data, compile once, run steps, log, evaluate, summarise.

Host-device syncs are kept off the hot path: metrics stay on device and are fetched every `log_every` steps;
the only per-step read is the previous step's bad-step counter, which is already computed while the current
step runs. The Trainer owns a `Checkpointer`: it resumes from the newest intact step at the start of `run()` and
saves every `checkpoint.every` steps and at the end; `Trainer.step_hook` runs after every step (tests use it).

`Trainer.run` is set-up (`_start`, `_compile`), a step iterator (`_steps`) and the hooks registered to run after each
step (`hooks.Hooks`: metrics and eval, `MetricsHook`; save and poll; `step_hook`), then the stop request, with one
`ExitStack` as the only clean-up path. The other public methods work in any order after `__init__`:
`Trainer(config).evaluate()` before `run()` evaluates the fresh state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from spmdkit.checkpoint import tiers
from spmdkit.checkpoint.manager import NonFiniteState
from spmdkit.data.stream import global_batch_arrays, make_data
from spmdkit.errors import SpmdkitError
from spmdkit.interop.hf_files import SIDECAR, find_tokenizer_dir
from spmdkit.interop.loading import check_source
from spmdkit.models.config import TransformerConfig
from spmdkit.parallel.context.zigzag import zigzag_batch
from spmdkit.rundir.identity import read_run_id, write_run_id
from spmdkit.rundir.ownership import check_run_directory, lock_run_directories
from spmdkit.train.config import TrainConfig, checkpoint_directory
from spmdkit.train.health.faults import Faults, attempt
from spmdkit.train.health.goodput import Goodput
from spmdkit.train.health.phases import PhaseClock
from spmdkit.train.health.preemption import StopRequest
from spmdkit.train.health.profiling import StepProfiler
from spmdkit.train.health.stragglers import StragglerWatch
from spmdkit.train.health.watchdog import Watchdog
from spmdkit.train.reporting.hooks import Hooks, MetricsHook, closing
from spmdkit.train.reporting.metrics import (
    MetricsWriter,
    read_metrics,
    record_config_change,
    replace_text,
    trim_metrics,
)
from spmdkit.train.reporting.report import Progress, describe_run, summary
from spmdkit.train.step.preflight import check_config_changes, check_resume, check_writable
from spmdkit.train.step.program import build_program
from spmdkit.train.step.state import TrainState
from spmdkit.train.step.train_step import Batch, batch_shardings, check_bad_steps, make_eval_step


@dataclasses.dataclass
class TrainResult:
    """What `Trainer.run` returns: the logged train and eval losses, the final state, where the run wrote."""

    losses: dict[int, float]  # step (1-based) -> loss, for the logged steps
    eval_losses: dict[int, float]
    state: TrainState
    run_dir: Path
    skipped_steps: int
    stopped_at: int | None = None  # the step a SIGTERM / SIGINT stopped the run after (checkpoint saved)


class Trainer:
    """One run: `Trainer(config).run()`."""

    def __init__(self, config: TrainConfig, log: Callable[[str], None] | None = None):
        """Check the config, the paths and the data, build the state and the eval step, open the checkpointer;
        nothing is compiled or written yet. `log` takes the run's messages (default: print on process 0)."""
        # Mesh, model, rules, kernel, schedule and optimizer, resolved and checked once (`build_program`): an
        # explicit attention kernel that cannot run here is an error now, before anything is built.
        self.program = program = build_program(config)
        self.config = config = program.config
        self.is_main = jax.process_index() == 0
        self.log = log or (lambda text: print(text, flush=True) if self.is_main else None)
        self.run_dir = Path(config.run.run_dir).absolute()
        self.mesh, self.context, self.rules = program.mesh, program.context, program.rules
        self.model_config: TransformerConfig = program.model_config
        self.attention, self.pipeline = program.attention, program.pipeline
        run = config.run
        # Paths and data first: a bad directory or an unreadable or too short file is reported before any
        # compilation, and before anything is written.
        check_writable(self.run_dir, "--run-dir")
        check_config_changes(config)
        check_writable(checkpoint_directory(config), "--checkpoint-dir")
        local_dir = tiers.check_local_dir(config.checkpoint.local_dir, checkpoint_directory(config), check_writable)
        check_run_directory(self.run_dir)  # a Hugging Face model or a user's files: never written into
        if config.model.init_from:  # the weights' files (shards, tensor shapes), before a state exists to fill
            check_source(config.model.init_from, self.model_config)
        self._make_data = functools.partial(
            make_data, config.data, seq_len=run.seq_len, global_batch=run.batch_size,
            vocab_size=self.model_config.vocab_size, seed=run.seed,
        )  # fmt: skip
        self.data = self._make_data(split="train")
        self.batch_shardings = batch_shardings(self.mesh, self.rules, self.data.keys)
        if run.eval_every:
            self._eval_stream()  # a missing or too short eval split, now rather than at the first evaluation
        self.state = program.create_state()
        # Jitted, not compiled (that happens at the first evaluation): `evaluate` works before `run`.
        self.eval_step = make_eval_step(self.state, self.mesh, self.rules, self.data.keys, self.data.token_bytes)
        self.profiler = StepProfiler(run.profile_steps, self.run_dir)
        health = config.health  # where each process is and where its time goes: watchdog, stragglers, goodput
        self.clock = PhaseClock(health.step_timeout, health.phase_timeout, Faults(jax.process_index()))
        self.stragglers = StragglerWatch(self.clock, health.straggler_threshold, health.straggler_windows, self.log)
        self.goodput = Goodput(self.clock, attempt=attempt())
        self.start_step = 0
        self.step_hook: Callable[[int, Trainer], None] | None = None  # called after every step
        # One writer per run directory, decided (on every process) before anything is written; held until `run`
        # ends (or, for a Trainer never run, until it is garbage-collected).
        written = {"--checkpoint-dir": checkpoint_directory(config), tiers.LOCAL_FLAG: local_dir}
        self.locks = lock_run_directories(self.run_dir, written, "spmdkit train", tiers.own_local_dirs(local_dir))
        # After the state: opened before it, Orbax's start-up barriers (XLA collectives) and the state's jit ran in
        # different orders on two processes, and gloo timed out at the first step.
        try:  # with --no-resume its directories must hold no steps; a step of another run is refused (`identity`)
            kept = read_run_id(self.run_dir) if self.is_main else None
            self.checkpointer = tiers.open_checkpointer(
                checkpoint_directory(config), config.checkpoint, kept, self.run_dir
            )
        except BaseException:
            self.release_lock(failed=True)
            raise

    def release_lock(self, failed: bool = False) -> None:
        """Free the run directory for another writer (`run` does at its end); `failed`: remove what the lock made."""
        locks, self.locks = self.locks, []
        for lock in reversed(locks):
            if lock is not None:
                lock.release(failed)

    # -- the loop ------------------------------------------------------------------------------------------

    def global_batch(self, local: dict[str, np.ndarray]) -> Batch:
        """This process's rows of a batch as global arrays on the mesh (zigzagged first for ring attention)."""
        if self.model_config.attention == "ring" and self.rules.ring_layout == "zigzag":  # over the ring's positions
            local = zigzag_batch(local, self.context // self.rules.ulysses)
        return global_batch_arrays(local, self.batch_shardings)

    def _eval_stream(self) -> Any:
        """A fresh pass over the eval split; its errors say how to train without one."""
        try:
            return self._make_data(split="eval")
        except SpmdkitError as error:
            raise SpmdkitError(f"{error} (or pass --eval-every 0 to train without evaluation)") from None

    def evaluate(self, eval_step: Callable[[Any, Batch], dict[str, jax.Array]] | None = None) -> dict[str, float]:
        """`eval_loss` (the mean over the scored tokens of up to `eval_batches` batches of the eval split) and,
        when the data has text, `eval_bits_per_byte`, of the current state: before `run`, the fresh (or, after
        `resume()`, the resumed) one. `eval_step` defaults to the Trainer's own (`self.eval_step`)."""
        eval_step = eval_step or self.eval_step
        batches = itertools.islice(self._eval_stream(), self.config.run.eval_batches)
        sums = [eval_step(self.state.state, self.global_batch(local)) for local in batches]
        if not sums:
            return {"eval_loss": float("nan")}
        total = {k: float(np.sum([s[k] for s in jax.device_get(sums)])) for k in sums[0]}
        out = {"eval_loss": total["loss_sum"] / max(total["tokens"], 1.0)}
        if "bytes" in total:
            out["eval_bits_per_byte"] = total["loss_sum"] / max(total["bytes"], 1.0) / math.log(2)
        return out

    def save_tokenizer(self) -> None:
        """The data's tokenizer (`tokenizer.json`, `tokenizer_config.json`) into the checkpoint directory's `hf/`,
        beside the checkpoints, where generation, `ckpt export` and `find_tokenizer_dir` (given the run or the
        checkpoint directory) find it. Weights from --init-from brought their own tokenizer there: it stays."""
        tokenizer, sidecar = self.data.tokenizer, self.checkpointer.directory / SIDECAR
        if tokenizer is None or not self.is_main or (self.config.model.init_from and find_tokenizer_dir(sidecar)):
            return
        tokenizer.save(sidecar)  # each file renamed into place

    def resume(self) -> None:
        """With `checkpoint.resume`: the state and data position of the newest intact step, if there is one."""
        if not self.config.checkpoint.resume:
            return
        changes: dict[int, dict[str, tuple[Any, Any]]] = {}  # step -> the setting changes allowed resuming it
        with self.clock.phase("restore"):
            found = self.checkpointer.restore_latest(
                self.state.state, self.state.shardings, self.data.iterator,
                accept=lambda step, saved: changes.update(
                    {step: check_resume(self.config, step, saved, self._restoring_from())}
                ),
            )  # fmt: skip
        if found is not None:
            self.start_step, self.state.state = found
            self.checkpointer.last_saved = self.start_step
            self.log(f"resumed from step {self.start_step} of {self._restoring_from()}")
        if self.is_main:  # the job's time so far (a killed run before its first save too), then the records the
            self.goodput.resume(read_metrics(self.run_dir), self.start_step)  # resumed run writes again dropped
            trim_metrics(self.run_dir, self.start_step)
        if changed := changes.get(self.start_step):  # what --allow-config-change let through: logged and recorded
            listed = "; ".join(f"{flag} {saved} -> {new}" for flag, (saved, new) in changed.items())
            self.log(f"resumed with changed settings (--allow-config-change): {listed}")
            if self.is_main:
                record_config_change(self.run_dir, self.start_step, changed)

    def _restoring_from(self) -> Path:
        """The directory of the step being restored: with two tiers, the one it came from."""
        return self.checkpointer.restored_from or self.checkpointer.directory

    def initialise_from(self) -> None:
        """`--init-from`: the source's weights replace the fresh parameters, each device reading only its block (a
        Hugging Face model or an spmdkit checkpoint); the optimizer state stays fresh. The source's Hugging Face
        files (tokenizer, configs) are copied into the checkpoint directory, where export and generation find them.
        A resumed run skips this, except a LoRA run's: its checkpoint holds no base (`initial_params` reads it)."""
        source = self.config.model.init_from
        if not source or (self.start_step and not self.config.lora.enabled):
            return
        from flax import nnx

        from spmdkit.interop.adapters import initial_params
        from spmdkit.interop.hf_files import copy_hf_files, find_hf_files

        trees = [nnx.to_pure_dict(tree[0]) for tree in (self.state.shardings, self.state.state)]
        model = nnx.merge(self.state.graphdef, self.state.state)[0]  # QLoRA: the weights it holds quantized
        params = initial_params(source, self.config.lora, self.model_config, *trees, not self.start_step, model)
        nnx.replace_by_pure_dict(self.state.state[0], params)
        hf_files = find_hf_files(source)
        if hf_files is not None and self.is_main:
            copy_hf_files(hf_files, self.checkpointer.directory / SIDECAR)
        what = "the frozen base" if self.start_step else "the parameters"
        self.log(f"initialised {what} from {source}" + (f" (tokenizer: {hf_files})" if hf_files else ""))

    def save(self, step: int, force: bool = False, metrics: dict[str, jax.Array] | None = None) -> bool:
        """Start an asynchronous save of `step` when due (or `force`); the state, data position and config. With the
        step's `metrics`, a step that went bad (a non-finite loss, too many bad steps) stops the run unsaved."""
        if not self.checkpointer.due(step, force):  # cheap check first: this runs after every step
            return False
        if metrics is not None:
            self._check_bad_steps(metrics, step)
        config = json.loads(self.config.to_json())
        try:
            return self.checkpointer.save(step, self.state.state, self.data.iterator, config, force=force)
        except NonFiniteState as error:
            raise SpmdkitError(f"{error}: lower --lr, or check the data") from None

    def run(self) -> TrainResult:
        """Train from the newest checkpoint (or the `--init-from` weights, or scratch) to `run.steps`, then summarise.

        Set-up (`_start`, `_compile`), then one step after another (`_steps`), each followed by its hooks: metrics
        and eval (`MetricsHook`), the save when due and a poll for a failed background save, `step_hook`, and a
        SIGTERM / SIGINT request (finish the step, save, wait, return with `stopped_at`). One `ExitStack` is the
        only clean-up path: it puts the signal handlers back and closes the progress bar, the checkpointer and the
        metrics writer on every way out. While a failure propagates, failures to close are swallowed (the first
        failure is the one reported); on a clean exit everything is closed and the first failure to close raised.
        The run directory's lock is released last, after the summary.
        """
        try:
            result = self._run()
        except BaseException:
            self.release_lock(failed=True)  # a run that wrote nothing leaves no directory behind
            raise
        self.release_lock()
        return result

    def _run(self) -> TrainResult:
        run, checkpointer = self.config.run, self.checkpointer
        self.log(describe_run(self))
        with contextlib.ExitStack() as stack:
            stack.push(closing(self._close_checkpointer))
            watchdog = Watchdog(self.clock, jax.process_index(), jax.process_count(), attempt()).start()
            stack.callback(watchdog.close)
            self._start()
            result = TrainResult({}, {}, self.state, self.run_dir, 0)
            if self.start_step >= run.steps:
                stack.close()
                self.log(f"nothing to do: {checkpointer.directory} already holds step {self.start_step} of {run.steps}")
                return result
            compiled, batch = self._compile()
            writer = self._open_writer(stack)
            progress = Progress(run.steps - self.start_step, self.start_step, self.is_main and run.progress)
            stack.push(closing(progress.close))
            stop = stack.enter_context(StopRequest())  # SIGTERM / SIGINT: finish this step, save, return
            stack.callback(self.profiler.close)
            hooks = Hooks()  # what runs after each step, in this order: the record, the save, `step_hook`
            hooks.append(MetricsHook(
                run, self.model_config, self.start_step, self.clock, self.stragglers, self.goodput, self.evaluate,
                writer, progress, result,
            ))  # fmt: skip
            hooks.append(self._save_when_due)
            hooks.append(lambda step, _: self.step_hook(step, self) if self.step_hook else None)
            for step, metrics in self._steps(compiled, batch):
                hooks(step, metrics)
                with self.clock.phase("wait", step):  # a small collective: every process agrees to stop, or not
                    stopping = stop.requested()
                if stopping:
                    result.stopped_at = step
                    with self.clock.phase("checkpoint", step):
                        self.save(step, True, metrics)
                        checkpointer.wait()
                    break
            self._check_bad_steps(metrics, step)  # the last step's counter: `_steps` checks each one before
        return self._finish(result, stop)

    def _save_when_due(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """The hook that saves `step` when due (the last step always), then polls: a save that failed in the
        background stops the run now."""
        with self.clock.phase("checkpoint", step):
            self.save(step, step == self.config.run.steps, metrics)
        self.checkpointer.poll()

    def _start(self) -> None:
        """Resume (or initialise from `--init-from`) and draw the first batch, then write config.json and the
        tokenizer into the run directory: only once the resume checks passed and the data's first read did (a
        damaged dataset stops here), so that a refused run changes nothing."""
        self.resume()
        self.initialise_from()
        self._first_batch = self.global_batch(next(self.data))
        if not self.is_main:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_run_id(self.run_dir, self.checkpointer.run["id"])
            replace_text(self.run_dir / "config.json", self.config.to_json())
            self.save_tokenizer()
        except OSError as error:
            where = error.filename or self.run_dir / "config.json"
            raise SpmdkitError(f"cannot write {where} ({error.strerror or error})") from None

    def _compile(self) -> tuple[Callable[[Any, Batch], tuple[Any, dict[str, jax.Array]]], Batch]:
        """The train step, compiled for the first batch, and that batch (the first step runs on it); with a
        pipeline, its schedule drawn into the run directory first."""
        # token_bytes: int32 [vocab] UTF-8 bytes per token (None without a tokenizer): bits per byte are logged
        step_fn = self.program.train_step(self.state, self.data.keys, self.data.token_bytes)
        if self.pipeline is not None and self.is_main:
            self.pipeline.plot(self.run_dir / "pipeline_schedule.png")
        batch = self._first_batch
        started = time.perf_counter()
        with self.clock.phase("compile"):
            compiled = step_fn.lower(self.state.state, batch).compile()
        self.log(f"compiled the train step in {time.perf_counter() - started:.1f} s")
        if self.config.run.dump_hlo and self.is_main:  # the optimized HLO, as XLA will run it
            (hlo := self.run_dir / "train_step.hlo.txt").write_text(compiled.as_text())
            self.log(f"wrote the compiled step's HLO to {hlo}")
        return compiled, batch

    def _open_writer(self, stack: contextlib.ExitStack) -> MetricsWriter:
        """The metrics writer, registered on `stack` to close after what `stack` already closes (the checkpointer):
        on a clean exit a failed last save, the failure that loses work, is the one reported."""
        writer = MetricsWriter(self.run_dir, enabled=self.is_main)
        opened_before = stack.pop_all()  # their callbacks, moved to run before the writer's
        stack.push(closing(writer.close))
        stack.enter_context(opened_before)
        return writer

    def _steps(self, compiled: Callable[..., Any], batch: Batch) -> Iterator[tuple[int, dict[str, jax.Array]]]:
        """Run the steps after `start_step` (the first on `batch`), yielding each (1-based) step and its metrics,
        still on device. Each step's bad-step counter is read once the next step is running (no sync on the hot
        path): the caller checks the last one."""
        previous, clock = None, self.clock
        self.goodput.first_step()
        for step in range(self.start_step + 1, self.config.run.steps + 1):
            with self.profiler.step(step):  # `--profile-steps`: a trace of the steps asked for, each annotated
                if step > self.start_step + 1:
                    with clock.phase("data", step):
                        batch = self.global_batch(next(self.data))
                with clock.phase("step", step):
                    self.state.state, metrics = compiled(self.state.state, batch)
                    if previous is not None:
                        with clock.phase("wait", step):  # the host waits for the devices (and so for the others)
                            self._check_bad_steps(previous, step - 1)
            self.profiler.finished(step, metrics)
            previous = metrics
            yield step, metrics

    def _close_checkpointer(self) -> None:
        """The checkpointer's close: the last asynchronous save finished (its barriers under the watchdog)."""
        with self.clock.phase("checkpoint"):
            self.checkpointer.close()

    def _finish(self, result: TrainResult, stop: StopRequest) -> TrainResult:
        """`result` with the skipped steps counted; the summary and, after a stop request, how to resume, logged."""
        result.skipped_steps = int(jax.device_get(self.state.state[1]["opt_state"]["total_notfinite"][...]))
        if self.is_main and result.losses:
            self.log(summary(self.run_dir, result.skipped_steps))
        if result.stopped_at is not None:
            self.log(
                f"stopped by {stop.name} after step {result.stopped_at}; checkpoint saved in "
                f"{self.checkpointer.directory}: run the same command again to resume"
            )
        return result

    def _check_bad_steps(self, metrics: dict[str, jax.Array], step: int) -> None:
        """`check_bad_steps` of `step`'s metrics (a sync: they are fetched)."""
        check_bad_steps(
            metrics, step, self.config.optimizer.max_bad_steps, self.checkpointer.newest, self.model_config.vocab_size
        )


def train(config: TrainConfig) -> TrainResult:
    """Run training as configured and return its losses and final state."""
    return Trainer(config).run()
