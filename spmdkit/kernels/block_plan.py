"""The schedule of the blockwise attention kernel, in plain Python: which (query block, key block) pairs it
computes, in which steps. The kernel (`spmdkit.kernels.blockwise_attention`) runs it; the planner
(`spmdkit.plan.estimate`) reads its largest step to size the kernel's scratch memory.

Step t pairs every query block with the t-th of the key blocks it needs, counted back from its last one (causal:
step 0 is the diagonal); a step holds at most `STEP_SCORES` scores per (batch row, head), so long sequences split a
step in several. Causal pairs whose key block lies wholly after the query block are never listed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

BLOCK_Q = 512  # defaults; both are cut to the sequence length when it is shorter
BLOCK_K = 512
STEP_SCORES = 2**22  # score elements per (batch row, head) one step may hold: it caps the pairs per step


@dataclasses.dataclass(frozen=True)
class Step:
    """One batch of block pairs: query block q[i] with key block k[i]; which masks the pairs need."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    causal_mask: bool  # some pair holds keys after some of its queries
    length_mask: bool  # some pair holds padded keys (positions >= seq)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Static description of one call (hashable: a custom_vjp non-differentiable argument)."""

    seq: int
    block_q: int
    block_k: int
    causal: bool
    scale: float

    @property
    def num_q(self) -> int:
        return math.ceil(self.seq / self.block_q)

    @property
    def num_k(self) -> int:
        return math.ceil(self.seq / self.block_k)

    def key_blocks(self, i: int) -> range:
        """Key blocks query block i needs: all, or (causal) those starting at or before its last position."""
        if not self.causal:
            return range(self.num_k)
        return range(min(self.num_k, ((i + 1) * self.block_q - 1) // self.block_k + 1))

    @functools.cached_property
    def steps(self) -> tuple[Step, ...]:
        needed = [self.key_blocks(i) for i in range(self.num_q)]
        most = max(1, STEP_SCORES // (self.block_q * self.block_k))
        steps = []
        for t in range(max(len(n) for n in needed)):
            pairs = [(i, n[-1 - t]) for i, n in enumerate(needed) if len(n) > t]
            for start in range(0, len(pairs), most):
                steps.append(self._step(pairs[start : start + most]))
        return tuple(steps)

    def _step(self, pairs: list[tuple[int, int]]) -> Step:
        causal = self.causal and any((j + 1) * self.block_k - 1 > i * self.block_q for i, j in pairs)
        padded = any((j + 1) * self.block_k > self.seq for _, j in pairs)
        return Step(tuple(i for i, _ in pairs), tuple(j for _, j in pairs), causal, padded)

    def widest_step(self) -> int:
        """The most pairs one step holds (it sizes the kernel's scratch memory)."""
        return max(len(s.q) for s in self.steps)
