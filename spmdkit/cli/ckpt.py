"""`spmdkit ckpt`: inspect, verify, reshard or convert (Hugging Face) checkpoints."""

from __future__ import annotations

import argparse

from spmdkit.cli import SUMMARIES
from spmdkit.cli.args import CommandGroup, Subcommands, add_cpu_devices

HELP = SUMMARIES["ckpt"]


def _inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="checkpoint directory (e.g. RUN_DIR/checkpoints)")
    p.add_argument("--step", type=int, metavar="N", help="the step to describe (default: the newest)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="checkpoint directory (e.g. RUN_DIR/checkpoints)")


def _reshard(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="checkpoint directory to read")
    p.add_argument("--mesh", required=True, help="the new mesh, e.g. 'data=8' or 'fsdp=4,tensor=2'")
    p.add_argument("--out", required=True, metavar="DIR2", help="new (empty) checkpoint directory")
    add_cpu_devices(p)
    p.add_argument("--step", type=int, metavar="N", help="the step to reshard (default: the newest)")


DTYPES = ("float32", "bfloat16", "float16")


def _export(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="checkpoint or run directory to read")
    p.add_argument("--out", required=True, metavar="OUT_DIR", help="the Hugging Face model directory to write")
    p.add_argument("--dtype", choices=DTYPES, help="stored dtype (default: the checkpoint's)")
    p.add_argument("--step", type=int, metavar="N", help="the step to export (default: the newest)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="largest weight file (default: 5GB)")
    p.add_argument(
        "--force", action="store_true", help="replace OUT_DIR if it is an earlier export (never another directory)"
    )
    p.add_argument(
        "--adapters", action="store_true",
        help="a LoRA run: write its adapters as a PEFT adapter directory (default: the model with them merged in)",
    )  # fmt: skip


def _import_hf(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="Hugging Face model directory, .safetensors file or index JSON")
    p.add_argument("--out", required=True, metavar="DIR", help="new (empty) checkpoint directory")
    p.add_argument("--dtype", choices=DTYPES, help="parameter dtype (default: as stored)")
    p.add_argument("--mesh", default="", help="mesh to lay the parameters out on (default: all on fsdp)")
    p.add_argument(
        "--adapters", metavar="PEFT_DIR",
        help="a PEFT LoRA adapter directory trained on PATH: the checkpoint holds these adapters on the base PATH",
    )  # fmt: skip
    add_cpu_devices(p)


def run_inspect(args: argparse.Namespace) -> int:
    import json

    from spmdkit.tools.ckpt_inspect import format_inspection, inspect_checkpoint

    info = inspect_checkpoint(args.directory, args.step)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from spmdkit.tools.ckpt_inspect import format_verification, verify_checkpoint

    report = verify_checkpoint(args.directory)
    print(format_verification(args.directory, report))
    return 1 if any(r["ok"] is False for r in report) else 0  # None: rotated away by a run while read


def run_reshard(args: argparse.Namespace) -> int:
    from spmdkit.tools.convert import reshard_checkpoint

    step = reshard_checkpoint(args.directory, args.out, args.mesh, args.step)
    print(f"resharded step {step} of {args.directory} onto mesh {args.mesh} in {args.out}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from spmdkit.tools.hf_checkpoint import export_hf

    out, step = export_hf(
        args.directory, args.out, args.dtype, args.step, args.max_shard_size, args.force, args.adapters
    )
    what = "'s LoRA adapters as a PEFT adapter directory" if args.adapters else " as a Hugging Face model"
    print(f"wrote step {step} of {args.directory}{what} in {out}")
    return 0


def run_import_hf(args: argparse.Namespace) -> int:
    from spmdkit.errors import SpmdkitError
    from spmdkit.tools.hf_checkpoint import import_hf, import_peft

    if args.adapters:
        if args.dtype or args.mesh:
            raise SpmdkitError("--adapters imports the adapters only (the base stays where it is): drop --dtype/--mesh")
        _, lora = import_peft(args.path, args.adapters, args.out)
        print(
            f"wrote checkpoint step 0 (LoRA rank {lora.rank} on {','.join(lora.target_names)} of the base "
            f"{args.path}) in {args.out}; evaluate, generate or export it: spmdkit eval {args.out}"
        )
        return 0

    model = import_hf(args.path, args.out, args.dtype, args.mesh)
    print(
        f"wrote checkpoint step 0 ({model.num_params():,} parameters, {model.param_dtype}) in {args.out}; "
        f"fine-tune it with: spmdkit train --init-from {args.out}"
    )
    return 0


SUBCOMMANDS: Subcommands = {
    "inspect": ("steps, saved config, and every array's shape, dtype and size", _inspect, run_inspect),
    "verify": ("read every step in full; exit 1 if any is damaged", _verify, run_verify),
    "reshard": ("restore a step onto another mesh and save it to a new directory", _reshard, run_reshard),
    "export": ("a complete Hugging Face model directory (weights, config, tokenizer)", _export, run_export),
    "import-hf": ("an spmdkit checkpoint from a Hugging Face Llama, Qwen2 or Qwen3 model", _import_hf, run_import_hf),
}


GROUP = CommandGroup("spmdkit ckpt", HELP, SUBCOMMANDS, quiet=True)
parser, subcommand_parser, parse, main = GROUP.parser, GROUP.subcommand_parser, GROUP.parse, GROUP.main
