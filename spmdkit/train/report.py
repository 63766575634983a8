"""What a run shows a person: the progress bar while it trains and the summary at the end (from `metrics.jsonl`)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from spmdkit.train.metrics import plot_loss_curve, read_metrics


class Progress:
    """A tqdm bar of optimizer steps with the last logged loss, bits per byte, tokens/s and MFU (off: no bar)."""

    def __init__(self, total: int, start_step: int, enabled: bool):
        self.start_step, self.bar = start_step, None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)

    def update(self, record: dict[str, Any], step: int) -> None:
        if self.bar is None:
            return
        self.bar.n = step - self.start_step
        mfu = record.get("mfu")
        self.bar.set_postfix(
            loss=f"{record['loss']:.3f}",
            **({"bpb": f"{record['bits_per_byte']:.3f}"} if "bits_per_byte" in record else {}),
            tok_s=f"{record['tokens_per_sec']:,.0f}",
            mfu="n/a" if mfu is None else f"{mfu:.1%}",
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summary(run_dir: Path, skipped_steps: int) -> str:
    """The end-of-run summary from `run_dir/metrics.jsonl` (and `loss.png` drawn from it): loss from the first to
    the last logged step (bits per byte and eval figures when logged), median speed and MFU, skipped steps."""
    records = read_metrics(run_dir)
    plot_loss_curve(records, run_dir / "loss.png")
    speed = [r["tokens_per_sec"] for r in records[1:]] or [records[-1]["tokens_per_sec"]]
    mfus = [r["mfu"] for r in records[1:] if r.get("mfu") is not None]
    first, last = records[0], records[-1]
    lines = [
        "",
        f"done: {last['step']} steps, loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f}"
        + (f", eval loss {last['eval_loss']:.3f}" if "eval_loss" in last else ""),
        *(
            [
                f"bits per byte: {first['bits_per_byte']:.3f} -> {last['bits_per_byte']:.3f}"
                + (f", eval {last['eval_bits_per_byte']:.3f}" if "eval_bits_per_byte" in last else "")
            ]
            if "bits_per_byte" in last
            else []
        ),
        f"speed: {np.median(speed):,.0f} tokens/s, {np.median([r['tflops_per_device'] for r in records]):.3g} "
        f"TFLOP/s per device, MFU " + (f"{np.median(mfus):.1%}" if mfus else "unknown (pass --peak-tflops)"),
        f"skipped steps (NaN/Inf): {skipped_steps}",
        f"run directory: {run_dir} (config.json, metrics.jsonl, loss.png, tensorboard/)",
    ]
    if not math.isfinite(last["loss"]):
        lines.append("warning: the last loss is not finite")
    return "\n".join(lines)
