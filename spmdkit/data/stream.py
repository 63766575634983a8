"""Deterministic, resumable training batches through grain, sharded by JAX process: `make_data`.

`make_data(config, *, seq_len, global_batch, vocab_size, seed, split="train") -> DataStream`, an iterator of this
process's batches: dicts of int32 [global_batch // process_count, seq_len] numpy arrays. The keys
(`DataStream.keys`) are the row fields of `spmdkit.data.packing.rows`: `inputs`, `targets`, `positions`, and with
documents packing (`spmdkit.data.config`) `segment_ids` and `loss_mask`; attention must stay within a segment (and
causal inside it).

Windows: records of `seq_len + 1` tokens (`spmdkit.data.sources`) become inputs (the first `seq_len`) and targets
(the last `seq_len`); each JAX process reads records `process_index::process_count`. Documents
(`spmdkit.data.packing`): a stream of global rows (one store, or a grain mixture of several); process p takes rows
`[s * global_batch + p * local_batch, ... + local_batch)` at step s, so the global batch (processes' rows
concatenated in process order, as `global_batch_arrays` does) is identical on any process count.

`DataStream` also carries `tokenizer` (a `spmdkit.data.tokenizer.Tokenizer`, None for token files and synthetic
data) and `token_bytes` (int32 [vocab_size] UTF-8 bytes per token id, for `spmdkit.data.bits`; None without a
tokenizer). `get_state` / `set_state` and `iterator` (for `grain.checkpoint.CheckpointSave`) resume exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import grain
import jax
import numpy as np

from spmdkit.data.config import DataConfig
from spmdkit.data.packing.rows import FIELDS, PackedRows, window_fields
from spmdkit.data.resolve import Resolved, check_vocab, resolve_source, shared_tokenizer
from spmdkit.data.sources import record_source, stdlib_documents
from spmdkit.data.store import PreparedDataset, check_vocabulary
from spmdkit.data.tokenizer import Tokenizer, byte_tokenizer
from spmdkit.errors import SpmdkitError

# One background thread builds the next batches while the device computes; more threads only fight the GIL.
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)


@dataclasses.dataclass(eq=False)
class DataStream(Iterator[dict[str, np.ndarray]]):
    """Iterator of local batches: a dict of int32 `[local_batch, seq_len]` arrays named by `keys` (see the module
    docstring); `tokenizer` and `token_bytes` as there.

    `get_state()` / `set_state(state)` give exact resume; `iterator` is the grain `DatasetIterator`, for
    `grain.checkpoint.CheckpointSave(stream.iterator)` inside an Orbax checkpoint.
    """

    iterator: grain.DatasetIterator
    seq_len: int
    global_batch: int
    local_batch: int
    num_records: int
    split: str
    packing: str = "windows"
    tokenizer: Tokenizer | None = None
    token_bytes: np.ndarray | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return FIELDS[self.packing]

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one pass over the split (the eval stream stops after this many)."""
        return self.num_records // self.global_batch

    def __iter__(self) -> DataStream:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self.iterator)

    def get_state(self) -> dict[str, Any]:
        return self.iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.iterator.set_state(state)


def make_data(
    config: DataConfig, *, seq_len: int, global_batch: int, vocab_size: int, seed: int, split: str = "train"
) -> DataStream:
    """This process's stream of `[global_batch // process_count, seq_len]` batches of `split` ("train" | "eval").

    train: shuffled with `seed` (reshuffled each epoch), repeated forever. eval: one pass in order, no shuffle.
    Processes read disjoint rows and their batches together form the global batch (see the module docstring).
    `vocab_size` is the model's: smaller than the source tokenizer's is an error naming `--model.vocab-size`.
    """
    if split not in ("train", "eval"):
        raise SpmdkitError(f"unknown data split {split!r}: use 'train' or 'eval'")
    if seq_len < 1 or global_batch < 1:
        raise SpmdkitError(f"seq_len={seq_len} and global_batch={global_batch} must both be positive")
    nproc = jax.process_count()
    if global_batch % nproc:
        raise SpmdkitError(
            f"global_batch={global_batch} does not divide by the {nproc} JAX processes: use a multiple of {nproc}"
        )
    resolved = resolve_source(config)
    documents = resolved.kind in ("prepared", "mixture") or resolved.packing == "documents"
    batches, num_records, tokenizer = (_packed_batches if documents else _window_batches)(
        config, resolved, seq_len, global_batch, vocab_size, seed, split
    )
    return DataStream(
        iter(batches.to_iter_dataset(_READ_OPTIONS)),
        seq_len=seq_len,
        global_batch=global_batch,
        local_batch=global_batch // nproc,
        num_records=num_records,
        split=split,
        packing=resolved.packing,
        tokenizer=tokenizer,
        token_bytes=None if tokenizer is None else tokenizer.token_bytes(vocab_size),
    )


