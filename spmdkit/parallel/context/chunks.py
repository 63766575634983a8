"""Which chunks a device holds and which (query chunk, key chunk) pairs and ring steps the ring computes: numpy
only, static (the ring program indexes these tables; the planner, JAX-free, counts the same steps).

The sequence is cut into 2N chunks of c = S / (2N) tokens over N ring positions; `slot_chunk_ids` says which two
sit on each position (zigzag or contiguous, `spmdkit.parallel.context.zigzag`), `pair_mode` how a causal pair is
computed, `pair_modes` the table of every step, device and slot pair, `ring_steps` the steps some pair needs.
"""

from __future__ import annotations

import numpy as np

from spmdkit.errors import SpmdkitError

LOAD_BALANCE_MODES: tuple[str | None, ...] = ("zigzag", "none", "contiguous", None)


def check_load_balance(load_balance: str | None) -> str:
    """The layout name ("zigzag" or "none") for a `load_balance` argument; `None` and "contiguous" mean "none".

    Raises `SpmdkitError` for anything else."""
    if load_balance not in LOAD_BALANCE_MODES:
        raise SpmdkitError(
            f"unknown load_balance {load_balance!r}: use 'zigzag' (balanced causal work) or None (contiguous chunks)"
        )
    return "zigzag" if load_balance == "zigzag" else "none"


def check_seq_len(seq_len: int, n: int) -> int:
    """Chunk size S / (2N); raises `SpmdkitError` when the sequence does not split into 2N chunks."""
    if n < 1 or seq_len % (2 * n):
        raise SpmdkitError(
            f"sequence length {seq_len} is not divisible by 2 x context size = {2 * n}: pad the sequence to a "
            f"multiple of {2 * n}"
        )
    return seq_len // (2 * n)


def slot_chunk_ids(n: int, load_balance: str | None) -> np.ndarray:
    """`ids[r, j]`: the original chunk held in slot j (0 or 1) of device r, shape [n, 2].

    In both layouts `ids[r, 0] < ids[r, 1]`, which the ring kernel relies on.
    """
    r = np.arange(n)
    if check_load_balance(load_balance) == "zigzag":
        return np.stack([r, 2 * n - 1 - r], axis=1)
    return np.stack([2 * r, 2 * r + 1], axis=1)


FULL, DIAG, SKIP, EDGE = 0, 1, 2, 3  # how ring attention computes a causal (query chunk, key chunk) pair


def pair_mode(q_chunk, k_chunk, chunk: int, window: int = 0):
    """How a causal (query chunk, key chunk) pair is computed, from the original chunk ids (ints or numpy
    arrays) and the chunk length: FULL (key chunk before the query chunk, inside every query's
    window), DIAG (the same chunk: a triangular mask), SKIP (key chunk after, or every key at or before every
    query - `window`) or EDGE (before, across the edge of some query's window: a window mask). window 0:
    unlimited."""
    where = np.where
    before = FULL
    if window > 0:  # the gap between the last key and the first query; between the first key and the last query
        gap = (q_chunk - k_chunk) * chunk
        before = where(gap - chunk + 1 >= window, SKIP, where(gap + chunk - 1 >= window, EDGE, FULL))
    return where(k_chunk < q_chunk, before, where(k_chunk == q_chunk, DIAG, SKIP))


def ring_steps(n: int, load_balance: str | None, chunk: int, window: int, causal: bool = True) -> tuple[int, ...]:
    """The ring steps t (device r attends the K/V of device (r - t) mod n) in which some device computes some
    pair: all n without a window; with one, only the steps whose key chunks reach into some query's window (the
    rest are not sent: a windowed ring moves only the K/V it reads)."""
    if not causal or window <= 0:
        return tuple(range(n))
    modes = pair_modes(n, load_balance, chunk, window)[0]
    return tuple(int(t) for t in np.flatnonzero((modes != SKIP).any(axis=(1, 2, 3))))


def ring_balance(windows: list[int], seq_len: int, n: int) -> str:
    """The ring's layout for a model whose layers have these sliding `windows` (0: global) over `n` ring
    positions: "contiguous" when every layer is windowed within one position's share seq / n (every query then
    sees at most W keys wherever it sits, so the work is balanced, and the ring sends only the next position's
    K/V), else "zigzag" (causal global attention's balance)."""
    local = all(0 < w <= seq_len // n for w in windows)
    return "contiguous" if local and n > 1 else "zigzag"


def causal_work_balance(n: int, load_balance: str | None) -> tuple[list[int], float]:
    """Causal attention work per device, counted in computed (query chunk, key chunk) pairs.

    Device r computes the pairs (its 2 query chunks) x (all 2n key chunks) with key chunk <= query chunk
    (a diagonal pair counts as one). Returns (pairs per device, max / mean): zigzag gives 2n+1 on every
    device (ratio 1.0); contiguous gives 4r+3 on device r (ratio ~1.82 at n=8).
    """
    ids = slot_chunk_ids(n, load_balance)
    per_device = [sum(k <= int(q) for q in ids[r] for k in range(2 * n)) for r in range(n)]
    return per_device, max(per_device) / (sum(per_device) / n)


def pair_modes(n: int, load_balance: str | None, chunk: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(modes, offsets), int32 [step t, device r, query slot i, key slot j]: the `pair_mode` of query slot i of
    device r against key slot j of device (r - t) mod n, and the key chunk's first true position less the query
    chunk's."""
    ids = slot_chunk_ids(n, load_balance)
    keys = np.stack([ids[(np.arange(n) - t) % n] for t in range(n)])  # [step, device, key slot]
    q, k = ids[None, :, :, None], keys[:, :, None, :]
    return pair_mode(q, k, chunk, window).astype(np.int32), ((k - q) * chunk).astype(np.int32)
