"""The layout planner: per-device memory, collective traffic, pipeline bubble, step time and MFU of a mesh layout,
and a recommended layout when none is given. Pure arithmetic (no JAX): `spmdkit plan` answers without a GPU.

Notation: N parameters, L layers, E embed, H/K query/kv heads of width d, F mlp width, V vocab; a = bytes of the
compute dtype, p = 4 (float32 parameters); mesh sizes D data, P pipeline, Fs fsdp, C context, T tensor;
B global batch (sequences) of S tokens, M microbatches; t = B S / (D Fs C) tokens per device per step.

Memory per device (each parameter tensor divided by the mesh axes its logical names map to, as
`spmdkit.sharding.rules.make_rules` maps them: heads/kv_heads/mlp/vocab -> tensor, layers -> pipeline,
embed -> fsdp for parameters at ZeRO-3, for optimizer state at ZeRO >= 1, for gradients at ZeRO >= 2):
  parameters p N/shards, gradients p N/shards (x2 while accumulating microbatches), AdamW moments 2 p N/shards;
  compute-dtype copies (one layer cast at use, a != p); communication buffers (two gathered layers under ZeRO-3);
  activations = tokens in flight x bytes per token (below).
Activation bytes per token per layer (r = a E, divided by T under SP; heads and mlp widths divided by T):
  none:   4r + a(H+2K)d + aHd + 3aF + (4+a) H S  [the last term: `dot` attention keeps the float32 softmax and
          its compute-dtype copy, [H, S] per query; ring attention (C > 1) keeps out + lse instead]
  dots_with_no_batch_dims_saveable: 3r + a(H+2K)d + 2aF    dots_saveable: that + aHd + 4 H S (the f32 scores)
  full:   r (the block input), plus one layer's "none" set while it is recomputed.
  Pipeline (spmdkit's 1F1B/interleaved recompute each chunk from its stashed input): stash slots (1F1B: P,
  GPipe: M, interleaved: 2(P-1)+(v-1)P) x [t/M, E] + one chunk's activations; GPipe keeps all M microbatches.
Collective operand bytes per device per step, by opcode (what `collective_report` reads from the HLO):
  DP: all-reduce of the gradients. ZeRO-1: same, then all-gather of the updated parameter shards.
  ZeRO-2/3 over fsdp: reduce-scatter of the gradients (operand = full local gradient), all-reduce of the shard
  over data (and context); ZeRO-3 all-gathers each layer's shard twice per microbatch (forward, backward), the
  head's and the embedding's (in the compute dtype) once.
  TP per layer: 2 all-reduces of [t, E] forward (again under full remat), 2 backward on GPU/TPU; XLA:CPU has no
  AllReduceReassociate and reduces each column-parallel projection's input gradient separately: 5 (q, k, v, gate,
  up; 3 when kv heads are replicated). + [t, E] each for the vocab-parallel embedding and LM head, + 3 [t] float32
  for the cross-entropy. SP: each forward all-reduce -> reduce-scatter [t, E] + all-gather [t/T, E], + 2
  all-gathers per layer backward (the backward sums stay all-reduces on CPU, reduce-scatters on GPU/TPU).
  CP ring: (C-1) K/V hops forward, (C-1) K/V + C f32 dK/dV hops backward per layer. PP: 2 ppermutes of [t/M, E]
  per tick, 2(vM+P-1) ticks (GPipe: 2(M+P-1) sends), + all-reduce over pipeline of embedding and head gradients.
Wire bytes (ring): all-reduce 2(n-1)/n x operand, reduce-scatter and all-to-all (n-1)/n x operand, all-gather
(n-1) x operand (the operand is the shard), ppermute 1 x; on NVLink when the axes stay in a node, else InfiniBand.
Time: compute = FLOPs / (devices x peak x efficiency); FLOPs = model FLOPs (6N + attention) + recomputation (full
remat, and spmdkit's 1F1B/interleaved chunk recompute: a forward each, +1/3; dots_with_no_batch_dims_saveable: the
attention forward); float32 runs at half the bf16 peak (TF32). Gradient and parameter traffic overlaps compute
(exposed: the excess over compute, at least one layer's share); activation traffic (TP/SP, PP) is exposed. Bubble
b = (P-1)/(M+P-1), interleaved (P-1)/(vM+P-1), adds (compute + exposed) b/(1-b). Step = compute + exposed +
bubble; tokens/s = B S / step; MFU = model FLOPs / (step x devices x peak bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from collections.abc import Mapping

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import PRESETS, TransformerConfig, model_preset
from spmdkit.plan_devices import (
    AXES,
    DEVICE_TYPES,
    Device,
    candidate_meshes,
    format_mesh,
    make_device,
    node_local_axes,
    parse_mesh,
    wire_bytes,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SCHEDULES = ("gpipe", "1f1b", "interleaved")  # = spmdkit.sharding.pipeline_schedule.KINDS
REMAT_ORDER = ("none", "dots_saveable", "dots_with_no_batch_dims_saveable", "full")  # least recompute first


def parameters(m: TransformerConfig) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """(name, shape, logical names) of every parameter as `spmdkit.models.transformer` builds it."""
    E, H, K, d, F, V, L = m.embed, m.heads, m.kv_heads, m.head_dim, m.mlp, m.vocab_size, m.layers
    block = [
        ("attention_norm", (E,), ("norm",)),
        ("q", (E, H, d), ("embed", "heads", "head_dim")),
        ("k", (E, K, d), ("embed", "kv_heads", "head_dim")),
        ("v", (E, K, d), ("embed", "kv_heads", "head_dim")),
        ("o", (H, d, E), ("heads", "head_dim", "embed")),
        ("mlp_norm", (E,), ("norm",)),
        ("gate", (E, F), ("embed", "mlp")),
        ("up", (E, F), ("embed", "mlp")),
        ("down", (F, E), ("mlp", "embed")),
    ]
    stack = [(name, (L, *shape), ("layers", *names)) for name, shape, names in block]
    return [("embedding", (V, E), ("vocab", "embed")), *stack, ("final_norm", (E,), ("norm",)),
            ("lm_head", (E, V), ("embed", "vocab"))]  # fmt: skip


def table(zero: int, kind: str) -> dict[str, str]:
    """Logical name -> mesh axis for `kind` in params / optimizer / grads, as `make_rules(zero)` maps them."""
    embed = {"params": zero == 3, "optimizer": zero >= 1, "grads": zero >= 2}[kind]
    names = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor", "experts": "expert"}
    return {**names, "layers": "pipeline", **({"embed": "fsdp"} if embed else {})}


@dataclasses.dataclass(frozen=True)
class Sharded:
    """One parameter's float32 bytes, the mesh axes its value, optimizer moments and gradient are split over, and
    `divisor[kind]`: (the product of those axes, the same without fsdp)."""

    name: str
    nbytes: int
    params: tuple[str, ...]
    optimizer: tuple[str, ...]
    grads: tuple[str, ...]
    divisor: dict[str, tuple[int, int]]

    @property
    def stacked(self) -> bool:
        return self.name not in ("embedding", "final_norm", "lm_head")


@functools.cache
def sharded(m: TransformerConfig, mesh: tuple[tuple[str, int], ...], zero: int) -> tuple[Sharded, ...]:
    """Every parameter under the rules; kv_heads replicate when the axis does not divide them (as rules.py)."""
    sizes, out = dict(mesh), []
    for name, shape, names in parameters(m):
        axes = {}
        for kind in ("params", "optimizer", "grads"):
            rules, axes[kind] = table(zero, kind), []
            for size, logical in zip(shape, names, strict=True):
                axis = rules.get(logical)
                if axis is None or sizes[axis] == 1 or (logical == "kv_heads" and size % sizes[axis]):
                    continue
                if size % sizes[axis]:
                    raise SpmdkitError(
                        f"parameter {name} {shape}: {logical}={size} is not divisible by mesh axis {axis}="
                        f"{sizes[axis]}; change the model size or the mesh"
                    )
                axes[kind].append(axis)
        divisor = {
            k: (math.prod(sizes[x] for x in v), math.prod(sizes[x] for x in v if x != "fsdp")) for k, v in axes.items()
        }
        out.append(
            Sharded(name, 4 * math.prod(shape), *(tuple(axes[k]) for k in ("params", "optimizer", "grads")), divisor)
        )
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A step's layout: the model (with its compute dtype and remat policy), mesh sizes, batch, ZeRO stage, SP,
    microbatches (gradient accumulation, or pipeline microbatches when pipeline > 1) and pipeline schedule."""

    model: TransformerConfig
    mesh: tuple[tuple[str, int], ...]
    batch_size: int
    seq_len: int
    zero: int = 3
    sequence_parallel: bool = False
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    def __getitem__(self, axis: str) -> int:
        return self.sizes[axis]

    def local(self, p: Sharded, kind: str, gathered: bool = False) -> float:
        """Bytes of `p` (value, optimizer moment or gradient) on a device; `gathered`: as if not split over fsdp."""
        return p.nbytes / p.divisor[kind][gathered]

    @functools.cached_property
    def params(self) -> tuple[Sharded, ...]:
        return sharded(self.model, self.mesh, self.zero)

    @property
    def a(self) -> int:
        return DTYPE_BYTES[self.model.dtype]

    @property
    def tokens(self) -> float:
        """t: this device's tokens per step (batch over data x fsdp, sequence over context)."""
        return self.batch_size * self.seq_len / (self["data"] * self["fsdp"] * self["context"])

    @property
    def stage_layers(self) -> float:
        return self.model.layers / self["pipeline"]


