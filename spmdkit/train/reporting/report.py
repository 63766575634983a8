"""What a run shows a person: the lines it prints before it compiles (`describe_run`), the progress bar while it
trains (`Progress`) and the summary at the end, read back from `metrics.jsonl` (`summary`)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmdkit.inspect.params import human_bytes, parameter_rows
from spmdkit.models.config import loss_chunks
from spmdkit.sharding.mesh import describe_parallelism, format_sizes
from spmdkit.sharding.rules import Rules
from spmdkit.train.reporting.metrics import plot_loss_curve, read_metrics

if TYPE_CHECKING:
    from spmdkit.train.loop import Trainer


def describe_run(trainer: Trainer) -> str:
    """The lines a run prints before it compiles: mesh, parallelism, model, kernels, memory per device, data,
    batch."""
    rows = parameter_rows(trainer.state.state, trainer.state.shardings)  # bytes held by one device
    params = sum(r.bytes_per_device for r in rows if r.path.startswith("0/"))
    opt = sum(r.bytes_per_device for r in rows) - params
    cfg, run, settings = trainer.model_config, trainer.config.run, trainer.config.model
    name = f"weights of {settings.init_from}" if settings.init_from else settings.name
    zero = {0: "replicated", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[trainer.rules.zero_stage]
    chunks = loss_chunks(run.seq_len, cfg.loss_chunk, trainer.context)
    return "\n".join(
        [
            f"mesh         {format_sizes(dict(trainer.mesh.shape))} on {trainer.mesh.devices.size} "
            f"{jax.devices()[0].platform.upper()} device(s), {jax.process_count()} process(es)",
            f"parallelism  {describe_parallelism(trainer.mesh)}; optimizer state {zero}"
            + ("; sequence parallel" if trainer.rules.sequence_parallel else "")
            + _context_parallelism(cfg.attention, trainer.rules, cfg.ulysses_parts),
            f"model        {name}: {cfg.num_params():,} parameters, {cfg.layers} layers, "
            f"compute {cfg.dtype}{' (dense matmuls in FP8)' if cfg.fp8 else ''}, remat {cfg.remat}",
            f"kernels      attention {trainer.attention}" + (" (auto)" if settings.attention == "auto" else "")
            + f"; loss over {chunks} chunk(s) of {run.seq_len // chunks} positions"
            + (f", z-loss weight {cfg.z_loss:g}" if cfg.z_loss else ""),
            *([_describe_experts(trainer)] if cfg.experts else []),
            f"memory       per device: parameters {human_bytes(params)} + optimizer {human_bytes(opt)}"
            + (" (in pinned host memory: --optimizer.offload)" if trainer.config.optimizer.offload else ""),
            f"data         {trainer.config.data.source}: {trainer.data.packing} packing"
            + (f", tokenizer {t.name} ({t.vocab_size:,} tokens)" if (t := trainer.data.tokenizer) else "")
            + f", model vocab {cfg.vocab_size:,}",
            f"batch        {run.batch_size} x {run.seq_len} tokens, grad accumulation {run.grad_accum}",
            *([_describe_pipeline(trainer)] if trainer.pipeline else []),
        ]
    )  # fmt: skip


def _context_parallelism(kernel: str, rules: Rules, parts: int = 1) -> str:
    """How the context axis splits attention: the ring, the 2D ring of Ulysses groups, or Ulysses (its output
    exchanged in `parts` head parts)."""
    if kernel == "ring":
        groups = f" of Ulysses groups of {rules.ulysses} (2D)" if rules.ulysses > 1 else ""
        return f"; ring attention ({rules.ring_layout}){groups}"
    parted = f", the output in {parts} head parts" if parts > 1 else ""
    return f"; Ulysses attention (all-to-alls{parted})" if kernel.startswith("ulysses") else ""


def _describe_experts(trainer: Trainer) -> str:
    c = trainer.model_config
    return (
        f"experts      {c.moe_layers} MoE layers of {c.experts} experts, top-{c.top_k}, {c.dispatch} dispatch"
        + (f" (capacity factor {c.capacity_factor})" if c.dispatch == "capacity" else "")
        + f", over expert={trainer.mesh.shape['expert']}; {c.num_params(active=True):,} parameters active per token"
        + f"\n             dispatch {trainer.program.dispatch_reason}"  # which runs and why (--moe-dispatch auto)
    )


def _describe_pipeline(trainer: Trainer) -> str:
    p = trainer.pipeline
    return (
        f"pipeline     {p.kind} over {p.num_stages} stages, {p.num_microbatches} microbatches, "
        f"{p.virtual_stages} virtual stage(s) each; bubble {p.bubble_fraction():.1%}"
    )


class Progress:
    """A tqdm bar of optimizer steps with the last logged loss, bits per byte, tokens/s and MFU (off: no bar)."""

    def __init__(self, total: int, start_step: int, enabled: bool):
        from tqdm import tqdm

        self.start_step = start_step
        self.bar = tqdm(
            total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True, disable=not enabled
        )

    def update(self, record: dict[str, Any], step: int) -> None:
        self.bar.n = step - self.start_step
        mfu = record.get("mfu")
        self.bar.set_postfix(
            loss=f"{record['loss']:.3f}",
            **({"bpb": f"{record['bits_per_byte']:.3f}"} if "bits_per_byte" in record else {}),
            tok_s=f"{record['tokens_per_sec']:,.0f}",
            mfu="n/a" if mfu is None else f"{mfu:.1%}",
        )

    def close(self) -> None:
        self.bar.close()


def summary(run_dir: Path, skipped_steps: int) -> str:
    """The end-of-run summary from `run_dir/metrics.jsonl` (and `loss.png` drawn from it): loss from the first to
    the last logged step (bits per byte and eval figures when logged), median speed and MFU, skipped steps."""
    losses = ("loss", "eval_loss", "bits_per_byte", "eval_bits_per_byte")  # null in metrics.jsonl: not finite
    steps = [r for r in read_metrics(run_dir) if "loss" in r]  # not the records of a resume's allowed changes
    records = [{k: math.nan if v is None and k in losses else v for k, v in r.items()} for r in steps]
    plot_loss_curve(records, run_dir / "loss.png")
    speed = [r["tokens_per_sec"] for r in records[1:]] or [records[-1]["tokens_per_sec"]]
    mfus = [r["mfu"] for r in records[1:] if r.get("mfu") is not None]
    first, last = records[0], records[-1]
    lines = [
        "",
        f"done: {last['step']} steps, loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f}"
        + (f", eval loss {last['eval_loss']:.3f}" if "eval_loss" in last else ""),
    ]
    if "bits_per_byte" in last:
        eval_bits = f", eval {last['eval_bits_per_byte']:.3f}" if "eval_bits_per_byte" in last else ""
        lines.append(f"bits per byte: {first['bits_per_byte']:.3f} -> {last['bits_per_byte']:.3f}{eval_bits}")
    lines += [
        f"speed: {np.median(speed):,.0f} tokens/s, {np.median([r['tflops_per_device'] for r in records]):.3g} "
        f"TFLOP/s per device, MFU " + (f"{np.median(mfus):.1%}" if mfus else "unknown (pass --peak-tflops)"),
        *([goodput_line(last)] if "goodput" in last else []),
        f"skipped steps (NaN/Inf): {skipped_steps}",
        f"run directory: {run_dir} (config.json, metrics.jsonl, loss.png, tensorboard/)",
    ]
    if not math.isfinite(last["loss"]):
        lines.append("warning: the last loss is not finite")
    return "\n".join(lines)


def goodput_line(record: dict) -> str:
    """'goodput: 62.0% of 1.2 h (lost: start-up 310 s incl. compile 95 s, redone 120 s, ...)' from a record's
    job totals (`spmdkit.train.health.goodput`)."""
    lost = {
        "start-up": record["lost_startup_s"], "redone steps": record["lost_redone_s"],
        "checkpoints": record["lost_checkpoint_s"], "data": record["lost_data_s"], "eval": record["lost_eval_s"],
        "other": record["lost_other_s"],
    }  # fmt: skip
    parts = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in lost.items() if seconds >= 0.05)
    compile_s = f" (compile {record['lost_compile_s']:.3g} s of the start-up)" if record["lost_compile_s"] else ""
    return (
        f"goodput: {record['goodput']:.1%} of {record['wall_s']:.3g} s since the job's first start, "
        f"{record['restarts']} restart(s); lost: {parts or 'nothing'}{compile_s}"
    )
