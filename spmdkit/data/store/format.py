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
```

`dataset.json`: `format`, `version`, `tokenizer` (name, file, sha256, vocab_size, model_vocab_size, bos_id,
eos_id, special_ids), `dtype`, `documents`, `tokens`, `bytes` (of text), `shards` ([{file, documents, tokens,
sha256}]), `index` ({offsets|bytes|keys: {file, sha256}}), `content_sha256` (sha256 of the dtype, the tokenizer's
sha256 and every shard's and index file's sha256, in order: equal for equal datasets), `inputs`, `options`,
`skipped` ({kind: count} of the bad records `--skip-bad` skipped), `seconds`, `created`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

FORMAT = "spmdkit-prepared-dataset"
VERSION = 1
META_FILE = "dataset.json"
OFFSETS_FILE = "documents.npy"
BYTES_FILE = "document_bytes.npy"
KEYS_FILE = "document_keys.npy"
INDEX_FILES = {"offsets": OFFSETS_FILE, "bytes": BYTES_FILE, "keys": KEYS_FILE}
UINT16_VOCAB = 1 << 16
EVAL_BUCKETS = 10_000  # the same rule as the stdlib source's eval files: crc32(name) % 10,000 < fraction x 10,000


def shard_file(index: int) -> str:
    return f"tokens-{index:05d}.bin"


def token_dtype(vocab_size: int, requested: str = "auto") -> str:
    """uint16 when every id fits (vocab <= 65,536), else uint32; "uint16"/"uint32" as requested when it fits."""
    if requested == "auto":
        return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"
    return requested


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
