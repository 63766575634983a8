"""The global row stream of one or several document stores, as a grain `MapDataset`.

One store: its `PackedRows`. Several (`--data A=0.7,B=0.3`): `grain.MapDataset.mix` of their row streams with the
weights, a deterministic interleave (row g comes from a component and a row index that g alone decides), so a
mixture is as resumable and as independent of the process count as one store. Each component draws its epochs
with its own salt (its place in the mixture). Train streams are infinite; an eval mixture ends when a component's
one pass does (grain's rule for finite components).
"""

from __future__ import annotations

from collections.abc import Sequence

import grain

from spmdkit.data.packing.rows import Documents, PackedRows
from spmdkit.errors import SpmdkitError


def packed_rows(
    stores: Sequence[tuple[str, Documents]], *, seq_len: int, packing: str, split: str, eval_fraction: float, seed: int
) -> list[PackedRows]:
    """One `PackedRows` per (name, store); a store whose split holds not a single row is an error."""
    rows = []
    for salt, (name, store) in enumerate(stores):
        part = PackedRows(
            store, seq_len=seq_len, packing=packing, split=split, eval_fraction=eval_fraction, seed=seed, salt=salt
        )
        if part.rows_per_epoch() == 0:
            raise SpmdkitError(
                f"{name} {split} split has {part.tokens:,} tokens in {len(part.doc_ids):,} documents, not one row of "
                f"seq_len {seq_len} ({packing} packing): use more data, a smaller seq_len or another eval_fraction"
            )
        rows.append(part)
    return rows


def global_rows(rows: Sequence[PackedRows], weights: Sequence[float]) -> grain.MapDataset:
    """The stream of global rows: row g of the run is element g (every process computes the same stream)."""
    sources = [grain.MapDataset.source(r) for r in rows]
    if len(sources) == 1:
        return sources[0]
    return grain.MapDataset.mix(sources, list(weights))
