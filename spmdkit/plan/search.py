"""The layout search of `spmdkit plan`: enumerate meshes worth trying and the settings on each, keep the layouts that
fit, rank them by estimated step time. The arithmetic of one layout is `spmdkit.plan.estimate`.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig
from spmdkit.models.lora_config import LoraConfig
from spmdkit.plan.devices import Device
from spmdkit.plan.estimate import REMAT_ORDER, Estimate, evaluate, planner_platform, with_dispatch
from spmdkit.plan.layout import Layout, check_layout
from spmdkit.plan.limits import LIMITS
from spmdkit.plan.memory import memory
from spmdkit.sharding.strategy import mesh_text

LONG_CONTEXT = 16384  # sequences at least this long make context parallelism a candidate


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_meshes(
    m: TransformerConfig, devices: int, gpus_per_node: int, batch: int, seq: int
) -> Iterator[dict[str, int]]:
    """Meshes worth trying: TP a power of two within a node dividing heads, mlp and vocab; PP dividing the layers;
    CP (a power of two) only for sequences of LONG_CONTEXT tokens or more; EP (mixture of experts only) dividing
    the experts, and then no PP (spmdkit's pipeline runs dense blocks only); data x fsdp take the rest, and
    data x fsdp x expert (the batch axes) must divide the batch. A pipeline goes with data parallelism, not fsdp:
    its stages' float32 gradient accumulators are whole on every fsdp device, several times over (XLA 0.12
    compiles a 70B pipeline=4,fsdp=8,tensor=2 step to 2.7 x what the planner counts; docs/jax-limits.md)."""
    powers = [2**k for k in range(devices.bit_length()) if devices % 2**k == 0]
    moe = m.moe_layers > 0
    for T in (t for t in powers if t <= gpus_per_node and not (m.heads % t or m.mlp % t or m.vocab_size % t)):
        for C in [c for c in powers if c * T <= devices and seq % (2 * c) == 0] if seq >= LONG_CONTEXT else [1]:
            for X in (x for x in _divisors(m.experts) if devices % (T * C * x) == 0) if moe else [1]:
                rest = devices // (T * C * X)
                for P in (p for p in _divisors(rest) if m.layers % p == 0 and not (moe and p > 1)):
                    for F in (f for f in _divisors(rest // P) if m.embed % f == 0 and (P == 1 or f == 1)):
                        D = rest // P // F
                        if batch % (D * F * X) == 0:
                            yield {"data": D, "pipeline": P, "fsdp": F, "context": C, "expert": X, "tensor": T}


def _variants(model: TransformerConfig, mesh: dict[str, int], batch_size: int, seq_len: int, zero: int | None,
              sequence_parallel: bool | None, remat: str | None, microbatches: int | None, schedule: str | None,
              virtual_stages: int | None, offload: bool, muon: bool,
              lora: LoraConfig | None = None) -> list[list[Layout]]:  # fmt: skip
    """Layouts to try on `mesh`: per (ZeRO stage, context algorithm, pipeline schedule), every remat policy (least
    recompute first) with every microbatch count. Settings left None are searched: ZeRO 2 and 3 where fsdp x context
    > 1 (the state axes); SP wherever tensor > 1; 1F1B and interleaved (v=2) pipelines; accumulation steps (powers
    of two) or pipeline microbatches P, 2P, 4P, 8P and one sequence per data-parallel rank."""
    T, P, F = mesh["tensor"], mesh["pipeline"], mesh["fsdp"]
    local_batch = batch_size // (mesh["data"] * F * mesh["expert"])
    sp = bool(T > 1 if sequence_parallel is None else sequence_parallel)
    pipes = (
        [(schedule or "1f1b", virtual_stages or (2 if schedule == "interleaved" else 1))] if P > 1 else [("1f1b", 1)]
    )
    if P > 1 and schedule is None and model.layers % (2 * P) == 0:
        pipes.append(("interleaved", virtual_stages or 2))
    out = []
    stages = [zero] if zero is not None else ([2, 3] if F * mesh["context"] > 1 else [3])
    for z, (cp, u), (sched, v) in itertools.product(stages, _context_algorithms(model, mesh), pipes):
        if microbatches:
            counts = [microbatches]
        elif P == 1:
            counts = [2**k for k in range(local_batch.bit_length()) if local_batch % 2**k == 0]
        else:
            counts = [c for c in sorted({P, 2 * P, 4 * P, 8 * P, local_batch}) if local_batch % c == 0 and c >= P]
        counts = [c for c in counts if c <= LIMITS["--microbatches"][0]] or counts[:1]
        layout = functools.partial(
            Layout, mesh_text(mesh), z, sp, batch_size=batch_size, seq_len=seq_len, muon=muon, lora=lora
        )
        policies = [remat] if remat else REMAT_ORDER
        out.append(
            [layout(M, sched, v, offload, cp, u, model=model.replace(remat=r)) for r in policies for M in counts]
        )
    return out


def _context_algorithms(model: TransformerConfig, mesh: dict[str, int]) -> list[tuple[str, int]]:
    """(--context-parallel, Ulysses factor) to price on `mesh`: none without a context axis; else the ring, Ulysses
    where the heads split over tensor x context, and 2D with each Ulysses factor that splits them (#38)."""
    C, T = mesh["context"], mesh["tensor"]
    if C == 1:
        return [("auto", 1)]
    heads = model.heads // T
    out = [("ring", 1)] + [("ulysses", 1)] * (heads % C == 0)
    return out + [("2d", u) for u in range(2, C) if C % u == 0 and heads % u == 0]


def search(
    model: TransformerConfig,
    meshes: list[dict[str, int]],
    dev: Device,
    batch_size: int,
    seq_len: int,
    *,
    zero: int | None = None,
    sequence_parallel: bool | None = None,
    remat: str | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    offload: bool = False,
    muon: bool = False,
    lora: LoraConfig | None = None,
    efficiency: float = 0.5,
    comm_efficiency: float = 0.8,
) -> tuple[list[Estimate], Estimate | None]:
    """(the layouts that fit, fastest first; the smallest one that does not fit, or None).

    Per mesh and per (ZeRO stage, schedule) of `_variants`: the fastest remat policy and microbatch count that fit
    (full remat without accumulation can beat lighter remat that needs it: FSDP gathers again per microbatch).
    Layouts spmdkit cannot run (indivisible sizes) are skipped. `offload`: every layout keeps the optimizer state in
    host memory (`--optimizer.offload`); `muon`: the optimizer is Muon (`--optimizer.name muon`); `lora`: only LoRA
    adapters train on a frozen base (`--lora.rank`)."""
    fitting, smallest = [], (math.inf, None)
    settings = (zero, sequence_parallel, remat, microbatches, schedule, virtual_stages, offload, muon, lora)
    for mesh in meshes:
        for layouts in _variants(model, mesh, batch_size, seq_len, *settings):
            fit = []
            for layout in layouts:
                try:
                    check_layout(layout)
                except SpmdkitError:
                    continue
                layout = with_dispatch(layout, planner_platform(dev))  # --moe-dispatch auto, as evaluate has it
                need = sum(memory(layout, planner_platform(dev), dev.compute_capability).values())
                if need <= dev.hbm_bytes:
                    fit.append(evaluate(layout, dev, efficiency, comm_efficiency))
                smallest = min(smallest, (need, layout), key=lambda x: x[0])
            if fit:  # the fastest policy and microbatch count: more recompute can be faster than accumulating
                fitting.append(min(fit, key=lambda e: e.step_s))
    fitting.sort(key=lambda e: (e.step_s, e.total_memory))
    return fitting, (evaluate(smallest[1], dev, efficiency, comm_efficiency) if smallest[1] else None)
