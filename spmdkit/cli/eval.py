"""`spmdkit eval`: loss, perplexity and bits per byte of a checkpoint on held-out data, sharded."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from spmdkit.cli import SUMMARIES
from spmdkit.cli.args import ArgumentParser, add_cpu_devices, use_cpu_devices
from spmdkit.errors import SpmdkitError

HELP = SUMMARIES["eval"]


def parser() -> ArgumentParser:
    """`spmdkit eval` (its handler is `main`)."""
    p = ArgumentParser(
        prog="spmdkit eval",
        description="Evaluate the newest checkpoint of a run on the held-out split of a data source: mean loss per "
        "scored token, perplexity and bits per byte (loss x tokens / bytes of text / ln 2, comparable across "
        "tokenizers). Rows are split over --mesh data=N, heads and MLP over tensor=N.",
    )
    add = p.add_argument
    add("path", metavar="PATH", help="a run directory or its checkpoints/ directory (the newest step is used)")
    add("--data", metavar="SOURCE", help="stdlib, a prepared dataset, a mixture or a token file (default: the run's)")
    add("--packing", choices=("auto", "documents", "windows"), help="how rows are cut (default: the run's)")
    add("--seq-len", type=int, metavar="N", help="tokens per row (default: the run's seq_len)")
    add("--batch-size", type=int, default=8, metavar="N", help="rows per batch (default: 8)")
    add(
        "--batches", type=int, default=20, metavar="N", help="batches to read at most (default: 20; 0: the whole split)"
    )
    add("--mesh", default="", help="mesh over tensor and data, e.g. 'data=8' (default: one device)")
    add("--json", action="store_true", help="print one JSON object")
    add_cpu_devices(p)
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    return parser().parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    if args.batches < 0:
        raise SpmdkitError(f"--batches {args.batches} must be >= 0 (0: the whole split)")
    from spmdkit.inference.loading import check_mesh_spec

    if args.mesh:
        check_mesh_spec(args.mesh)
    if not Path(args.path).expanduser().exists():
        raise SpmdkitError(f"{args.path} does not exist: pass a run directory or its checkpoints/ directory")
    use_cpu_devices(args.cpu_devices)
    import dataclasses

    from spmdkit.inference.evaluate import evaluate
    from spmdkit.inference.loading import inference_mesh, inference_rules, open_checkpoint, restore_model

    mesh, rules = inference_mesh(args.mesh), inference_rules()
    source = open_checkpoint(args.path)
    data = source.data
    changes = {k: v for k, v in (("source", args.data), ("packing", args.packing)) if v is not None}
    data = dataclasses.replace(data, **changes)
    model = restore_model(source, mesh, rules, param_dtype="float32", config=source.model.replace(attention="dot"))
    seq_len = args.seq_len or source.seq_len or 128
    result = evaluate(
        model, data, mesh, rules, seq_len=seq_len, batch_size=args.batch_size, max_batches=args.batches or None
    )
    result = {"path": str(args.path), "step": source.step, "data": data.source, "seq_len": seq_len, **result}
    if args.json:
        print(json.dumps(result))
        return 0
    bpb = "n/a (no tokenizer)" if result["bits_per_byte"] is None else f"{result['bits_per_byte']:.4f}"
    print(
        f"{source.directory} step {source.step} on {data.source} (eval split, {result['batches']} batches x "
        f"{args.batch_size} x {seq_len}, {result['tokens']:,} tokens)\n"
        f"loss {result['loss']:.4f}   perplexity {result['perplexity']:.3f}   bits per byte {bpb}"
    )
    return 0
