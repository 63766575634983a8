"""Throughput and MFU, and where metrics go: `metrics.jsonl`, TensorBoard, a loss-curve PNG.

MFU = achieved model FLOP/s per device / the device's peak bf16 FLOP/s. Model FLOPs per token come from
`TransformerConfig.flops_per_token` (6N plus attention, causal attention counted as half), so recomputation
(remat) does not inflate it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from spmdkit.plan.devices import device_for_kind


def peak_flops(device: jax.Device | None = None, override_tflops: float | None = None) -> float | None:
    """Peak bf16 FLOP/s of `device` (default: the first) from the planner's device table, or None when unknown
    (e.g. CPU)."""
    if override_tflops:
        return override_tflops * 1e12
    known = device_for_kind((device or jax.devices()[0]).device_kind)
    return known.peak_flops if known else None


def throughput(
    tokens_per_step: int, step_time_s: float, flops_per_token: float, num_devices: int, peak: float | None
) -> dict[str, float | None]:
    """tokens/s, TFLOP/s per device and MFU (None when the peak is unknown)."""
    tokens_per_sec = tokens_per_step / step_time_s
    flops_per_device = tokens_per_sec * flops_per_token / num_devices
    return {
        "tokens_per_sec": tokens_per_sec,
        "tflops_per_device": flops_per_device / 1e12,
        "mfu": flops_per_device / peak if peak else None,
    }


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.tensorboard = None
        if enabled:
            from tensorboardX import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                self.tensorboard.add_scalar(key, value, record["step"])
            elif isinstance(value, list):  # per-expert load: one curve per expert, under one tag group
                for i, v in enumerate(value):
                    self.tensorboard.add_scalar(f"{key}/{i}", v, record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop `metrics.jsonl` records past `step` (a resumed run writes them again)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        path.write_text("".join(line + "\n" for line in kept))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def plot_loss_curve(records: list[dict[str, Any]], path: Path) -> None:
    """Train (and eval) loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
