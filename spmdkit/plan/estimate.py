"""The layout planner: per-device memory, collective traffic, pipeline bubble, step time and MFU of a mesh layout,
and a recommended layout when none is given. Pure arithmetic (no JAX): `spmdkit plan` answers without a GPU.

Notation: N parameters, L layers, E embed, H/K query/kv heads of width d, F mlp width, V vocab; a = bytes of the
compute dtype, p = 4 (float32 parameters); mesh sizes D data, P pipeline, Fs fsdp, C context, X expert, T tensor;
B global batch (sequences) of S tokens, M microbatches; t = B S / (D Fs X C) tokens per device per step (the
batch is split over data, fsdp and expert). Mixture of experts: L_moe MoE layers of n experts, top_k, Q expert
slots per sequence (n x capacity, `spmdkit.plan.layout`), the parameter inventory in `spmdkit.plan.layout`.

Memory per device at the step's peak (`spmdkit.plan.memory`: the formulas, checked against XLA:GPU's buffer
assignment); each parameter tensor divided by the mesh axes its logical names map to, as
`spmdkit.sharding.rules.make_rules` maps them: heads/kv_heads/mlp/vocab -> tensor, layers -> pipeline,
embed -> (fsdp, context) for parameters at ZeRO-3, for optimizer state at ZeRO >= 1, for gradients at ZeRO >= 2
(the state axes: "over fsdp" below means over fsdp x context).
  Persistent: parameters p N/shards, AdamW moments 2 p N/shards, the residuals (tokens in flight x bytes kept
  per token and layer under the remat policy, `activation_bytes`), without remat the layers' compute-dtype casts.
  LoRA: gradients and moments of the adapters only, the frozen base as stored (`spmdkit.plan.layout.BASE_BYTES`).
  Transient, the largest phase: the forward (attention scratch, gathered layers), the loss (gradients, the LM
  head's float32 gradient accumulators, its cast and gathered copy, one loss chunk's float32 logits and their
  gradient, 8V/(T n) per token), or a layer's backward (gradients, its recompute, scratch, gathered layers).
  An MoE layer (roughly): its routed MLP's per-token terms (6aF, 2aF) give way to Q/S slots per token of
  4aE + 6aF/T (none: dispatch and returned buffers on both sides of the all-to-alls, the gated MLP's six) or
  aE + 2aF/T (dots_saveable: the expert matmuls' outputs); the others keep nothing per slot (the expert
  einsums have a batch dim); a shared expert keeps its dense MLP terms.
  Pipeline (spmdkit's 1F1B/interleaved recompute each chunk from its stashed input): stash slots (1F1B: P,
  GPipe: M, interleaved: 2(P-1)+(v-1)P) x [t/M, E] + one chunk's activations; GPipe keeps all M microbatches.
Collective operand bytes per device per step, by opcode (what `collective_report` reads from the HLO):
  DP: all-reduce of the gradients. ZeRO-1: same, then all-gather of the updated parameter shards.
  ZeRO-2/3 over fsdp: reduce-scatter of the gradients (operand = full local gradient), all-reduce of the shard
  over data and expert (and context); ZeRO-3 all-gathers each layer's shard twice per microbatch (forward,
  backward), the head's and the embedding's (in the compute dtype) once.
  TP per layer: 2 all-reduces of [t, E] forward (again under full remat), 2 backward on GPU/TPU; XLA:CPU has no
  AllReduceReassociate and reduces each column-parallel projection's input gradient separately: 5 (q, k, v, gate,
  up; 3 when kv heads are replicated). + [t, E] each for the vocab-parallel embedding and LM head, + 3 [t] float32
  for the cross-entropy. SP: each forward all-reduce -> reduce-scatter [t, E] + all-gather [t/T, E], + 2
  all-gathers per layer backward (the backward sums stay all-reduces on CPU, reduce-scatters on GPU/TPU).
  CP ring: (C-1) K/V hops forward, (C-1) K/V + C f32 dK/dV hops backward per layer. Ulysses: 4 all-to-alls
  (q, k, v, out; kv heads repeated until C divides them) per layer forward, again under full remat, and backward.
  2D (a ring of R = C/U positions over Ulysses groups of U): the ring's hops over R, + its exchanges
  (`_context_collectives`). The state is sharded over fsdp x context: "over fsdp" above means both. PP: 2
  ppermutes of [t/M, E] per tick, 2(vM+P-1) ticks (GPipe: 2(M+P-1) sends), + all-reduce over pipeline of
  embedding and head gradients.
  EP (X > 1): per MoE layer 2 all-to-alls over expert forward and 2 backward (+2 when remat recomputes the
  forward) of the dispatch buffer [B/(D Fs X), n, Q/n, E] in the compute dtype. Gradients of non-expert weights
  reduce over every batch axis (data, fsdp, expert) and context. Expert weights (in `expert_ffn`'s shard_map,
  their gradient summed by the transpose of a pcast over the non-expert batch axes) reduce as above but never
  over expert, and with data (or context) > 1 by one all-reduce of the full gradient over data, fsdp and
  context; under ZeRO-3 they are gathered once per microbatch (the backward keeps the shard_map's input) unless
  remat recomputes it. The dispatch buffer is not divided by context (the shard_map leaves context automatic),
  and TP collectives of the expert MLPs are counted as for a dense MLP (neither checked against XLA).
Wire bytes (ring): all-reduce 2(n-1)/n x operand, reduce-scatter and all-to-all (n-1)/n x operand, all-gather
(n-1) x operand (the operand is the shard), ppermute 1 x; on NVLink when the axes stay in a node, else InfiniBand.
Time: compute = FLOPs / (devices x peak x efficiency); FLOPs = model FLOPs (6N + attention) + recomputation (full
remat, and spmdkit's 1F1B/interleaved chunk recompute: a forward each, +1/3; dots_with_no_batch_dims_saveable: the
attention forward; the loss's logits, 2EV per token; the O(S) attention kernels' q k^T, half the attention
forward; MoE: expert FLOPs on Q slots per sequence instead of top_k S tokens, the capacity padding); float32 runs
at half the bf16 peak (TF32). Gradient and parameter traffic overlaps compute
(exposed: the excess over compute, at least one layer's share); activation traffic (TP/SP, PP) is exposed. Bubble
b = (P-1)/(M+P-1), interleaved (P-1)/(vM+P-1), adds (compute + exposed) b/(1-b). Step = compute + exposed +
bubble; tokens/s = B S / step; MFU = model FLOPs / (step x devices x peak bf16). With `fp8` the blocks' projections
(their share of the FLOPs, `TransformerConfig.fp8_flops_per_token`) count at the FP8 peak, in compute and in MFU's
peak (`mixed_peak`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig
from spmdkit.models.lora_config import LoraConfig
from spmdkit.models.presets import PRESETS, model_preset
from spmdkit.parallel.context.chunks import ring_balance, ring_steps
from spmdkit.plan.devices import Device, make_device, mixed_peak, node_local_axes, wire_bytes
from spmdkit.plan.dispatch import expert_flops_ratio, resolve_dispatch
from spmdkit.plan.layout import Layout, Sharded, check_layout, state_axes
from spmdkit.plan.memory import layout_kernel, manual_region, memory, optimizer_bytes, pipeline_schedule
from spmdkit.plan.muon import muon_collectives, muon_flops
from spmdkit.plan.remat_cost import REMAT_ORDER as REMAT_ORDER  # re-exported: the search's order
from spmdkit.plan.remat_cost import forward_sums, host_kept_bytes, named_recompute_flops
from spmdkit.sharding.strategy import Strategy, mesh_text


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
    host_bytes: float = 0.0  # per device: the activations the remat policy offloads to pinned host memory
    # and, with `--optimizer.offload`, the optimizer state (then 0 in `memory`), moved in and out every step:
    offload_s: float = 0.0  # seconds per step of that move, 2 x its bytes over the host link (in `step_s`)
    attention: str = ""  # the kernel (`layout_kernel`): ring, ulysses_cudnn, ...
    ulysses: int = 1  # 2D context parallelism's Ulysses factor (with attention "ring")

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


def planner_platform(dev: Device) -> str:
    """The platform `choose_attention` sees on `dev` (the device table's GPUs are NVIDIA: "cuda")."""
    return "cuda" if dev.backend == "gpu" else dev.backend


@dataclasses.dataclass
class Collective:
    """One kind of collective of a step: opcode, the mesh axes of its groups, operand bytes per device per step."""

    opcode: str
    axes: tuple[str, ...]
    operand_bytes: float
    overlapped: bool  # gradient/parameter traffic hides behind compute; activation traffic does not


def collectives(s: Layout, reassociate: bool = True, kernel: str = "ring") -> list[Collective]:
    """The step's collectives (formulas in the module docstring); `reassociate`: XLA's GPU/TPU passes run;
    `kernel`: the attention kernel (`layout_kernel`), which says how a context axis exchanges K/V."""
    m, a, E, T, P, M = s.model, s.a, s.model.embed, s["tensor"], s["pipeline"], s.microbatches
    act, out = s.tokens * E * a, []

    def add(opcode: str, axes: tuple[str, ...], nbytes: float, overlapped: bool = True) -> None:
        axes = tuple(x for x in axes if s[x] > 1)
        if axes and nbytes > 0:
            out.append(Collective(opcode, axes, nbytes, overlapped))

    for p in s.params:
        _parameter_collectives(s, p, add)
    if T > 1:
        layers, ends = s.stage_layers, 1 if P > 1 else 2  # ends: embedding forward, LM-head input grad backward
        forward = layers * forward_sums(m.remat_policy)  # 2 per layer, and the remat repeats (plan.remat_cost)
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
    if s["context"] > 1:
        _context_collectives(s, kernel, add)
    if P > 1:
        sends = 2 * (M + P - 1) if s.schedule == "gpipe" else 4 * (s.virtual_stages * M + P - 1)
        add("collective-permute", ("pipeline",), sends * act / M / (T if s.sequence_parallel else 1), False)
    if s["expert"] > 1:  # dispatch and return, forward and backward; remat recomputes the forward's pair
        passes = 4 + (2 if m.remat_policy.recomputes else 0)
        add("all-to-all", ("expert",), passes * m.moe_layers / P * s.dispatch_bytes, overlapped=False)
    if s.muon:  # Newton-Schulz on whole matrices: its stacks' reshards (spmdkit.plan.muon)
        muon_collectives(s, add)
    return out


def _context_collectives(s: Layout, kernel: str, add: Callable[..., None]) -> None:
    """The context axis's traffic (C devices): Ulysses' all-to-alls (U = C), the ring's K/V hops (U = 1), or both
    (2D: a ring of C/U positions, Ulysses in groups of U). Per layer and pass (forward, again under full remat, and
    backward): Ulysses sends q, k, v in and the output back (autodiff's transposes in the backward); 2D's ring
    exchanges its residuals and cotangents in its own backward (q, k, v, dout, lse, D in; dq, dk, dv back), and
    full remat's second forward only its output (XLA shares that pass's q, k, v exchanges with the backward's); the
    ring sends K/V around its R positions and brings the float32 dK/dV home."""
    m, a, T, C, d = s.model, s.a, s["tensor"], s["context"], s.model.head_dim
    passes = 3 if s.model.remat_policy.full else 2
    U, H = (C if kernel.startswith("ulysses") else s.ulysses), m.heads / T
    kv = m.kv_heads / T if m.kv_heads % T == 0 else (m.heads / T if U > 1 else m.kv_heads)  # Ulysses repeats them
    if U > 1:
        kv *= U // math.gcd(int(kv), U)  # each device's kv heads repeated until U devices split them
        if U == C:
            per_layer = passes * s.tokens * d * a * (2 * H + 2 * kv)
        else:
            forward, backward = d * a * (2 * H + 2 * kv) + 4 * H, d * a * (3 * H + 4 * kv) + 8 * H
            # full remat's forward again: only the output goes back, XLA shares its q, k, v with the backward's
            per_layer = s.tokens * (forward + (passes - 2) * d * a * H + backward)
        add("all-to-all", ("context",), s.stage_layers * per_layer, overlapped=False)
    if kernel == "ring":  # per layer, the steps its window reaches (`ring_steps`; all R without a window)
        R, windows = C // U, [m.window_of(i) for i in range(m.layers)]
        layout = ring_balance(windows, s.seq_len, R)
        steps = {w: ring_steps(R, layout, s.seq_len // (2 * R), w) for w in set(windows)}
        hops = sum((len(steps[w]) - 1) * a * passes + (len(steps[w]) - (steps[w][-1] == 0)) * 4 for w in windows)
        add("collective-permute", ("context",), s.stage_layers / m.layers * s.tokens * 2 * d * kv * hops)


def _parameter_collectives(s: Layout, p: Sharded, add: Callable[..., None]) -> None:
    """The collectives of parameter `p`: its gradient's reduction, the pipeline's psum of the replicated ones, and
    its gathers (the updated parameters under ZeRO-1/2, the weights per microbatch under ZeRO-3)."""
    m, a, P, M = s.model, s.a, s["pipeline"], s.microbatches
    full = s.local(p, "grads", gathered=True)  # the gradient before any fsdp reduction
    # Expert weights hold their own experts' gradients: summed over the other batch axes only, not `expert`,
    # by one psum over them all (the transpose of the shard_map's pcast), sliced to the fsdp shard after.
    routed = p.routed and s.expert_shard_map
    expert = () if routed else ("expert",)
    split = state_axes(p.grads, p.routed)  # fsdp, context (and expert but for expert weights): the gradient's shard
    if routed and split and s["data"] * s["context"] > 1:
        add("all-reduce", ("data", "fsdp", "context"), full)
    elif split:
        add("reduce-scatter", split, full)
        rest = tuple(x for x in ("data", *expert, "context") if x not in split)
        add("all-reduce", rest, full / math.prod(s[x] for x in split))
    else:  # replicated gradients; norm scales under SP (and q/k norms: over heads) also sum on `tensor`
        norm_sp = ("tensor",) if p.name.endswith("norm") and (s.sequence_parallel or "attention." in p.name) else ()
        add("all-reduce", ("data", "fsdp", *expert, "context", *norm_sp), full)
    if not p.stacked and P > 1:  # embedding and head are replicated over pipeline: psum of their gradients
        add("all-reduce", ("pipeline",), s.local(p, "grads"))
    if state_axes(p.optimizer, p.routed) and s.zero < 3:  # the updated parameters, gathered once per step
        add("all-gather", state_axes(p.optimizer, p.routed), s.local(p, "optimizer"))
    elif state_axes(p.params, p.routed):
        # Per microbatch: the scanned layers are gathered in the forward and again in the backward; the head,
        # outside the scan, once; the embedding table once, cast to the compute dtype before the gather; expert
        # weights once at the shard_map's edge (the backward keeps that input) unless remat recomputes it.
        gathers, nbytes = {"embedding": (1, a / 4), "lm_head": (1, 1)}.get(p.name, (2, 1))
        if p.name == "embedding" and m.tie_embeddings:  # tied: gathered for the lookup and for the head
            gathers, nbytes = 2, (a / 4 + 1) / 2
        gathers = 1 if p.routed and s.expert_shard_map and not m.remat_policy.recomputes else gathers
        add("all-gather", state_axes(p.params, p.routed), M * gathers * nbytes * s.local(p, "params"))


def estimate(
    model: TransformerConfig | str,
    layout: Strategy | Mapping[str, int] | str,
    *,
    device: Device | str = "h100",
    devices: int | None = None,
    batch_size: int | None = None,
    seq_len: int = 4096,
    efficiency: float = 0.5,
    comm_efficiency: float = 0.8,
    lora: LoraConfig | None = None,
) -> Estimate:
    """Memory, traffic, bubble, step time and MFU of one layout; the model's `dtype` and `remat` are used.

    `layout`: a `Strategy` (mesh, ZeRO stage, SP, microbatches, schedule, offload), or only its mesh: axis sizes
    or a string like "data=2,tensor=4" (`devices` fills a -1); `batch_size` in sequences (default: about 1M
    tokens, a multiple of data x fsdp); the strategy's microbatches default to 1, or with a pipeline to one sequence
    per data-parallel rank per microbatch (`Layout.of`); `efficiency`: achieved share of peak FLOP/s;
    `comm_efficiency`: achieved share of link bandwidth; `lora`: LoRA adapters train on the frozen model.
    """
    m = model_preset(model) if isinstance(model, str) else model
    dev = make_device(device) if isinstance(device, str) else device
    if not (0 < efficiency <= 1 and 0 < comm_efficiency <= 1):
        raise SpmdkitError(f"efficiencies must be in (0, 1], got {efficiency} and {comm_efficiency}")
    if not isinstance(layout, Strategy):
        layout = Strategy(layout if isinstance(layout, str) else mesh_text(layout))
    planned = Layout.of(m, layout, devices, batch_size, seq_len, lora)
    check_layout(planned)
    return evaluate(planned, dev, efficiency, comm_efficiency)


def with_dispatch(s: Layout, platform: str) -> Layout:
    """`s` with `--moe-dispatch auto` resolved as `build_program` would on `platform` and this batch split."""
    return dataclasses.replace(s, model=resolve_dispatch(s.model, s.seq_len, s.replicas > 1, platform))


def _traffic(
    s: Layout, dev: Device, kernel: str, comm_efficiency: float
) -> tuple[dict[str, float], dict[str, dict[str, float | str]], float, float]:
    """The step's collectives on `dev`: (operand bytes by opcode, wire bytes and seconds by axes with their link,
    seconds overlapped with compute, seconds that block it)."""
    sizes, local = s.sizes, node_local_axes(s.sizes, dev.gpus_per_node)
    by_opcode: dict[str, float] = {}
    traffic: dict[str, dict[str, float | str]] = {}
    hidden = blocking = 0.0
    for c in collectives(s, reassociate=dev.backend != "cpu", kernel=kernel):
        by_opcode[c.opcode] = by_opcode.get(c.opcode, 0.0) + c.operand_bytes
        n, link = math.prod(sizes[x] for x in c.axes), "nvlink" if set(c.axes) <= local else "infiniband"
        wire = wire_bytes(c.opcode, n, c.operand_bytes)
        seconds = wire / ((dev.intra_node_bw if link == "nvlink" else dev.inter_node_bw) * comm_efficiency)
        row = traffic.setdefault("+".join(c.axes), {"link": link, "wire_bytes": 0.0, "seconds": 0.0})
        row["wire_bytes"], row["seconds"] = float(row["wire_bytes"]) + wire, float(row["seconds"]) + seconds
        hidden, blocking = hidden + seconds * c.overlapped, blocking + seconds * (not c.overlapped)
    return by_opcode, traffic, hidden, blocking


def evaluate(s: Layout, dev: Device, efficiency: float = 0.5, comm_efficiency: float = 0.8) -> Estimate:
    """The Estimate of a checked layout on `dev` (`--moe-dispatch auto` resolved first, as `build_program` would
    on this device and batch split: `estimate` and the search's layouts alike)."""
    platform = planner_platform(dev)
    s = with_dispatch(s, platform)
    m, sizes = s.model, s.sizes
    devices = math.prod(sizes.values())
    kernel = layout_kernel(s, platform, dev.compute_capability)
    by_opcode, traffic, hidden, blocking = _traffic(s, dev, kernel, comm_efficiency)
    model_flops = m.flops_per_token(s.seq_len) * s.batch_size * s.seq_len
    # The experts compute every slot, padding included (and drop what overflows): Q slots, not top_k S tokens, or
    # a dense ragged_dot's E top_k S (`spmdkit.plan.dispatch`); 6 FLOPs per weight and slot (forward and
    # backward), 3 E F weights per expert.
    routed = m.top_k * s.seq_len
    executed = expert_flops_ratio(m, m.dispatch, s.seq_len, s.replicas > 1, platform) * routed if m.moe_layers else 0
    padding = 18 * m.embed * m.routed_mlp * m.moe_layers * (executed - routed) * s.batch_size
    attention_forward = 2 * m.layers * m.heads * m.head_dim * s.seq_len * s.batch_size * s.seq_len
    run = model_flops + padding
    repeated = {"full": run / 3, "dots_with_no_batch_dims_saveable": attention_forward}
    extra = padding + repeated.get(m.remat_policy.kind, 0.0)
    extra += named_recompute_flops(m, s.seq_len) * s.batch_size * s.seq_len  # spmdkit.plan.remat_cost
    # The loss recomputes its logits in the backward, the O(seq) attention kernels q k^T; LoRA: `lora_flops`.
    extra += (2 * m.embed * m.vocab_size + lora_flops(s)) * s.batch_size * s.seq_len
    local = kernel.removeprefix("ulysses_")  # the kernel per device
    if local != "dot":
        extra += attention_forward / 2
    if local == "cudnn" and manual_region(s):  # its backward there recomputes the forward kernel (attention.py)
        extra += attention_forward
    if sizes["pipeline"] > 1 and s.schedule != "gpipe":  # spmdkit's 1F1B backward recomputes the chunk forward
        extra += run / 3
    peak = dev.peak_flops * (0.5 if m.dtype == "float32" else 1.0)  # float32 matmuls run as TF32, about half rate
    # --model.fp8: the blocks' projections (forward, backward, and the forward again under full remat) at FP8's peak
    fp8 = m.fp8_flops_per_token() * s.batch_size * s.seq_len * (4 / 3 if m.remat_policy.full else 1.0)
    fp8_peak = dev.fp8_peak_flops or peak
    compute = ((model_flops + extra - fp8) / peak + fp8 / fp8_peak) / devices / efficiency
    if s.muon:  # Newton-Schulz per device, in float32 (the momentum's dtype): TF32, about half the peak
        compute += muon_flops(s) / (dev.peak_flops * 0.5) / efficiency
    exposed = blocking + max(hidden - compute, hidden / s.stage_layers)
    P = sizes["pipeline"]
    bubble = pipeline_schedule(s.schedule, P, s.microbatches, s.virtual_stages).bubble_fraction() if P > 1 else 0.0
    bubble_s = (compute + exposed) * bubble / (1 - bubble)
    moments = optimizer_bytes(s) if s.offload else 0.0  # host -> device before the update, back after it
    offload_s = 2 * moments / dev.host_bw
    step = compute + exposed + bubble_s + offload_s
    # one layer more than the stage has: the layer loop's double buffering (XLA 0.11 on) holds the next
    # iteration's offloaded residuals in pinned host memory beside the stack's
    layers = s.stage_layers + (s.stage_layers > 1)
    host = layers * s.tokens / s.microbatches * host_kept_bytes(m, sizes["tensor"], s.sequence_parallel)
    return Estimate(
        model=model_name(m), mesh=sizes, device=dev.name, batch_size=s.batch_size, seq_len=s.seq_len,
        dtype=m.dtype, remat=m.remat, zero=s.zero, sequence_parallel=s.sequence_parallel and sizes["tensor"] > 1,
        microbatches=s.microbatches, schedule=s.schedule, virtual_stages=s.virtual_stages,
        memory=memory(s, platform, dev.compute_capability),
        hbm_bytes=dev.hbm_bytes, collective_bytes=by_opcode, traffic=traffic, bubble=bubble, compute_s=compute,
        exposed_comm_s=exposed, bubble_s=bubble_s, step_s=step, tokens_per_s=s.batch_size * s.seq_len / step,
        mfu=model_flops / (step * devices * mixed_peak(dev, m.fp8_flops_per_token() / m.flops_per_token(s.seq_len))),
        host_bytes=host + moments, offload_s=offload_s, attention=kernel, ulysses=s.ulysses,
    )  # fmt: skip


def lora_flops(s: Layout) -> float:
    """FLOPs per token that LoRA changes (0 without it): the frozen weights' gradients are not computed (-2 per
    matrix weight: the embedding lookup, norms and biases never cost any), each adapter weight costs 6."""
    if s.lora is None or not s.lora.enabled:
        return 0.0
    vector = ("norm", "bias")
    tied = s.model.tie_embeddings  # a tied table is the LM head's matrix
    frozen = sum(
        p.nbytes / p.element_bytes for p in s.params
        if not p.trained and (p.name != "embedding" or tied) and not p.name.endswith(vector)
    )  # fmt: skip
    adapters = sum(p.nbytes / p.element_bytes for p in s.params if p.trained)
    return 6 * adapters - 2 * frozen


@functools.cache
def model_name(m: TransformerConfig) -> str:
    """The preset `m` is, up to how a run computes it (its resolved kernel, dispatch, remat, dtype), or "custom"."""
    run = {k: getattr(m, k) for k in ("dtype", "remat", "attention", "ulysses_parts", "dispatch")}
    names = [n for n, p in PRESETS.items() if p.replace(**run) == m]
    return names[0] if names else f"custom ({m.num_params() / 1e9:.3g}B parameters)"
