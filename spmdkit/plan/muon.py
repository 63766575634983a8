"""Muon's terms in the planner: the traffic and FLOPs of its Newton-Schulz iterations on whole matrices, one device
each (`spmdkit.train.step.muon`). Pure arithmetic (no JAX).

A stack of B hidden matrices (a weight's `layers` x `experts` axes; each m x n after the iterations' transpose, m
<= n) on N devices is padded to ceil(B/N) N matrices and moved to whole matrices split over every device, one mesh
axis at a time: per step an all-to-all of the device's share of the padded stack over each axis that splits the
rows or columns, there and back, and over the axes the momentum is replicated on (data) a slice there and an
all-gather of the update back. Each device then runs `ns_steps` iterations on ceil(B/N) matrices of each stack,
4 m^2 n + 2 m^3 FLOPs each (X X^T, A A, B X), in float32 (TF32 on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from spmdkit.models.matrices import STACK_AXES, matrix_axes
from spmdkit.plan.layout import Layout, parameters
from spmdkit.sharding.rules import make_rules

NS_STEPS = 5  # --optimizer.muon-ns-steps' default (a Layout does not carry the run's value)


def _stacks(s: Layout) -> dict[str, tuple[int, int, int]]:
    """Each hidden matrix stack's parameter name -> (B matrices, m, n), m <= n."""
    out = {}
    for name, shape, names in parameters(s.model):
        if (axes := matrix_axes(name, names)) is None:
            continue
        rows, columns = (math.prod(shape[i] for i in group) for group in axes)
        count = math.prod(size for size, logical in zip(shape, names, strict=True) if logical in STACK_AXES)
        out[name] = (count, min(rows, columns), max(rows, columns))
    return out


def muon_collectives(s: Layout, add: Callable[..., None]) -> None:
    """`add(opcode, axes, bytes, overlapped)` Muon's resharding of each stack (module docstring); it runs between
    the backward and the next step's forward, with nothing to hide behind but other stacks' iterations."""
    devices, stacks = math.prod(s.sizes.values()), _stacks(s)
    rules = make_rules(s.zero).optimizer
    stack_axes = {axis for name in STACK_AXES for axis in rules.get(name, ())}  # they split the stack already
    for p in s.params:
        if not (p.matrix and p.trained) or p.name not in stacks:
            continue
        count = stacks[p.name][0]
        share = s.local(p, "optimizer") * (-(-count // devices) * devices) / count  # the padded stack's
        for axis in p.optimizer:
            if axis not in stack_axes:
                add("all-to-all", (axis,), 2 * share, False)
        rest = tuple(x for x, size in s.sizes.items() if size > 1 and x not in p.optimizer)
        if rest:
            add("all-gather", rest, share / math.prod(s[x] for x in rest), False)


def muon_flops(s: Layout, ns_steps: int = NS_STEPS) -> float:
    """Newton-Schulz FLOPs per step on each device: ceil(B/N) matrices of each stack (module docstring)."""
    devices = math.prod(s.sizes.values())
    return sum(-(-b // devices) * ns_steps * (4 * m * m * n + 2 * m**3) for b, m, n in _stacks(s).values())
