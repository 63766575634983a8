"""Every process's value of something, in process order: the one way spmdkit's processes agree on anything (a stop
request, a checkpoint verdict, a lock refusal, checksums, the steps each holds, each process's step time).

It is an all-gather over the devices (`multihost_utils.process_allgather`), so it is a collective: every process
must call it, in the same order. With one process nothing is exchanged.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np


def gather_over_processes(value: Any) -> list[Any]:
    """`value` of every process, by process index. A number or numpy array (the same shape on every process) is
    gathered as it is, in one all-gather (a Python int as int32, a float as float32); anything else (a string, a
    list, a dict) as JSON, its size free to differ between processes (two all-gathers)."""
    import jax

    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    if isinstance(value, int | float):  # as JAX holds them (no 64-bit types unless enabled)
        value = np.int32(value) if isinstance(value, int) else np.float32(value)
    if isinstance(value, np.ndarray | np.generic):
        return list(np.asarray(multihost_utils.process_allgather(value)))
    own = np.frombuffer(json.dumps(value).encode(), np.uint8)
    width = int(np.max(multihost_utils.process_allgather(np.int32(own.size))))
    padded = np.zeros(width, np.uint8)
    padded[: own.size] = own
    rows = np.asarray(multihost_utils.process_allgather(padded), np.uint8).reshape(-1, width)
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in rows]
