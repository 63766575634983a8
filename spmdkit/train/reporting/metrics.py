"""Throughput and MFU, and where metrics go: `metrics.jsonl`, TensorBoard, a loss-curve PNG.

MFU = achieved model FLOP/s per device / the device's peak bf16 FLOP/s. Model FLOPs per token come from
`TransformerConfig.flops_per_token` (6N plus attention, causal attention counted as half), so recomputation
(remat) does not inflate it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from spmdkit.errors import SpmdkitError, SpmdkitWarning
from spmdkit.plan.devices import device_for_kind, mixed_peak


def peak_flops(
    device: jax.Device | None = None, override_tflops: float | None = None, fp8_share: float = 0.0
) -> float | None:
    """Peak FLOP/s of `device` (default: the first) from the planner's device table, bf16, or mixed with FP8's
    peak for the `fp8_share` of the FLOPs an FP8 model runs in FP8 (`spmdkit.plan.devices.mixed_peak`); None
    when unknown (e.g. CPU)."""
    if override_tflops:
        return override_tflops * 1e12
    known = device_for_kind((device or jax.devices()[0]).device_kind)
    return mixed_peak(known, fp8_share) if known else None


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


class MetricsWarning(SpmdkitWarning):
    """metrics.jsonl ended in a partial line (a crash mid-write), which was dropped."""


@contextlib.contextmanager
def _write_errors(what: Path) -> Iterator[None]:
    """An OSError while writing `what` (a full disk, a read-only file system) -> one-line SpmdkitError."""
    try:
        yield
    except OSError as error:
        raise SpmdkitError(
            f"cannot write {what} ({error.strerror or error}): free space or fix the permissions there, or pass "
            "another --run-dir; the checkpoints saved so far are intact"
        ) from None


def append_line(path: Path, line: str) -> None:
    """Append one line in one write; on failure the file is cut back to its previous end (no partial line)."""
    data = line.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def replace_text(path: Path, text: str | bytes) -> None:
    """Write `path` (text, or bytes) through a temporary file in the same directory and a rename: never a
    half-written file."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_bytes(text if isinstance(text, bytes) else text.encode())
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def json_safe(value: Any) -> Any:
    """`value` with every NaN or infinite float (in dicts and lists too) as None: JSON has no NaN, and
    `metrics.jsonl` stays readable by any JSON parser (null: not finite)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` and mirrors scalars to TensorBoard.

    Both are written in the calling thread and flushed at once (tensorboardX's `EventsWriter`, not its writer
    thread, which dies on a full disk and then blocks the loop for good): a failed write raises a one-line
    `SpmdkitError` at the step it happens, and SIGTERM / Ctrl-C keep working.
    """

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.events: Any = None
        if enabled:
            from tensorboardX.event_file_writer import EventsWriter

            with _write_errors(run_dir / "tensorboard"):
                (run_dir / "tensorboard").mkdir(parents=True, exist_ok=True)
                self.events = EventsWriter(str(run_dir / "tensorboard" / "events"))
                self.events.flush()

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        with _write_errors(self.path):
            append_line(self.path, json.dumps(json_safe(record), allow_nan=False) + "\n")
        values = []
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, int | float):  # time: an epoch, not a curve
                values.append(Summary.Value(tag=key, simple_value=value))
            elif isinstance(value, list):  # per-expert load: one curve per expert, under one tag group
                values += [Summary.Value(tag=f"{key}/{i}", simple_value=v) for i, v in enumerate(value)]
        with _write_errors(self.path.parent / "tensorboard"):
            self.events.write_event(Event(summary=Summary(value=values), step=record["step"], wall_time=time.time()))
            self.events.flush()

    def close(self) -> None:
        if self.events is not None:
            events, self.events = self.events, None
            with _write_errors(self.path.parent / "tensorboard"):
                events.close()


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop `metrics.jsonl` records past `step` (a resumed run writes them again); rewritten through a temporary
    file and a rename, so that a kill here leaves the old file or the new one."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    lines = _lines(path)
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines) or not path.read_bytes().endswith(b"\n"):
        with _write_errors(path):
            replace_text(path, "".join(line + "\n" for line in kept))


def record_config_change(run_dir: Path, step: int, changed: dict[str, tuple[Any, Any]]) -> None:
    """Append the settings a resume from `step` changed (flag -> (saved, new), `--allow-config-change`) to
    `metrics.jsonl` as `{"step": step, "config_change": {flag: [saved, new]}}`."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    record = {"step": step, "config_change": {flag: list(change) for flag, change in changed.items()}}
    append_line(Path(run_dir) / "metrics.jsonl", json.dumps(json_safe(record)) + "\n")


def _lines(path: Path) -> list[str]:
    """The JSON lines of a metrics file; a partial last line (a crash mid-write) is dropped with a warning, any
    other unreadable line is an error."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except ValueError:
            if number == len(lines):
                warnings.warn(f"{path}: dropped its unfinished last line (a crash mid-write)", MetricsWarning, 2)
                return lines[:-1]
            raise SpmdkitError(
                f"{path} line {number} is not JSON: delete that line or the file (metrics are only a record)"
            ) from None
    return lines


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in _lines(path)] if path.exists() else []


def plot_loss_curve(records: list[dict[str, Any]], path: Path) -> None:
    """Train (and eval) loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(png := io.BytesIO(), dpi=100, format="png")
    finally:
        plt.close(fig)
    with _write_errors(path):
        replace_text(path, png.getvalue())
