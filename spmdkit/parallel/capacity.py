"""Expert capacity: how many token slots each expert gets per routing group (a sequence). Pure Python, shared by
the dispatch program (`spmdkit.parallel.experts`) and the planner."""

from __future__ import annotations

import math


def capacity(seq: int, top_k: int, num_experts: int, factor: float) -> int:
    """Slots per expert per sequence: ceil(factor x seq x top_k / experts), at least 1, at most seq."""
    return max(1, min(seq, math.ceil(factor * seq * top_k / num_experts)))
