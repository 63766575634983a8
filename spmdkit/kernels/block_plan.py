"""The schedule of the blockwise attention kernel, in plain Python: which (query block, key block) pairs it
computes, in which steps. The kernel (`spmdkit.kernels.blockwise_attention`) runs it; the planner
(`spmdkit.plan.estimate`) reads its largest step to size the kernel's scratch memory.

Step t pairs every query block with the t-th of the key blocks it needs, counted back from its last one (causal:
step 0 is the diagonal); a step holds at most `STEP_SCORES` scores per (batch row, head), so long sequences split a
step in several. Causal pairs whose key block lies wholly after the query block are never listed, nor (sliding
window W) pairs whose key block lies wholly before the window of every query of the block (keys j > i - W).

Under a window the partially visible pairs (the diagonal's and the window edge's, about half hidden each) are
halved: each becomes 2 x 2 pairs of half blocks, of which those holding no visible (query, key) are dropped, those
wholly visible kept, and those again partially visible halved again, `SPLIT_DEPTH` times at most (down to 1/8 of a
block); each size runs in steps of its own (`Step.split`: 1, 2, 4, 8, in that order). A window W then costs about
(W + block / 8) / (seq / 2) of full causal's FLOPs (whole blocks: (W + block) / (seq / 2)), most of it in whole
blocks. A windowed plan also holds at most as many scores per step as one query block's key blocks, so the widest
step's scratch is O(block x (W + block)), not O(seq x block). Without a window the plan is unsplit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable

from spmdkit.kernels.attention_spec import AttentionSpec

STEP_SCORES = 2**22  # score elements per (batch row, head) one step may hold: it caps the pairs per step
SPLIT_DEPTH = 3  # a windowed plan halves its partially visible pairs up to this many times (blocks of 512: 64)

Pair = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Step:
    """One batch of block pairs: query block q[i] with key block k[i]; which masks the pairs need. Blocks are of
    block_q / split and block_k / split positions (the plan's blocks when split is 1), numbered at that size."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    causal_mask: bool  # some pair holds keys after some of its queries
    length_mask: bool  # some pair holds padded keys (positions >= seq)
    window_mask: bool = False  # some pair holds keys before the window of some of its queries
    split: int = 1


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Static description of one call (hashable: a custom_vjp non-differentiable argument): `spec` resolved for
    `seq` (`AttentionSpec.resolved`: its blocks at most seq long, its window shorter than seq or 0)."""

    seq: int
    spec: AttentionSpec

    @property
    def block_q(self) -> int:
        return self.spec.block_q

    @property
    def block_k(self) -> int:
        return self.spec.block_k

    @property
    def num_q(self) -> int:
        return math.ceil(self.seq / self.block_q)

    @property
    def num_k(self) -> int:
        return math.ceil(self.seq / self.block_k)

    @property
    def depth(self) -> int:
        """How many times partially visible pairs are halved: under a window, while both block sizes are even, at
        most `SPLIT_DEPTH` times; 0 (nothing split) without a window."""
        depth = 0
        while self.spec.causal and self.spec.window > 0 and depth < SPLIT_DEPTH:
            if (self.block_q >> depth) % 2 or (self.block_k >> depth) % 2:
                break
            depth += 1
        return depth

    def sizes(self, step: Step) -> tuple[int, int]:
        """(query, key) positions per block of the step."""
        return self.block_q // step.split, self.block_k // step.split

    def key_blocks(self, i: int) -> range:
        """Key blocks query block i needs: all, or (causal) those starting at or before its last position and
        (window W) ending after its first position - W."""
        if not self.spec.causal:
            return range(self.num_k)
        first = max(0, i * self.block_q - self.spec.window + 1) // self.block_k if self.spec.window > 0 else 0
        return range(first, min(self.num_k, ((i + 1) * self.block_q - 1) // self.block_k + 1))

    def _seen(self, pair: Pair, split: int) -> tuple[bool, bool]:
        """(some, all): whether some / every (real query, key) of the pair, blocks at `split`, is visible (the
        causal and window rules; padded queries and keys count as hidden for `some`, and are ignored for `all`)."""
        bq, bk = self.block_q // split, self.block_k // split
        q0, q1, k0, k1 = pair[0] * bq, (pair[0] + 1) * bq - 1, pair[1] * bk, (pair[1] + 1) * bk - 1
        if not self.spec.causal:
            return q0 < self.seq and k0 < self.seq, True
        window = self.spec.window if self.spec.window > 0 else self.seq + max(bq, bk)
        some = k0 <= min(q1, self.seq - 1) and min(k1, self.seq - 1) > q0 - window and q0 < self.seq
        return some, k1 <= q0 and k0 > q1 - window

    def _levels(self) -> list[tuple[int, list[Pair]]]:
        """(split, pairs) per level: the whole pairs fully visible (split 1), then, halving the partially visible
        ones `depth` times, the sub-block pairs fully visible at split 2, 4, ...; the last level keeps its
        partially visible sub-block pairs too. Sub-block pairs holding no visible (query, key) are dropped."""
        pairs, split, levels = [(i, j) for i in range(self.num_q) for j in self.key_blocks(i)], 1, []
        for _ in range(self.depth):
            levels.append((split, [p for p in pairs if self._seen(p, split)[1]]))
            split *= 2
            halves = (
                (2 * i + a, 2 * j + c)
                for i, j in pairs
                if not self._seen((i, j), split // 2)[1]
                for a in (0, 1)
                for c in (0, 1)
            )
            pairs = [p for p in halves if self._seen(p, split)[0]]
        return [*levels, (split, pairs)]

    @functools.cached_property
    def steps(self) -> tuple[Step, ...]:
        most = max(1, STEP_SCORES // (self.block_q * self.block_k))
        if self.spec.window > 0:  # the scratch of a step scales with the window, not with the sequence
            most = min(most, max(len(self.key_blocks(i)) for i in range(self.num_q)))
        return tuple(step for split, pairs in self._levels() for step in self._layers(pairs, most * split**2, split))

    def _layers(self, pairs: Iterable[Pair], most: int, split: int) -> list[Step]:
        """Layer t: each query block with the t-th of its key blocks counted back from its last, at most `most`
        pairs per step (a query block appears at most once in a step: the forward sets its state)."""
        keys: dict[int, list[int]] = {}
        for i, j in sorted(pairs, key=lambda p: (p[0], -p[1])):  # each query block's keys, its last one first
            keys.setdefault(i, []).append(j)
        steps = []
        for t in range(max(map(len, keys.values()), default=0)):
            layer = [(i, n[t]) for i, n in keys.items() if len(n) > t]
            for start in range(0, len(layer), most):
                steps.append(self._step(layer[start : start + most], split))
        return steps

    def _step(self, pairs: list[Pair], split: int) -> Step:
        bq, bk = self.block_q // split, self.block_k // split
        causal = self.spec.causal and any((j + 1) * bk - 1 > i * bq for i, j in pairs)
        padded = any((j + 1) * bk > self.seq for _, j in pairs)
        windowed = (
            self.spec.causal
            and self.spec.window > 0
            and any(j * bk <= (i + 1) * bq - 1 - self.spec.window for i, j in pairs)
        )
        return Step(tuple(i for i, _ in pairs), tuple(j for _, j in pairs), causal, padded, windowed, split)

    def scores(self, step: Step) -> int:
        """Score elements per (batch row, head) the step holds."""
        bq, bk = self.sizes(step)
        return len(step.q) * bq * bk

    def widest_step(self) -> int:
        """The most score elements per (batch row, head) one step holds (it sizes the kernel's scratch memory)."""
        return max(map(self.scores, self.steps))
