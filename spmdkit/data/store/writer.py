"""`DatasetWriter`: token shards, the document index and `dataset.json`, written into a temporary directory beside
the output and renamed to it at the end, so an interrupted or failed run leaves no half-written dataset behind."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from spmdkit.data.store import format as fmt
from spmdkit.data.tokenizer import Tokenizer
from spmdkit.errors import SpmdkitError


class DatasetWriter:
    """Appends batches of documents to shards of at most `shard_tokens` tokens (a longer document gets a shard of
    its own). Use as a context manager: leaving it by an exception removes the temporary directory."""

    def __init__(self, out: str | Path, tokenizer: Tokenizer, dtype: str = "auto", shard_tokens: int = 1 << 28):
        self.out = Path(out)
        if self.out.exists():
            raise SpmdkitError(
                f"--out {out} already exists: choose a new directory (prepared data is never overwritten)"
            )
        if shard_tokens < 1:
            raise SpmdkitError(f"--shard-tokens {shard_tokens} must be positive")
        self.dtype = fmt.token_dtype(tokenizer.vocab_size, dtype)
        if self.dtype not in ("uint16", "uint32"):
            raise SpmdkitError(f"--dtype {dtype}: use auto, uint16 or uint32")
        limit = np.iinfo(self.dtype).max + 1
        if tokenizer.vocab_size > limit:
            raise SpmdkitError(
                f"the tokenizer has {tokenizer.vocab_size:,} ids, more than {self.dtype} holds ({limit:,}): "
                "use --dtype uint32 (or auto)"
            )
        self.tokenizer, self.shard_tokens = tokenizer, shard_tokens
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        except OSError as error:
            raise SpmdkitError(f"cannot create --out {self.out} ({error.strerror or error})") from None
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._hash: Any = None
        self.lengths: list[np.ndarray] = []
        self.text_bytes: list[np.ndarray] = []
        self.keys: list[np.ndarray] = []
        self.tokens = self.documents = 0

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if kind is not None:
            self.abort()

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- writing ---------------------------------------------------------------------------------------------

    def _open_shard(self) -> None:
        name = fmt.shard_file(len(self.shards))
        self._file = open(self.tmp / name, "wb")
        self._hash = hashlib.sha256()
        self.shards.append({"file": name, "documents": 0, "tokens": 0})

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self.shards[-1]["sha256"] = self._hash.hexdigest()

    def add(self, tokens: np.ndarray, lengths: np.ndarray, text_bytes: np.ndarray, keys: np.ndarray) -> None:
        """Append documents: `tokens` [sum(lengths)] (each document with its BOS/EOS), `lengths`, `text_bytes`
        (UTF-8 bytes of each text) and `keys` (uint32 crc32 of each name), all [documents]."""
        self.lengths.append(np.asarray(lengths, np.int64))
        self.text_bytes.append(np.asarray(text_bytes, np.int64))
        self.keys.append(np.asarray(keys, np.uint32))
        data = np.asarray(tokens).astype(self.dtype, copy=False)
        ends = np.cumsum(lengths)
        done_docs, done_tokens = 0, 0
        while done_docs < len(lengths):
            if self._file is None:
                self._open_shard()
            shard = self.shards[-1]
            room = self.shard_tokens - shard["tokens"]
            # documents that still fit this shard; at least one in an empty shard (a document larger than a shard)
            fit = int(np.searchsorted(ends[done_docs:] - done_tokens, room, side="right"))
            if fit == 0 and shard["tokens"]:
                self._close_shard()
                continue
            fit = max(fit, 1)
            stop = int(ends[done_docs + fit - 1])
            chunk = data[done_tokens:stop].tobytes()
            self._file.write(chunk)
            self._hash.update(chunk)
            shard["documents"] += fit
            shard["tokens"] += stop - done_tokens
            done_docs, done_tokens = done_docs + fit, stop
        self.documents += len(lengths)
        self.tokens += int(ends[-1]) if len(ends) else 0

    def finish(self, info: dict[str, Any]) -> dict[str, Any]:
        """Close the last shard, write the index, the tokenizer and `dataset.json`, rename into place; returns
        what `dataset.json` holds. `info` adds `inputs`, `options`, `skipped`, `seconds` and the like."""
        self._close_shard()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        arrays = {
            "offsets": offsets,
            "bytes": np.concatenate(self.text_bytes) if self.text_bytes else np.zeros(0, np.int64),
            "keys": np.concatenate(self.keys) if self.keys else np.zeros(0, np.uint32),
        }
        index = {}
        for name, array in arrays.items():
            path = self.tmp / fmt.INDEX_FILES[name]
            np.save(path, array)
            index[name] = {"file": path.name, "sha256": fmt.file_sha256(str(path))}
        self.tokenizer.save(self.tmp)
        hashes = [s["sha256"] for s in self.shards] + [index[k]["sha256"] for k in fmt.INDEX_FILES]
        meta = {
            "format": fmt.FORMAT,
            "version": fmt.VERSION,
            "tokenizer": self.tokenizer.describe(),
            "dtype": self.dtype,
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": int(arrays["bytes"].sum()),
            "shards": self.shards,
            "index": index,
            "content_sha256": fmt.content_hash(self.dtype, self.tokenizer.sha256, hashes),
            **info,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        (self.tmp / fmt.META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(self.tmp, self.out)  # atomic on one filesystem; fails if --out appeared meanwhile
        except OSError as error:
            self.abort()
            raise SpmdkitError(f"could not move the dataset into --out {self.out}: {error.strerror}") from None
        return meta
