"""`spmdkit eval`: loss, perplexity and bits per byte of a checkpoint on held-out data, sharded."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from spmdkit.cli.args import ArgumentParser, add_cpu_devices, quiet_absl, use_cpu_devices
from spmdkit.cli.generate import PATH_HELP, check_source
from spmdkit.errors import SpmdkitError
from spmdkit.plan.limits import check_sizes

HF_SEQ_LEN = 1024  # the default row length of a Hugging Face model (its max positions are often far longer)


def parser() -> ArgumentParser:
    """`spmdkit eval` (its handler is `main`)."""
    p = ArgumentParser(
        prog="spmdkit eval",
        description="Evaluate the newest checkpoint of a run (or a Hugging Face model directory) on the held-out split "
        "of a data source: mean loss per scored token, perplexity and bits per byte (loss x tokens / bytes of text / "
        "ln 2, comparable across tokenizers). A Hugging Face model needs --data, prepared with its tokenizer "
        "('spmdkit data prepare --tokenizer MODEL_DIR'). Rows are split over --mesh data=N, heads and MLP over "
        "tensor=N.",
    )
    add = p.add_argument
    add("path", metavar="PATH", help=PATH_HELP)
    add("--data", metavar="SOURCE", help="stdlib, a prepared dataset, a mixture or a token file (default: the run's)")
    add("--packing", choices=("auto", "documents", "windows"), help="how rows are cut (default: the run's)")
    add(
        "--seq-len",
        type=int,
        metavar="N",
        help=f"tokens per row (default: the run's seq_len; a Hugging Face model's max positions, at most {HF_SEQ_LEN})",
    )
    add("--batch-size", type=int, default=8, metavar="N", help="rows per batch (default: 8)")
    add(
        "--batches", type=int, default=20, metavar="N", help="batches to read at most (default: 20; 0: the whole split)"
    )
    add("--mesh", default="", help="mesh over tensor and data, e.g. 'data=8' (default: one device)")
    add("--json", action="store_true", help="print one JSON object")
    add_cpu_devices(p)
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    if args.batches < 0:  # the flags and the path, before anything is read
        raise SpmdkitError(f"--batches {args.batches} must be >= 0 (0: the whole split)")
    if args.seq_len is not None and args.seq_len < 1:
        raise SpmdkitError(f"--seq-len {args.seq_len} must be at least 1 (default: the run's seq_len)")
    if args.batch_size < 1:
        raise SpmdkitError(f"--batch-size {args.batch_size} must be at least 1")
    check_sizes({"--seq-len": args.seq_len, "--batch-size": args.batch_size})
    check_source(args)
    quiet_absl()
    use_cpu_devices(args.cpu_devices)
    import dataclasses

    from spmdkit.data.config import DataConfig
    from spmdkit.data.resolve import source_tokenizer
    from spmdkit.inference.evaluate import evaluate
    from spmdkit.inference.loading import inference_mesh, inference_rules
    from spmdkit.inference.sources import model_tokenizer, open_source, same_tokenizer
    from spmdkit.interop.loading import load_model

    mesh, rules = inference_mesh(args.mesh), inference_rules()
    source = open_source(args.path)
    if source.data is None and args.data is None:
        raise SpmdkitError(
            f"{args.path} is a Hugging Face model, which names no data: pass --data (a prepared dataset made with its "
            f"tokenizer: spmdkit data prepare INPUT --tokenizer {args.path}, or a token file)"
        )
    changes = {k: v for k, v in (("source", args.data), ("packing", args.packing)) if v is not None}
    data = dataclasses.replace(source.data or DataConfig(), **changes)
    model_tok, data_tok = model_tokenizer(source), source_tokenizer(data)
    if model_tok is not None and data_tok is not None and not same_tokenizer(model_tok, data_tok):
        raise SpmdkitError(
            f"--data {data.source} is tokenized with {data_tok.name}, but the model reads {model_tok.name}: prepare "
            "the data with the model's tokenizer (spmdkit data prepare --tokenizer PATH_OF_ITS_TOKENIZER_JSON)"
        )
    config = source.model.replace(attention="dot")  # evaluation's own kernel choice; parameters in float32
    model = load_model(source.directory, mesh, rules, config.dtype, "float32", step=source.step, config=config)
    seq_len = args.seq_len if args.seq_len is not None else source.seq_len or 128
    if source.kind == "hf" and args.seq_len is None:
        seq_len = min(seq_len, HF_SEQ_LEN)
    result = evaluate(
        model, data, mesh, rules, seq_len=seq_len, batch_size=args.batch_size, max_batches=args.batches or None
    )
    if not math.isfinite(result["loss"]):
        raise SpmdkitError(
            f"the loss of {source.describe()} on {data.source} is {result['loss']}: check the data (token ids must be "
            f"below the model's vocab_size {config.vocab_size}) and the checkpoint (spmdkit ckpt verify)"
        )
    result = {"path": str(args.path), "step": source.step, "data": data.source, "seq_len": seq_len, **result}
    if args.json:
        print(json.dumps(result))
        return 0
    bpb = "n/a (no tokenizer)" if result["bits_per_byte"] is None else f"{result['bits_per_byte']:.4f}"
    print(
        f"{source.describe()} on {data.source} (eval split, {result['batches']} batches x "
        f"{args.batch_size} x {seq_len}, {result['tokens']:,} tokens)\n"
        f"{_loss_name(data.source)} {result['loss']:.4f}   perplexity {result['perplexity']:.3f}   bits per byte {bpb}"
    )
    return 0


def _loss_name(source: str) -> str:
    """ "assistant-token loss" for a chat dataset (its loss mask scores the assistant turns only), else "loss"."""
    from spmdkit.data.store import PreparedDataset, is_prepared_dataset

    if is_prepared_dataset(source) and PreparedDataset(source).has_mask:
        return "assistant-token loss"
    return "loss"
