"""Prepared datasets on disk: the format (`format.py`), writing one (`writer.py`), reading and checking one
(`reader.py`)."""

from spmdkit.data.store.reader import PreparedDataset, is_prepared_dataset
from spmdkit.data.store.writer import DatasetWriter

__all__ = ["DatasetWriter", "PreparedDataset", "is_prepared_dataset"]
