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

# The chunk bookkeeping (numpy only: the planner reads it) moved to `chunks`; re-exported here.
from spmdkit.parallel.context.chunks import (
    DIAG,
    EDGE,
    FULL,
    LOAD_BALANCE_MODES,
    SKIP,
    causal_work_balance,
    check_load_balance,
    check_seq_len,
    pair_mode,
    ring_balance,
    ring_steps,
    slot_chunk_ids,
)

__all__ = [
    "DIAG", "EDGE", "FULL", "LOAD_BALANCE_MODES", "SKIP", "causal_work_balance", "check_load_balance",
    "check_seq_len", "from_zigzag", "inverse_zigzag_indices", "pair_mode", "ring_balance", "ring_steps",
    "slot_chunk_ids", "to_zigzag", "zigzag_batch", "zigzag_indices",
]  # fmt: skip


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


def zigzag_batch(batch: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """Put every [batch, seq] array of a host batch into the zigzag layout for `n` context devices."""
    if n <= 1:
        return batch
    return {name: np.ascontiguousarray(to_zigzag(x, axis=1, n=n)) for name, x in batch.items()}