@dataclasses.dataclass
class Estimate:
    """What a layout costs per device and per step. Bytes are per device, times in seconds."""

    model: str
    mesh: dict[str, int]
    device: str
    batch_size: int
    seq_len: int
    dtype: str
    remat: str
    zero: int
    sequence_parallel: bool
    microbatches: int
    schedule: str
    virtual_stages: int
    memory: dict[str, float]  # parameters, gradients, optimizer, compute_copies, comm_buffers, activations
    hbm_bytes: float
    collective_bytes: dict[str, float]  # opcode -> operand bytes per step, as collective_report reads them
    traffic: dict[str, dict[str, float | str]]  # "axis[+axis]" -> link, wire_bytes, seconds
    bubble: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    step_s: float
    tokens_per_s: float
    mfu: float

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.total_memory <= self.hbm_bytes

    @property
    def margin(self) -> float:
        """HBM left over (negative: short by that much)."""
        return self.hbm_bytes - self.total_memory

    @property
    def state_bytes(self) -> float:
        """Parameters + optimizer state: what the compiled step takes as arguments besides the batch."""
        return self.memory["parameters"] + self.memory["optimizer"]

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_memory": self.total_memory, "fits": self.fits, "margin": self.margin}


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(P-1)/(vM+P-1): the idle share of a GPipe or 1F1B (v=1) or interleaved pipeline."""
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def stash_slots(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> int:
    """Stage inputs held at once (stage 0): GPipe M, 1F1B min(P, M), interleaved min(2(P-1)+(v-1)P, vM)."""
    P, M, v = stages, microbatches, virtual_stages
    return {"gpipe": M, "1f1b": min(P, M), "interleaved": min(2 * (P - 1) + (v - 1) * P, v * M)}[schedule]


def activation_bytes(m: TransformerConfig, T: int, sp: bool, C: int, seq: int) -> tuple[float, float]:
    """(bytes kept per token per layer under `m.remat`, per token of one layer's recompute); see the module doc."""
    a, E, H, d, F = DTYPE_BYTES[m.dtype], m.embed, m.heads / T, m.head_dim, m.mlp / T
    K = m.kv_heads / T if m.kv_heads % T == 0 else m.kv_heads
    r = a * E / (T if sp else 1)
    qkv, out = a * (H + 2 * K) * d, a * H * d
    none = 4 * r + qkv + out + 3 * a * F + ((4 + a) * H * seq if C == 1 else 4 * H)
    kept = {
        "none": none,
        "dots_with_no_batch_dims_saveable": 3 * r + qkv + 2 * a * F,
        "dots_saveable": 3 * r + qkv + 2 * a * F + out + (4 * H * seq if C == 1 else 0),
        "full": r,
    }[m.remat]
    return kept, (0.0 if m.remat == "none" else none)


@dataclasses.dataclass
class Collective:
    """One kind of collective of a step: opcode, the mesh axes of its groups, operand bytes per device per step."""

    opcode: str
    axes: tuple[str, ...]
    operand_bytes: float
    overlapped: bool  # gradient/parameter traffic hides behind compute; activation traffic does not


def collectives(s: Layout, reassociate: bool = True) -> list[Collective]:
    """The step's collectives (formulas in the module docstring); `reassociate`: XLA's GPU/TPU passes run."""
    m, a, E, T, P, M = s.model, s.a, s.model.embed, s["tensor"], s["pipeline"], s.microbatches
    act, out = s.tokens * E * a, []

    def add(opcode: str, axes: tuple[str, ...], nbytes: float, overlapped: bool = True) -> None:
        axes = tuple(x for x in axes if s[x] > 1)
        if axes and nbytes > 0:
            out.append(Collective(opcode, axes, nbytes, overlapped))

    for p in s.params:
        full = s.local(p, "grads", gathered=True)  # the gradient before any fsdp reduction
        if "fsdp" in p.grads:
            add("reduce-scatter", ("fsdp",), full)
            add("all-reduce", ("data", "context"), full / s["fsdp"])
        else:  # replicated gradients; norm scales under SP also sum over the sequence shards on `tensor`
            norm_sp = ("tensor",) if s.sequence_parallel and p.name.endswith("norm") else ()
            add("all-reduce", ("data", "fsdp", "context", *norm_sp), full)
        if not p.stacked and P > 1:  # embedding and head are replicated over pipeline: psum of their gradients
            add("all-reduce", ("pipeline",), s.local(p, "grads"))
        if "fsdp" in p.optimizer and s.zero < 3:
            add("all-gather", ("fsdp",), s.local(p, "optimizer"))  # the updated parameters, once per step
        elif "fsdp" in p.params:
            # Per microbatch: the scanned layers are gathered in the forward and again in the backward; the head,
            # outside the scan, once; the embedding table once, cast to the compute dtype before the gather.
            gathers, nbytes = {"embedding": (1, a / 4), "lm_head": (1, 1)}.get(p.name, (2, 1))
            add("all-gather", ("fsdp",), M * gathers * nbytes * s.local(p, "params"))
    if T > 1:
        layers, ends = s.stage_layers, 1 if P > 1 else 2  # ends: embedding forward, LM-head input grad backward
        forward = 2 * layers * (2 if m.remat == "full" else 1)  # full remat repeats the forward's collectives
        # Backward: each block sums the partial input gradients of its column-parallel projections (q, k, v;
        # gate, up). GPU/TPU XLA sums before reducing (AllReduceReassociate; under SP, ReduceScatterCreator then
        # makes it a reduce-scatter): one per block. XLA:CPU has neither pass: one all-reduce per projection.
        per_projection = 3 + (2 if m.kv_heads % T == 0 else 0)  # k, v only when their heads are split
        backward = 2 * layers if reassociate else per_projection * layers
        if s.sequence_parallel:
            add("reduce-scatter", ("tensor",), (forward + ends + reassociate * backward) * act, overlapped=False)
            add("all-gather", ("tensor",), (forward + 2 * layers + ends) * act / T, overlapped=False)
        else:
            add("all-reduce", ("tensor",), (forward + ends + reassociate * backward) * act, overlapped=False)
        # + the CPU backward, and the vocab-parallel cross-entropy's max, sum and target logit ([t] float32 each)
        add("all-reduce", ("tensor",), (not reassociate) * backward * act + 3 * s.tokens * 4, overlapped=False)
    if s["context"] > 1:  # ring attention: K/V forward (again under full remat) and backward, f32 dK/dV home
        C, kv_heads = s["context"], m.kv_heads / T if m.kv_heads % T == 0 else m.kv_heads
        hops = (C - 1) * a * (3 if m.remat == "full" else 2) + C * 4
        add("collective-permute", ("context",), s.stage_layers * s.tokens * 2 * m.head_dim * kv_heads * hops)
    if P > 1:
        sends = 2 * (M + P - 1) if s.schedule == "gpipe" else 4 * (s.virtual_stages * M + P - 1)
        add("collective-permute", ("pipeline",), sends * act / M / (T if s.sequence_parallel else 1), False)
    return out


def memory(s: Layout) -> dict[str, float]:
    """Per-device bytes by component (formulas in the module docstring)."""
    m, a, E, T, P, M = s.model, s.a, s.model.embed, s["tensor"], s["pipeline"], s.microbatches
    gathers = s.zero == 3 and s["fsdp"] > 1
    used = {p.name: s.local(p, "params", gathered=gathers) for p in s.params}  # as the math sees it
    layer = sum(used[p.name] for p in s.params if p.stacked) / s.stage_layers
    mb, seq_split = s.tokens / M, T if s.sequence_parallel else 1
    kept, recompute = activation_bytes(m, T, s.sequence_parallel, s["context"], s.seq_len)
    acts = mb * recompute + mb * (m.vocab_size / T * 4 * 2 + E * a)  # + f32 logits and their gradient, embeddings
    if P == 1:
        acts += s.stage_layers * mb * kept
    elif s.schedule == "gpipe":  # autodiff through the forward loop keeps every microbatch
        acts += M * s.stage_layers * mb * kept + 2 * s.tokens * E * a / seq_split
    else:  # spmdkit recomputes a chunk from its stashed input; + pipeline inputs and their gradient accumulator
        slots = stash_slots(s.schedule, P, M, s.virtual_stages) + max(1, P // 2 if s.virtual_stages > 1 else 1)
        acts += (slots * mb + 2 * s.tokens) * E * a / seq_split + s.stage_layers / s.virtual_stages * mb * kept
    return {
        "parameters": sum(s.local(p, "params") for p in s.params),
        "gradients": sum(s.local(p, "grads") for p in s.params) * (2 if M > 1 and P == 1 else 1),  # + accumulator
        "optimizer": 2 * sum(s.local(p, "optimizer") for p in s.params),  # AdamW's two float32 moments
        "compute_copies": (layer + used["lm_head"]) * a / 4 if a != 4 else 0.0,  # one layer and the head, cast
        "comm_buffers": (2 * layer + used["lm_head"] if gathers else 0.0) + (2 * mb * E * a if T > 1 else 0.0),
        "activations": acts,
    }


def estimate(
    model: TransformerConfig | str,
    mesh: Mapping[str, int] | str,
    *,
    device: Device | str = "h100",
    devices: int | None = None,
    batch_size: int | None = None,
    seq_len: int = 4096,
    zero: int = 3,
    sequence_parallel: bool = False,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    efficiency: float = 0.5,
    comm_efficiency: float = 0.8,
) -> Estimate:
    """Memory, traffic, bubble, step time and MFU of one layout; the model's `dtype` and `remat` are used.

    `mesh`: axis sizes or a string like "data=2,tensor=4" (`devices` fills a -1); `batch_size` in sequences
    (default: about 1M tokens, a multiple of data x fsdp); `microbatches` (default: 1, or with a pipeline one
    sequence per data-parallel rank per microbatch); `efficiency`: achieved share of peak FLOP/s;
    `comm_efficiency`: achieved share of link bandwidth.
    """
    m = model_preset(model) if isinstance(model, str) else model
    dev = make_device(device) if isinstance(device, str) else device
    if not (0 < efficiency <= 1 and 0 < comm_efficiency <= 1):
        raise SpmdkitError(f"efficiencies must be in (0, 1], got {efficiency} and {comm_efficiency}")
    if isinstance(mesh, str):
        sizes = parse_mesh(mesh, devices)
    else:
        sizes = parse_mesh(",".join(f"{axis}={size}" for axis, size in mesh.items()), devices)
    replicas = sizes["data"] * sizes["fsdp"]
    batch_size = batch_size or replicas * max(1, round(2**20 / seq_len / replicas))
    if microbatches is None:
        microbatches = batch_size // replicas if sizes["pipeline"] > 1 else 1
    mesh_items = tuple(sizes.items())
    layout = Layout(m, mesh_items, batch_size, seq_len, zero, sequence_parallel, microbatches, schedule, virtual_stages)
    check_layout(layout)
    return evaluate(layout, dev, efficiency, comm_efficiency)


def check_layout(s: Layout) -> None:
    """SpmdkitError with a one-line fix for layouts spmdkit cannot run."""
    P, M, v, replicas = s["pipeline"], s.microbatches, s.virtual_stages, s["data"] * s["fsdp"]
    if s.zero not in (0, 1, 2, 3):
        raise SpmdkitError(f"ZeRO stage {s.zero} is not one of 0, 1, 2, 3")
    if s.schedule not in SCHEDULES:
        raise SpmdkitError(f"unknown pipeline schedule {s.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if min(s.batch_size, s.seq_len, M, v) < 1:
        raise SpmdkitError("batch size, sequence length, microbatches and virtual stages must be positive")
    if s.batch_size % (replicas * M):
        raise SpmdkitError(
            f"batch {s.batch_size} does not split into {M} microbatches over data x fsdp = {replicas} devices: "
            f"use a multiple of {replicas * M}"
        )
    if s.model.layers % (P * v):
        raise SpmdkitError(f"{s.model.layers} layers do not split into {P} stages x {v} virtual stages")
    if v > 1 and s.schedule != "interleaved":
        raise SpmdkitError(f"{v} virtual stages need the interleaved pipeline schedule")
    if P > 1 and s.schedule != "gpipe" and (M < P or (s.schedule == "interleaved" and M % P)):
        raise SpmdkitError(f"{s.schedule} needs microbatches >= stages (a multiple for interleaved), got {M}, {P}")
    if s["context"] > 1 and s.seq_len % (2 * s["context"]):
        raise SpmdkitError(f"sequence {s.seq_len} does not split into 2 x context = {2 * s['context']} chunks")
    if s["expert"] > 1:
        raise SpmdkitError("expert parallelism needs a mixture-of-experts model; TransformerConfig is dense")
    s.params  # noqa: B018  (raises if an axis does not divide a parameter)


def evaluate(s: Layout, dev: Device, efficiency: float = 0.5, comm_efficiency: float = 0.8) -> Estimate:
    """The Estimate of a checked layout on `dev`."""
    m, sizes = s.model, s.sizes
    devices, local = math.prod(sizes.values()), node_local_axes(sizes, dev.gpus_per_node)
    by_opcode: dict[str, float] = {}
    traffic: dict[str, dict[str, float | str]] = {}
    hidden = blocking = 0.0
    for c in collectives(s, reassociate=dev.backend != "cpu"):
        by_opcode[c.opcode] = by_opcode.get(c.opcode, 0.0) + c.operand_bytes
        n, link = math.prod(sizes[x] for x in c.axes), "nvlink" if set(c.axes) <= local else "infiniband"
        wire = wire_bytes(c.opcode, n, c.operand_bytes)
        seconds = wire / ((dev.intra_node_bw if link == "nvlink" else dev.inter_node_bw) * comm_efficiency)
        row = traffic.setdefault("+".join(c.axes), {"link": link, "wire_bytes": 0.0, "seconds": 0.0})
        row["wire_bytes"], row["seconds"] = float(row["wire_bytes"]) + wire, float(row["seconds"]) + seconds
        hidden, blocking = hidden + seconds * c.overlapped, blocking + seconds * (not c.overlapped)
    model_flops = m.flops_per_token(s.seq_len) * s.batch_size * s.seq_len
    attention_forward = 2 * m.layers * m.heads * m.head_dim * s.seq_len * s.batch_size * s.seq_len
    extra = {"full": model_flops / 3, "dots_with_no_batch_dims_saveable": attention_forward}.get(m.remat, 0.0)
    if sizes["pipeline"] > 1 and s.schedule != "gpipe":  # spmdkit's 1F1B backward recomputes the chunk forward
        extra += model_flops / 3
    peak = dev.peak_flops * (0.5 if m.dtype == "float32" else 1.0)  # float32 matmuls run as TF32, about half rate
    compute = (model_flops + extra) / devices / (peak * efficiency)
    exposed = blocking + max(hidden - compute, hidden / s.stage_layers)
    bubble = bubble_fraction(sizes["pipeline"], s.microbatches, s.virtual_stages)
    bubble_s = (compute + exposed) * bubble / (1 - bubble)
    step = compute + exposed + bubble_s
    return Estimate(
        model=_model_name(m), mesh=sizes, device=dev.name, batch_size=s.batch_size, seq_len=s.seq_len,
        dtype=m.dtype, remat=m.remat, zero=s.zero, sequence_parallel=s.sequence_parallel and sizes["tensor"] > 1,
        microbatches=s.microbatches, schedule=s.schedule, virtual_stages=s.virtual_stages, memory=memory(s),
        hbm_bytes=dev.hbm_bytes, collective_bytes=by_opcode, traffic=traffic, bubble=bubble, compute_s=compute,
        exposed_comm_s=exposed, bubble_s=bubble_s, step_s=step, tokens_per_s=s.batch_size * s.seq_len / step,
        mfu=model_flops / (step * devices * dev.peak_flops),
    )  # fmt: skip


@functools.cache
def _model_name(m: TransformerConfig) -> str:
    names = [n for n, p in PRESETS.items() if p.replace(dtype=m.dtype, remat=m.remat, attention=m.attention) == m]
    return names[0] if names else f"custom ({m.num_params() / 1e9:.3g}B parameters)"


def _variants(model: TransformerConfig, mesh: dict[str, int], batch_size: int, seq_len: int, zero: int | None,
              sequence_parallel: bool | None, remat: str | None, microbatches: int | None, schedule: str | None,
              virtual_stages: int | None) -> list[list[list[Layout]]]:  # fmt: skip
    """Layouts to try on `mesh`: per (ZeRO stage, pipeline schedule), per remat policy (least recompute first), per
    microbatch count. Settings left None are searched: ZeRO 2 and 3 where fsdp > 1; SP wherever tensor > 1; 1F1B
    and interleaved (v=2) pipelines; accumulation steps (powers of two) or pipeline microbatches P, 2P, 4P, 8P and
    one sequence per data-parallel rank."""
    T, P, F = mesh["tensor"], mesh["pipeline"], mesh["fsdp"]
    local_batch, sp = batch_size // (mesh["data"] * F), bool(T > 1 if sequence_parallel is None else sequence_parallel)
    pipes = (
        [(schedule or "1f1b", virtual_stages or (2 if schedule == "interleaved" else 1))] if P > 1 else [("1f1b", 1)]
    )
    if P > 1 and schedule is None and model.layers % (2 * P) == 0:
        pipes.append(("interleaved", virtual_stages or 2))
    out = []
    for z in [zero] if zero is not None else ([2, 3] if F > 1 else [3]):
        for sched, v in pipes:
            if microbatches:
                counts = [microbatches]
            elif P == 1:
                counts = [2**k for k in range(local_batch.bit_length()) if local_batch % 2**k == 0]
            else:
                counts = [c for c in sorted({P, 2 * P, 4 * P, 8 * P, local_batch}) if local_batch % c == 0 and c >= P]
            layout = functools.partial(Layout, mesh=tuple(mesh.items()), batch_size=batch_size, seq_len=seq_len,
                                       zero=z, sequence_parallel=sp, schedule=sched, virtual_stages=v)  # fmt: skip
            policies = [remat] if remat else REMAT_ORDER
            out.append([[layout(model.replace(remat=r), microbatches=M) for M in counts] for r in policies])
    return out


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
    efficiency: float = 0.5,
    comm_efficiency: float = 0.8,
) -> tuple[list[Estimate], Estimate | None]:
    """(the layouts that fit, fastest first; the smallest one that does not fit, or None).

    Per mesh and per (ZeRO stage, schedule) of `_variants`: the least-recompute remat policy that fits, with its
    fastest microbatch count. Layouts spmdkit cannot run (indivisible sizes) are skipped."""
    fitting, smallest = [], (math.inf, None)
    settings = (zero, sequence_parallel, remat, microbatches, schedule, virtual_stages)
    for mesh in meshes:
        for by_policy in _variants(model, mesh, batch_size, seq_len, *settings):
            for layouts in by_policy:
                fit = []
                for layout in layouts:
                    try:
                        check_layout(layout)
                    except SpmdkitError:
                        continue
                    need = sum(memory(layout).values())
                    if need <= dev.hbm_bytes:
                        fit.append(evaluate(layout, dev, efficiency, comm_efficiency))
                    smallest = min(smallest, (need, layout), key=lambda x: x[0])
                if fit:
                    fitting.append(min(fit, key=lambda e: e.step_s))
                    break
    fitting.sort(key=lambda e: (e.step_s, e.total_memory))
    return fitting, (evaluate(smallest[1], dev, efficiency, comm_efficiency) if smallest[1] else None)


def explain(best: Estimate, runner_up: Estimate | None, gpus_per_node: int) -> str:
    """One paragraph: why this layout (TP inside a node, PP across nodes, DP/FSDP outermost, CP for long context)."""
    mesh, local = best.mesh, node_local_axes(best.mesh, gpus_per_node)
    gb = lambda b: f"{b / 1e9:,.0f} GB" if b >= 1e11 else f"{b / 1e9:.3g} GB"  # noqa: E731
    wire = {x: sum(float(r["wire_bytes"]) for g, r in best.traffic.items() if x in g.split("+")) for x in AXES}
    where = {x: "inside a node (NVLink)" if x in local else "across nodes (InfiniBand)" for x in AXES}
    text = [
        f"{format_mesh(mesh)} is the fastest layout that fits: {best.step_s:.3g} s per step, {best.tokens_per_s:,.0f} "
        f"tokens/s, MFU {best.mfu:.0%}, {gb(best.total_memory)} of {gb(best.hbm_bytes)} per device."
    ]
    if mesh["tensor"] > 1:
        text.append(
            f"Tensor parallelism over {mesh['tensor']} runs {where['tensor']}: its {gb(wire['tensor'])} of activation "
            f"collectives per step{' (sequence-parallel)' if best.sequence_parallel else ''} cannot hide behind "
            "compute, so they need the fastest links."
        )
    if mesh["pipeline"] > 1:
        virtual = f" x {best.virtual_stages} virtual stages" if best.virtual_stages > 1 else ""
        text.append(
            f"Pipeline parallelism over {mesh['pipeline']} runs {where['pipeline']}: only stage-boundary activations "
            f"travel ({gb(wire['pipeline'])} per step), and {best.schedule} with {best.microbatches} "
            f"microbatches{virtual} leaves a {best.bubble:.1%} bubble."
        )
    if mesh["fsdp"] > 1 or mesh["data"] > 1:
        state = {0: "nothing", 1: "the optimizer state", 2: "gradients and optimizer state"}.get(best.zero, "all state")
        parts = [f"FSDP over {mesh['fsdp']} (ZeRO-{best.zero}) shards {state}"] if mesh["fsdp"] > 1 else []
        parts += [f"{mesh['data']} data-parallel replicas"] if mesh["data"] > 1 else []
        text.append(
            f"Outermost, {' across '.join(parts)}: their {gb(wire['data'] + wire['fsdp'])} of gradient and parameter "
            "traffic per step overlaps the backward pass."
        )
    if mesh["context"] > 1:
        text.append(
            f"Context parallelism over {mesh['context']} splits the {best.seq_len}-token sequences (ring attention)."
        )
    if best.remat != "none":
        text.append(f"Remat '{best.remat}' is the least recomputation that fits.")
    if runner_up is not None:
        text.append(f"Next: {format_mesh(runner_up.mesh)} ({runner_up.step_s / best.step_s - 1:+.0%} step time).")
    return " ".join(text)


def format_table(estimates: list[Estimate]) -> str:
    """One row per layout: mesh, settings, memory against HBM, step time and its parts, tokens/s, MFU."""
    head = f"{'#':>2} {'mesh':<34}{'zero':>5}{'sp':>4} {'remat':<14}{'M':>5} {'schedule':<12}{'mem/HBM GB':>13}"
    head += f"{'step s':>9}{'compute':>9}{'comm':>8}{'bubble':>8}{'tokens/s':>11}{'MFU':>6}"
    rows = [head]
    for i, e in enumerate(estimates, 1):
        sched = (
            "-" if e.mesh["pipeline"] == 1 else e.schedule + (f"x{e.virtual_stages}" if e.virtual_stages > 1 else "")
        )
        rows.append(
            f"{i:>2} {format_mesh(e.mesh):<34}{e.zero if e.mesh['fsdp'] > 1 else '-':>5}"
            f"{'y' if e.sequence_parallel else 'n':>4} {e.remat.replace('with_no_batch_dims_saveable', 'no_batch'):<14}"
            f"{e.microbatches:>5} {sched:<12}{f'{e.total_memory / 1e9:.1f}/{e.hbm_bytes / 1e9:.0f}':>13}"
            f"{e.step_s:>9.3g}{e.compute_s:>9.3g}{e.exposed_comm_s:>8.3g}{e.bubble_s:>8.3g}{e.tokens_per_s:>11,.0f}"
            f"{e.mfu:>6.1%}"
        )
    return "\n".join(rows)


def format_details(e: Estimate) -> str:
    """Memory by component, traffic per mesh axis and collective bytes per opcode of one layout."""
    lines = [f"memory per device ({'fits' if e.fits else 'does NOT fit'}: {e.margin / 1e9:+.1f} GB of margin)"]
    lines += [f"  {k:<16}{v / 1e9:>10.2f} GB" for k, v in e.memory.items()]
    lines.append(f"  {'total':<16}{e.total_memory / 1e9:>10.2f} GB of {e.hbm_bytes / 1e9:.0f} GB")
    lines.append("traffic per step per device (ring formulas)")
    lines += [
        f"  {axes:<22}{r['link']:<12}{float(r['wire_bytes']) / 1e9:>10.3f} GB{float(r['seconds']) * 1e3:>10.1f} ms"
        for axes, r in e.traffic.items()
    ] or ["  (none)"]
    lines.append("collective operand bytes per step per device (as in the compiled HLO)")
    lines += [f"  {op:<22}{b / 1e9:>10.3f} GB" for op, b in sorted(e.collective_bytes.items())] or ["  (none)"]
    return "\n".join(lines)


def plot(estimates: list[Estimate], path: str) -> None:
    """PNG: stacked per-device memory against HBM, and the step-time breakdown, for each layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg without touching pyplot's global backend
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(8.0, 2.2 * len(estimates)), 5.5))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    labels = [f"#{i}\n" + format_mesh(e.mesh).replace(",", "\n") for i, e in enumerate(estimates, 1)]  # table ranks
    x = list(range(len(estimates)))
    memory_parts = {k: [e.memory[k] for e in estimates] for k in estimates[0].memory}
    time_parts = {k: [getattr(e, f"{k}_s") for e in estimates] for k in ("compute", "exposed_comm", "bubble")}
    for ax, parts, scale, unit in [(left, memory_parts, 1e9, "GB per device"), (right, time_parts, 1, "s per step")]:
        bottom = [0.0] * len(x)
        for name, values in parts.items():
            ax.bar(x, [v / scale for v in values], bottom=bottom, label=name.replace("_", " "))
            bottom = [b + v / scale for b, v in zip(bottom, values, strict=True)]
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel(unit)
    left.axhline(estimates[0].hbm_bytes / 1e9, color="black", linestyle="--", label="HBM")
    left.set_title("memory")
    right.set_title("step time")
    for ax in (left, right):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `spmdkit plan` subcommand (its handler is `run_plan`)."""
    parser = subparsers.add_parser(
        "plan",
        help="predict memory, traffic, bubble and MFU of a layout; recommend one",
        description="Estimate a layout's per-device memory, collective traffic, pipeline bubble, step time and MFU "
        "(no accelerator needed). Without --mesh, search the meshes of --devices and recommend the fastest that "
        "fits; settings not given (ZeRO stage, SP, remat, microbatches, schedule) are searched too.",
    )
    add = parser.add_argument
    add("--model", default="7b", help=f"model preset: {', '.join(PRESETS)} (default: 7b)")
    add("--devices", type=int, default=8, help="number of accelerators (default: 8)")
    add("--device-type", default="h100", help=f"{', '.join(DEVICE_TYPES)} (default: h100)")
    add("--gpus-per-node", type=int, help="devices per node / fast-link domain (default: the device's)")
    add("--hbm-gb", type=float, help="HBM per device in GB (custom devices; overrides the table)")
    add("--peak-tflops", type=float, help="dense bf16 peak TFLOP/s per device (custom devices)")
    add("--intra-node-gbs", type=float, help="NVLink/ICI GB/s per device per direction (custom devices)")
    add("--inter-node-gbs", type=float, help="InfiniBand/DCN GB/s per device per direction (custom devices)")
    add("--batch-size", type=int, help="global batch in sequences (default: about 1M tokens)")
    add("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    add("--dtype", default="bfloat16", help="compute dtype: bfloat16, float16, float32 (default: bfloat16)")
    add("--mesh", help="evaluate this mesh, e.g. 'fsdp=8,tensor=8' (default: search)")
    add("--zero", type=int, help="ZeRO stage 0-3 over fsdp (default: search 2 and 3)")
    add("--remat", help="none, full, dots_saveable, dots_with_no_batch_dims_saveable (default: search)")
    add("--sequence-parallel", action=argparse.BooleanOptionalAction, help="SP with TP (default: on when tensor > 1)")
    add("--microbatches", type=int, help="gradient-accumulation / pipeline microbatches (default: search)")
    add("--pipeline-schedule", help=f"{', '.join(SCHEDULES)} (default: search 1f1b and interleaved)")
    add("--virtual-stages", type=int, help="virtual stages per device for the interleaved schedule")
    add("--efficiency", type=float, default=0.5, help="achieved share of peak FLOP/s (default: 0.5)")
    add("--top", type=int, default=5, help="layouts to list (default: 5)")
    add("--json", action="store_true", help="print JSON instead of text")
    add("--plot", metavar="FILE.png", help="write memory and step-time bars of the listed layouts")
    parser.set_defaults(handler=run_plan)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    """One-line errors for settings that would otherwise only make every layout look impossible."""
    if args.devices < 1 or args.seq_len < 1 or (args.batch_size is not None and args.batch_size < 1):
        raise SpmdkitError("--devices, --seq-len and --batch-size must be positive")
    if args.zero is not None and args.zero not in (0, 1, 2, 3):
        raise SpmdkitError(f"--zero {args.zero} is not one of 0, 1, 2, 3")
    if args.pipeline_schedule is not None and args.pipeline_schedule not in SCHEDULES:
        raise SpmdkitError(
            f"unknown --pipeline-schedule {args.pipeline_schedule!r}: choose one of {', '.join(SCHEDULES)}"
        )
    if min(args.microbatches or 1, args.virtual_stages or 1, args.top) < 1 or not 0 < args.efficiency <= 1:
        raise SpmdkitError("--microbatches, --virtual-stages and --top must be positive, --efficiency in (0, 1]")


def run_plan(args: argparse.Namespace) -> int:
    """Handler of `spmdkit plan`: print the table (or JSON), the chosen layout's details and why."""
    model = model_preset(args.model).replace(dtype=args.dtype, remat=args.remat or "none")
    dev = make_device(
        args.device_type,
        hbm_gb=args.hbm_gb,
        peak_tflops=args.peak_tflops,
        intra_node_gbs=args.intra_node_gbs,
        inter_node_gbs=args.inter_node_gbs,
        gpus_per_node=args.gpus_per_node,
    )
    _check_args(args)
    if args.mesh:
        meshes = [parse_mesh(args.mesh, args.devices)]
        replicas = meshes[0]["data"] * meshes[0]["fsdp"]
        batch = args.batch_size or replicas * max(1, round(2**20 / args.seq_len / replicas))
    else:
        batch = args.batch_size or max(1, 2**20 // args.seq_len)
        meshes = list(candidate_meshes(model, args.devices, dev.gpus_per_node, batch, args.seq_len))
    fitting, smallest = search(
        model, meshes, dev, batch, args.seq_len, zero=args.zero, sequence_parallel=args.sequence_parallel,
        remat=args.remat, microbatches=args.microbatches, schedule=args.pipeline_schedule,
        virtual_stages=args.virtual_stages, efficiency=args.efficiency,
    )  # fmt: skip
    if args.mesh and smallest is None:  # no setting could run on this mesh: raise its own error
        estimate(model, meshes[0], device=dev, batch_size=batch, seq_len=args.seq_len, zero=3 if args.zero is None
                 else args.zero, sequence_parallel=bool(args.sequence_parallel), microbatches=args.microbatches,
                 schedule=args.pipeline_schedule or "1f1b", virtual_stages=args.virtual_stages or 1)  # fmt: skip
    if not fitting and not (args.mesh and smallest):
        raise SpmdkitError(
            f"no layout of {args.devices} x {dev.name} fits {args.model} with batch {batch} x {args.seq_len}"
            + (f" (smallest needs {smallest.total_memory / 1e9:.0f} GB)" if smallest else "")
            + ": add devices, shorten the batch or sequence, or check --mesh/--zero/--remat"
        )
    shown = fitting[: max(1, args.top)] or [smallest]
    best = shown[0]
    runner_up = next((e for e in fitting if e.mesh != best.mesh), None)
    why = explain(best, runner_up, dev.gpus_per_node) if best.fits else ""
    if args.plot:
        plot(shown, args.plot)
    if args.json:
        report = {"recommended": best.to_dict(), "explanation": why, "candidates": [e.to_dict() for e in shown]}
        print(json.dumps(report, indent=1))
        return 0
    title = f"spmdkit plan: {args.model} on {args.devices} x {dev.name} ({dev.gpus_per_node} per node), batch {batch}"
    print(f"{title} x {args.seq_len} tokens, {args.dtype}; {len(fitting)} layouts on {len(meshes)} meshes fit")
    print(format_table(shown))
    print(f"\n{'recommended' if best.fits else 'does NOT fit'}: {format_mesh(best.mesh)}\n{format_details(best)}")
    if why:
        print(f"\n{why}")
    return 0
