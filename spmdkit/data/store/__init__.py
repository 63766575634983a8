"""Prepared datasets on disk: the format (`format.py`), writing one (`writer.py`), reading and checking one
(`reader.py`, `check_vocabulary`), the staging directory a dataset is written in (`staging.py`)."""

from spmdkit.data.store.reader import PreparedDataset, check_vocabulary, is_prepared_dataset
from spmdkit.data.store.writer import DatasetWriter

__all__ = ["DatasetWriter", "PreparedDataset", "check_vocabulary", "is_prepared_dataset"]
