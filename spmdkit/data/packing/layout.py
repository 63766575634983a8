"""Where each document goes in a stream of rows: the packing plans (pure numpy, no I/O).

`documents` packing: documents are placed in order; a document that fits in a row (length <= seq_len) but not in
what is left of the current row starts a new row, and the rest of the current row is padding; a longer document
starts where the current row is and continues over the next rows. So a document is never cut unless it is longer
than a row, and padding only fills the end of a row that the next document would not fit.

`windows` packing (today's behaviour, `--packing windows`): documents back to back with no padding, cut into
non-overlapping windows of seq_len + 1 tokens (inputs = the first seq_len, targets = the last seq_len); the tail
that does not fill a window is dropped.

A `Plan` is one epoch of a split: the document order, where each starts in the stream, and the order the rows are
read in (a permutation for training, `None` for eval).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Plan:
    """One epoch: `order` int64 [n] document ids in stream order, `starts` int64 [n] stream offset of each,
    `lengths` int64 [n] their lengths, `rows` rows of `row_len` tokens, `row_order` int64 [rows] or None."""

    order: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    rows: int
    row_len: int
    row_order: np.ndarray | None = None

    def row(self, r: int) -> int:
        """The stream row read as the epoch's r-th row."""
        return int(self.row_order[r]) if self.row_order is not None else r


def pack_starts(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
    """`documents` packing of documents of `lengths` (in order): (start of each in the padded stream, rows)."""
    starts = np.empty(len(lengths), np.int64)
    pos = 0
    for i, length in enumerate(np.asarray(lengths).tolist()):
        fill = pos % seq_len
        if fill and length <= seq_len and fill + length > seq_len:
            pos += seq_len - fill  # it fits a row, not this one: pad, start the next row
        starts[i] = pos
        pos += length
    return starts, -(-pos // seq_len)


def make_plan(
    doc_ids: np.ndarray, lengths: np.ndarray, seq_len: int, packing: str, rng: np.random.Generator | None
) -> Plan:
    """The plan of one epoch of documents `doc_ids` (their `lengths`): shuffled documents and rows with `rng`
    (training; windows keep the document order and shuffle only the windows), in order with `rng=None` (eval)."""
    order = np.asarray(doc_ids, np.int64)
    lengths = np.asarray(lengths, np.int64)
    if rng is not None and packing == "documents":
        permutation = rng.permutation(len(order))
        order, lengths = order[permutation], lengths[permutation]
    if packing == "documents":
        starts, rows = pack_starts(lengths, seq_len)
        row_len = seq_len
    else:  # back to back, whole windows of seq_len + 1
        starts, row_len = np.cumsum(lengths) - lengths, seq_len + 1
        rows = int(lengths.sum() // row_len)
    row_order = rng.permutation(rows) if rng is not None else None
    return Plan(order, starts, lengths, rows, row_len, row_order)


def row_pieces(plan: Plan, row: int) -> list[tuple[int, int, int, int]]:
    """The documents in stream row `row`: (position in the row, document id, offset in the document, tokens),
    in row order; positions not covered are padding."""
    lo = row * plan.row_len
    hi = lo + plan.row_len
    i = max(int(np.searchsorted(plan.starts, lo, side="right")) - 1, 0)
    pieces = []
    while i < len(plan.starts) and plan.starts[i] < hi:
        start, length = int(plan.starts[i]), int(plan.lengths[i])
        a, b = max(lo, start), min(hi, start + length)
        if a < b:
            pieces.append((a - lo, int(plan.order[i]), a - start, b - a))
        i += 1
    return pieces
