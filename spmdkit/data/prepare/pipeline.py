"""`prepare(options)`: inputs -> tokenizer -> token shards + document index + `dataset.json` (the format is in
`spmdkit.data.store.format`).

The tokenizer is `bytes`, a `tokenizer.json` (or a directory holding one), or `bpe:N`, trained first on the same
inputs (one extra pass over them, fed to the trainer in pieces of at most 64 Ki characters). Everything streams:
records are read (`inputs.py`), cut into pieces (`text.py`), gathered into batches of about `batch_bytes` of text,
tokenized by `--workers` processes (`workers.py`) and written as they come (`DatasetWriter`, into a `Staging`
directory), so memory does not grow with the input. A progress bar on stderr, and a final throughput line.

`--chat`: the records are conversations (`messages`), each rendered with the tokenizer directory's chat template
and tokenized in this process, one at a time (`chat.py`), written as whole documents with their loss mask; one
longer than `--seq-len` tokens is cut to it or dropped (`--chat-overflow`), and counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from zlib import crc32

import numpy as np

from spmdkit.data.prepare.chat import ChatError, ChatRenderer, chat_tokens, load_chat_template
from spmdkit.data.prepare.inputs import Bad, Document, InputOptions, check_inputs, input_bytes, read_inputs
from spmdkit.data.prepare.text import PIECE_CHARS, split_text
from spmdkit.data.prepare.workers import Pieces, encode, steady_heap
from spmdkit.data.store import DatasetWriter
from spmdkit.data.store.staging import Staging, check_new_directory
from spmdkit.data.tokenizer import Tokenizer, load_tokenizer, parse_bpe_spec, train_bpe
from spmdkit.errors import SpmdkitError
from spmdkit.rundir.ownership import check_output

CHAT_BATCH = 256  # conversations written at once
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
    chat: bool = False  # records are conversations (`text_key` "" means "messages" then, else "text")
    chat_template: str | None = None  # a file overriding the tokenizer directory's template
    seq_len: int = 0  # --chat: the longest conversation kept, in tokens (the training --seq-len)
    chat_overflow: str = "truncate"  # --chat: a longer conversation is cut to seq_len ("truncate") or "drop"ped

    @property
    def key(self) -> str:
        return self.text_key or ("messages" if self.chat else "text")


def _documents(records: Iterator[Document | Bad], skip_bad: bool, skipped: Counter[str]) -> Iterator[Document]:
    """The documents of `records`; a bad record is raised as one line, or counted in `skipped` when `skip_bad`."""
    for record in records:
        if isinstance(record, Document):
            yield record
        elif skip_bad:
            skipped[record.kind] += 1
        else:
            raise SpmdkitError(
                f"{record.where}: {record.reason}: fix the input or pass --skip-bad to count and skip bad records"
            )


def _pieces(documents: Iterator[Document], limit: int) -> Iterator[Document]:
    """Documents, each text longer than `limit` characters cut into pieces (`text.split_text`)."""
    for document in documents:
        pieces = split_text(document.text, limit)
        piece, first = next(pieces), document.first
        for following in pieces:
            yield Document(document.name, piece, first, False)
            piece, first = following, False
        yield Document(document.name, piece, first, document.last)


def _batches(pieces: Iterator[Document], batch_bytes: int) -> Iterator[Pieces]:
    """`pieces` in batches of about `batch_bytes` characters of text."""
    batch: list[Document] = []
    size = 0
    for piece in itertools.chain(pieces, [None]):  # None: the input ended
        if piece is not None:
            batch.append(piece)
            size += len(piece.text)
        if batch and (piece is None or size >= batch_bytes):
            firsts, lasts = np.array([p.first for p in batch], bool), np.array([p.last for p in batch], bool)
            yield Pieces(
                [p.text for p in batch], firsts, lasts, np.array([crc32(p.name.encode()) for p in batch], np.uint32)
            )
            batch, size = [], 0


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

    def texts() -> Iterator[str]:
        # fails fast on a bad record; the encoding pass counts the skipped ones
        for document in _documents(read_inputs(list(options.inputs), input_options), options.skip_bad, Counter()):
            bar.update(len(document.text))
            yield from split_text(document.text, TRAIN_PIECE_CHARS)

    started = time.perf_counter()
    with _progress(options.progress, input_bytes(list(options.inputs), input_options), f"train {spec}") as bar:
        tokenizer = train_bpe(texts(), vocab)
    log(f"trained {spec} in {time.perf_counter() - started:.1f} s: {tokenizer.vocab_size:,} ids")
    return tokenizer


WORKERS_PER_CPU = 4  # more tokenizer processes than this only add memory: each is one process on one core


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a batch job's share of the node), at least 1."""
    if hasattr(os, "process_cpu_count"):  # Python 3.13
        return os.process_cpu_count() or 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare(options: PrepareOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Prepare a dataset as `options` say; returns its `dataset.json` content."""
    inputs = list(options.inputs)
    if not inputs:
        raise SpmdkitError("no INPUT given: pass text/JSONL/Parquet files, directories, datasets or 'stdlib'")
    Staging(options.out).remove_stale()  # also when --out exists: a run killed after its rename left a lock file
    check_new_directory(options.out)
    check_output(options.out, [], "--out")  # not inside a checkpoint directory
    cpus = usable_cpus()
    if not 0 <= options.workers <= WORKERS_PER_CPU * cpus:
        raise SpmdkitError(
            f"--workers {options.workers}: pass 1 to {WORKERS_PER_CPU * cpus} ({WORKERS_PER_CPU} per CPU this process "
            f"may use, {cpus}; each worker holds its own tokenizer), or 0: one per CPU"
        )
    renderer_template = _check_chat_options(options)
    input_options = InputOptions(
        options.glob, options.key, options.split, piece_chars=options.piece_chars, chat=options.chat
    )
    steady_heap()
    for warning in check_inputs(inputs, options.out, input_options):
        print(f"spmdkit: {warning}", file=sys.stderr)
    with Staging(options.out) as staging:
        input_options = dataclasses.replace(input_options, cache_dir=str(staging.cache))
        tokenizer = resolve_tokenizer(options.tokenizer, options, input_options, log)
        skipped: Counter[str] = Counter()
        started = time.perf_counter()
        extra: dict[str, Any] = {}
        with DatasetWriter(staging, tokenizer, options.dtype, options.shard_tokens, masked=options.chat) as writer:
            bar = _progress(options.progress, input_bytes(inputs, input_options), "tokenize")
            documents = _documents(read_inputs(inputs, input_options), options.skip_bad, skipped)
            with bar:
                if options.chat:
                    renderer = ChatRenderer(renderer_template, tokenizer)
                    extra["chat"] = _write_chat(options, renderer, documents, writer, bar, skipped)
                else:
                    _write_text(options, tokenizer, documents, writer, bar, options.workers or cpus)
            if writer.documents == 0:
                raise SpmdkitError("the inputs hold no documents (every one was empty or bad): check the INPUTs")
            flags = {"glob": options.glob, "text_key": options.key, "split": options.split}
            extra |= {"inputs": inputs, "options": flags, "skipped": dict(sorted(skipped.items()))}
            meta = writer.finish(extra)
        seconds = time.perf_counter() - started
    if skipped:
        log(f"skipped {skipped.total():,} bad records ({', '.join(f'{k}: {v}' for k, v in meta['skipped'].items())})")
    if "chat" in meta:
        chat = meta["chat"]
        log(
            f"chat: {meta['documents']:,} conversations, {chat['scored_tokens']:,} assistant tokens scored "
            f"({chat['mask_rule']}); {chat['truncated']:,} truncated and {chat['dropped']:,} dropped at --seq-len "
            f"{options.seq_len} ({options.chat_overflow}), {chat['unscored']:,} dropped without an assistant token, "
            f"{chat['unscored_turns']:,} assistant turns the template renders without their content"
        )
    text_bytes = meta["bytes"]
    log(
        f"prepared {meta['documents']:,} documents, {meta['tokens']:,} tokens from {text_bytes / 1e6:,.2f} MB of "
        f"text ({meta['tokens'] / max(text_bytes, 1):.3f} tokens/byte) into {len(meta['shards'])} shard(s) of "
        f"{meta['dtype']} in {seconds:.1f} s: {text_bytes / 1e6 / seconds:,.2f} MB/s, "
        f"{meta['tokens'] / seconds:,.0f} tokens/s -> {options.out}"
    )
    return meta


def _write_text(
    options: PrepareOptions, tokenizer: Tokenizer, documents: Iterator[Document], writer: DatasetWriter, bar: Any,
    workers: int,
) -> None:  # fmt: skip
    """Cut `documents` into pieces, tokenize them in `workers` processes and write them, in input order."""
    batches = _batches(_pieces(documents, options.piece_chars), options.batch_bytes)
    with contextlib.closing(encode(tokenizer, workers, writer.dtype, batches)) as encoded:
        for done in encoded:  # in input order, from worker processes
            writer.add_pieces(done.tokens, done.lengths, done.text_bytes, done.keys, done.firsts, done.lasts)
            bar.update(int(done.text_bytes.sum()))


def _check_chat_options(options: PrepareOptions) -> str | None:
    """The chat template of a `--chat` prepare (None without `--chat`), after checking the chat flags."""
    if not options.chat:
        if options.chat_template or options.seq_len:
            raise SpmdkitError("--chat-template and --seq-len are for conversations: add --chat")
        return None
    if options.tokenizer.startswith("bpe:"):
        raise SpmdkitError("--chat renders with a model's tokenizer and template: pass --tokenizer MODEL_DIR")
    if options.seq_len < 2:
        raise SpmdkitError("--chat needs --seq-len N (the training --seq-len; longer conversations are cut or dropped)")
    if options.chat_overflow not in ("truncate", "drop"):
        raise SpmdkitError(f"--chat-overflow {options.chat_overflow}: use truncate or drop")
    if options.workers > 1:
        raise SpmdkitError("--chat renders and tokenizes in this process: leave out --workers")
    return load_chat_template(options.tokenizer, options.chat_template)


def _write_chat(
    options: PrepareOptions, renderer: ChatRenderer, documents: Iterator[Document], writer: DatasetWriter, bar: Any,
    skipped: Counter[str],
) -> dict[str, Any]:  # fmt: skip
    """Render, tokenize and write every conversation of `documents` with its loss mask; returns `dataset.json`'s
    `chat` entry (the counts)."""
    counts: Counter[str] = Counter(truncated=0, dropped=0, unscored=0)
    batch: list[tuple[str, str, np.ndarray, np.ndarray]] = []
    scored = 0

    def flush() -> None:
        if batch:
            ids = np.concatenate([b[2] for b in batch])
            writer.add(
                ids, np.array([len(b[2]) for b in batch]), np.array([len(b[1].encode()) for b in batch]),
                np.array([crc32(b[0].encode()) for b in batch], np.uint32), np.concatenate([b[3] for b in batch]),
            )  # fmt: skip
            batch.clear()

    conversations = ((d.name, d.messages or []) for d in documents)
    for item in chat_tokens(renderer, conversations, options.seq_len, options.chat_overflow, counts):
        if isinstance(item[1], ChatError):
            if not options.skip_bad:
                raise SpmdkitError(f"{item[0]}: {item[1]}: fix the conversation or pass --skip-bad to skip it")
            skipped["template"] += 1
            continue
        batch.append(item)  # type: ignore[arg-type]
        scored += int(item[3][1:].sum())  # type: ignore[index]
        bar.update(len(item[1]))
        if len(batch) >= CHAT_BATCH:
            flush()
    flush()
    rule = "generation blocks" if renderer.has_generation else "assistant content spans"
    template_sha = hashlib.sha256(renderer.source.encode()).hexdigest()
    return {
        "template_sha256": template_sha, "mask_rule": rule, "max_tokens": options.seq_len,
        "overflow": options.chat_overflow, "scored_tokens": scored, **counts, "unscored_turns": renderer.unscored_turns,
    }  # fmt: skip
