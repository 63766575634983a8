"""The `spmdkit` command. JAX is imported only after the flags are read: `--cpu-devices` must set the XLA flag
before JAX starts.

Every `train` flag maps onto one field of `TrainConfig` (see `TRAIN_FLAGS`); `--config FILE.toml` is read
first and the flags override it. Errors a user can cause print one line and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# flag, section, key, type, help. The default shown in --help is read from TrainConfig.
TRAIN_FLAGS: list[tuple[str, str, str, type, str]] = [
    ("--model", "model", "name", str, "model preset: tiny, tiny-moe, 125m, 1b, 7b, 70b, 405b, mixtral-8x7b"),
    ("--dtype", "model", "dtype", str, "compute dtype (parameters stay float32): bfloat16, float32, float16"),
    (
        "--remat",
        "model",
        "remat",
        str,
        "recompute in backward: none, full, dots_saveable, dots_with_no_batch_dims_saveable",
    ),
    ("--attention", "model", "attention", str, "auto (ring when context > 1), dot, ring"),
    ("--moe-dispatch", "model", "dispatch", str, "mixture of experts: capacity, dropless or dense (empty: preset's)"),
    ("--capacity-factor", "model", "capacity_factor", float, "MoE expert slots per sequence x top_k / experts"),
    ("--mesh", "mesh", "mesh", str, "mesh axis sizes, e.g. 'data=2,fsdp=2,tensor=2'; empty = all devices on fsdp"),
    ("--dcn", "mesh", "dcn", str, "across-node factor of axes, e.g. 'data=2' (default: processes fill outer axes)"),
    (
        "--zero",
        "mesh",
        "zero",
        int,
        "ZeRO stage over fsdp: 0 (replicate), 1 (optimizer), 2 (+gradients), 3 (+parameters)",
    ),
    ("--pipeline-schedule", "mesh", "pipeline_schedule", str, "with pipeline > 1: gpipe, 1f1b or interleaved"),
    ("--microbatches", "mesh", "microbatches", int, "pipeline microbatches per step (0 = twice the stages)"),
    ("--virtual-stages", "mesh", "virtual_stages", int, "layer chunks per pipeline stage (interleaved schedule)"),
    ("--lr", "optimizer", "lr", float, "peak learning rate (linear warmup, cosine decay to 10%%)"),
    ("--warmup-steps", "optimizer", "warmup_steps", int, "learning-rate warmup steps"),
    ("--weight-decay", "optimizer", "weight_decay", float, "AdamW weight decay (not applied to norm scales)"),
    ("--clip-norm", "optimizer", "clip_norm", float, "clip gradients to this global norm (0 = off)"),
    ("--max-bad-steps", "optimizer", "max_bad_steps", int, "stop after this many consecutive NaN/Inf steps"),
    ("--data", "data", "source", str, "stdlib (embedded Python sources), synthetic, or a .bin/.npy token file"),
    ("--token-dtype", "data", "token_dtype", str, "dtype of a .bin token file: uint16 or uint32"),
    ("--steps", "run", "steps", int, "optimizer steps"),
    ("--batch-size", "run", "batch_size", int, "global batch, in sequences"),
    ("--seq-len", "run", "seq_len", int, "tokens per sequence"),
    ("--grad-accum", "run", "grad_accum", int, "microbatches accumulated per optimizer step"),
    ("--eval-every", "run", "eval_every", int, "evaluate on the held-out split every N steps (0 = never)"),
    ("--eval-batches", "run", "eval_batches", int, "batches per evaluation"),
    ("--log-every", "run", "log_every", int, "write metrics every N steps"),
    ("--seed", "run", "seed", int, "seed for initialisation and data order"),
    ("--run-dir", "run", "run_dir", str, "directory for config.json, metrics.jsonl, loss.png, tensorboard/"),
    ("--peak-tflops", "run", "peak_tflops", float, "peak TFLOP/s per device for MFU where the device is unknown"),
    ("--checkpoint-dir", "checkpoint", "directory", str, "Orbax checkpoint directory (empty: RUN_DIR/checkpoints)"),
    ("--checkpoint-every", "checkpoint", "every", int, "save a checkpoint every N steps (0: only at the end)"),
    ("--keep", "checkpoint", "keep", int, "keep the newest N checkpoints"),
]
BOOL_FLAGS: list[tuple[str, str, str, bool, str]] = [
    ("--sequence-parallel", "mesh", "sequence_parallel", True, "shard the residual stream's sequence over tensor (SP)"),
    ("--no-progress", "run", "progress", False, "no progress bar"),
    ("--no-resume", "checkpoint", "resume", False, "start from step 0 (the checkpoint directory must not hold steps)"),
]


def _default(section: str, key: str) -> object:
    from spmdkit.train.config import TrainConfig  # light: no JAX computation happens at import

    return getattr(getattr(TrainConfig(), section), key)


def add_train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a model",
        description="Train a Llama-style model with the parallelism the mesh describes. With no flags: the tiny "
        "model on the embedded stdlib data, on every device present.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        help="TOML config ([model], [mesh], [optimizer], [data], [run], [checkpoint]); flags override it",
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        metavar="N",
        help="simulate N devices on the CPU (sets the XLA flag before JAX starts)",
    )
    for flag, section, key, kind, text in TRAIN_FLAGS:
        parser.add_argument(
            flag,
            type=kind,
            dest=f"{section}.{key}",
            metavar=flag.lstrip("-").upper().replace("-", "_"),
            help=f"{text} (default: {_default(section, key)!r})",
        )
    for flag, section, key, value, text in BOOL_FLAGS:
        parser.add_argument(flag, action="store_const", const=value, dest=f"{section}.{key}", help=text)
    return parser


def overrides_from_args(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    overrides: dict[str, dict[str, object]] = {}
    for dest, value in vars(args).items():
        if "." in dest and value is not None:
            section, key = dest.split(".", 1)
            overrides.setdefault(section, {})[key] = value
    return overrides


def simulate_cpu_devices(count: int | None) -> None:
    """Make JAX see `count` CPU devices. Must run before JAX is imported."""
    if count is None:
        return
    from spmdkit.errors import SpmdkitError

    if count < 1:
        raise SpmdkitError(f"--cpu-devices {count} must be at least 1")
    if "jax" in sys.modules:
        raise SpmdkitError("--cpu-devices must be set before JAX is imported")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def run_train(args: argparse.Namespace) -> int:
    from spmdkit.launch import initialize_distributed

    initialize_distributed()  # joins a multi-process job (spmdkit launch, SLURM, Open MPI) before JAX computes
    from spmdkit.train.config import TrainConfig, apply_overrides, load_toml
    from spmdkit.train.loop import train

    config = TrainConfig()
    if args.config:
        config = apply_overrides(config, load_toml(args.config))
    config = apply_overrides(config, overrides_from_args(args))
    train(config)
    return 0


def add_ckpt_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("ckpt", help="inspect, verify, reshard or convert (Hugging Face) checkpoints")
    commands = parser.add_subparsers(dest="ckpt_command", required=True)
    inspect = commands.add_parser("inspect", help="steps, saved config, and every array's shape, dtype and size")
    inspect.add_argument("directory", metavar="DIR", help="checkpoint directory (e.g. RUN_DIR/checkpoints)")
    inspect.add_argument("--step", type=int, metavar="N", help="the step to describe (default: the newest)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(handler=run_ckpt_inspect)
    verify = commands.add_parser("verify", help="read every step in full; exit 1 if any is damaged")
    verify.add_argument("directory", metavar="DIR", help="checkpoint directory (e.g. RUN_DIR/checkpoints)")
    verify.set_defaults(handler=run_ckpt_verify)
    reshard = commands.add_parser("reshard", help="restore a step onto another mesh and save it to a new directory")
    reshard.add_argument("directory", metavar="DIR", help="checkpoint directory to read")
    reshard.add_argument("--mesh", required=True, help="the new mesh, e.g. 'data=8' or 'fsdp=4,tensor=2'")
    reshard.add_argument("--out", required=True, metavar="DIR2", help="new (empty) checkpoint directory")
    reshard.add_argument("--cpu-devices", type=int, metavar="N", help="simulate N devices on the CPU")
    reshard.add_argument("--step", type=int, metavar="N", help="the step to reshard (default: the newest)")
    reshard.set_defaults(handler=run_ckpt_reshard)
    export = commands.add_parser("export", help="parameters as Hugging Face Llama safetensors + config.json")
    export.add_argument("directory", metavar="DIR", help="checkpoint directory to read")
    export.add_argument("--out", required=True, metavar="FILE.safetensors", help="config.json is written beside it")
    export.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="stored dtype")
    export.add_argument("--step", type=int, metavar="N", help="the step to export (default: the newest)")
    export.set_defaults(handler=run_ckpt_export)
    import_hf = commands.add_parser("import-hf", help="an spmdkit checkpoint from Hugging Face Llama safetensors")
    import_hf.add_argument("file", metavar="FILE.safetensors", help="with its config.json beside it")
    import_hf.add_argument("--out", required=True, metavar="DIR", help="new (empty) checkpoint directory")
    import_hf.add_argument("--mesh", default="", help="mesh to lay the parameters out on (default: all on fsdp)")
    import_hf.add_argument("--cpu-devices", type=int, metavar="N", help="simulate N devices on the CPU")
    import_hf.set_defaults(handler=run_ckpt_import_hf)
    return parser


def _quiet_absl() -> None:
    """Orbax logs read-only notices through absl; the ckpt commands print their own report."""
    from absl import logging

    logging.set_verbosity(logging.ERROR)


def run_ckpt_inspect(args: argparse.Namespace) -> int:
    import json

    from spmdkit.checkpoint.inspect import format_inspection, inspect_checkpoint

    _quiet_absl()
    info = inspect_checkpoint(args.directory, args.step)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0


def run_ckpt_verify(args: argparse.Namespace) -> int:
    from spmdkit.checkpoint.inspect import format_verification, verify_checkpoint

    _quiet_absl()
    report = verify_checkpoint(args.directory)
    print(format_verification(args.directory, report))
    return 0 if all(r["ok"] for r in report) else 1


def run_ckpt_reshard(args: argparse.Namespace) -> int:
    from spmdkit.checkpoint.convert import reshard_checkpoint

    _quiet_absl()
    step = reshard_checkpoint(args.directory, args.out, args.mesh, args.step)
    print(f"resharded step {step} of {args.directory} onto mesh {args.mesh} in {args.out}")
    return 0


def run_ckpt_export(args: argparse.Namespace) -> int:
    from spmdkit.checkpoint.convert import export_hf

    _quiet_absl()
    out = export_hf(args.directory, args.out, args.dtype, args.step)
    print(f"wrote {out} and {out.parent / 'config.json'}")
    return 0


def run_ckpt_import_hf(args: argparse.Namespace) -> int:
    from spmdkit.checkpoint.convert import import_hf

    _quiet_absl()
    out = import_hf(args.file, args.out, args.mesh)
    print(f"wrote checkpoint step 0 (fresh optimizer state) in {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from spmdkit.bench import add_bench_parser
    from spmdkit.launch import add_launch_parser
    from spmdkit.plan_report import add_plan_parser

    parser = argparse.ArgumentParser(
        prog="spmdkit", description="SPMD sharding toolkit for training transformers with JAX."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_train_parser(subparsers).set_defaults(handler=run_train)
    add_ckpt_parser(subparsers)
    add_plan_parser(subparsers)
    add_launch_parser(subparsers)
    add_bench_parser(subparsers)
    return parser


def _early_cpu_devices(argv: Sequence[str]) -> int | None:
    """Read --cpu-devices before anything imports JAX (building the parser's help text does)."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--cpu-devices", type=int)
    return early.parse_known_args(list(argv))[0].cpu_devices


def main(argv: Sequence[str] | None = None) -> int:
    from spmdkit.errors import SpmdkitError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        simulate_cpu_devices(_early_cpu_devices(argv))
        args = build_parser().parse_args(argv)
        return args.handler(args)
    except SpmdkitError as error:
        print(f"spmdkit: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spmdkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
