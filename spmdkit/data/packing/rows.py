"""`PackedRows`: the rows of one split of a document store, by global row index, for grain.

Row fields (each int32 [seq_len]; the last two only with `documents` packing):

- `inputs`: token ids (0 at padding);
- `targets`: the token after each input in its document (0 where there is none);
- `positions`: the token's position in its document, 0 at a document's first token; a document continued from
  the previous row continues its positions (`windows`: 0..seq_len-1);
- `segment_ids`: 0 = padding, 1, 2, ... = the documents of the row in order (a continued document is 1);
- `loss_mask`: 1 where `targets` is a real next token; 0 at padding and at each document's last token; in a store
  with a loss mask (`has_mask`: chat data, assistant turns only) also 0 where the target token is not scored.

Train rows repeat forever: epoch e packs the split's documents in an order drawn from (seed, salt, e) and reads its
rows in a permutation from the same generator (a batch mixes documents from all over the data); a row's index
decides everything, so reading resumes anywhere and any process reads any row. Eval rows are one pass in order.
"""

from __future__ import annotations

import bisect
import sys
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from spmdkit.data.packing.layout import Plan, make_plan, row_pieces
from spmdkit.data.store.format import is_eval
from spmdkit.data.store.memory import ArrayDocuments

FIELDS = {"documents": ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
FIELDS["windows"] = FIELDS["documents"][:3]


class Documents(Protocol):
    """A document store: a prepared dataset (`PreparedDataset`) or one in memory (`ArrayDocuments`)."""

    lengths: np.ndarray  # int64 [documents]
    keys: np.ndarray  # uint32 [documents]: crc32 of each name, for the eval split

    def read(self, doc: int, start: int, stop: int) -> np.ndarray: ...


def split_documents(store: Documents, split: str, eval_fraction: float) -> np.ndarray:
    """int64 ids of the documents of `split` ("train" | "eval"), in store order."""
    evals = is_eval(store.keys, eval_fraction)
    return np.flatnonzero(evals if split == "eval" else ~evals)


class PackedRows(Sequence[dict[str, np.ndarray]]):
    """Row `g` of `split` of `store`, packed as `packing` says (see the module docstring); `len` is sys.maxsize for
    train (epochs repeat) and the rows of the one eval pass otherwise."""

    def __init__(
        self,
        store: Documents,
        *,
        seq_len: int,
        packing: str,
        split: str,
        eval_fraction: float,
        seed: int,
        salt: int = 0,
    ):
        self.store, self.seq_len, self.packing, self.split = store, seq_len, packing, split
        self.seed, self.salt = seed, salt
        self.doc_ids = split_documents(store, split, eval_fraction)
        self.doc_lengths = np.asarray(store.lengths, np.int64)[self.doc_ids]
        self.fields = FIELDS[packing]
        self._lock = threading.RLock()  # grain may read from a background thread
        self._plans: dict[int, Plan] = {}
        self._epoch_ends: list[int] = []  # cumulative rows at the end of each planned epoch
        self._eval_plan = (
            None if split == "train" else make_plan(self.doc_ids, self.doc_lengths, seq_len, packing, None)
        )

    def epoch_plan(self, epoch: int) -> Plan:
        """The plan of train epoch `epoch` (the two most recent are kept)."""
        if self._eval_plan is not None:
            return self._eval_plan
        with self._lock:
            if epoch not in self._plans:
                rng = np.random.default_rng([self.seed, self.salt, epoch])
                plan = make_plan(self.doc_ids, self.doc_lengths, self.seq_len, self.packing, rng)
                self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
                self._plans[epoch] = plan
            return self._plans[epoch]

    def rows_per_epoch(self, epoch: int = 0) -> int:
        return self.epoch_plan(epoch).rows

    def __len__(self) -> int:
        return sys.maxsize if self._eval_plan is None else self._eval_plan.rows

    def locate(self, index: int) -> tuple[int, int]:
        """(epoch, row of that epoch) of global row `index`."""
        if self._eval_plan is not None:
            return 0, index
        with self._lock:
            while not self._epoch_ends or self._epoch_ends[-1] <= index:
                epoch = len(self._epoch_ends)
                self._epoch_ends.append((self._epoch_ends[-1] if epoch else 0) + self.rows_per_epoch(epoch))
            epoch = bisect.bisect_right(self._epoch_ends, index)
            return epoch, index - (self._epoch_ends[epoch - 1] if epoch else 0)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:  # type: ignore[override]
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        epoch, r = self.locate(index)
        plan = self.epoch_plan(epoch)
        return assemble_row(self.store, plan, plan.row(r), self.seq_len, self.packing)


def window_fields(window: np.ndarray) -> dict[str, np.ndarray]:
    """[seq_len + 1] tokens -> inputs, targets (shifted by one), positions: int32 [seq_len] each."""
    window = np.asarray(window, dtype=np.int32)
    return {"inputs": window[:-1], "targets": window[1:], "positions": np.arange(len(window) - 1, dtype=np.int32)}


def assemble_row(store: Documents, plan: Plan, row: int, seq_len: int, packing: str) -> dict[str, np.ndarray]:
    """The fields (module docstring) of stream row `row` of `plan`."""
    if packing == "windows":
        window = np.zeros(seq_len + 1, np.int32)
        for p, doc, offset, count in row_pieces(plan, row):
            window[p : p + count] = store.read(doc, offset, offset + count)
        return window_fields(window)
    inputs, targets, positions, segments, mask = (np.zeros(seq_len, np.int32) for _ in range(5))
    for segment, (p, doc, offset, count) in enumerate(row_pieces(plan, row), start=1):
        tokens = store.read(doc, offset, min(offset + count + 1, int(store.lengths[doc])))
        inputs[p : p + count] = tokens[:count]
        targets[p : p + len(tokens) - 1] = tokens[1:]
        positions[p : p + count] = np.arange(offset, offset + count)
        segments[p : p + count] = segment
        if getattr(store, "has_mask", False):  # the target at token t + 1 is scored where the store says so
            mask[p : p + len(tokens) - 1] = store.read_mask(doc, offset + 1, offset + len(tokens))
        else:
            mask[p : p + len(tokens) - 1] = 1  # the last token of a document has no target
    return {"inputs": inputs, "targets": targets, "positions": positions, "segment_ids": segments, "loss_mask": mask}


def pack_documents(
    documents: Sequence[np.ndarray | Sequence[int]], seq_len: int
) -> tuple[dict[str, np.ndarray], list[list[tuple[int, int, int, int]]]]:
    """Pack token sequences, in order, as a prepared dataset's eval split is packed: (fields, each int32 [rows,
    seq_len]; for each row its pieces (position in the row, document index, offset in the document, tokens)). For
    tests and tools that need a packed batch of chosen documents (e.g. packed vs one document at a time)."""
    lengths = np.array([len(d) for d in documents], np.int64)
    if len(lengths) == 0 or lengths.min() < 1:
        raise ValueError("pack_documents needs at least one document, none of them empty")
    tokens = np.concatenate([np.asarray(d, np.int64) for d in documents])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    store = ArrayDocuments(tokens, offsets, np.zeros(len(lengths), np.uint32), np.zeros(len(lengths), np.int64))
    plan = make_plan(np.arange(len(lengths)), lengths, seq_len, "documents", None)
    rows = [assemble_row(store, plan, r, seq_len, "documents") for r in range(plan.rows)]
    fields = {key: np.stack([row[key] for row in rows]) for key in FIELDS["documents"]}
    return fields, [row_pieces(plan, r) for r in range(plan.rows)]
