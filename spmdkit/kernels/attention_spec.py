"""What one layer's attention computes, besides q, k, v and the segment ids: one frozen record every kernel takes.

`AttentionSpec(causal, window, scale, softcap, block_q, block_k, key_tile)`, with one meaning in every kernel:
`window` W > 0 (sliding-window attention, causal only: a query at position i sees keys i - W < j <= i, W keys
including itself; 0: unlimited), `scale` (the multiplier of q k^T; None: 1/sqrt(head_dim)), `softcap` c > 0
(Gemma 2's logit soft cap: scores s become c tanh(s / c) before masking and softmax; 0: off), `block_q`, `block_k`
(positions per query and key block of the blockwise kernel) and `key_tile` (keys per tile of a ring chunk pair;
None: `ring_key_tile`). The constructor checks them once (one SpmdkitError line each); `resolved(head_dim, seq)`
fixes what depends on the shapes. Pure Python: the planner (JAX-free) reads the block schedule built on it.
"""

from __future__ import annotations

import dataclasses
import math

from spmdkit.errors import SpmdkitError

BLOCK_Q = 512  # defaults; both are cut to the sequence length when it is shorter
BLOCK_K = 512
KEY_TILE = 512  # keys per tile inside a ring chunk pair: bounds attention scratch at long context


def ring_key_tile(chunk: int) -> int:
    """Keys per tile of a ring chunk of `chunk` positions: `KEY_TILE` when it divides a longer chunk, else whole."""
    return KEY_TILE if chunk % KEY_TILE == 0 and chunk > KEY_TILE else chunk


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static options of one attention call (hashable: kernels pass it as a custom_vjp static argument)."""

    causal: bool = True
    window: int = 0
    scale: float | None = None
    softcap: float = 0.0
    block_q: int = BLOCK_Q
    block_k: int = BLOCK_K
    key_tile: int | None = None

    def __post_init__(self) -> None:
        if self.window < 0 or (self.window > 0 and not self.causal):
            raise SpmdkitError(f"attention: window={self.window} must be 0 (unlimited) or, with causal=True, positive")
        if self.softcap < 0 or not math.isfinite(self.softcap):
            raise SpmdkitError(f"attention: softcap={self.softcap} must be 0 (off) or positive")
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale > 0):
            raise SpmdkitError(f"attention: scale={self.scale} must be positive (None: 1/sqrt(head_dim))")
        if self.block_q < 1 or self.block_k < 1:
            raise SpmdkitError(f"block_q={self.block_q} and block_k={self.block_k} must be positive")

    @classmethod
    def of_layer(cls, window: int, scale: float, softcap: float, block: int) -> AttentionSpec:
        """A causal layer's spec from its config fields (`scale` 0: 1/sqrt(head_dim); `block`: both block sizes)."""
        return cls(True, window, scale or None, float(softcap), block, block)

    def resolved(self, head_dim: int, seq: int) -> AttentionSpec:
        """The spec of a call on these shapes: the scale a float, a window as long as the sequence dropped (it
        hides nothing), the blocks cut to the sequence."""
        scale = head_dim**-0.5 if self.scale is None else float(self.scale)
        window = self.window if self.window < seq else 0
        return dataclasses.replace(
            self, scale=scale, window=window, block_q=min(self.block_q, seq), block_k=min(self.block_k, seq)
        )
