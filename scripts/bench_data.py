"""Data throughput and memory: `spmdkit data prepare` against the `tokenizers` batch encoder, its memory at any
corpus size, and the packed loader with and without its chunk checksums.

1. Tokenization. The text: the embedded standard-library corpus (~8 MB of Python, 692 files) or `--inputs`. The
   tokenizer: `bpe:N` trained once on that text (or `--tokenizer T`). Timed, alternately, `--repeats` times each
   (best wall time):
   - direct: `tokenizers.Tokenizer.encode_batch_fast(texts, add_special_tokens=False)` on the texts already in
     memory (the library alone, its own threads on all cores);
   - prepare, `--workers 1` and `--workers 2` (or the `--workers` list): `spmdkit.data.prepare.prepare` of the same
     inputs with the same tokenizer.json: reading the files, encoding in worker processes, BOS/EOS, shards,
     index, hashes and chunk checksums, dataset.json.
2. Memory. For each size in `--sizes` (MB; default 100 and 1000): a generated JSONL (records of 1-12 stdlib files'
   text) and a single plain text file (the stdlib files one after the other), prepared by `spmdkit data prepare` in
   a fresh process (`python -c 'from spmdkit.cli.data import main ...'`, the command without the JAX start of the
   `spmdkit` entry point) with the bench's tokenizer and the default `--workers`: the peak resident memory of that
   process and its workers together (their VmRSS summed, sampled every 20 ms), the peaks of the main process and of
   the largest worker (VmHWM; `ru_maxrss` would count the bench's own memory, inherited at fork), wall time, MB/s.
   Generated files live in a temporary directory under `--work` (default /tmp) and are deleted at the end.
3. Loader. `make_data` on the dataset prepared from the smallest generated JSONL at `--seq-len` 4096 and
   `--global-batch` 64 (one process, grain's background thread as in training): tokens/s over `--batches` batches
   after one warm-up batch, documents packing with the chunk checksums checked as chunks are first read (on) and
   not (`PreparedDataset.check_chunks` made a no-op: off), and windows packing, alternately, best of `--repeats`;
   the seconds to check every chunk of the dataset once (the whole cost the checks add to an epoch) against one
   epoch's reading time; and, to say what bounds the loader, the same rows assembled in this thread without grain
   (`PackedRows[g]` x global batch + np.stack) and a plain copy of as many bytes.

Usage: python scripts/bench_data.py [--vocab 4096] [--inputs PATH ...] [--tokenizer T] [--repeats 3]
  [--sizes 100 1000] [--workers 1 2] [--json FILE]
Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = "import sys; from spmdkit.cli.data import main; sys.exit(main(sys.argv[1:]))"


def _texts(inputs: list[str]) -> list[str]:
    from spmdkit.data.prepare.inputs import Document, InputOptions, read_inputs

    texts, pieces = [], []
    for record in read_inputs(inputs, InputOptions()):
        if isinstance(record, Document):
            pieces.append(record.text)
            if record.last:
                texts.append("".join(pieces))
                pieces = []
    return texts


def tokenization(inputs: list[str], tokenizer_spec: str, vocab: int, args: argparse.Namespace, work: Path) -> dict:
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
    times: dict[str, list[float]] = {"direct": [], **{f"workers {n}": [] for n in args.workers}}
    tokens = 0
    for k in range(args.repeats):
        started = time.perf_counter()
        encodings = tokenizer.hf.encode_batch_fast(texts, add_special_tokens=False)
        times["direct"].append(time.perf_counter() - started)
        tokens = sum(len(e) for e in encodings)
        del encodings
        for n in args.workers:
            out = work / f"prepared-{n}-{k}"
            options = PrepareOptions(tuple(inputs), str(work / "tok"), str(out), progress=False, workers=n)
            started = time.perf_counter()
            prepare(options, log=lambda _: None)
            times[f"workers {n}"].append(time.perf_counter() - started)
            subprocess.run(["rm", "-rf", str(out)], check=True)
    return {
        "documents": len(texts),
        "text_mb": text_mb,
        "tokens": tokens,
        "seconds": {name: min(values) for name, values in times.items()},
        "vocab": tokenizer.vocab_size,
        "model_vocab": tokenizer.model_vocab_size,
    }


# -- memory ---------------------------------------------------------------------------------------------------


def generate(path: Path, megabytes: int, jsonl: bool, seed: int = 0) -> int:
    """A JSONL of records of 1-12 stdlib files' text, or one text file of the stdlib files one after the other,
    of about `megabytes` MB; returns its size."""
    from spmdkit.data.sources import stdlib_texts

    files = [data.decode("utf-8") for _, data in stdlib_texts() if data.strip()]
    rng = random.Random(seed)
    size, goal = 0, megabytes * 1_000_000
    with open(path, "w", encoding="utf-8") as f:
        while size < goal:
            text = "\n".join(rng.choice(files) for _ in range(rng.randint(1, 12)))
            line = json.dumps({"text": text}) + "\n" if jsonl else text + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
    return path.stat().st_size


def tree_memory(pid: int) -> dict[int, tuple[int, int]]:
    """{pid: (VmRSS, VmHWM) in bytes} of process `pid` and all its descendants now (VmHWM: its peak since exec)."""
    found, stack = {}, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            found[p] = tuple(int(status.split(f"{key}:")[1].split()[0]) * 1024 for key in ("VmRSS", "VmHWM"))
            stack += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, IndexError):
            continue
    return found


def measured_prepare(source: Path, tokenizer: Path, out: Path) -> dict:
    """`spmdkit data prepare` of `source` in a fresh process: its peak memory with its workers (VmRSS summed,
    sampled every 20 ms), the peak of the main process and of the largest worker (VmHWM), seconds."""
    argv = [sys.executable, "-c", CLI, "prepare", str(source), "--tokenizer", str(tokenizer), "--out", str(out)]
    started = time.perf_counter()
    process = subprocess.Popen([*argv, "--no-progress"], stdout=subprocess.PIPE, text=True)
    peak, hwm = 0, {}
    while process.poll() is None:
        now = tree_memory(process.pid)
        peak = max(peak, sum(rss for rss, _ in now.values()))
        hwm.update({p: max(h, hwm.get(p, 0)) for p, (_, h) in now.items()})
        time.sleep(0.02)
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"prepare of {source} failed ({process.returncode})")
    workers = [h for p, h in hwm.items() if p != process.pid]
    return {
        "peak_mb": peak / 1e6,
        "main_mb": hwm.get(process.pid, 0) / 1e6,
        "worker_mb": max(workers, default=0) / 1e6,
        "seconds": seconds,
    }


def memory(sizes: list[int], tokenizer: Path, work: Path) -> list[dict]:
    rows = []
    for megabytes in sizes:
        for jsonl in (True, False):
            source = work / (f"gen-{megabytes}.jsonl" if jsonl else f"gen-{megabytes}.txt")
            size = generate(source, megabytes, jsonl)
            out = work / f"ds-{source.name}"
            row = {"input": f"{'JSONL' if jsonl else 'one text file'}, {size / 1e6:,.0f} MB", "mb": size / 1e6}
            row.update(measured_prepare(source, tokenizer, out))
            rows.append(row)
            print(f"{row['input']}: peak {row['peak_mb']:.0f} MB, {row['seconds']:.0f} s", flush=True)
            source.unlink()
            if not (megabytes == min(sizes) and jsonl):
                subprocess.run(["rm", "-rf", str(out)], check=True)
    return rows


# -- loader ---------------------------------------------------------------------------------------------------


def _rate(dataset: str, packing: str, vocab: int, args: argparse.Namespace) -> float:
    """make_data's tokens/s over `args.batches` batches after one warm-up batch."""
    from spmdkit.data.config import DataConfig
    from spmdkit.data.stream import make_data

    stream = make_data(
        DataConfig(source=dataset, packing=packing), seq_len=args.seq_len, global_batch=args.global_batch,
        vocab_size=vocab, seed=0,
    )  # fmt: skip
    next(stream)
    started = time.perf_counter()
    for _ in range(args.batches):
        next(stream)
    return args.batches * args.global_batch * args.seq_len / (time.perf_counter() - started)


