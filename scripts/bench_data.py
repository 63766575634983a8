"""Data throughput: `spmdkit data prepare` against the `tokenizers` batch encoder, and the packed loader.

1. Tokenization. The text: the embedded standard-library corpus (~8 MB of Python, 692 files) or `--inputs`. The
   tokenizer: `bpe:N` trained once on that text (or `--tokenizer T`). Timed, alternately, `--repeats` times each:
   - direct: `tokenizers.Tokenizer.encode_batch_fast(texts, add_special_tokens=False)` on the texts already in
     memory (the library alone, the upper bound);
   - prepare: `spmdkit.data.prepare.prepare` of the same inputs with the same tokenizer.json: reading the files,
     encoding, BOS/EOS, shards, index, hashes, dataset.json (its own `seconds`).
   MB of text/s and tokens/s of the best run of each, and prepare / direct; also the CPU seconds (all threads)
   of each, the cost of the work whatever else shares the machine.
2. Loader. `make_data` on the prepared dataset at `--seq-len` 4096 and `--global-batch` 64 (one process; documents
   packing, and windows): tokens/s over `--batches` batches after one warm-up batch, with grain's background
   thread as in training. To say what bounds it, the same rows assembled in this thread without grain
   (`PackedRows[g]` x global batch + np.stack) and a plain copy of as many bytes.

Usage: python scripts/bench_data.py [--vocab 4096] [--inputs PATH ...] [--tokenizer T] [--repeats 3]
Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def _texts(inputs: list[str]) -> list[str]:
    from spmdkit.data.prepare.inputs import Document, InputOptions, read_inputs

    return [r.text for r in read_inputs(inputs, InputOptions()) if isinstance(r, Document)]


def tokenization(inputs: list[str], tokenizer_spec: str, vocab: int, repeats: int, work: Path) -> dict:
    from spmdkit.data.prepare import PrepareOptions, prepare
    from spmdkit.data.tokenizer import load_tokenizer, train_bpe

    texts = _texts(inputs)
    text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    if tokenizer_spec:
        tokenizer = load_tokenizer(tokenizer_spec)
    else:
        started = time.perf_counter()
        tokenizer = train_bpe(iter(texts), vocab)
        print(f"trained bpe:{vocab} on {text_mb:.2f} MB in {time.perf_counter() - started:.1f} s")
    tokenizer.save(work / "tok")
    hf = tokenizer.hf
    direct, ours, direct_cpu, ours_cpu = [], [], [], []
    tokens = 0
    for k in range(repeats):
        started, cpu = time.perf_counter(), time.process_time()
        encodings = hf.encode_batch_fast(texts, add_special_tokens=False)
        direct.append(time.perf_counter() - started)
        direct_cpu.append(time.process_time() - cpu)
        tokens = sum(len(e) for e in encodings)
        options = PrepareOptions(tuple(inputs), str(work / "tok"), str(work / f"prepared{k}"), progress=False)
        cpu = time.process_time()
        meta = prepare(options, log=lambda _: None)
        ours_cpu.append(time.process_time() - cpu)
        ours.append(meta["seconds"])
    specials = meta["tokens"] - tokens  # BOS/EOS per document
    return {
        "documents": len(texts),
        "text_mb": text_mb,
        "tokens": tokens,
        "direct_s": min(direct),
        "prepare_s": min(ours),
        "direct_cpu_s": min(direct_cpu),
        "prepare_cpu_s": min(ours_cpu),  # CPU seconds of all threads: what the work costs, whatever else runs
        "prepare_tokens": meta["tokens"],
        "specials": specials,
        "dataset": str(work / "prepared0"),
        "vocab": tokenizer.vocab_size,
        "model_vocab": tokenizer.model_vocab_size,
    }


def loader(dataset: str, vocab: int, seq_len: int, global_batch: int, batches: int) -> dict:
    from spmdkit.data.config import DataConfig
    from spmdkit.data.packing import PackedRows
    from spmdkit.data.store import PreparedDataset
    from spmdkit.data.stream import make_data

    out = {}
    for packing in ("documents", "windows"):
        stream = make_data(
            DataConfig(source=dataset, packing=packing), seq_len=seq_len, global_batch=global_batch,
            vocab_size=vocab, seed=0,
        )  # fmt: skip
        next(stream)
        started = time.perf_counter()
        for _ in range(batches):
            next(stream)
        seconds = time.perf_counter() - started
        out[packing] = batches * global_batch * seq_len / seconds
    rows = PackedRows(
        PreparedDataset(dataset), seq_len=seq_len, packing="documents", split="train", eval_fraction=0.05, seed=0
    )
    rows[0]
    started = time.perf_counter()
    for b in range(batches):
        batch = [rows[b * global_batch + i] for i in range(global_batch)]
        stacked = {k: np.stack([r[k] for r in batch]) for k in batch[0]}
    assemble = (time.perf_counter() - started) / batches
    nbytes = sum(v.nbytes for v in stacked.values())
    source = np.ones(nbytes // 4, np.int32)
    started = time.perf_counter()
    for _ in range(batches):
        source.copy()
    copy = (time.perf_counter() - started) / batches
    out.update(assemble_ms=assemble * 1e3, batch_mb=nbytes / 1e6, copy_ms=copy * 1e3)
    out["fill"] = rows.tokens / (rows.rows_per_epoch(0) * seq_len)  # documents packing: share of non-padding
    out["assemble_tokens_s"] = global_batch * seq_len / assemble
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", nargs="+", default=["stdlib"], help="what to prepare (default: stdlib)")
    parser.add_argument("--tokenizer", default="", help="a tokenizer.json (default: train bpe:--vocab)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as work:
        tok = tokenization(args.inputs, args.tokenizer, args.vocab, args.repeats, Path(work))
        load = loader(tok["dataset"], tok["model_vocab"], args.seq_len, args.global_batch, args.batches)
    mb, n = tok["text_mb"], tok["tokens"]
    print(f"\nmachine: {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.1f}")
    print(
        f"text: {', '.join(args.inputs)}: {tok['documents']} documents, {mb:.2f} MB, {n:,} tokens "
        f"(vocab {tok['vocab']})"
    )
    print("\n| tokenization | seconds | MB of text/s | tokens/s |\n|---|---|---|---|")
    for name, seconds in (
        ("tokenizers encode_batch_fast", tok["direct_s"]),
        ("spmdkit data prepare", tok["prepare_s"]),
    ):
        print(f"| {name} | {seconds:.2f} | {mb / seconds:.2f} | {n / seconds:,.0f} |")
    print(
        f"\nprepare / direct throughput: {tok['direct_s'] / tok['prepare_s']:.2f} "
        f"(best wall time of {args.repeats} each); "
        f"CPU seconds (all threads) direct {tok['direct_cpu_s']:.2f}, prepare {tok['prepare_cpu_s']:.2f}: "
        f"{tok['direct_cpu_s'] / tok['prepare_cpu_s']:.2f}. tokens/s counts text tokens (without BOS/EOS)"
    )
    print(f"\n| loader, seq {args.seq_len} x global batch {args.global_batch} | tokens/s |\n|---|---|")
    print(f"| make_data, documents packing | {load['documents']:,.0f} |")
    print(f"| make_data, windows packing | {load['windows']:,.0f} |")
    print(f"| rows assembled in one thread, no grain | {load['assemble_tokens_s']:,.0f} |")
    print(f"\ndocuments packing fills {load['fill']:.1%} of the row slots at seq {args.seq_len} (the rest is padding)")
    print(
        f"\none batch: {load['batch_mb']:.1f} MB of int32 fields, assembled in {load['assemble_ms']:.1f} ms; "
        f"a plain copy of as many bytes: {load['copy_ms']:.2f} ms"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"tokenization": tok, "loader": load}, indent=2))


if __name__ == "__main__":
    main()
