"""Deterministic, resumable training batches through grain, sharded by JAX process.

Records (from `spmdkit.data.sources`) of `seq_len + 1` tokens become inputs (the first `seq_len`) and targets (the
last `seq_len`). Each JAX process reads only records `process_index::process_count` and yields
`global_batch // process_count` rows per step; `global_batch_arrays` assembles the per-process batches into global
`jax.Array`s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grain
import jax
import numpy as np

from spmdkit.data.config import DataConfig
from spmdkit.data.sources import record_source
from spmdkit.errors import SpmdkitError

# One background thread builds the next batches while the device computes; more threads only fight the GIL.
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)


class DataStream(Iterator[dict[str, np.ndarray]]):
    """Iterator of local batches: `inputs`, `targets`, `positions`, each int32 `[local_batch, seq_len]`.

    `get_state()` / `set_state(state)` give exact resume; `iterator` is the grain `DatasetIterator`, for
    `grain.checkpoint.CheckpointSave(stream.iterator)` inside an Orbax checkpoint.
    """

    def __init__(
        self,
        dataset: grain.IterDataset,
        *,
        seq_len: int,
        global_batch: int,
        local_batch: int,
        num_records: int,
        split: str,
    ):
        self.dataset = dataset
        self.iterator: grain.DatasetIterator = iter(dataset)
        self.seq_len, self.global_batch, self.local_batch = seq_len, global_batch, local_batch
        self.num_records, self.split = num_records, split

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


def _to_example(window: np.ndarray) -> dict[str, np.ndarray]:
    """[seq_len + 1] tokens -> inputs, targets (shifted by one), positions: int32 [seq_len] each."""
    window = np.asarray(window, dtype=np.int32)
    seq_len = len(window) - 1
    return {"inputs": window[:-1], "targets": window[1:], "positions": np.arange(seq_len, dtype=np.int32)}


def make_data(
    config: DataConfig, *, seq_len: int, global_batch: int, vocab_size: int, seed: int, split: str = "train"
) -> DataStream:
    """This process's stream of `[global_batch // process_count, seq_len]` batches of `split` ("train" | "eval").

    train: shuffled with `seed` (reshuffled each epoch), repeated forever. eval: one pass in order, no shuffle.
    Records are sharded by JAX process (`[process_index::process_count]`), so processes read disjoint records
    and their batches together form the global batch.
    """
    if split not in ("train", "eval"):
        raise SpmdkitError(f"unknown data split {split!r}: use 'train' or 'eval'")
    if seq_len < 1 or global_batch < 1:
        raise SpmdkitError(f"seq_len={seq_len} and global_batch={global_batch} must both be positive")
    if not 0.0 <= config.eval_fraction < 1.0:
        raise SpmdkitError(f"eval_fraction={config.eval_fraction} is out of range: use a value in [0, 1)")
    nproc, pid = jax.process_count(), jax.process_index()
    if global_batch % nproc:
        raise SpmdkitError(
            f"global_batch={global_batch} does not divide by the {nproc} JAX processes: use a multiple of {nproc}"
        )
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
    local_batch = global_batch // nproc
    ds = grain.MapDataset.source(source)[:num_records]
    if split == "train":
        ds = ds.seed(seed).shuffle()
    ds = ds[pid::nproc].map(_to_example)
    if split == "train":
        ds = ds.repeat()
    iter_ds = ds.batch(local_batch, drop_remainder=True).to_iter_dataset(_READ_OPTIONS)
    return DataStream(
        iter_ds,
        seq_len=seq_len,
        global_batch=global_batch,
        local_batch=local_batch,
        num_records=num_records,
        split=split,
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
