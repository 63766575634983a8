"""`spmdkit plan`: predict a layout's memory, traffic, bubble, step time and MFU, or recommend one; with
`--inference`, decode latency and throughput by batch size. No JAX."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from spmdkit.cli.args import ArgumentParser, flag_values
from spmdkit.errors import SpmdkitError
from spmdkit.interop.sources import source_model
from spmdkit.models.config import TransformerConfig
from spmdkit.models.lora_config import LoraConfig
from spmdkit.models.presets import PRESETS
from spmdkit.models.resolve import build_model
from spmdkit.parallel.pipeline.schedule import KINDS as SCHEDULES
from spmdkit.plan.devices import DEVICE_FLAGS, DEVICE_TYPES, Device, make_device, parse_mesh
from spmdkit.plan.estimate import REMAT_ORDER, estimate
from spmdkit.plan.inference import BATCHES, format_inference, inference_meshes, inference_report
from spmdkit.plan.limits import check_sizes
from spmdkit.plan.report import context_flag, explain, format_details, format_table, plot
from spmdkit.plan.search import candidate_meshes, search
from spmdkit.sharding.mesh_config import format_sizes
from spmdkit.sharding.strategy import Strategy, mesh_text


def parser() -> ArgumentParser:
    """`spmdkit plan` (its handler is `main`)."""
    parser = ArgumentParser(
        prog="spmdkit plan",
        description="Estimate a layout's per-device memory, collective traffic, pipeline bubble, step time and MFU "
        "(no accelerator needed). Without --mesh, search the meshes of --devices and recommend the fastest that "
        "fits; settings not given (ZeRO stage, SP, remat, microbatches, schedule) are searched too.",
    )
    add = parser.add_argument
    add(
        "--model",
        default="7b",
        help=f"model preset ({', '.join(PRESETS)}), or a Hugging Face model directory / config.json or an spmdkit "
        "checkpoint whose shape is used (default: 7b)",
    )
    add("--devices", type=int, default=8, help="number of accelerators (default: 8)")
    add("--device-type", default="h100", help=f"{', '.join(DEVICE_TYPES)} (default: h100)")
    add("--gpus-per-node", type=int, help="devices per node / fast-link domain (default: the device's)")
    add("--hbm-gb", type=float, help="HBM per device in GB (custom devices; overrides the table)")
    add("--peak-tflops", type=float, help="dense bf16 peak TFLOP/s per device (custom devices)")
    add("--intra-node-gbs", type=float, help="NVLink/ICI GB/s per device per direction (custom devices)")
    add("--inter-node-gbs", type=float, help="InfiniBand/DCN GB/s per device per direction (custom devices)")
    add("--batch-size", type=int, help="global batch in sequences (default: about 1M tokens)")
    add("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    add("--dtype", default="bfloat16", help="compute dtype: bfloat16, float16, float32 (default: bfloat16)")
    add("--mesh", help="evaluate this mesh, e.g. 'fsdp=8,tensor=8' (default: search)")
    add("--zero", type=int, help="ZeRO stage 0-3 over fsdp (default: search 2 and 3)")
    add(
        "--remat",
        help="a remat preset or save:/offload: names, as --model.remat of train (default: search "
        f"{', '.join(REMAT_ORDER)})",
    )
    add("--sequence-parallel", action=argparse.BooleanOptionalAction, help="SP with TP (default: on when tensor > 1)")
    add("--microbatches", type=int, help="gradient-accumulation / pipeline microbatches (default: search)")
    add("--fp8", action="store_true", help="the blocks' matmuls in FP8 at the FP8 peak (train's --model.fp8)")
    add("--optimizer-offload", action="store_true", help="optimizer state in host memory (train's --optimizer.offload)")
    add(
        "--optimizer-name",
        choices=("adamw", "muon"),
        default="adamw",
        help="the optimizer whose state is counted "
        "(train's --optimizer.name; muon: one moment for hidden matrices, AdamW's two for the rest)",
    )
    add_lora_flags(parser)
    add("--pipeline-schedule", help=f"{', '.join(SCHEDULES)} (default: search 1f1b and interleaved)")
    add("--virtual-stages", type=int, help="virtual stages per device for the interleaved schedule")
    add("--efficiency", type=float, default=0.5, help="achieved share of peak FLOP/s (default: 0.5)")
    add("--top", type=int, default=5, help="layouts to list (default: 5)")
    add(
        "--inference",
        action="store_true",
        help="predict decode latency and throughput by batch size instead "
        "(meshes of tensor x data; --seq-len is the context, --batch-size one batch; default: compare the meshes)",
    )
    add("--hbm-gbs", type=float, help="HBM bandwidth in GB/s (custom devices; overrides the table)")
    add("--json", action="store_true", help="print JSON instead of text")
    add("--plot", metavar="FILE.png", help="write memory and step-time bars of the listed layouts")
    return parser


def add_lora_flags(parser: ArgumentParser) -> None:
    """`--lora-rank` and `--lora-targets`: plan a LoRA run (train's `--lora.rank`, `--lora.targets`)."""
    add = parser.add_argument
    add(
        "--lora-rank", type=int, default=0,
        help="LoRA rank (train's --lora.rank): only the adapters train, so gradients and optimizer state are theirs "
        "alone; the frozen base is counted as stored (default: 0, every parameter trains)",
    )  # fmt: skip
    add("--lora-targets", default=LoraConfig.targets, help="projections with adapters (train's --lora.targets)")


def _check_args(args: argparse.Namespace) -> None:
    """One-line errors for settings that would otherwise only make every layout look impossible."""
    if args.devices < 1 or args.seq_len < 1 or (args.batch_size is not None and args.batch_size < 1):
        raise SpmdkitError("--devices, --seq-len and --batch-size must be positive")
    sizes = ("devices", "gpus_per_node", "seq_len", "batch_size", "microbatches")
    check_sizes({f"--{name.replace('_', '-')}": getattr(args, name) for name in sizes})
    if args.zero is not None and args.zero not in (0, 1, 2, 3):
        raise SpmdkitError(f"--zero {args.zero} is not one of 0, 1, 2, 3")
    if args.pipeline_schedule is not None and args.pipeline_schedule not in SCHEDULES:
        raise SpmdkitError(
            f"unknown --pipeline-schedule {args.pipeline_schedule!r}: choose one of {', '.join(SCHEDULES)}"
        )
    if min(args.microbatches or 1, args.virtual_stages or 1, args.top) < 1 or not 0 < args.efficiency <= 1:
        raise SpmdkitError("--microbatches, --virtual-stages and --top must be positive, --efficiency in (0, 1]")
    if args.plot:
        plot = Path(args.plot).expanduser().absolute()
        if plot.is_dir():
            raise SpmdkitError(f"--plot {args.plot} is a directory: name an image file, e.g. plan.png")
        if not plot.parent.is_dir():
            raise SpmdkitError(f"--plot {args.plot}: directory {plot.parent} does not exist: create it first")
        if not os.access(plot.parent, os.W_OK | os.X_OK):
            raise SpmdkitError(f"--plot {args.plot}: directory {plot.parent} is not writable")


def lora_of(args: argparse.Namespace, model: TransformerConfig) -> LoraConfig | None:
    """The LoRA settings of `--lora-rank` / `--lora-targets` (None without them), refused in one line where
    train refuses them (`spmdkit.models.lora.check_lora`)."""
    if not args.lora_rank:
        return None
    lora = LoraConfig(rank=args.lora_rank, targets=args.lora_targets)
    if model.experts:
        raise SpmdkitError("--lora-rank on a mixture-of-experts model is not supported yet: drop --lora-rank")
    if model.fp8:
        raise SpmdkitError("--lora-rank with --fp8: the adapters do not wrap the FP8 matmuls yet; drop one")
    if args.inference:
        raise SpmdkitError("--lora-rank plans training: drop it with --inference (merge the adapters to serve)")
    return lora


def parse(argv: Sequence[str]) -> argparse.Namespace:
    return parser().parse_args(list(argv))


def inference(args: argparse.Namespace, dev: Device) -> int:
    """`spmdkit plan --inference`: decode latency and throughput of each mesh (or --mesh) by batch size."""
    model = build_model({"name": args.model}, source_model).replace(dtype=args.dtype, param_dtype=args.dtype)
    meshes = [parse_mesh(args.mesh, args.devices)] if args.mesh else inference_meshes(args.devices, model)
    reports = []
    for sizes in meshes:
        if args.batch_size and args.batch_size % sizes["data"]:
            raise SpmdkitError(f"--batch-size {args.batch_size} is not a multiple of data={sizes['data']}")
        per_replica = (args.batch_size // sizes["data"],) if args.batch_size else BATCHES
        reports.append(
            inference_report(model, sizes, dev, context=args.seq_len, batches=per_replica, efficiency=args.efficiency)
        )
    if args.json:
        print(json.dumps({"model": args.model, "inference": reports}, indent=1))
    else:
        print(format_inference(args.model, model, dev, reports))
    return 0


def main(argv: Sequence[str]) -> int:
    """`spmdkit plan`: print the table (or JSON), the chosen layout's details and why."""
    args = parse(argv)
    model = build_model({"name": args.model}, source_model).replace(
        dtype=args.dtype, remat=args.remat or "none", fp8=args.fp8
    )
    dev = make_device(args.device_type, **flag_values(args, *DEVICE_FLAGS))
    _check_args(args)
    lora = lora_of(args, model)
    if args.inference:
        return inference(args, dev)
    if args.mesh:
        meshes = [parse_mesh(args.mesh, args.devices)]
        replicas = meshes[0]["data"] * meshes[0]["fsdp"] * meshes[0]["expert"]
        batch = args.batch_size or replicas * max(1, round(2**20 / args.seq_len / replicas))
    else:
        batch = args.batch_size or max(1, 2**20 // args.seq_len)
        meshes = list(candidate_meshes(model, args.devices, dev.gpus_per_node, batch, args.seq_len))
    fitting, smallest = search(
        model, meshes, dev, batch, args.seq_len, zero=args.zero, sequence_parallel=args.sequence_parallel,
        remat=args.remat, microbatches=args.microbatches, schedule=args.pipeline_schedule,
        virtual_stages=args.virtual_stages, offload=args.optimizer_offload, muon=args.optimizer_name == "muon",
        lora=lora, efficiency=args.efficiency,
    )  # fmt: skip
    if args.mesh and smallest is None:  # no setting could run on this mesh: raise its own error
        given = Strategy(
            mesh_text(meshes[0]), 3 if args.zero is None else args.zero, bool(args.sequence_parallel),
            args.microbatches, args.pipeline_schedule or "1f1b", args.virtual_stages or 1, args.optimizer_offload,
            muon=args.optimizer_name == "muon",
        )  # fmt: skip
        estimate(model, given, device=dev, batch_size=batch, seq_len=args.seq_len, lora=lora)
    if not fitting and not (args.mesh and smallest):
        raise SpmdkitError(
            f"no layout of {args.devices} x {dev.name} fits {args.model} with batch {batch} x {args.seq_len}"
            + (f" (smallest needs {smallest.total_memory / 1e9:.0f} GB)" if smallest else "")
            + ": add devices, shorten the batch or sequence, or check --mesh/--zero/--remat"
        )
    shown = fitting[: max(1, args.top)] or [smallest]
    best = shown[0]
    runner_up = next((e for e in fitting if e.mesh != best.mesh), None)
    why = explain(best, runner_up, dev.gpus_per_node) if best.fits else ""
    if args.json:
        report = {"recommended": best.to_dict(), "explanation": why, "candidates": [e.to_dict() for e in shown]}
        print(json.dumps(report, indent=1))
    else:
        tuned = f" LoRA rank {lora.rank}" if lora else ""
        title = f"spmdkit plan: {args.model}{tuned} on {args.devices} x {dev.name} ({dev.gpus_per_node} per node)"
        print(f"{title}, batch {batch} x {args.seq_len} tokens, {args.dtype}; {len(fitting)} layouts on {len(meshes)}"
              " meshes fit")  # fmt: skip
        print(format_table(shown))
        cp = "" if best.mesh["context"] == 1 else f" --context-parallel {context_flag(best)}"
        print(
            f"\n{'recommended' if best.fits else 'does NOT fit'}: {format_sizes(best.mesh)}{cp}\n{format_details(best)}"
        )
        if why:
            print(f"\n{why}")
    if args.plot:  # after the report: a plot that cannot be written does not lose it
        sys.stdout.flush()
        plot(shown, args.plot)
    return 0
