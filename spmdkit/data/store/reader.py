"""`PreparedDataset`: a prepared dataset opened for reading, checked against its `dataset.json`.

Opening checks what costs nothing (the format, every file present, each shard's size against its token count,
the index's shapes and offsets, the tokenizer file's sha256, the dtype against the vocab); `verify()` also reads
every shard and index file and compares their sha256 and the content hash (`spmdkit data verify DIR`). A mismatch is
one line naming the file and saying to prepare the dataset again.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from spmdkit.data.store import format as fmt
from spmdkit.data.tokenizer import Tokenizer, load_tokenizer
from spmdkit.errors import SpmdkitError


def is_prepared_dataset(path: str | Path) -> bool:
    return (Path(path) / fmt.META_FILE).is_file()


class PreparedDataset:
    """Documents of a prepared dataset: `lengths` int64 [documents], `keys` uint32 [documents] (eval split),
    `text_bytes` int64 [documents], `read(doc, start, stop)` -> the tokens [stop - start] of one document."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_path = self.path / fmt.META_FILE
        if not meta_path.is_file():
            hint = "it is a directory without" if self.path.is_dir() else "no such directory with"
            raise SpmdkitError(
                f"{path} is not a prepared dataset ({hint} {fmt.META_FILE}): make one with "
                f"`spmdkit data prepare INPUT... --tokenizer T --out {path}`"
            )
        try:
            self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            self._damaged(f"{meta_path} is not JSON ({error})")
        if not isinstance(self.meta, dict) or self.meta.get("format") != fmt.FORMAT:
            self._damaged(f"{meta_path} is not a {fmt.FORMAT} description")
        if self.meta.get("version") != fmt.VERSION:
            raise SpmdkitError(
                f"{meta_path} is version {self.meta.get('version')} of the format, this spmdkit reads version "
                f"{fmt.VERSION}: prepare the dataset again with this spmdkit"
            )
        try:
            self.dtype = np.dtype(self.meta["dtype"])
            self._check_files()
        except (KeyError, TypeError) as error:
            self._damaged(f"{meta_path} lacks or mangles {error}")
        self.offsets = np.load(self.path / fmt.OFFSETS_FILE, mmap_mode="r")
        self.text_bytes = np.load(self.path / fmt.BYTES_FILE, mmap_mode="r")
        self.keys = np.load(self.path / fmt.KEYS_FILE, mmap_mode="r")
        self._check_index()
        self.lengths = np.diff(self.offsets).astype(np.int64)
        counts = [s["tokens"] for s in self.meta["shards"]]
        self._shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._shards = [np.memmap(self.path / s["file"], dtype=self.dtype, mode="r") for s in self.meta["shards"]]

    def _damaged(self, what: str) -> None:
        raise SpmdkitError(f"{what}: the prepared dataset {self.path} is damaged or was changed; prepare it again")

    @property
    def documents(self) -> int:
        return int(self.meta["documents"])

    @property
    def tokens(self) -> int:
        return int(self.meta["tokens"])

    def __repr__(self) -> str:
        return f"PreparedDataset({str(self.path)!r}, documents={self.documents}, tokens={self.tokens})"

    def _check_files(self) -> None:
        """Every file present, each shard of the size its token count says, the tokenizer's hash, dtype vs vocab."""
        meta = self.meta
        tokenizer = meta["tokenizer"]
        if tokenizer["vocab_size"] > np.iinfo(self.dtype).max + 1:
            self._damaged(f"{fmt.META_FILE} says {self.dtype} shards for a vocab of {tokenizer['vocab_size']:,}")
        names = [s["file"] for s in meta["shards"]] + list(fmt.INDEX_FILES.values()) + [tokenizer["file"]]
        for name in names:
            if not (self.path / name).is_file():
                self._damaged(f"{self.path / name} is missing")
        total = 0
        for shard in meta["shards"]:
            size = (self.path / shard["file"]).stat().st_size
            if size != shard["tokens"] * self.dtype.itemsize:
                self._damaged(
                    f"{self.path / shard['file']} has {size:,} bytes, but {fmt.META_FILE} says {shard['tokens']:,} "
                    f"{self.dtype} tokens ({shard['tokens'] * self.dtype.itemsize:,} bytes)"
                )
            total += shard["tokens"]
        if total != meta["tokens"]:
            self._damaged(f"its shards hold {total:,} tokens, but {fmt.META_FILE} says {meta['tokens']:,}")
        if self._tokenizer_sha256() != tokenizer["sha256"]:
            self._damaged(f"{self.path / tokenizer['file']} is not the tokenizer {fmt.META_FILE} names (sha256)")

    def _tokenizer_sha256(self) -> str:
        import hashlib

        return hashlib.sha256((self.path / self.meta["tokenizer"]["file"]).read_bytes()).hexdigest()

    def _check_index(self) -> None:
        docs = self.meta["documents"]
        if self.offsets.shape != (docs + 1,) or self.text_bytes.shape != (docs,) or self.keys.shape != (docs,):
            self._damaged(f"its document index does not hold {docs:,} documents as {fmt.META_FILE} says")
        if docs == 0 or self.offsets[0] != 0 or self.offsets[-1] != self.meta["tokens"]:
            self._damaged(f"{fmt.OFFSETS_FILE} does not span the {self.meta['tokens']:,} tokens")
        if np.any(np.diff(self.offsets) <= 0):
            self._damaged(f"{fmt.OFFSETS_FILE} has an empty or negative document")

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The dataset's tokenizer (`tokenizer.json` + `tokenizer_config.json` of the directory), named as when it
        was prepared (e.g. "bpe:4096")."""
        tokenizer = load_tokenizer(self.path)
        tokenizer.name = self.meta["tokenizer"]["name"]
        return tokenizer

    @functools.cached_property
    def _doc_shard(self) -> np.ndarray:
        """int32 [documents]: the shard holding each document."""
        return (np.searchsorted(self._shard_starts, self.offsets[:-1], side="right") - 1).astype(np.int32)

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Tokens `start:stop` of document `doc`, as stored (uint16/uint32), without copying."""
        shard = self._doc_shard[doc]
        base = int(self.offsets[doc]) - int(self._shard_starts[shard])
        return self._shards[shard][base + start : base + stop]

    def document(self, doc: int) -> np.ndarray:
        return self.read(doc, 0, int(self.lengths[doc]))

    def verify(self) -> dict[str, Any]:
        """Read every shard and index file and compare their sha256 (and the content hash) with `dataset.json`."""
        hashes = []
        for shard in self.meta["shards"]:
            found = fmt.file_sha256(str(self.path / shard["file"]))
            if found != shard["sha256"]:
                self._damaged(f"{self.path / shard['file']} does not match its sha256 in {fmt.META_FILE}")
            hashes.append(found)
        for name in fmt.INDEX_FILES:
            entry = self.meta["index"][name]
            found = fmt.file_sha256(str(self.path / entry["file"]))
            if found != entry["sha256"]:
                self._damaged(f"{self.path / entry['file']} does not match its sha256 in {fmt.META_FILE}")
            hashes.append(found)
        content = fmt.content_hash(self.meta["dtype"], self.meta["tokenizer"]["sha256"], hashes)
        if content != self.meta["content_sha256"]:
            self._damaged(f"its content hash is not the one {fmt.META_FILE} records")
        return self.meta
