"""The on-disk format of a prepared dataset (what `spmdkit data prepare` writes and `--data DIR` reads).

```
DIR/dataset.json            what is here (below); written last, so a directory with it is complete
DIR/tokenizer.json          the tokenizer, byte for byte as given (or as trained: bpe:N; built: bytes)
DIR/tokenizer_config.json   its BOS/EOS (the model directory's own file when it had one)
DIR/tokens-00000.bin ...    token shards: raw little-endian uint16 (vocab <= 65,536) or uint32, nanoGPT style;
                            documents back to back, each [BOS] + text tokens + [EOS]; no document spans shards
DIR/documents.npy           int64 [documents + 1]: document i is tokens [offsets[i], offsets[i+1]) of the shards
                            read as one stream
DIR/document_bytes.npy      int64 [documents]: UTF-8 bytes of each document's text
DIR/document_keys.npy       uint32 [documents]: crc32 of each document's name (file path, `file:line`, ...): the
                            eval split, `is_eval`
DIR/mask-00000.bin ...      only in a dataset with a loss mask (`data prepare --chat`): uint8, one per token of the
                            shard of the same number; 1 where the token is a target the loss scores (an assistant
                            turn's), 0 elsewhere. Without these files every target is scored.
```

`dataset.json`: `format`, `version` (1; 2 with mask files), `tokenizer` (name, file, sha256, vocab_size,
model_vocab_size, bos_id, eos_id, special_ids), `dtype`, `documents`, `tokens`, `bytes` (of text), `max_token_id`
(the largest id in the shards), `chunk_tokens` (CHUNK_TOKENS), `shards` ([{file, documents, tokens, sha256,
chunks}]: `chunks` the crc32 of each `chunk_tokens` tokens of the shard, the last one shorter; `mask`: {file,
sha256, chunks} of its mask file, in a masked dataset), `index` ({offsets|bytes|keys: {file, sha256}}),
`content_sha256` (sha256 of the dtype, the tokenizer's sha256 and every shard's and index file's sha256, in order,
then every mask file's: equal for equal datasets), `inputs`, `options`, `skipped` ({kind: count} of the bad records
`--skip-bad` skipped); a chat dataset adds `chat` (its template's sha256, the mask rule, `max_tokens` and the
counts of truncated, dropped and unscored conversations).
The same inputs and flags give the same bytes in every file, `dataset.json` included (no time stamps), whatever
`--workers` and whether an earlier run was killed.

Every file name in `dataset.json` is a plain name inside DIR (no absolute path, no `..`, no symlink leading out).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import zlib
from collections.abc import Iterable

import numpy as np

FORMAT = "spmdkit-prepared-dataset"
VERSION = 1
MASKED_VERSION = 2  # a dataset with loss masks: a reader of version 1 only refuses it rather than ignore its masks
VERSIONS = (VERSION, MASKED_VERSION)
META_FILE = "dataset.json"
INDEX_FILES = {"offsets": "documents.npy", "bytes": "document_bytes.npy", "keys": "document_keys.npy"}
CHUNK_TOKENS = 1 << 20  # tokens per checksummed chunk of a shard (2 MiB of uint16)
EVAL_BUCKETS = 10_000  # the same rule as the stdlib source's eval files: crc32(name) % 10,000 < fraction x 10,000


def shard_file(index: int) -> str:
    return f"tokens-{index:05d}.bin"


def mask_file(index: int) -> str:
    return f"mask-{index:05d}.bin"


def is_eval(keys: np.ndarray, eval_fraction: float) -> np.ndarray:
    """bool [documents]: which documents (by their name's crc32) form the eval split."""
    return np.asarray(keys, np.uint32) % EVAL_BUCKETS < round(eval_fraction * EVAL_BUCKETS)


def content_hash(dtype: str, tokenizer_sha256: str, file_hashes: Iterable[str]) -> str:
    digest = hashlib.sha256(f"{FORMAT}/{VERSION}/{dtype}/{tokenizer_sha256}".encode())
    for h in file_hashes:
        digest.update(h.encode())
    return digest.hexdigest()


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def chunk_crcs(path: str | os.PathLike, itemsize: int, chunk_tokens: int = CHUNK_TOKENS) -> tuple[str, list[int]]:
    """(sha256, [crc32 of each chunk of `chunk_tokens` tokens]) of a shard file, read once in chunks."""
    digest, crcs = hashlib.sha256(), []
    with open(path, "rb") as f:
        while block := f.read(chunk_tokens * itemsize):
            digest.update(block)
            crcs.append(zlib.crc32(block))
    return digest.hexdigest(), crcs


def write_npy(path: str, dtype: str, count: int, raw: str) -> str:
    """Write `path` as `np.save` writes a 1-D array of `count` `dtype` items whose bytes are the file `raw` (copied
    in blocks); returns its sha256."""
    with open(path, "wb") as out:
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (count,)}
        np.lib.format.write_array_header_1_0(out, header)
        with open(raw, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 22)
    return file_sha256(path)
