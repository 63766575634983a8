"""`ArrayDocuments`: documents held in memory (one token array + offsets), e.g. the embedded stdlib corpus, read
through the same interface as a prepared dataset (`lengths`, `keys`, `text_bytes`, `read`)."""

from __future__ import annotations

import numpy as np


class ArrayDocuments:
    """Document i is `tokens[offsets[i]:offsets[i + 1]]`; `keys` uint32 [documents] decide the eval split."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, keys: np.ndarray, text_bytes: np.ndarray):
        self.tokens, self.offsets = tokens, np.asarray(offsets, np.int64)
        self.lengths = np.diff(self.offsets)
        self.keys = np.asarray(keys, np.uint32)
        self.text_bytes = np.asarray(text_bytes, np.int64)

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        base = int(self.offsets[doc])
        return self.tokens[base + start : base + stop]
