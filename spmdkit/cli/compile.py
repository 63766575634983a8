"""`spmdkit compile`: compile a run's training step for a GPU cluster that is not here, and say whether it fits.

Takes every flag `spmdkit train` takes (the same config dataclasses, `--config FILE.toml` too), plus the target:
`--target` (h100, h200, a100, b200), `--devices N`, `--devices-per-host` (default 8: 64 devices are 8 hosts of 8
GPUs as one topology) and `--json`. Runs on a CPU-only machine (deviceless ahead-of-time compilation: the
`gpu-aot` extra). Exit 0: it fits; 1: it compiled but does not fit (one line with the numbers); 2: bad input.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from spmdkit.cli.args import ArgumentParser
from spmdkit.cli.train import parse_flags
from spmdkit.errors import SpmdkitError
from spmdkit.plan.limits import check_sizes
from spmdkit.targets.topology import TARGETS, gpu_target, host_count, require_aot
from spmdkit.train.config import TrainConfig, config_from_toml

PROG = "spmdkit compile"


def parser() -> ArgumentParser:
    """The target's flags; every other flag is `spmdkit train`'s."""
    parser = ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [--target TARGET] [--devices N] [--devices-per-host N] [--json] [--roofline] "
        "[spmdkit train flags ...]",
        description="Compile the exact training step of a `spmdkit train` command line for N GPUs of the target, "
        "on this machine without a GPU (XLA's deviceless ahead-of-time compilation; needs pip install "
        "'spmdkit[gpu-aot]'), and print per-device memory against the GPU's HBM and whether it fits, the attention "
        "kernel and the collectives in the compiled program, its FLOPs (loops multiplied, a pipeline's branches as "
        "its schedule runs them) and the planner's prediction; a layout that does not fit exits 1 and names a remat "
        "policy that does, if one does. Every flag of spmdkit train is accepted (--model, --mesh, --seq-len, "
        "--batch-size, --model.remat, --config, ...); LoRA (--lora.rank) compiles on a base of shapes, without "
        "--init-from weights.",
    )
    parser.add_argument("--target", default="h100", help=f"the GPU: {', '.join(TARGETS)} (default h100)")
    parser.add_argument("--devices", type=int, default=8, help="GPUs in the job (default 8)")
    parser.add_argument("--devices-per-host", type=int, default=8, help="GPUs per host (default 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    parser.add_argument(
        "--decode", action="store_true",
        help="compile the decode step of spmdkit generate instead (--batch-size rows, a cache of --seq-len "
        "positions; the inference mesh: tensor and data only)",
    )  # fmt: skip
    parser.add_argument(
        "--roofline", action="store_true",
        help="also list the compiled program's kernels by kind (GEMMs, attention, norms and elementwise, the loss, "
        "the optimizer, casts and copies, collectives) with their FLOPs, HBM bytes and time at the target's peak "
        "FLOP/s and HBM bandwidth, their sum as a predicted step time and MFU (--json: a \"roofline\" key)",
    )  # fmt: skip
    parser.add_argument("--config", help="defaults from a TOML file, as spmdkit train --config")
    return parser


def parse(argv: Sequence[str]) -> tuple[TrainConfig, object]:
    """(the train config, the target flags) of `spmdkit compile ARGV`."""
    known, rest = parser().parse_known_args(list(argv))
    if "--cpu-devices" in rest or any(a.startswith("--cpu-devices=") for a in rest):
        raise SpmdkitError("spmdkit compile compiles for --target GPUs: drop --cpu-devices")
    config = parse_flags(rest, config_from_toml(known.config) if known.config else TrainConfig())
    if known.decode and config.lora.enabled:  # generation runs a merged model: the adapters would be left out
        raise SpmdkitError("--decode compiles generation, which runs merged weights: drop --lora.rank")
    return config, known


def main(argv: Sequence[str]) -> int:
    config, args = parse(argv)
    gpu_target(args.target)  # the bad-input checks first, before JAX starts
    host_count(args.devices, args.devices_per_host)
    run = config.run
    check_sizes({"--devices": args.devices, "--devices-per-host": args.devices_per_host, "--seq-len": run.seq_len,
                 "--batch-size": run.batch_size, "--microbatches": config.mesh.microbatches,
                 "--grad-accum": run.grad_accum})  # fmt: skip
    require_aot()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices: no driver is needed, nor looked for
    from spmdkit.tools.gpu_compile import compile_for_target, decode_report, format_report, not_fit_line

    build = decode_report if args.decode else compile_for_target
    report = build(config, args.target, args.devices, args.devices_per_host, with_roofline=args.roofline)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if not report["fits"]:
        print(f"spmdkit: {not_fit_line(report)}", file=sys.stderr)
        return 1
    return 0
