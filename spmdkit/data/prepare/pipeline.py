"""`prepare(options)`: inputs -> tokenizer -> token shards + document index + `dataset.json` (the format is in
`spmdkit.data.store.format`).

The tokenizer is `bytes`, a `tokenizer.json` (or a directory holding one), or `bpe:N`, trained first on the same
inputs (one extra pass over them, fed to the trainer in pieces of at most 64 Ki characters). Everything streams:
records are read, cut into pieces (a plain text file is read in pieces of `piece_chars` characters, and so is any
longer text: `text.py`), gathered into batches of about `batch_bytes` of text, tokenized by `--workers` processes
(`workers.py`, results in input order: the same bytes for any worker count) and written as they come
(`DatasetWriter`), so memory does not grow with the input. A progress bar on stderr, and a final throughput line.
The dataset appears in `--out` only when complete, and a run killed midway is cleaned up by the next one
(`spmdkit.data.store.staging`). `inputs.check_inputs` refuses an input given twice and an `--out` inside an input.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from spmdkit.data.prepare.inputs import Bad, Document, InputOptions, check_inputs, input_bytes, read_inputs
from spmdkit.data.prepare.text import PIECE_CHARS, split_text
from spmdkit.data.prepare.workers import Encoded, Encoder, Pieces, steady_heap
from spmdkit.data.store import DatasetWriter
from spmdkit.data.store.staging import Staging
from spmdkit.data.tokenizer import Tokenizer, load_tokenizer, parse_bpe_spec, train_bpe
from spmdkit.errors import SpmdkitError

TRAIN_PIECE_CHARS = 1 << 16  # the BPE trainer buffers 256 texts at a time: pieces keep that small


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
    piece_chars: int = PIECE_CHARS  # longer texts are encoded in pieces of at most this many characters
    progress: bool = True
    workers: int = 0  # tokenizer processes; 0: one per CPU core


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


def _pieces(documents: Iterator[Document], limit: int) -> Iterator[Document]:
    """Documents, each text longer than `limit` characters cut into pieces (`text.split_text`)."""
    for document in documents:
        if len(document.text) <= limit:
            yield document
            continue
        pieces = split_text(document.text, limit)
        piece = next(pieces)
        first = document.first
        for following in pieces:
            yield Document(document.name, piece, first, False)
            piece, first = following, False
        yield Document(document.name, piece, first, document.last)


def _batches(pieces: Iterator[Document], batch_bytes: int) -> Iterator[Pieces]:
    batch: list[Document] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= batch_bytes:
            yield _batch(batch)
            batch, size = [], 0
    if batch:
        yield _batch(batch)


def _batch(pieces: list[Document]) -> Pieces:
    return Pieces(
        [p.text for p in pieces],
        np.fromiter((p.first for p in pieces), bool, count=len(pieces)),
        np.fromiter((p.last for p in pieces), bool, count=len(pieces)),
        np.fromiter((zlib.crc32(p.name.encode()) for p in pieces), np.uint32, count=len(pieces)),
    )


def _progress(enabled: bool, total: int | None, desc: str) -> Any:
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, pipes), so an error stays the only line there
    disable = None if enabled else True
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, disable=disable)


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
            yield from split_text(document.text, TRAIN_PIECE_CHARS)

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
    inputs = list(options.inputs)
    if not inputs:
        raise SpmdkitError("no INPUT given: pass text/JSONL/Parquet files, directories, datasets or 'stdlib'")
    Staging(options.out).remove_stale()  # also when --out exists: a run killed after its rename left a lock file
    check_new_directory(options.out)
    if options.workers < 0:
        raise SpmdkitError(f"--workers {options.workers}: pass a positive number (0: one per CPU core)")
    input_options = InputOptions(options.glob, options.text_key, options.split, piece_chars=options.piece_chars)
    steady_heap()
    for warning in check_inputs(inputs, options.out, input_options):
        print(f"spmdkit: {warning}", file=sys.stderr)
    with Staging(options.out) as staging:
        input_options = dataclasses.replace(input_options, cache_dir=str(staging.cache))
        tokenizer = resolve_tokenizer(options.tokenizer, options, input_options, log)
        counter = _Counter(options.skip_bad)
        started = time.perf_counter()
        with DatasetWriter(options.out, tokenizer, options.dtype, options.shard_tokens, staging) as writer:
            _tokenize(writer, tokenizer, counter, input_options, options)
            if writer.documents == 0:
                raise SpmdkitError("the inputs hold no documents (every one was empty or bad): check the INPUTs")
            skipped = dict(sorted(counter.skipped.items()))
            flags = {"glob": options.glob, "text_key": options.text_key, "split": options.split}
            meta = writer.finish({"inputs": inputs, "options": flags, "skipped": skipped})
        seconds = time.perf_counter() - started
    if skipped:
        log(f"skipped {sum(skipped.values()):,} bad records ({', '.join(f'{k}: {v}' for k, v in skipped.items())})")
    text_bytes = meta["bytes"]
    log(
        f"prepared {meta['documents']:,} documents, {meta['tokens']:,} tokens from {text_bytes / 1e6:,.2f} MB of "
        f"text ({meta['tokens'] / max(text_bytes, 1):.3f} tokens/byte) into {len(meta['shards'])} shard(s) of "
        f"{meta['dtype']} in {seconds:.1f} s: {text_bytes / 1e6 / seconds:,.2f} MB/s, "
        f"{meta['tokens'] / seconds:,.0f} tokens/s -> {options.out}"
    )
    return meta


def _tokenize(
    writer: DatasetWriter, tokenizer: Tokenizer, counter: _Counter, input_options: InputOptions, options: PrepareOptions
) -> None:
    """Read, cut, batch, encode (in worker processes, in order) and write every document of the inputs."""
    inputs = list(options.inputs)
    bar = _progress(options.progress, input_bytes(inputs, input_options), "tokenize")
    documents = counter.documents(read_inputs(inputs, input_options))
    workers = options.workers or os.cpu_count() or 1
    try:
        with Encoder(tokenizer, workers, writer.dtype) as encoder:
            for batch in _batches(_pieces(documents, options.piece_chars), options.batch_bytes):
                for done in encoder.submit(batch):
                    _write(writer, done, bar)
            for done in encoder.drain():
                _write(writer, done, bar)
    finally:
        bar.close()


def _write(writer: DatasetWriter, done: Encoded, bar: Any) -> None:
    writer.add_pieces(done.tokens, done.lengths, done.text_bytes, done.keys, done.firsts, done.lasts)
    bar.update(int(done.text_bytes.sum()))
