"""Where training tokens come from: record sources (sequences of `seq_len + 1` tokens) for grain.

- `"stdlib"` (default, no download): byte-level tokens of the running interpreter's standard library `.py`
  files (sorted paths, no `site-packages`, capped at ~8 MB). Each file is `BOS + utf-8 bytes + EOS`; the files
  are concatenated and cut into non-overlapping windows. A stable hash of each relative path puts a fixed
  ~`eval_fraction` of whole files into the eval split.
- a token file: a flat `.bin` (raw `uint16`/`uint32`, nanoGPT format) or `.npy`, memory-mapped and read lazily
  window by window; the eval split is the tail `eval_fraction` of the stream.
- `"synthetic"`: uniform random tokens from a numpy generator seeded per record (1,000,000 records), for benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
import zlib
from collections.abc import Sequence

import numpy as np

from spmdkit.data.config import DataConfig
from spmdkit.data.store.format import is_eval
from spmdkit.data.store.memory import ArrayDocuments
from spmdkit.errors import SpmdkitError

BOS = 256
EOS = 257
VOCAB_SIZE = 264  # byte tokens + specials, padded to a multiple of 8

STDLIB_MAX_BYTES = 8_000_000
SYNTHETIC_RECORDS = 1_000_000

# ----------------------------------------------------------------------------------------------- record sources


@dataclasses.dataclass(frozen=True)
class SyntheticSource(Sequence[np.ndarray]):
    """Record `i`: `seq_len + 1` uniform tokens in `[0, vocab_size)` from `np.random.default_rng((seed, stream, i))`."""

    num_records: int
    seq_len: int
    vocab_size: int
    seed: int
    stream: int

    def __len__(self) -> int:
        return self.num_records

    def __getitem__(self, index: int) -> np.ndarray:  # type: ignore[override]
        rng = np.random.default_rng((self.seed, self.stream, int(index)))
        return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)


# ----------------------------------------------------------------------------------------------- stdlib corpus


def stdlib_root() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=1)
def stdlib_texts() -> tuple[tuple[str, bytes], ...]:
    """(relative path, utf-8 bytes) of the stdlib `.py` files in sorted path order, up to ~8 MB in all."""
    root = stdlib_root()
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        paths += [os.path.relpath(os.path.join(directory, f), root) for f in files if f.endswith(".py")]
    texts, total = [], 0
    for relpath in sorted(paths):
        with open(os.path.join(root, relpath), "rb") as f:
            data = f.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        texts.append((relpath, data))
        total += len(data)
        if total >= STDLIB_MAX_BYTES:
            break
    return tuple(texts)


@functools.lru_cache(maxsize=1)
def stdlib_documents() -> ArrayDocuments:
    """Every stdlib file (train and eval alike) as a document `BOS + bytes + EOS`, keyed by the crc32 of its relative
    path: `is_eval` of the keys is the eval split (`stdlib_files`, `--packing documents` on the stdlib), stable
    across runs and machines (not Python's salted `hash`), the rule a prepared dataset's documents follow too."""
    texts = stdlib_texts()
    lengths = np.array([len(data) + 2 for _, data in texts], np.int64)
    tokens = np.empty(int(lengths.sum()), np.uint16)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for (_, data), start, end in zip(texts, offsets[:-1], offsets[1:], strict=True):
        tokens[start], tokens[end - 1] = BOS, EOS
        tokens[start + 1 : end - 1] = np.frombuffer(data, np.uint8)
    keys = np.array([zlib.crc32(relpath.encode()) for relpath, _ in texts], np.uint32)
    return ArrayDocuments(tokens, offsets, keys, lengths - 2)


def stdlib_files(eval_fraction: float = 0.05) -> dict[str, tuple[str, ...]]:
    """{"train": relative paths, "eval": relative paths} of the stdlib corpus, each in sorted order; disjoint."""
    split: dict[str, list[str]] = {"train": [], "eval": []}
    for (relpath, _), evals in zip(stdlib_texts(), is_eval(stdlib_documents().keys, eval_fraction), strict=True):
        split["eval" if evals else "train"].append(relpath)
    return {name: tuple(paths) for name, paths in split.items()}


@functools.lru_cache(maxsize=4)
def _stdlib_tokens(eval_fraction: float, split: str) -> np.ndarray:
    """[n] uint16: `BOS + bytes + EOS` of every file of `split`, concatenated in sorted path order."""
    documents = stdlib_documents()
    wanted = is_eval(documents.keys, eval_fraction) == (split == "eval")
    return documents.tokens[np.repeat(wanted, documents.lengths)]


# ----------------------------------------------------------------------------------------------- token files


def _open_token_file(path: str, token_dtype: str) -> np.ndarray:
    """[n] memory-mapped tokens of a `.bin` or `.npy` file, checked for existence, extension and dtype."""
    if not os.path.isfile(path):
        raise SpmdkitError(
            f"data file {path!r} not found: pass an existing .bin/.npy token file, 'stdlib' or 'synthetic'"
        )
    ext = os.path.splitext(path)[1].lower()
    if ext == ".bin":
        itemsize = np.dtype(token_dtype).itemsize
        size = os.path.getsize(path)
        if size % itemsize:
            raise SpmdkitError(
                f"{path} has {size} bytes, not a multiple of {itemsize} ({token_dtype}): check token_dtype or the file"
            )
        if size == 0:
            return np.zeros(0, token_dtype)
        return np.memmap(path, dtype=token_dtype, mode="r")
    if ext == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise SpmdkitError(f"{path} is not a readable .npy file ({e}): rewrite it with np.save") from None
        if tokens.dtype.kind not in "ui":
            raise SpmdkitError(f"{path} holds {tokens.dtype} values: token files must hold integer ids (e.g. uint16)")
        return tokens.reshape(-1)
    raise SpmdkitError(f"data file {path!r} has unknown extension {ext!r}: use a flat .bin (raw tokens) or .npy file")


@functools.lru_cache(maxsize=8)
def _id_range(path: str, size: int, mtime_ns: int, token_dtype: str) -> tuple[int, int]:
    """(min, max) token id of a file, computed once per file version with numpy on the memmap."""
    tokens = _open_token_file(path, token_dtype)
    if len(tokens) == 0:
        return 0, -1
    return int(tokens.min()), int(tokens.max())


def _file_tokens(config: DataConfig, vocab_size: int, seq_len: int, split: str) -> np.ndarray:
    """[n] tokens of the `split` part of a token file (train: the head; eval: the tail), checked against vocab."""
    path = config.source
    tokens = _open_token_file(path, config.token_dtype)
    stat = os.stat(path)
    lo, hi = _id_range(path, stat.st_size, stat.st_mtime_ns, config.token_dtype)
    if hi >= vocab_size:
        raise SpmdkitError(f"{path} holds token id {hi} but vocab_size is {vocab_size}: raise vocab_size above {hi}")
    if lo < 0:
        raise SpmdkitError(f"{path} holds negative token id {lo}: token ids must be in [0, vocab_size)")
    if len(tokens) < seq_len + 1:
        raise SpmdkitError(
            f"{path} has {len(tokens)} tokens, shorter than one sequence of seq_len+1={seq_len + 1}: "
            "use a longer file or a smaller seq_len"
        )
    n_eval = int(len(tokens) * config.eval_fraction)
    return tokens[len(tokens) - n_eval :] if split == "eval" else tokens[: len(tokens) - n_eval]


def record_source(config: DataConfig, seq_len: int, vocab_size: int, seed: int, split: str) -> Sequence[np.ndarray]:
    if config.source == "synthetic":
        n_eval = max(1, int(SYNTHETIC_RECORDS * config.eval_fraction))
        count = n_eval if split == "eval" else SYNTHETIC_RECORDS
        return SyntheticSource(count, seq_len, vocab_size, seed, stream=int(split == "eval"))
    if config.source == "stdlib":
        if vocab_size < VOCAB_SIZE:
            raise SpmdkitError(
                f"the stdlib source needs vocab_size >= {VOCAB_SIZE} (bytes + BOS/EOS), got {vocab_size}"
            )
        return _windows(_stdlib_tokens(float(config.eval_fraction), split), seq_len)
    return _windows(_file_tokens(config, vocab_size, seq_len, split), seq_len)


def _windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """[records, seq_len + 1]: record `i` is `tokens[i * (seq_len + 1) : (i + 1) * (seq_len + 1)]`, non-overlapping
    windows (a view: a memory-mapped file is still read lazily, window by window)."""
    records = len(tokens) // (seq_len + 1)
    return tokens[: records * (seq_len + 1)].reshape(records, seq_len + 1)
