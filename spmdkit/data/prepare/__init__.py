"""`spmdkit data prepare`: read inputs (`inputs.py`), tokenize in parallel and write a prepared dataset
(`pipeline.py`)."""

from spmdkit.data.prepare.pipeline import PrepareOptions, prepare

__all__ = ["PrepareOptions", "prepare"]