def _window_batches(
    config: DataConfig, resolved: Resolved, seq_len: int, global_batch: int, vocab_size: int, seed: int, split: str
) -> tuple[grain.MapDataset, int, Tokenizer | None]:
    """The stdlib, token files and synthetic data in windows: (this process's batches, records, tokenizer)."""
    source = record_source(config, seq_len, vocab_size, seed, split)
    if len(source) < global_batch:
        raise SpmdkitError(
            f"{config.source} {split} split has {len(source)} sequences of seq_len+1={seq_len + 1} tokens, fewer "
            f"than one global batch of {global_batch}: use more data, a smaller seq_len or a smaller global_batch"
        )
    # Every process gets the same number of records, so all of them take the same number of steps.
    # Whole global batches only: the record count, the shuffle and the epoch boundaries then do not depend on the
    # process count, so 1 process x 8 devices and 2 x 4 read the same global batches.
    num_records = len(source) - len(source) % global_batch
    nproc = jax.process_count()
    ds = grain.MapDataset.source(source)[:num_records]
    if split == "train":
        ds = ds.seed(seed).shuffle()
    ds = ds[jax.process_index() :: nproc].map(window_fields)
    if split == "train":
        ds = ds.repeat()
    tokenizer = byte_tokenizer() if resolved.kind == "stdlib" else None
    return ds.batch(global_batch // nproc, drop_remainder=True), num_records, tokenizer


def _packed_batches(
    config: DataConfig, resolved: Resolved, seq_len: int, global_batch: int, vocab_size: int, seed: int, split: str
) -> tuple[grain.MapDataset, int, Tokenizer]:
    """Prepared datasets, mixtures, and the stdlib under `--packing documents`: rows from document stores.

    One store: its `PackedRows`. Several (`--data A=0.7,B=0.3`): `grain.MapDataset.mix` of their rows with the
    weights, a deterministic interleave (row g comes from a component and a row index that g alone decides), so a
    mixture is as resumable and as independent of the process count as one store. Each component draws its epochs
    with its own salt (its place in the mixture). Train streams are infinite; an eval mixture ends when a component's
    one pass does (grain's rule for finite components)."""
    if resolved.kind == "stdlib":
        stores, tokenizer, name = [("stdlib", stdlib_documents())], byte_tokenizer(), "stdlib"
        if vocab_size < tokenizer.vocab_size:
            record_source(config, seq_len, vocab_size, seed, split)  # the stdlib source's own error
    else:
        datasets = [PreparedDataset(path) for path in resolved.paths]
        stores, tokenizer, name = [(str(d.path), d) for d in datasets], shared_tokenizer(datasets), config.source
    check_vocab(tokenizer, vocab_size, name)
    for store in (s for _, s in stores if isinstance(s, PreparedDataset)):
        check_vocabulary(store, vocab_size)  # the largest id recorded at prepare time
        _check_chat(store, seq_len, resolved.packing)
    parts, packing = [], resolved.packing
    options: dict[str, Any] = dict(seq_len=seq_len, packing=packing, split=split, eval_fraction=config.eval_fraction)
    for salt, (store_name, store) in enumerate(stores):
        part = PackedRows(store, seed=seed, salt=salt, **options)
        if part.rows_per_epoch() == 0:
            raise SpmdkitError(
                f"{store_name} {split} split has {int(part.doc_lengths.sum()):,} tokens in {len(part.doc_ids):,} "
                f"documents, not one row of seq_len {seq_len} ({packing} packing): use more data, a smaller seq_len "
                "or another eval_fraction"
            )
        parts.append(part)
    sources = [grain.MapDataset.source(part) for part in parts]
    rows = sources[0] if len(sources) == 1 else grain.MapDataset.mix(sources, list(resolved.weights))
    if split == "eval":
        num_records = len(rows) - len(rows) % global_batch
        if num_records == 0:
            raise SpmdkitError(
                f"{name} eval split packs into {len(rows)} rows of seq_len {seq_len}, fewer than one global batch of "
                f"{global_batch}: use more data, a larger eval_fraction, a smaller seq_len or a smaller global_batch"
            )
        rows = rows[:num_records]
    else:
        num_records = sum(p.rows_per_epoch() for p in parts)
        if len(parts) == 1 and num_records < global_batch:
            raise SpmdkitError(
                f"{name} train split packs into {num_records} rows of seq_len {seq_len}, fewer than one global batch "
                f"of {global_batch}: use more data, a smaller seq_len or a smaller global_batch"
            )
    # Blocks of local_batch consecutive global rows; process p takes blocks p, p + nproc, ...: at step s the
    # processes' rows together are global rows [s * global_batch, (s + 1) * global_batch) in process order.
    nproc = jax.process_count()
    return rows.batch(global_batch // nproc, drop_remainder=True)[jax.process_index() :: nproc], num_records, tokenizer


def _check_chat(store: PreparedDataset, seq_len: int, packing: str) -> None:
    """A dataset with a loss mask (chat) is read in documents packing, each conversation within one row: refuse
    windows packing (it has no mask) and a seq_len shorter than the conversations were cut to."""
    if not store.has_mask:
        return
    if packing != "documents":
        raise SpmdkitError(
            f"{store.path} has a loss mask (chat data), which --packing {packing} would ignore: use --packing "
            "documents (the default for prepared data)"
        )
    longest = int(store.lengths.max())
    if longest > seq_len:
        raise SpmdkitError(
            f"{store.path} holds conversations of up to {longest:,} tokens, longer than --seq-len {seq_len}: train "
            f"with --seq-len {longest} or more, or prepare it again with --seq-len {seq_len}"
        )


def global_batch_arrays(
    local: dict[str, np.ndarray], shardings: dict[str, jax.sharding.NamedSharding]
) -> dict[str, jax.Array]:
    """This process's `[local_batch, ...]` arrays -> global `jax.Array`s of `[local_batch * process_count, ...]`.

    Each `shardings[name]` should split the batch dimension over the mesh axes that span the processes.
    """
    nproc = jax.process_count()
    out = {}
    for name, array in local.items():
        if name not in shardings:
            raise SpmdkitError(f"no sharding given for batch field {name!r}: pass shardings for {sorted(local)}")
        global_shape = (array.shape[0] * nproc, *array.shape[1:])
        out[name] = jax.make_array_from_process_local_data(shardings[name], array, global_shape)
    return out
