"""Rows from documents: packing plans (`layout.py`), packed rows with positions, segment ids and a loss mask
(`rows.py`), and one or several stores as one grain row stream (`mixture.py`)."""

from spmdkit.data.packing.layout import PACKINGS, Plan, make_plan, pack_starts, row_pieces
from spmdkit.data.packing.rows import FIELDS, PackedRows, assemble_row, pack_documents, split_documents

__all__ = [
    "FIELDS", "PACKINGS", "PackedRows", "Plan", "assemble_row", "make_plan", "pack_documents", "pack_starts",
    "row_pieces", "split_documents",
]  # fmt: skip
