"""Reduce a jax.profiler trace of `spmdkit train` steps to the roofline's kind table: the measured kernel time per
kind beside the roofline's prediction for the same compiled program (`spmdkit.inspect.roofline`).

Usage: python scripts/profile_kinds.py RUN_DIR [--steps N] [--target h100] [--json OUT.json]

RUN_DIR is a run of `spmdkit train ... --profile-steps A:B --dump-hlo`: its `train_step.hlo.txt` (the program XLA
ran) is classified kernel by kernel as `spmdkit compile --roofline` does, and each event of its trace
(`profile/**/*.trace.json.gz`) is given the kind of the instruction it ran: its `hlo_op` argument, else its
kernel name (XLA names a fusion's kernel after the instruction, `.` as `_`), else the library that launched it
(cuBLAS/cuBLASLt GEMMs, cuDNN attention, NCCL collectives, memcpy/memset). The events of the GPU's streams are
read where the trace has a GPU (a CPU trace: the host's XLA thunks). N: the profiled steps (B - A + 1); times are
per step. Prints a Markdown table (kind, measured ms, roofline ms, measured / roofline) and the totals.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path

from spmdkit.inspect.roofline import KINDS, roofline
from spmdkit.tools.gpu_compile import roofline_report

# kernels launched by libraries rather than XLA's emitters, by their names (first match wins)
LIBRARIES = (
    ("collective", re.compile(r"nccl", re.IGNORECASE)),
    ("attention", re.compile(r"cudnn|fmha|flash", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|cublas|nvjet|xmma|cutlass|matmul", re.IGNORECASE)),
    ("cast/copy", re.compile(r"memcpy|memset", re.IGNORECASE)),
)


def kernel_events(trace: dict) -> list[tuple[str, str, float]]:
    """(name, hlo_op or "", seconds) of each complete event on the GPU's streams (every process where no GPU is)."""
    processes = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpus = {pid for pid, name in processes.items() if "/device:GPU" in name}
    return [
        (e.get("name", ""), e.get("args", {}).get("hlo_op", ""), float(e.get("dur", 0)) / 1e6)
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and (not gpus or e.get("pid") in gpus)
    ]


def kind_of(name: str, hlo_op: str, kinds: dict[str, str]) -> str | None:
    """The kind of one event: its instruction's, else its library's; None: not a kernel of the program."""
    for candidate in (hlo_op, name, name.replace("_", ".")):
        if candidate in kinds:
            return kinds[candidate]
    if hlo_op:  # an instruction that launches nothing itself (a loop, a thunk around others): not counted
        return None
    return next((kind for kind, pattern in LIBRARIES if pattern.search(name)), None)


def measured_kinds(events: list[tuple[str, str, float]], kinds: dict[str, str], steps: int) -> dict[str, float]:
    """{kind: seconds per step} of the events; events of no kind are summed under "unattributed" when they carry
    an XLA instruction's name no kernel has, else left out (host work, Python)."""
    totals: dict[str, float] = collections.defaultdict(float)
    for name, hlo_op, seconds in events:
        kind = kind_of(name, hlo_op, kinds)
        if kind is not None:
            totals[kind] += seconds / steps
    return {k: totals[k] for k in (*KINDS, "unattributed") if k in totals}


def load_trace(run_dir: Path) -> dict:
    traces = sorted(run_dir.glob("profile/**/*.trace.json.gz"))
    if not traces:
        raise SystemExit(f"profile_kinds: no profile/**/*.trace.json.gz under {run_dir} (run with --profile-steps)")
    return json.loads(gzip.decompress(traces[-1].read_bytes()))


def model_flops_per_step(run_dir: Path) -> float | None:
    """Model FLOPs per device per step, as the run logged them (TFLOP/s x step time of its last window)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    rows = [json.loads(line) for line in lines if '"tflops_per_device"' in line]
    return rows[-1]["tflops_per_device"] * 1e12 * rows[-1]["step_time_s"] if rows else None


def table(measured: dict[str, float], predicted: dict[str, dict[str, float]]) -> str:
    lines = ["| kind | measured ms/step | roofline ms/step | measured / roofline |", "|---|---|---|---|"]
    for kind in (*KINDS, "unattributed"):
        if kind not in measured and kind not in predicted:
            continue
        got, bound = measured.get(kind, 0.0), predicted.get(kind, {}).get("seconds", 0.0)
        ratio = f"{got / bound:.2f}" if bound else "-"
        lines.append(f"| {kind} | {got * 1e3:.2f} | {bound * 1e3:.2f} | {ratio} |")
    got, bound = sum(measured.values()), sum(t["seconds"] for t in predicted.values())
    lines.append(f"| **all kernels** | {got * 1e3:.2f} | {bound * 1e3:.2f} | {got / bound if bound else 0:.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a spmdkit train run directory (--profile-steps, --dump-hlo)")
    parser.add_argument("--steps", type=int, default=2, help="how many steps the trace holds (default 2)")
    parser.add_argument("--target", default="h100", help="the roofline's peaks: a spmdkit compile --target")
    parser.add_argument("--json", type=Path, help="also write the measured and predicted tables here")
    args = parser.parse_args(argv)
    hlo = args.run_dir / "train_step.hlo.txt"
    if not hlo.exists():
        raise SystemExit(f"profile_kinds: no {hlo} (run spmdkit train with --dump-hlo)")
    if args.steps < 1:
        raise SystemExit(f"profile_kinds: --steps {args.steps}: give the number of profiled steps, at least 1")
    text = hlo.read_text()
    report = roofline_report(text, args.target, 8, model_flops=model_flops_per_step(args.run_dir))
    kinds = {k.name: k.kind for k in roofline(text, 1.0, 1.0).kernels}  # a kernel's kind does not hang on peaks
    measured = measured_kinds(kernel_events(load_trace(args.run_dir)), kinds, args.steps)
    print(table(measured, report["kinds"]))
    if args.json:
        args.json.write_text(json.dumps({"measured_seconds": measured, "roofline": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
