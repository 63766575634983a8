"""`prepare(options)`: inputs -> tokenizer -> token shards + document index + `dataset.json` (the format is in
`spmdkit.data.store.format`).

The tokenizer is `bytes`, a `tokenizer.json` (or a directory holding one), or `bpe:N`, trained first on the same
inputs (one extra pass over them). Documents are encoded in batches of about `batch_bytes` of text by the Rust
tokenizer on all cores (`encode_batch_fast`, which releases the GIL), while this thread reads and parses the next
batch and writes the previous one: a progress bar on stderr, and a final throughput line. The dataset appears in
`--out` only when complete (a temporary directory beside it is renamed at the end).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from spmdkit.data.prepare.inputs import Bad, Document, InputOptions, input_bytes, read_inputs
from spmdkit.data.store import DatasetWriter
from spmdkit.data.tokenizer import Tokenizer, load_tokenizer, parse_bpe_spec, train_bpe
from spmdkit.errors import SpmdkitError

IN_FLIGHT = 2  # batches encoding at once


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
    """What `spmdkit data prepare` was asked (its flags, one for one)."""

    inputs: tuple[str, ...]
    tokenizer: str
    out: str
    glob: str = "*"
    text_key: str = "text"
    split: str = "train"
    skip_bad: bool = False
    dtype: str = "auto"
    shard_tokens: int = 1 << 28
    batch_bytes: int = 1 << 20
    progress: bool = True


class _Counter:
    """Passes documents through; raises a bad record as one line, or counts it when `skip_bad`."""

    def __init__(self, skip_bad: bool):
        self.skip_bad = skip_bad
        self.skipped: collections.Counter[str] = collections.Counter()

    def documents(self, records: Iterator[Document | Bad]) -> Iterator[Document]:
        for record in records:
            if isinstance(record, Bad):
                if not self.skip_bad:
                    raise SpmdkitError(record.message())
                self.skipped[record.kind] += 1
                continue
            yield record


def _batches(documents: Iterator[Document], batch_bytes: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for document in documents:
        batch.append(document)
        size += len(document.text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _progress(enabled: bool, total: int | None, desc: str) -> Any:
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, pipes), so an error stays the only line there
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=None if enabled else True,
    )


def resolve_tokenizer(spec: str, options: PrepareOptions, input_options: InputOptions, log: Callable) -> Tokenizer:
    """The tokenizer `--tokenizer` names; `bpe:N` is trained here on the inputs."""
    if not spec.startswith("bpe:"):
        return load_tokenizer(spec)
    vocab = parse_bpe_spec(spec)
    counter = _Counter(options.skip_bad)  # fails fast on a bad record; the encoding pass counts the skipped ones
    bar = _progress(options.progress, input_bytes(list(options.inputs), input_options), f"train {spec}")

    def texts() -> Iterator[str]:
        for document in counter.documents(read_inputs(list(options.inputs), input_options)):
            bar.update(len(document.text))
            yield document.text

    started = time.perf_counter()
    try:
        tokenizer = train_bpe(texts(), vocab)
    finally:
        bar.close()
    log(f"trained {spec} in {time.perf_counter() - started:.1f} s: {tokenizer.vocab_size:,} ids")
    return tokenizer


def check_new_directory(out: str | Path) -> None:
    """SpmdkitError unless `out` does not exist yet and could be created (its nearest existing ancestor is a
    writable directory); nothing is created. Checked before any input is read."""
    path = Path(out).expanduser().absolute()
    if path.exists():
        raise SpmdkitError(f"--out {out} already exists: choose a new directory (prepared data is never overwritten)")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise SpmdkitError(f"--out {out} lies under {existing}, which is a file: pass a new directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpmdkitError(f"--out {out} cannot be created ({existing} is not writable): pass a writable place")


def prepare(options: PrepareOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Prepare a dataset as `options` say; returns its `dataset.json` content."""
    check_new_directory(options.out)
    with tempfile.TemporaryDirectory(prefix="spmdkit-prepare-") as cache:
        input_options = InputOptions(options.glob, options.text_key, options.split, cache_dir=cache)
        inputs = list(options.inputs)
        if not inputs:
            raise SpmdkitError("no INPUT given: pass text/JSONL/Parquet files, directories, datasets or 'stdlib'")
        tokenizer = resolve_tokenizer(options.tokenizer, options, input_options, log)
        counter = _Counter(options.skip_bad)
        bar = _progress(options.progress, input_bytes(inputs, input_options), "tokenize")
        started = time.perf_counter()
        text_bytes = 0
        with DatasetWriter(options.out, tokenizer, options.dtype, options.shard_tokens) as writer:
            # Up to IN_FLIGHT batches encode at once (the Rust encoder runs without the GIL, on all cores), so a
            # batch's slowest document never leaves a core idle; this thread meanwhile reads and parses the next
            # batch and turns finished encodings into token arrays and shards, in input order.
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="tokenize")
            pending: collections.deque = collections.deque()
            try:
                for batch in _batches(counter.documents(read_inputs(inputs, input_options)), options.batch_bytes):
                    texts = [d.text for d in batch]
                    future = pool.submit(tokenizer.hf.encode_batch_fast, texts, add_special_tokens=False)
                    sizes = np.fromiter((len(t.encode("utf-8")) for t in texts), np.int64, count=len(texts))
                    keys = np.fromiter((zlib.crc32(d.name.encode()) for d in batch), np.uint32, count=len(batch))
                    pending.append((future, sizes, keys))
                    if len(pending) > IN_FLIGHT:
                        text_bytes += _write(writer, tokenizer, pending.popleft(), bar)
                while pending:
                    text_bytes += _write(writer, tokenizer, pending.popleft(), bar)
            finally:
                pool.shutdown(cancel_futures=True)
                bar.close()
            if writer.documents == 0:
                raise SpmdkitError("the inputs hold no documents (every one was empty or bad): check the INPUTs")
            seconds = time.perf_counter() - started
            skipped = dict(sorted(counter.skipped.items()))
            meta = writer.finish(
                {
                    "inputs": inputs,
                    "options": {"glob": options.glob, "text_key": options.text_key, "split": options.split},
                    "skipped": skipped,
                    "seconds": round(seconds, 3),
                }
            )
    if skipped:
        log(f"skipped {sum(skipped.values()):,} bad records ({', '.join(f'{k}: {v}' for k, v in skipped.items())})")
    log(
        f"prepared {meta['documents']:,} documents, {meta['tokens']:,} tokens from {text_bytes / 1e6:,.2f} MB of "
        f"text ({meta['tokens'] / max(text_bytes, 1):.3f} tokens/byte) into {len(meta['shards'])} shard(s) of "
        f"{meta['dtype']} in {seconds:.1f} s: {text_bytes / 1e6 / seconds:,.2f} MB/s, "
        f"{meta['tokens'] / seconds:,.0f} tokens/s -> {options.out}"
    )
    return meta


def _write(writer: DatasetWriter, tokenizer: Tokenizer, pending: tuple[Any, np.ndarray, np.ndarray], bar: Any) -> int:
    future, sizes, keys = pending
    tokens, lengths = tokenizer.documents_of(future.result())
    writer.add(tokens, lengths, sizes, keys)
    total = int(sizes.sum())
    bar.update(total)
    return total
