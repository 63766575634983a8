"""Rows from documents: packing plans (`layout.py`) and packed rows with positions, segment ids and a loss mask
(`rows.py`); `spmdkit.data.stream` mixes several stores' rows into one grain stream."""

from spmdkit.data.packing.layout import Plan, make_plan, pack_starts, row_pieces
from spmdkit.data.packing.rows import FIELDS, PackedRows, assemble_row, pack_documents, split_documents

__all__ = [
    "FIELDS", "PackedRows", "Plan", "assemble_row", "make_plan", "pack_documents", "pack_starts",
    "row_pieces", "split_documents",
]  # fmt: skip
