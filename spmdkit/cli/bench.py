"""`spmdkit bench` (and `scripts/benchmark.py`): compile and time every strategy that fits the devices present."""

from __future__ import annotations

from collections.abc import Sequence

from spmdkit.cli import SUMMARIES
from spmdkit.cli.args import ArgumentParser, sentence
from spmdkit.errors import SpmdkitError
from spmdkit.models.attention_choice import KERNELS
from spmdkit.models.presets import model_preset
from spmdkit.tools.bench import STRATEGIES, run
from spmdkit.train.step.preflight import check_writable

HELP = SUMMARIES["bench"]


def parser() -> ArgumentParser:
    """`spmdkit bench` (also run by `scripts/benchmark.py`; its handler is `main`)."""
    parser = ArgumentParser(prog="spmdkit bench", description=sentence(HELP))
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (minutes on a laptop CPU)")
    parser.add_argument("--peer", action="store_true", help="the fixed peer configuration (fsdp=8, fsdp=4,tensor=2)")
    parser.add_argument("--out", default="results", metavar="DIR", help="results directory (default: results/)")
    parser.add_argument("--steps", type=int, metavar="N", help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps after compiling")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), metavar="NAME", help="subset to run")
    parser.add_argument("--model", default="tiny", help="model preset on CPU (default: tiny)")
    parser.add_argument("--dtype", default="float32", help="compute dtype on CPU (default: float32)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch in sequences (CPU; default 16)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (CPU; default 256)")
    parser.add_argument("--microbatches", type=int, default=8, help="pipeline microbatches (default 8)")
    parser.add_argument(
        "--attention",
        default="auto",
        choices=["auto", *KERNELS],
        help="attention kernel (default auto: ring under context > 1, else cudnn on an NVIDIA GPU, else blockwise)",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    # one-line errors for values the benchmark cannot run with, before anything compiles or is written
    for flag, value, least in (
        ("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--batch-size", args.batch_size, 1),
        ("--seq-len", args.seq_len, 1), ("--microbatches", args.microbatches, 1),
    ):  # fmt: skip
        if value is not None and value < least:
            raise SpmdkitError(f"{flag} {value} must be at least {least}")
    check_writable(args.out, "--out")
    model_preset(args.model).replace(dtype=args.dtype)  # an unknown preset or dtype: its own one-line error
    return run(args)
