"""XLA:GPU's per-device memory of the training step against the planner's, on the layouts that matter, compiled
for H100 targets on this machine without a GPU (`spmdkit compile`, one process per row: its peak RSS is the
compile's).

Rows: `1b` on 1 x H100 at seq 8192; `llama3-8b` on 8 x H100 at seq 8192 with fsdp=8 and fsdp=4,tensor=2;
`llama3-8b` at seq 32768 with context=4,fsdp=2; `llama3-70b` on 64 x H100 (8 hosts x 8) with the layout
`spmdkit plan` recommends for it. Each with every remat policy. Prints a Markdown table (with the speed levers'
marks: FP8 GEMMs and windowed-einsum hops per step) and writes results/gpu_compile.json; `--extra` adds flags to
every row (a lever on: `--extra=--overlap-tp`).

    python scripts/bench_gpu_compile.py [--remat none full ...] [--extra FLAGS] [--out results]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REMATS = ("none", "dots_with_no_batch_dims_saveable", "dots_saveable", "full")


def recommended_70b() -> list[str]:
    """The flags of the layout `spmdkit plan` recommends for llama3-70b on 64 H100s at seq 8192."""
    plan = subprocess.run(
        [sys.executable, "-m", "spmdkit", "plan", "--model", "llama3-70b", "--devices", "64", "--device-type",
         "h100", "--seq-len", "8192", "--json"], capture_output=True, text=True, check=True,
    )  # fmt: skip
    best = json.loads(plan.stdout)
    best = best.get("recommended", best)
    mesh = ",".join(f"{k}={v}" for k, v in best["mesh"].items() if v > 1)
    flags = ["--mesh", mesh, "--batch-size", str(best["batch_size"]), "--zero", str(best["zero"])]
    if best["mesh"].get("pipeline", 1) > 1:
        flags += ["--microbatches", str(best["microbatches"])]
    elif best.get("microbatches", 1) > 1:  # without a pipeline the planner's microbatches are gradient accumulation
        flags += ["--grad-accum", str(best["microbatches"])]
    return flags + (["--sequence-parallel"] if best.get("sequence_parallel") else [])


def rows() -> list[tuple[str, list[str]]]:
    return [
        ("1b, 1 x H100, seq 8192", "--model 1b --devices 1 --mesh fsdp=1 --seq-len 8192 --batch-size 1".split()),
        ("8b, fsdp=8, seq 8192", "--model llama3-8b --mesh fsdp=8 --seq-len 8192 --batch-size 8".split()),
        ("8b, fsdp=4 x tensor=2, seq 8192", "--model llama3-8b --mesh fsdp=4,tensor=2 --seq-len 8192 --batch-size 8"
         .split()),
        ("8b, context=4 x fsdp=2, seq 32768", "--model llama3-8b --mesh context=4,fsdp=2 --seq-len 32768 "
         "--batch-size 2".split()),
        ("70b, 64 x H100, plan's layout", ["--model", "llama3-70b", "--devices", "64", "--seq-len", "8192",
                                            *recommended_70b()]),
    ]  # fmt: skip


def compile_row(flags: list[str], remat: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "spmdkit", "compile", "--target", "h100", *flags, "--model.remat", remat, "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode not in (0, 1):
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout)


def levers(report: dict) -> str:
    """FP8 GEMMs and the hops of decomposed collective matmuls, per call of the step (loops multiplied)."""
    fp8, windowed = report.get("fp8_gemms") or {}, report.get("windowed_einsums") or {}
    return f"{fp8.get('executions', 0)} / {windowed.get('executions', 0)}"


def cell(report: dict) -> list[str]:
    if "error" in report:
        return ["error: " + report["error"][:60], "", "", "", "", "", "", ""]
    gb = lambda b: f"{b / 1e9:.1f}"  # noqa: E731
    coll = ", ".join(f"{op} {t['asynchronous']}/{t['instructions']}" for op, t in report["collectives"].items())
    return [
        gb(report["per_device_bytes"]["total"]), gb(report["planner_bytes"]), f"{report['planner_ratio']:.2f}",
        "yes" if report["fits"] else "no", report["attention_kernel"], coll, levers(report),
        f"{report['compile_seconds']:.0f} s / {report['peak_rss_bytes'] / 1e9:.1f} GB",
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remat", nargs="+", default=list(REMATS))
    parser.add_argument("--out", default="results")
    parser.add_argument("--extra", default="", help="flags added to every row, e.g. --extra=--overlap-tp")
    args = parser.parse_args()
    print(
        "| layout | remat | XLA:GPU GB/device | planner GB | planner / XLA | fits 80 GB | attention | collectives "
        "(async/all) | FP8 GEMMs / windowed-einsum hops | compile / peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for name, flags in rows():
        flags = [*flags, *args.extra.split()]
        for remat in args.remat:
            report = compile_row(flags, remat)
            results.append({"layout": name, "flags": flags, "remat": remat, **report})
            print("| " + " | ".join([name, remat, *cell(report)]) + " |", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_compile.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
