"""Sequence layouts for context parallelism: zigzag (load-balanced) and contiguous.

The sequence of length S is cut into 2N equal chunks of c = S / (2N) tokens, N being the size of the context
mesh axis. Sharding a sequence contiguously over N devices gives device r the two *layout slots* 2r and 2r+1.
Which original chunks sit in those slots depends on the layout:

    zigzag      device r holds chunks r and 2N-1-r     (one early chunk, one late chunk)
    contiguous  device r holds chunks 2r and 2r+1      (load_balance=None; the identity permutation)

Under a causal mask, query chunk i attends to key chunks <= i, so with the contiguous layout the last device
does ~2N times the work of the first; the zigzag layout gives every device the same number of chunk pairs.

The layout is changed once per batch, outside the attention kernel, on *every* per-token array: token ids,
targets, loss masks, segment ids and the RoPE positions. Positions follow their tokens: pass
`positions = to_zigzag(np.arange(S)[None], n=N)` to the model so rotary embeddings see each token's original
position. Do it on the host (numpy, in the data pipeline): on an already sequence-sharded jax array the
permutation compiles to an all-gather.
"""

from __future__ import annotations

import jax.numpy as jnp
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


def zigzag_indices(seq_len: int, n: int) -> np.ndarray:
    """The zigzag permutation, shape [seq_len]: `perm[p]` is the original position of the token at layout
    position p.

    `x[:, perm]` sharded contiguously over n devices gives device r the chunks r and 2n-1-r.
    """
    c = check_seq_len(seq_len, n)
    chunks = slot_chunk_ids(n, "zigzag").reshape(-1)  # original chunk of each layout slot
    return (chunks[:, None] * c + np.arange(c)[None, :]).reshape(-1)


def inverse_zigzag_indices(seq_len: int, n: int) -> np.ndarray:
    """Inverse of `zigzag_indices`: `y[:, inverse_zigzag_indices(S, n)]` undoes `y = x[:, zigzag_indices(S, n)]`."""
    return np.argsort(zigzag_indices(seq_len, n))


def _take[ArrayT](x: ArrayT, indices: np.ndarray, axis: int) -> ArrayT:
    if isinstance(x, np.ndarray):
        return np.take(x, indices, axis=axis)
    return jnp.take(x, jnp.asarray(indices), axis=axis)


def to_zigzag[ArrayT](x: ArrayT, axis: int = 1, *, n: int) -> ArrayT:
    """Permute the sequence axis `axis` of `x` (numpy or jax) into the zigzag layout for n context devices."""
    return _take(x, zigzag_indices(x.shape[axis], n), axis)


def from_zigzag[ArrayT](x: ArrayT, axis: int = 1, *, n: int) -> ArrayT:
    """Undo `to_zigzag`: the sequence axis `axis` of `x` back in the original token order."""
    return _take(x, inverse_zigzag_indices(x.shape[axis], n), axis)


FULL, DIAG, SKIP, EDGE = 0, 1, 2, 3  # how ring attention computes a causal (query chunk, key chunk) pair


def pair_mode(q_chunk, k_chunk, chunk: int, window: int = 0):
    """How a causal (query chunk, key chunk) pair is computed, from the original chunk ids (ints or jax arrays) and
    the chunk length: FULL (key chunk before the query chunk, inside every query's window), DIAG (the same chunk: a
    triangular mask), SKIP (key chunk after, or every key at or before every query - `window`) or EDGE (before,
    across the edge of some query's window: a window mask). window 0: unlimited."""
    before = FULL
    if window > 0:  # the gap between the last key and the first query; between the first key and the last query
        gap = (q_chunk - k_chunk) * chunk
        before = jnp.where(gap - chunk + 1 >= window, SKIP, jnp.where(gap + chunk - 1 >= window, EDGE, FULL))
    return jnp.where(k_chunk < q_chunk, before, jnp.where(k_chunk == q_chunk, DIAG, SKIP))


def causal_work_balance(n: int, load_balance: str | None) -> tuple[list[int], float]:
    """Causal attention work per device, counted in computed (query chunk, key chunk) pairs.

    Device r computes the pairs (its 2 query chunks) x (all 2n key chunks) with key chunk <= query chunk
    (a diagonal pair counts as one). Returns (pairs per device, max / mean): zigzag gives 2n+1 on every
    device (ratio 1.0); contiguous gives 4r+3 on device r (ratio ~1.82 at n=8).
    """
    ids = slot_chunk_ids(n, load_balance)
    per_device = [sum(k <= int(q) for q in ids[r] for k in range(2 * n)) for r in range(n)]
    return per_device, max(per_device) / (sum(per_device) / n)


def zigzag_batch(batch: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """Put every [batch, seq] array of a host batch into the zigzag layout for `n` context devices."""
    if n <= 1:
        return batch
    return {name: np.ascontiguousarray(to_zigzag(x, axis=1, n=n)) for name, x in batch.items()}