def _assemble(dataset: str, args: argparse.Namespace) -> dict:
    """The same rows assembled in this thread without grain, and a plain copy of as many bytes."""
    import numpy as np

    from spmdkit.data.packing import PackedRows
    from spmdkit.data.store import PreparedDataset

    seq_len, global_batch, batches = args.seq_len, args.global_batch, args.batches
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
    return {
        "assemble_ms": assemble * 1e3,
        "batch_mb": nbytes / 1e6,
        "copy_ms": copy * 1e3,
        "fill": rows.tokens / (rows.rows_per_epoch(0) * seq_len),  # documents packing: share of non-padding
        "assemble_tokens_s": global_batch * seq_len / assemble,
    }


def loader(dataset: str, vocab: int, args: argparse.Namespace) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the loader's arrays are numpy; no accelerator to look for
    from spmdkit.data.store import PreparedDataset

    check = PreparedDataset.check_chunks
    rates: dict[str, list[float]] = {"on": [], "off": [], "windows": []}
    for _ in range(args.repeats):
        for mode in ("on", "off", "windows"):
            PreparedDataset.check_chunks = check if mode != "off" else (lambda self, *a: None)  # type: ignore
            try:
                rates[mode].append(_rate(dataset, "windows" if mode == "windows" else "documents", vocab, args))
            finally:
                PreparedDataset.check_chunks = check  # type: ignore
    opened = PreparedDataset(dataset)
    started = time.perf_counter()
    for k, shard in enumerate(opened.meta["shards"]):
        opened.check_chunks(k, 0, shard["tokens"])
    all_chunks = time.perf_counter() - started
    best = {mode: max(values) for mode, values in rates.items()}
    epoch = opened.tokens / best["off"]
    return {**best, "all_chunks_s": all_chunks, "epoch_s": epoch, "tokens": opened.tokens, **_assemble(dataset, args)}


