"""Tokenization in worker processes, in input order: `encode(tokenizer, workers, dtype, batches)`.

Batches of pieces (`Pieces`: texts with first/last flags) are submitted in input order and their results
(`Encoded`) come back in that order, whatever the number of workers, so the output bytes do not depend on it. Each
worker is a fresh Python running `main` (nothing of the parent's threads, locks or main module is
inherited; it exits when its stdin ends, also when the parent is killed) that holds the tokenizer and encodes one
batch at a time on one core (`TOKENIZERS_PARALLELISM=false`): N workers use N cores.
At most `2 x workers` batches are in flight, which bounds memory (the Rust encoder needs ~100+ bytes per token of
the batch it encodes). The pool starts with the second batch: an input of one batch is encoded in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from spmdkit.data.tokenizer import Tokenizer
from spmdkit.data.tokenizer.builtin import BYTES_NAME
from spmdkit.errors import SpmdkitError


@dataclasses.dataclass
class Pieces:
    """A batch: texts of documents or of pieces of documents, with their names' crc32 `keys`."""

    texts: list[str]
    firsts: np.ndarray  # bool: the piece starts its document (gets BOS)
    lasts: np.ndarray  # bool: the piece ends its document (gets EOS)
    keys: np.ndarray  # uint32


@dataclasses.dataclass
class Encoded:
    tokens: np.ndarray  # dtype of the dataset [sum(lengths)]
    lengths: np.ndarray  # int64 [pieces], BOS/EOS included
    text_bytes: np.ndarray  # int64 [pieces]
    keys: np.ndarray
    firsts: np.ndarray
    lasts: np.ndarray


def steady_heap() -> None:
    """Keep this process's resident memory flat however long it streams: glibc raises its mmap threshold whenever a
    large block is freed, after which blocks of a few MB (reads, token arrays) come from the heap, which fragments
    and grows with the input (200 MB of text: +150 MB). A fixed threshold (128 KiB) stops that. glibc only."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(-3, 1 << 17)  # M_MMAP_THRESHOLD


def encode_pieces(tokenizer: Tokenizer, pieces: Pieces, dtype: str) -> Encoded:
    """The tokens of each piece (`[BOS]` on first pieces, `[EOS]` on last ones), concatenated."""
    if tokenizer.name == BYTES_NAME:  # its ids are the UTF-8 bytes (`builtin`): the same ids, without the encoder
        ids = [np.frombuffer(t.encode("utf-8"), np.uint8).astype(dtype) for t in pieces.texts]
    else:
        encodings = tokenizer.hf.encode_batch_fast(pieces.texts, add_special_tokens=False)
        ids = [np.asarray(e.ids, dtype) for e in encodings]
    bos = np.asarray(tokenizer.bos, dtype)
    eos = np.asarray(tokenizer.eos, dtype)
    parts = []
    for first, last, piece in zip(pieces.firsts, pieces.lasts, ids, strict=True):
        parts.extend(((bos if first else bos[:0]), piece, (eos if last else eos[:0])))
    lengths = np.fromiter((len(x) for x in ids), np.int64, count=len(ids))
    lengths += len(bos) * pieces.firsts + len(eos) * pieces.lasts
    text_bytes = np.fromiter((len(t.encode("utf-8")) for t in pieces.texts), np.int64, count=len(ids))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype)
    return Encoded(tokens, lengths, text_bytes, pieces.keys, pieces.firsts, pieces.lasts)


class _Worker:
    """One worker process (`main`): batches in on its stdin, results out on its stdout
    (length-prefixed pickles); a thread writes the batches, so that neither side blocks the other."""

    def __init__(self, tokenizer: Tokenizer, dtype: str):
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")  # one core per worker: N workers, N cores
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from spmdkit.data.prepare.workers import main; main()"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env,
        )  # fmt: skip
        self.inbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._feed, daemon=True, name="tokenize-feed")
        self.thread.start()
        self.inbox.put((tokenizer.json_text, tokenizer.name, tokenizer.config, dtype))

    def _feed(self) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        with contextlib.suppress(OSError):  # the worker died: `receive` says so
            while (item := self.inbox.get()) is not None:
                _send(stdin, item)
            stdin.close()

    def receive(self) -> Encoded:
        assert self.process.stdout is not None
        try:
            return _receive(self.process.stdout)
        except EOFError:
            raise SpmdkitError(
                f"a tokenizer worker process died (exit status {self.process.wait()}; out of memory?): try fewer "
                "--workers"
            ) from None

    def stop(self) -> None:
        self.inbox.put(None)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdout, self.process.stdin):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _send(stream: Any, item: Any) -> None:
    data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: Any) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def encode(tokenizer: Tokenizer, workers: int, dtype: str, batches: Iterator[Pieces]) -> Iterator[Encoded]:
    """The `Encoded` of each of `batches`, in input order: batch k goes to worker k mod N and its result is read back
    in turn. Close the generator (or exhaust it) to stop the workers."""
    first, second = next(batches, None), next(batches, None)
    if second is None:
        if first is not None:
            yield encode_pieces(tokenizer, first, dtype)
        return
    workers = max(1, workers)
    pool = [_Worker(tokenizer, dtype) for _ in range(workers)]
    sent = received = 0
    try:
        for pieces in itertools.chain([first, second], batches, [None]):  # None: the input ended, drain the rest
            if pieces is not None:
                pool[sent % workers].inbox.put(pieces)
                sent += 1
            while received < sent and (pieces is None or sent - received > 2 * workers):
                yield pool[received % workers].receive()
                received += 1
    finally:
        for worker in pool:
            worker.stop()


def main() -> None:
    """A worker: the tokenizer first, then batches until its stdin ends; the results in the same order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it stops the workers)
    steady_heap()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    with contextlib.suppress(EOFError, BrokenPipeError):  # the parent is done (or gone)
        json_text, name, config, dtype = _receive(stdin)
        tokenizer = Tokenizer(json_text, name=name, config=config)
        while True:
            _send(stdout, encode_pieces(tokenizer, _receive(stdin), dtype))
