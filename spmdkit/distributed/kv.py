"""The job's key-value store: the coordination service that `jax.distributed.initialize` started in process 0, which
every process reaches over its own connection (not through the devices, so it answers while a collective hangs).

JAX (0.10 to 0.12) has no public accessor for it: `jax._src.distributed.global_state.client` is what
`jax.experimental.multihost_utils` and Orbax's multihost helpers use, and this module is the one place spmdkit
touches it. Every call is bounded in time: a store whose process 0 is frozen must not freeze the caller.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="spmdkit-kv")


def client() -> Any | None:
    """The coordination service client of this process, or None (a single process, or not joined)."""
    from jax._src import distributed

    return distributed.global_state.client


def put(key: str, value: str) -> None:
    """Set `key` (overwriting); a no-op without a job."""
    store = client()
    if store is not None:
        store.key_value_set(key, value, allow_overwrite=True)


def read_dir(prefix: str, timeout: float = 5.0) -> dict[str, str] | None:
    """Every key under `prefix` -> its value; None when the store does not answer within `timeout` s (its process
    is frozen or gone) or there is no job."""
    store = client()
    if store is None:
        return None
    future = _POOL.submit(store.key_value_dir_get, prefix)
    try:
        return dict(future.result(timeout=timeout))
    except Exception:  # noqa: BLE001 - a store that does not answer, for whatever reason, is reported as such
        return None