def report(args: argparse.Namespace, tok: dict, rows: list[dict], load: dict | None) -> None:
    mb, n = tok["text_mb"], tok["tokens"]
    print(f"\nmachine: {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.1f}")
    inputs = ", ".join(args.inputs)
    print(f"text: {inputs}: {tok['documents']} documents, {mb:.2f} MB, {n:,} tokens (vocab {tok['vocab']})")
    print("\n| tokenization | seconds | MB of text/s | tokens/s |\n|---|---|---|---|")
    for name, seconds in tok["seconds"].items():
        label = "tokenizers encode_batch_fast (its threads)" if name == "direct" else f"data prepare, {name}"
        print(f"| {label} | {seconds:.2f} | {mb / seconds:.2f} | {n / seconds:,.0f} |")
    if rows:
        print("\n| data prepare of | peak RSS, all processes | main process | largest worker | seconds | MB/s |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['input']} | {r['peak_mb']:.0f} MB | {r['main_mb']:.0f} MB | {r['worker_mb']:.0f} MB | "
                f"{r['seconds']:.0f} | {r['mb'] / r['seconds']:.2f} |"
            )
    if load:
        print(f"\n| loader, seq {args.seq_len} x global batch {args.global_batch}, documents | tokens/s |\n|---|---|")
        print(f"| chunk checksums on | {load['on']:,.0f} |\n| chunk checksums off | {load['off']:,.0f} |")
        print(f"| windows packing (checksums on) | {load['windows']:,.0f} |")
        print(f"| rows assembled in one thread, no grain | {load['assemble_tokens_s']:,.0f} |")
        print(
            f"\nchecks cost {1 - load['on'] / load['off']:.1%} of the loader's rate over {args.batches} batches; "
            f"checking every chunk of the dataset ({load['tokens']:,} tokens) takes {load['all_chunks_s']:.2f} s, "
            f"{load['all_chunks_s'] / load['epoch_s']:.1%} of one epoch's reading ({load['epoch_s']:.1f} s)"
        )
        print(
            f"documents packing fills {load['fill']:.1%} of the row slots; one batch: {load['batch_mb']:.1f} MB of "
            f"int32 fields, assembled in {load['assemble_ms']:.1f} ms; a plain copy of as many bytes: "
            f"{load['copy_ms']:.2f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", nargs="+", default=["stdlib"], help="what to tokenize (default: stdlib)")
    parser.add_argument("--tokenizer", default="", help="a tokenizer.json (default: train bpe:--vocab)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sizes", type=int, nargs="*", default=[100, 1000], help="MB of generated input")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--work", default=tempfile.gettempdir(), help="where generated files go (deleted after)")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-", dir=args.work) as work:
        tok = tokenization(args.inputs, args.tokenizer, args.vocab, args, Path(work))
        tokenizer = Path(work) / "tok" / "tokenizer.json"
        rows = memory(sorted(args.sizes), tokenizer, Path(work)) if args.sizes else []
        dataset = Path(work) / f"ds-gen-{min(args.sizes)}.jsonl" if args.sizes else None
        load = loader(str(dataset), tok["model_vocab"], args) if dataset else None
    report(args, tok, rows, load)
    if args.json:
        Path(args.json).write_text(json.dumps({"tokenization": tok, "memory": rows, "loader": load}, indent=2))


if __name__ == "__main__":
    main()
