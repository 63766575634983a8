"""`PreparedDataset`: a prepared dataset opened for reading, checked against its `dataset.json`.

Opening checks what costs little, whatever the dataset's size: the format, every file name a plain name inside
the directory (no absolute path, no `..`, no symlink leading out), every file present, each shard entry's fields,
each shard's size against its token count and the dtype, the chunk checksum lists against the shard sizes, the
index's shapes and offsets, the tokenizer file's sha256, the dtype against the vocab. Reading checks the rest as it
goes: the first `read` touching a chunk of a shard (`format.CHUNK_TOKENS` tokens) checks that chunk's crc32, and a
damaged chunk stops the run with one line naming the shard and the offset. `verify()` reads every shard and index
file and compares their sha256, every chunk's crc32 and the content hash (`spmdkit data verify DIR`).
`check_vocabulary(dataset, vocab_size)` refuses a model vocabulary that does not hold the dataset's largest token id.
A mismatch is one line naming the file and saying to prepare the dataset again. Datasets written before the chunk
checksums and `max_token_id` get every other check. A masked dataset (`has_mask`, `data prepare --chat`) also has
its mask files checked (names, sizes; `verify`: sha256), and `read_mask` reads them.
"""

from __future__ import annotations

import functools
import json
import zlib
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
    `text_bytes` int64 [documents], `read(doc, start, stop)` -> the tokens [stop - start] of one document;
    `has_mask` and `read_mask(doc, start, stop)` -> its loss mask (uint8) where the dataset has one."""

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
        if self.meta.get("version") not in fmt.VERSIONS:
            raise SpmdkitError(
                f"{meta_path} is version {self.meta.get('version')} of the format, this spmdkit reads versions "
                f"{', '.join(map(str, fmt.VERSIONS))}: prepare the dataset again with this spmdkit"
            )
        try:
            if self.meta["dtype"] not in ("uint16", "uint32"):
                self._damaged(f"{fmt.META_FILE} says dtype {self.meta['dtype']!r}, not uint16 or uint32")
            self.dtype = np.dtype(self.meta["dtype"])
            self._check_names()
            self._check_files()
            self._chunk_tokens = self._check_chunk_lists()
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            self._damaged(f"{meta_path} lacks or mangles {error}")
        self.offsets, self.text_bytes, self.keys = (self._index_array(name) for name in fmt.INDEX_FILES.values())
        self._check_index()
        self.documents, self.tokens = int(self.meta["documents"]), int(self.meta["tokens"])
        self.lengths = np.diff(self.offsets).astype(np.int64)
        counts = [s["tokens"] for s in self.meta["shards"]]
        self._shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        shards = self.meta["shards"]
        # per shard, then per mask file: its entry, its mapped tokens (mask bytes), which chunks were checked (the
        # first read of a chunk checks it), and how many are left
        self._entries = [*shards, *(s["mask"] for s in shards if self.has_mask)]
        self._arrays = [np.memmap(self.path / s["file"], dtype=self.dtype, mode="r") for s in shards] + [
            np.memmap(self.path / s["mask"]["file"], dtype=np.uint8, mode="r") if s["tokens"] else np.zeros(0, np.uint8)
            for s in shards if self.has_mask
        ]  # fmt: skip
        self._checked = [bytearray(len(e.get("chunks", ()))) for e in self._entries]
        self._unchecked = [len(c) for c in self._checked]

    def _index_array(self, name: str) -> np.ndarray:
        """One of the document index's `.npy` arrays, mapped; never unpickled (`np.load` refuses objects)."""
        try:
            array = np.load(self.path / name, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as error:
            self._damaged(f"{name} is not a plain numeric .npy array ({error})")
        if array.dtype.kind not in "iu":
            self._damaged(f"{name} holds {array.dtype} values, not the integers `data prepare` writes")
        return array

    def _damaged(self, what: str) -> None:
        raise SpmdkitError(f"{what}: the prepared dataset {self.path} is damaged or was changed; prepare it again")

    def __repr__(self) -> str:
        return f"PreparedDataset({str(self.path)!r}, documents={self.documents}, tokens={self.tokens})"

    def _check_names(self) -> None:
        """Every file `dataset.json` names is a plain name inside the directory and present; shard entries are well
        formed."""
        meta = self.meta
        if not isinstance(meta["shards"], list) or not meta["shards"]:
            self._damaged(f"{fmt.META_FILE} lists no shards")
        fields = {"file": str, "tokens": int, "documents": int, "sha256": str}
        for k, shard in enumerate(meta["shards"]):
            entry = shard if isinstance(shard, dict) else {}
            bad = [f for f, kind in fields.items() if not isinstance(entry.get(f), kind)]
            if bad or shard["tokens"] < 0 or shard["documents"] < 0:
                self._damaged(f"{fmt.META_FILE} shard {k} lacks or mangles {', '.join(bad) or 'its counts'}")
        index = [e["file"] for e in meta["index"].values()]
        if index != [meta["index"][k]["file"] for k in fmt.INDEX_FILES]:
            self._damaged(f"{fmt.META_FILE} has another index than {', '.join(fmt.INDEX_FILES.values())}")
        masked = ["mask" in s for s in meta["shards"]]
        if any(masked) and not all(masked):
            self._damaged(f"{fmt.META_FILE} gives a loss mask to some shards only")
        self.has_mask = all(masked)
        if self.has_mask != (meta["version"] == fmt.MASKED_VERSION):
            self._damaged(
                f"{fmt.META_FILE} is version {meta['version']} but its shards {'have' if any(masked) else 'lack'} masks"
            )
        masks = [s["mask"]["file"] for s in meta["shards"]] if self.has_mask else []
        root = self.path.resolve()
        for name in [*(s["file"] for s in meta["shards"]), *index, *masks, meta["tokenizer"]["file"]]:
            path = Path(name) if isinstance(name, str) else None
            if path is None or path.is_absolute() or ".." in path.parts or not name:
                self._damaged(f"{fmt.META_FILE} names the file {name!r}, which is not a plain name inside the dataset")
            real = (self.path / path).resolve()
            if root not in real.parents:
                self._damaged(f"{self.path / path} leads outside the dataset (to {real})")
            if not real.is_file():
                self._damaged(f"{self.path / name} is missing")

    def _check_chunk_lists(self) -> int:
        """`chunk_tokens` (0 for a dataset without chunk checksums) and each shard's list of them against its size."""
        if "chunk_tokens" not in self.meta:
            return 0
        chunk = self.meta["chunk_tokens"]
        if not isinstance(chunk, int) or chunk < 1:
            self._damaged(f"{fmt.META_FILE} says chunk_tokens {chunk!r}")
        for shard in self.meta["shards"]:
            for entry in (shard, shard["mask"]) if self.has_mask else (shard,):
                chunks = entry.get("chunks")
                if not isinstance(chunks, list) or len(chunks) != -(-shard["tokens"] // chunk):
                    self._damaged(f"{fmt.META_FILE} has no chunk checksum list of {self.path / entry['file']}'s size")
        return chunk

    def _check_files(self) -> None:
        """Each shard of the size its token count says, the tokenizer's hash, dtype vs vocab."""
        meta = self.meta
        tokenizer = meta["tokenizer"]
        if tokenizer["vocab_size"] > np.iinfo(self.dtype).max + 1:
            self._damaged(f"{fmt.META_FILE} says {self.dtype} shards for a vocab of {tokenizer['vocab_size']:,}")
        total = 0
        for shard in meta["shards"]:
            size = (self.path / shard["file"]).stat().st_size
            if size != shard["tokens"] * self.dtype.itemsize:
                self._damaged(
                    f"{self.path / shard['file']} has {size:,} bytes, but {fmt.META_FILE} says {shard['tokens']:,} "
                    f"{self.dtype} tokens ({shard['tokens'] * self.dtype.itemsize:,} bytes)"
                )
            if self.has_mask and (self.path / shard["mask"]["file"]).stat().st_size != shard["tokens"]:
                self._damaged(f"{self.path / shard['mask']['file']} does not hold one byte per token of its shard")
            total += shard["tokens"]
        if total != meta["tokens"]:
            self._damaged(f"its shards hold {total:,} tokens, but {fmt.META_FILE} says {meta['tokens']:,}")
        if fmt.file_sha256(str(self.path / tokenizer["file"])) != tokenizer["sha256"]:
            self._damaged(f"{self.path / tokenizer['file']} is not the tokenizer {fmt.META_FILE} names (sha256)")

    def _check_index(self) -> None:
        docs = self.meta["documents"]
        if self.offsets.shape != (docs + 1,) or self.text_bytes.shape != (docs,) or self.keys.shape != (docs,):
            self._damaged(f"its document index does not hold {docs:,} documents as {fmt.META_FILE} says")
        if docs == 0 or self.offsets[0] != 0 or self.offsets[-1] != self.meta["tokens"]:
            self._damaged(f"{fmt.INDEX_FILES['offsets']} does not span the {self.meta['tokens']:,} tokens")
        if np.any(np.diff(self.offsets) <= 0):
            self._damaged(f"{fmt.INDEX_FILES['offsets']} has an empty or negative document")

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
        """Tokens `start:stop` of document `doc`, as stored (uint16/uint32), without copying; the first read of a
        chunk checks its checksum (`check_chunks`)."""
        return self._read(doc, start, stop, mask=False)

    def read_mask(self, doc: int, start: int, stop: int) -> np.ndarray:
        """uint8 [stop - start]: the loss mask of tokens `start:stop` of document `doc` (a masked dataset's)."""
        return self._read(doc, start, stop, mask=True)

    def _read(self, doc: int, start: int, stop: int, mask: bool) -> np.ndarray:
        shard = int(self._doc_shard[doc])
        base = int(self.offsets[doc]) - int(self._shard_starts[shard])
        index = shard + len(self.meta["shards"]) * mask  # a mask file's checksums follow the shards'
        if self._unchecked[index] and stop > start:  # nothing to do once every chunk of the file was checked
            self.check_chunks(index, base + start, base + stop)
        return self._arrays[index][base + start : base + stop]

    def check_chunks(self, shard: int, start: int, stop: int) -> None:
        """Check the crc32 of each chunk of shard `shard` (a mask file: the shard count + its shard) that tokens
        `start:stop` touch and that was not checked yet: a mismatch is one line naming the file and the offset.
        Nothing for a dataset without checksums."""
        if not self._chunk_tokens:
            return
        size, checked = self._chunk_tokens, self._checked[shard]
        entry, array = self._entries[shard], self._arrays[shard]
        for c in range(start // size, (stop - 1) // size + 1):
            if checked[c]:
                continue
            if zlib.crc32(array[c * size : (c + 1) * size]) != entry["chunks"][c]:
                self._damaged(
                    f"{self.path / entry['file']} is damaged at token offset {c * size:,} (byte "
                    f"{c * size * array.dtype.itemsize:,}): chunk {c} does not match its crc32 in {fmt.META_FILE}"
                )
            checked[c] = 1
            self._unchecked[shard] -= 1

    def document(self, doc: int) -> np.ndarray:
        return self.read(doc, 0, int(self.lengths[doc]))

    def verify(self) -> dict[str, Any]:
        """Read every shard and index file and compare their sha256 (and the content hash) with `dataset.json`."""
        shards, hashes = self.meta["shards"], []
        index = [self.meta["index"][name] for name in fmt.INDEX_FILES]
        # the order of the content hash: the shards, the index files, then the mask files (`self._entries[k]`)
        for item in [*range(len(shards)), *index, *range(len(shards), len(self._entries))]:
            entry = item if isinstance(item, dict) else self._entries[item]
            if not isinstance(item, dict):  # a shard or mask file: every chunk's crc32 first
                self._checked[item] = bytearray(len(self._checked[item]))
                self._unchecked[item] = len(self._checked[item])
                self.check_chunks(item, 0, shards[item % len(shards)]["tokens"])
            hashes.append(fmt.file_sha256(str(self.path / entry["file"])))
            if hashes[-1] != entry["sha256"]:
                self._damaged(f"{self.path / entry['file']} does not match its sha256 in {fmt.META_FILE}")
        content = fmt.content_hash(self.meta["dtype"], self.meta["tokenizer"]["sha256"], hashes)
        if content != self.meta["content_sha256"]:
            self._damaged(f"its content hash is not the one {fmt.META_FILE} records")
        return self.meta


def check_vocabulary(dataset: PreparedDataset, vocab_size: int) -> None:
    """SpmdkitError (one line) unless a model with `vocab_size` embedding rows holds every token id of `dataset`:
    its `max_token_id` (recorded at prepare time; older datasets: the tokenizer's largest id). Call it before the
    first step (`make_data` does, for every prepared dataset it reads)."""
    tokenizer = dataset.meta["tokenizer"]
    largest = dataset.meta.get("max_token_id", tokenizer["vocab_size"] - 1)
    if not isinstance(largest, int) or largest >= np.iinfo(dataset.dtype).max + 1:
        dataset._damaged(f"{fmt.META_FILE} says max_token_id {largest!r}")
    if largest >= vocab_size:
        need = max(tokenizer["model_vocab_size"], largest + 1)
        raise SpmdkitError(
            f"the prepared dataset {dataset.path} holds token id {largest:,}, but the model's vocabulary has "
            f"{vocab_size:,} ids: use a model vocab_size of at least {need:,} (its tokenizer is {tokenizer['name']}) "
            "or prepare the data with the model's tokenizer"
        )
