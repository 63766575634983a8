"""`DatasetWriter`: token shards, the document index and `dataset.json`, written into a staging directory beside
the output (`staging.Staging`) and renamed to it at the end, so an interrupted or failed run leaves no half-written
dataset behind (and the next run removes what a killed one left).

Memory stays bounded whatever the dataset's size: tokens go to the shard file as they come, the index to raw files
that become the `.npy` files at the end, and a document may arrive in pieces (`add_pieces`), its tokens written as
each piece comes. Each shard's sha256 and chunk checksums are computed by reading it back when it is closed.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import numpy as np

from spmdkit.data.store import format as fmt
from spmdkit.data.store.staging import Staging
from spmdkit.data.tokenizer import Tokenizer
from spmdkit.errors import SpmdkitError

INDEX_DTYPES = {"offsets": "int64", "bytes": "int64", "keys": "uint32"}


class DatasetWriter:
    """Appends documents to shards of at most `shard_tokens` tokens (a longer document gets a shard of its own; no
    document spans shards), in the directory of an entered `Staging`. A context manager: it closes its files; leaving
    the `Staging` without `finish` removes what was written."""

    def __init__(
        self, staging: Staging, tokenizer: Tokenizer, dtype: str = "auto", shard_tokens: int = 1 << 28,
        masked: bool = False,
    ):  # fmt: skip
        if shard_tokens < 1:
            raise SpmdkitError(f"--shard-tokens {shard_tokens} must be positive")
        # auto: uint16 when every id fits (vocab <= 65,536), else uint32
        self.dtype = ("uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32") if dtype == "auto" else dtype
        if self.dtype not in ("uint16", "uint32"):
            raise SpmdkitError(f"--dtype {dtype}: use auto, uint16 or uint32")
        limit = np.iinfo(self.dtype).max + 1
        if tokenizer.vocab_size > limit:
            raise SpmdkitError(
                f"the tokenizer has {tokenizer.vocab_size:,} ids, more than {self.dtype} holds ({limit:,}): "
                "use --dtype uint32 (or auto)"
            )
        self.tokenizer, self.shard_tokens = tokenizer, shard_tokens
        self.itemsize = np.dtype(self.dtype).itemsize
        self.chunk_tokens = fmt.CHUNK_TOKENS
        assert staging.directory is not None
        self.staging, self.tmp = staging, staging.directory
        # the document index, appended to raw files (offsets, its leading 0 first; bytes; keys), `.npy` at the end
        self._index = {name: open(self.tmp / f"{name}.raw", "wb", buffering=1 << 20) for name in INDEX_DTYPES}
        self._index["offsets"].write(np.zeros(1, np.int64).tobytes())
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self.masked = masked  # a uint8 loss mask per token beside each shard (`format.mask_file`)
        self._mask_file: Any = None
        self._open_doc: list[int] | None = None  # [start in shard, tokens, text bytes, key] of a document in pieces
        self.tokens = self.documents = self.text_bytes = 0
        self.max_token_id = -1

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in (self._file, self._mask_file, *self._index.values()):
            if f is not None:
                f.close()

    def _index_documents(self, lengths: Any, text_bytes: Any, keys: Any) -> None:
        """Append documents of `lengths` tokens (written to the shards already) to the index and the counts."""
        ends = self.tokens + np.cumsum(lengths, dtype=np.int64)
        for name, values in zip(INDEX_DTYPES, (ends, text_bytes, keys), strict=True):
            self._index[name].write(np.asarray(values, INDEX_DTYPES[name]).tobytes())
        self.documents += len(lengths)
        self.tokens += int(np.sum(lengths))
        self.text_bytes += int(np.sum(text_bytes))

    # -- shards ----------------------------------------------------------------------------------------------

    def _open_shard(self) -> None:
        name = fmt.shard_file(len(self.shards))
        self._file = open(self.tmp / name, "wb")
        self.shards.append({"file": name, "documents": 0, "tokens": 0})
        if self.masked:
            self._mask_file = open(self.tmp / fmt.mask_file(len(self.shards) - 1), "wb")

    def _close_shard(self) -> None:
        if self._file is None:
            return
        shard, mask = self.shards[-1], fmt.mask_file(len(self.shards) - 1)
        self._file.close()
        shard["sha256"], shard["chunks"] = fmt.chunk_crcs(self.tmp / shard["file"], self.itemsize, self.chunk_tokens)
        if self._mask_file is not None:
            self._mask_file.close()
            sha256, chunks = fmt.chunk_crcs(self.tmp / mask, 1, self.chunk_tokens)
            shard["mask"] = {"file": mask, "sha256": sha256, "chunks": chunks}
        self._file = self._mask_file = None

    def _write(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        if len(tokens):
            self._file.write(tokens.tobytes())
            if self._mask_file is not None:
                assert mask is not None and len(mask) == len(tokens), "a masked dataset needs a mask for each token"
                self._mask_file.write(np.asarray(mask, np.uint8).tobytes())
            self.max_token_id = max(self.max_token_id, int(tokens.max()))

    def _move_open_document(self, start: int) -> None:
        """The document in pieces that began at token `start` of the last shard does not fit there after all: move
        its tokens (copied in blocks) to a new shard, cut the old one back."""
        old = self.tmp / self.shards[-1]["file"]
        self._file.close()
        new = fmt.shard_file(len(self.shards))
        with open(old, "r+b") as f, open(self.tmp / new, "wb") as out:
            f.seek(start * self.itemsize)
            shutil.copyfileobj(f, out, 1 << 22)
            f.truncate(start * self.itemsize)
        moved = self.shards[-1]["tokens"] - start
        self.shards[-1]["tokens"] = start
        self._file = open(old, "ab")
        self._close_shard()  # hashes the shard as cut
        self.shards.append({"file": new, "documents": 0, "tokens": moved})
        self._file = open(self.tmp / new, "ab")

    # -- documents -------------------------------------------------------------------------------------------

    def add(
        self, tokens: np.ndarray, lengths: np.ndarray, text_bytes: np.ndarray, keys: np.ndarray,
        masks: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """Append whole documents: `tokens` [sum(lengths)] (each document with its BOS/EOS), `lengths`, `text_bytes`
        (UTF-8 bytes of each text) and `keys` (uint32 crc32 of each name), all [documents]; a masked writer's
        `masks` uint8 [sum(lengths)] (1: the token is a target the loss scores)."""
        assert self._open_doc is None, "a document in pieces is still open"
        lengths = np.asarray(lengths, np.int64)
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
            self._write(data[done_tokens:stop], None if masks is None else masks[done_tokens:stop])
            shard["documents"] += fit
            shard["tokens"] += stop - done_tokens
            done_docs, done_tokens = done_docs + fit, stop
        self._index_documents(lengths, text_bytes, keys)

    def add_pieces(
        self,
        tokens: np.ndarray,
        lengths: np.ndarray,
        text_bytes: np.ndarray,
        keys: np.ndarray,
        firsts: np.ndarray,
        lasts: np.ndarray,
    ) -> None:
        """Append pieces of documents, in order: piece i has `lengths[i]` tokens (BOS only on a document's first
        piece, EOS only on its last); `firsts`/`lasts` say which pieces start/end a document."""
        assert not self.masked, "a masked dataset takes whole documents (`add`)"
        whole = np.asarray(firsts, bool) & np.asarray(lasts, bool)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        k, n = 0, len(lengths)
        while k < n:
            if whole[k]:  # a run of whole documents, written at once
                j = k + (int(np.argmin(whole[k:])) if not whole[k:].all() else n - k)
                self.add(tokens[starts[k] : ends[j - 1]], lengths[k:j], text_bytes[k:j], keys[k:j])
                k = j
                continue
            if firsts[k]:
                assert self._open_doc is None, "a document in pieces is still open"
                if self._file is not None and self.shards[-1]["tokens"] >= self.shard_tokens:
                    self._close_shard()
                if self._file is None:
                    self._open_shard()
                self._open_doc = [self.shards[-1]["tokens"], 0, 0, int(keys[k])]
            assert self._open_doc is not None, "a document's middle piece came without its first"
            piece = np.asarray(tokens[starts[k] : ends[k]]).astype(self.dtype, copy=False)
            self._write(piece)
            self.shards[-1]["tokens"] += len(piece)
            self._open_doc[1] += len(piece)
            self._open_doc[2] += int(text_bytes[k])
            if lasts[k]:
                start, count, size, key = self._open_doc
                self._open_doc = None
                if start > 0 and start + count > self.shard_tokens:
                    self._move_open_document(start)
                self.shards[-1]["documents"] += 1
                self._index_documents([count], [size], [key])
            k += 1

    # -- the end ---------------------------------------------------------------------------------------------

    def finish(self, info: dict[str, Any]) -> dict[str, Any]:
        """Close the last shard, write the index, the tokenizer and `dataset.json`, rename into place; returns
        what `dataset.json` holds. `info` adds `inputs`, `options`, `skipped` and the like."""
        assert self._open_doc is None, "a document in pieces is still open"
        self._close_shard()
        index = {}
        for name, dtype in INDEX_DTYPES.items():
            self._index[name].close()
            path, raw = self.tmp / fmt.INDEX_FILES[name], self.tmp / f"{name}.raw"
            count = self.documents + 1 if name == "offsets" else self.documents
            index[name] = {"file": path.name, "sha256": fmt.write_npy(str(path), dtype, count, str(raw))}
            raw.unlink()
        self.tokenizer.save(self.tmp)
        hashes = [s["sha256"] for s in self.shards] + [index[k]["sha256"] for k in fmt.INDEX_FILES]
        hashes += [s["mask"]["sha256"] for s in self.shards if "mask" in s]  # after the rest: old hashes unchanged
        meta = {
            "format": fmt.FORMAT,
            "version": fmt.MASKED_VERSION if self.masked else fmt.VERSION,
            "tokenizer": self.tokenizer.describe(),
            "dtype": self.dtype,
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": self.text_bytes,
            "max_token_id": self.max_token_id,
            "chunk_tokens": self.chunk_tokens,
            "shards": self.shards,
            "index": index,
            "content_sha256": fmt.content_hash(self.dtype, self.tokenizer.sha256, hashes),
            **info,
        }
        (self.tmp / fmt.META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        self.staging.commit()
        return meta
