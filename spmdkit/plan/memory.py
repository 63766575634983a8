"""Per-device memory of a training step at its peak, as XLA:GPU's buffer assignment finds it for spmdkit's step.
Pure arithmetic (no JAX). Notation as in `spmdkit.plan.estimate`; here E, H, K, d, F are the widths on one device
(heads, kv heads and mlp divided by T; kv heads replicate when T does not divide them), s = 1/T under sequence
parallelism (the residual stream's sequence is split over tensor) else 1, t_m = t / M the tokens of one
microbatch on a device, L_s the layers of a pipeline stage, S the sequence length, V the vocabulary.

Persistent through the step: parameters (p = 4 bytes, split as the rules split them), the optimizer moments (AdamW:
residuals the forward keeps for the backward, L_s t_m x kept bytes per token and layer (`activation_bytes`; the
pipeline adds its stashes, `estimate`'s docstring), without remat the compute-dtype cast of every layer's weights
as stored (a/4 of the stage's local layer parameters; the backward's matmuls read them), and under ZeRO-3 over
the state axes (fsdp, context, expert) a second float32 copy of a few stacked weight shards (`_relayouts`).

Kept per token and layer (what JAX's autodiff saves for `spmdkit.models.transformer.Block`; tests/test_plan.py
compares it with the residuals of the step's vjp):
  none: (`spmdkit.models.remat_policy.all_but_elementwise_saveable`: no GEMM, attention kernel, collective or
        narrowing cast of float32 is recomputed, the other elementwise ops are) what dots_with_no_batch_dims_saveable
        keeps, + the 2 RMSNorms' outputs in the compute dtype 2aE, + the attention's outputs: its output in the
        compute dtype and the float32 log-sum-exp aHd + 4H (cudnn), + a second row statistic, aHd + 8H (blockwise,
        ring); the dot kernel's float32 scores, P in the compute dtype and P V, (4 + a)HS + aHd.
  dots_with_no_batch_dims_saveable: the block input aEs, the q/k/v projections a(H + 2K)d, the attention
        projection's output aEs, gate and up 2aF (the MLP's down output is not read by the backward).
  dots_saveable: that + the attention's own matmuls, which have batch dims: dot: its float32 scores and P V,
        4HS + aHd; blockwise: every block pair's float32 scores and P V, pairs x b (b + d) x 4H / S; ring: every
        step's and chunk pair's (skipped pairs kept as zeros), 4HS (1 + d / tile); cudnn: none (a custom call).
  full: the block input aEs.
  named policies (minimal, save_qkv_proj, ..., save:NAMES; `spmdkit.plan.remat_cost`): the block input and the
        names they save; names they offload are host bytes (`Estimate.host_bytes`), not counted here.
Transient: the largest of three phases, each on top of the persistent part.
  forward:  the attention kernel's scratch (blockwise: 3 float32 scores of its widest step, `attention_scratch`;
            ring: 3 float32 scores of one key tile, `ring_scratch`; ring and blockwise under dots_saveable: two
            more copies of one layer's kept scores, made in the kernel's loops before they are copied into the
            layers' stack) + two gathered layers (ZeRO-3, compute dtype) + TP's 2 t_m E a.
            No gradients yet: XLA allocates them after the forward when memory is short.
  loss:     the gradients + the LM head's float32 gradient accumulator 4EV/T (gathered over fsdp when the loss
            runs in its shard_map over the token axes) + its cast aEV/T (XLA 0.11 on casts the head before it
            gathers it, and keeps one accumulator: 0.10 kept two and a float32 gathered copy) + one loss chunk's
            float32 logits and their gradient, 8V/(T n) per token, + aE + 4 per token (`spmdkit.models.loss`).
  backward: the gradients + one layer's recompute t_m x (autodiff - kept) + the blockwise scratch + the gathered
            layers + one layer's float32 gradient before its reduce-scatter (gradients split over fsdp) + TP's.
Gradients: float32, split as the rules split them; accumulation over M > 1 microbatches in a loop, and 1F1B's
accumulator of the stage's layers: `_gradients`.
LoRA (`Layout.lora`, measured against XLA:GPU on 8B/1 x H100 and 70B/8 x H100 within 5%): the frozen base is stored
as `spmdkit.plan.layout.BASE_BYTES` says and has no gradient, no moment and no gradient accumulator (the LM head's
float32 gradient in the loss phase is gone, its compute-dtype cast stays); the adapters are trained parameters;
`lora_activation_bytes` adds their kept activations; accumulating under a dots policy keeps the stacked weights'
casts (`_casts_kept`).
XLA's scheduler may also use spare memory to overlap one microbatch's backward with the next one's forward (two
residual stacks); the planner counts the schedule that needs the least, one microbatch in flight.
"""

from __future__ import annotations

import functools
import math

from spmdkit.kernels.attention_spec import AttentionSpec, ring_key_tile
from spmdkit.kernels.block_plan import BlockPlan
from spmdkit.models.attention_choice import choose_attention
from spmdkit.models.config import TransformerConfig, loss_chunks
from spmdkit.models.lora_config import LoraConfig
from spmdkit.models.remat import RematPolicy
from spmdkit.parallel.pipeline.schedule import Schedule, make_schedule
from spmdkit.plan.layout import BATCH_AXES, DTYPE_BYTES, STATE_AXES, Layout, Sharded, state_axes
from spmdkit.plan.remat_cost import mlp_named_bytes, named_kept_bytes

MEMORY_KEYS = ("parameters", "gradients", "optimizer", "compute_copies", "comm_buffers", "activations")
AUTODIFF_MLP = 6  # [F] arrays plain autodiff keeps of a gated MLP (gate, up, sigmoid, its derivative, silu, product)


@functools.cache
def pipeline_schedule(kind: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule table the pipeline program would run (its bubble and stash slots are the planner's)."""
    return make_schedule(kind, stages, microbatches, virtual_stages)


def manual_region(s: Layout) -> bool:
    """Does the model run in a partly manual shard_map: pipeline stages, or a dense model's gradient accumulation
    over replica axes (data, and fsdp below ZeRO-3; `spmdkit.train.step.train_step.loss_and_grads`)? The trainer's
    attention choice reads it too (`spmdkit.train.step.program.build_program`)."""
    replicas = s["data"] > 1 or (s["fsdp"] > 1 and s.zero < 3)
    return s["pipeline"] > 1 or (s.microbatches > 1 and replicas and not s.model.moe_layers)


def attention_kernel(
    m: TransformerConfig, C: int, platform: str | None, capability: int = 0, context_parallel: str = "auto", T: int = 1
) -> str:
    """The attention kernel the run would use (`spmdkit.models.attention_choice.choose_attention`). `capability`:
    the GPU's major compute capability (0: unknown, the limits every GPU runs); `context_parallel`: the algorithm
    over a context axis C > 1; T: the tensor axis (Ulysses splits the heads over T x C)."""
    return choose_attention(
        m.attention, context=C, platform=platform, dtype=m.dtype, head_dim=m.head_dim,
        softcap=m.attention_softcap, compute_capability=capability, context_parallel=context_parallel,
        sinks=m.attention_sinks,
        head_split=0 if m.heads % (T * C) else m.heads // (T * C),
    )  # fmt: skip


def layout_kernel(s: Layout, platform: str | None, capability: int = 0) -> str:
    """`attention_kernel` of a layout."""
    return attention_kernel(s.model, s["context"], platform, capability, s.context_parallel, s["tensor"])


def local_kernel(kernel: str) -> str:
    """The kernel each device runs on its tokens: Ulysses' per-device kernel runs the whole sequence for
    heads / (T x C) heads and C times the sequences, so per token it keeps and computes what that kernel does
    without context parallelism (its formulas below apply unchanged)."""
    return kernel.removeprefix("ulysses_")


def kernel_scores(m: TransformerConfig, kernel: str, T: int, C: int, seq: int) -> float:
    """Bytes per token and layer that dots_saveable keeps of the attention's own (batch-dim) matmuls."""
    a, H, d = DTYPE_BYTES[m.dtype], m.heads / T, m.head_dim
    if kernel == "dot":
        return 4 * H * seq + a * H * d
    if kernel == "ring":
        return 4 * H * seq * (1 + d / ring_key_tile(seq // (2 * C)))
    if kernel == "blockwise":  # the mean over the layers (a local layer's plan skips what its window hides)
        plans = [_block_plan(m, seq, m.window_of(i)) for i in range(m.layers)]  # per pair, its scores and p v
        kept = [sum(len(s.q) * p.sizes(s)[0] * (p.sizes(s)[1] + d) for s in p.steps) for p in plans]
        return sum(kept) / len(kept) * 4 * H / seq
    return 0.0


def _block_plan(m: TransformerConfig, seq: int, window: int) -> BlockPlan:
    spec = AttentionSpec.of_layer(window, m.attention_scale, m.attention_softcap, m.attention_block)
    return BlockPlan(seq, spec.resolved(m.head_dim, seq))


def activation_bytes(
    m: TransformerConfig, T: int, sp: bool, C: int, seq: int, platform: str | None = None, capability: int = 0,
    context_parallel: str = "auto",
) -> tuple[float, float]:  # fmt: skip
    """(bytes kept per token per layer under `m.remat`, bytes per token of one layer's recompute); module doc."""
    a, E, H, d, F = DTYPE_BYTES[m.dtype], m.embed, m.heads / T, m.head_dim, m.mlp / T
    K = m.kv_heads / T if m.kv_heads % T == 0 else m.kv_heads
    s = 1 / T if sp else 1
    kernel = local_kernel(attention_kernel(m, C, platform, capability, context_parallel, T))
    dots = 2 * a * E * s + a * (H + 2 * K) * d + 2 * a * F
    outputs = {"cudnn": a * H * d + 4 * H, "dot": (4 + a) * H * seq + a * H * d}.get(kernel, a * H * d + 8 * H)
    none = dots + 2 * a * E + outputs
    # one recomputed layer's backward (full, dots*, named policies) is plain autodiff inside jax.checkpoint, which
    # keeps every intermediate: the norms' float32 inputs, q/k/v/out, the kernel's statistics, the MLP's six [F]
    statistics = (4 + a) * H * seq if kernel == "dot" else 4 * H
    autodiff = 2 * (8 * (E + 1) * s + a * E) + a * (2 * H + 2 * K) * d + statistics + AUTODIFF_MLP * a * F
    kept = {
        "none": none,
        "dots_with_no_batch_dims_saveable": dots,
        "dots_saveable": dots + kernel_scores(m, kernel, T, C, seq),
        "full": a * E * s,
    }
    policy = m.remat_policy  # named policies: spmdkit.plan.remat_cost
    kept = named_kept_bytes(m, T, sp) if policy.named else kept[policy.kind]
    return kept, (autodiff if policy.recomputes else none) - kept


def attention_scratch(m: TransformerConfig, T: int, seq: int, seqs: float, kernel: str) -> float:
    """Bytes the blockwise kernel holds while one layer runs: 3 float32 score arrays (P, dP, dS) of its widest step
    (`spmdkit.kernels.block_plan`), for `seqs` sequences per device and the local heads; 0 for the other kernels."""
    if kernel != "blockwise":
        return 0.0
    windows = {m.window_of(i) for i in range(m.layers)}  # each layer's sliding window (0: global)
    scores = max(_block_plan(m, seq, w).widest_step() for w in windows)  # per (sequence, head)
    return 3 * 4 * scores * m.heads / T * seqs


def ring_scratch(m: TransformerConfig, T: int, C: int, seq: int, seqs: float) -> float:
    """Bytes the ring kernel holds while one layer runs: as the blockwise kernel, 3 float32 score arrays (P, dP,
    dS) of one key tile of a chunk pair, [seqs, H, c, tile] with c = S / 2C. (Its masks and pair modes are tied to
    the data, `spmdkit.parallel.context.ring_attention._position`: before that, the layer scan's partial evaluation
    kept them for every step and chunk pair, 4 (C + 1) x that x c / tile.)"""
    c = seq // (2 * C)
    return 3 * 4 * seqs * m.heads / T * c * ring_key_tile(c)


def moe_activation_bytes(m: TransformerConfig, T: int, slots_per_token: float) -> tuple[float, float]:
    """What an MoE layer adds to `activation_bytes` per token (kept, recompute): Q/S slots x per-slot bytes, less
    the routed dense MLP's terms; see `estimate`'s docstring. Rough: the router's float32 logits and one-hots are
    left out."""
    a, E, F, R = DTYPE_BYTES[m.dtype], m.embed, m.mlp / T, m.routed_mlp / T
    shared = (m.shared_expert_mlp or m.mlp) / T if m.shared_expert else 0.0

    def mlp(width: float, policy: RematPolicy) -> float:  # a dense MLP's kept bytes per token (activation_bytes')
        if policy.named:
            return mlp_named_bytes(policy, a, width)
        return {"full": 0.0}.get(policy.kind, 2 * a * width)  # gate and up (`none` recomputes the rest)

    # slots of routed experts, plus the shared expert, less the dense MLP activation_bytes counted for this layer
    policy = m.remat_policy
    # per slot under `none`: its dispatched input and expert output (gathers), gate and up (GEMMs)
    per_slot = {"none": 2 * a * E + 2 * a * R, "dots_saveable": a * E + 2 * a * R}.get(policy.kind, 0.0)
    kept = slots_per_token * per_slot + mlp(shared, policy) - mlp(F, policy)
    autodiff = slots_per_token * (4 * a * E + AUTODIFF_MLP * a * R) + AUTODIFF_MLP * a * (shared - F)  # recomputed
    return kept, (autodiff if policy.recomputes else 0.0)


def lora_activation_bytes(m: TransformerConfig, lora: LoraConfig, T: int) -> tuple[float, float]:
    """What LoRA adds to `activation_bytes` per token and layer (kept, kept without remat): each targeted
    projection's x A [rank] (dB reads it), a r per target, kept under none and the dots policies; the dots
    policies also keep the adapters' product x A B beside x W where the backward reads their sum (q, k, v, gate,
    up: its output width on a device). Full remat and the named policies keep neither (they recompute them)."""
    a, d = DTYPE_BYTES[m.dtype], m.head_dim
    K = m.kv_heads / T if m.kv_heads % T == 0 else m.kv_heads
    widths = {"q": m.heads / T * d, "k": K * d, "v": K * d, "gate": m.mlp / T, "up": m.mlp / T}
    ranks = a * lora.rank * len(lora.target_names)
    policy = m.remat_policy
    if policy.named or policy.full:
        return 0.0, ranks
    products = a * sum(widths.get(t, 0.0) for t in lora.target_names) if policy.kind.startswith("dots") else 0.0
    return ranks + products, ranks


def _layer_bytes(s: Layout, kind: str) -> float:
    """Bytes of the largest layer (dense or MoE) on a device, whole over fsdp: its weights cast to the compute
    dtype (`kind` "compute": what ZeRO-3 gathers) or its float32 gradient ("grads": none for a frozen base)."""
    counts = {"blocks": s.model.layers - s.model.moe_layers, "moe_blocks": s.model.moe_layers}

    def local(p: Sharded) -> float:
        if kind == "compute":
            return s.local(p, "params", gathered=True) * s.a / p.element_bytes
        return s.local(p, kind, gathered=True)

    return max(
        sum(local(p) for p in s.params if p.stack == stack) * s["pipeline"] / count
        for stack, count in counts.items()
        if count
    )


def _kept(s: Layout, platform: str | None, capability: int) -> tuple[float, float, str]:
    """(kept bytes per token and layer, one layer's recompute per token, the attention kernel), MoE included."""
    m, T = s.model, s["tensor"]
    sp, C = s.sequence_parallel, s["context"]
    kept, recompute = activation_bytes(m, T, sp, C, s.seq_len, platform, capability, s.context_parallel)
    if s.lora is not None and s.lora.enabled:
        lora_kept, lora_none = lora_activation_bytes(m, s.lora, T)
        kept, recompute = kept + lora_kept, max(0.0, recompute + lora_none - lora_kept)
    if m.moe_layers:  # per layer on average; the recomputed layer is the larger of the two kinds
        moe_kept, moe_recompute = moe_activation_bytes(m, T, s.slots / s.seq_len)
        kept, recompute = kept + moe_kept * m.moe_layers / m.layers, recompute + max(0.0, moe_recompute)
    return kept, recompute, local_kernel(layout_kernel(s, platform, capability))


def _residuals(s: Layout, kept: float) -> float:
    """Bytes the forward keeps for the backward: every stage layer's, or the pipeline's stashes and one chunk's."""
    P, M, E, a = s["pipeline"], s.microbatches, s.model.embed, s.a
    mb, seq_split = s.tokens / M, s["tensor"] if s.sequence_parallel else 1
    if P == 1:
        return s.stage_layers * mb * kept
    if s.schedule == "gpipe":  # autodiff through the forward loop keeps every microbatch
        return M * s.stage_layers * mb * kept + 2 * s.tokens * E * a / seq_split
    # spmdkit recomputes a chunk from its stashed input; + pipeline inputs and their gradient accumulator
    stash = pipeline_schedule(s.schedule, P, M, s.virtual_stages).num_stash_slots
    slots = stash + max(1, P // 2 if s.virtual_stages > 1 else 1)
    return (slots * mb + 2 * s.tokens) * E * a / seq_split + s.stage_layers / s.virtual_stages * mb * kept


def _casts_kept(s: Layout, gathers: bool) -> bool:
    """Whether the stacked weights' compute-dtype casts live through the step: without remat (the backward's
    matmuls read them), and for a LoRA run's frozen base accumulating microbatches in a loop under a policy that
    saves the dots (measured on 8B, 1 x H100: XLA hoists the loop-invariant cast out of the loop; not under full
    remat or the named policies, nor when ZeRO-3 gathers each layer inside the loop)."""
    policy = s.model.remat_policy
    frozen = s.lora is not None and s.lora.enabled
    dots = policy.kind.startswith("dots")
    hoisted = frozen and dots and s.microbatches > 1 and s["pipeline"] == 1 and not gathers
    return not policy.recomputes or hoisted


# The stacked weights whose relaid-out float32 copy XLA:GPU keeps under ZeRO-3 (`_relayouts`), the operands of
# their gathers: a dense block's MLP gate and the query (the state axes split them), an MoE block's three expert
# weights where fsdp or context splits them (gpt-oss-20b on fsdp=2,expert=4: f32[1440, 24, 8, 2880] each).
RELAID_OUT = ("blocks.mlp.gate", "blocks.attention.q", "moe_blocks.attention.q", *(
    f"moe_blocks.mlp.{w}" for w in ("gate", "up", "down")))  # fmt: skip


def _state_split(s: Layout) -> int:
    """How many ways ZeRO splits the dense weights' state: the product of `STATE_AXES` (`embed`'s rule)."""
    return math.prod(s[x] for x in STATE_AXES)


def _relayouts(s: Layout) -> float:
    """Under ZeRO-3 XLA:GPU keeps a relaid-out (the split dim outermost, layers inward) float32 copy of the stacked
    shards of `RELAID_OUT` that the state axes split (an expert weight's `expert` splits its experts, not its
    state). Not modelled: on gpt-oss-20b's expert=8 under full remat XLA also holds the expert weights' gradients
    twice (the stacked, scaled gradient beside the per-layer products it is assembled from; 9.6 GB, #39)."""
    if s.zero < 3 or _state_split(s) == 1:
        return 0.0
    return sum(s.local(p, "params") for p in s.params if p.name in RELAID_OUT and state_axes(p.params, p.routed))


def _gradients(s: Layout) -> float:
    """float32 gradients as the rules split them. Accumulating M > 1 microbatches in a loop: the running sum, which
    XLA's while-loop double buffering keeps twice, and one microbatch's (unsplit over the replica axes when the loop
    runs in their shard_map), + the embedding's gradient in the compute dtype, scatter-added over the whole loop
    body (the whole vocabulary under SP, whose split token ids make XLA gather the whole table for the lookup)."""
    if s["pipeline"] == 1 and s.microbatches > 1:
        kind = "params" if manual_region(s) else "grads"
        vocab = s.model.vocab_size / (1 if s.sequence_parallel else s["tensor"])
        embedding = next(p for p in s.params if p.name == "embedding").trained  # a LoRA base's is frozen
        return 3 * sum(s.local(p, kind) for p in s.params if p.trained) + embedding * s.a * vocab * s.model.embed
    grads = sum(s.local(p, "grads") for p in s.params)
    if s["pipeline"] > 1 and s.schedule != "gpipe":  # 1F1B's tick loop carries a float32 accumulator of the stage's
        # layers laid out as their parameters (the loop is manual over the batch axes: ZeRO-2's split comes after
        # it), live beside the reduced gradient (XLA 0.11 on; measured on H100 compiles, docs/jax-limits.md)
        grads += sum(s.local(p, "params") for p in s.params if p.stacked and p.trained)
    return grads


def _loss_phase(s: Layout) -> dict[str, float]:
    """The LM head's gradient accumulators, cast and gathered copy, and one loss chunk (module doc)."""
    m, a, T = s.model, s.a, s["tensor"]
    head = next(p for p in s.params if p.name == ("embedding" if m.tie_embeddings else "lm_head"))
    chunks = loss_chunks(s.seq_len, m.loss_chunk, s["context"])
    accumulating = s["pipeline"] == 1 and manual_region(s)  # the replica axes are manual around the loss
    manual = ({"data", "fsdp"} if s.zero < 3 else {"data"}) if accumulating else set()
    token_axes = [x for x in (*BATCH_AXES, "context") if s[x] > 1 and x not in manual]
    whole = s.local(head, "params", gathered="fsdp" in token_axes)  # [E, V/T] as stored, as the loss sees it
    mb = s.tokens / s.microbatches
    return {
        "gradients": whole * head.trained,  # float32; a LoRA base's head is frozen
        "compute_copies": whole * a / head.element_bytes,
        "activations": mb * (m.vocab_size / T * 4 * 2 / chunks + m.embed * a + 4),
    }


def optimizer_bytes(s: Layout) -> float:
    """Per device: AdamW's two float32 moments, sharded as the optimizer table says (ZeRO >= 1 over fsdp); with
    Muon one (its momentum) for each hidden matrix (`Sharded.matrix`), AdamW's two for the rest."""
    return sum((1 if s.muon and p.matrix else 2) * s.local(p, "optimizer") for p in s.params)


def memory(s: Layout, platform: str | None = None, capability: int = 0) -> dict[str, float]:
    """Per-device bytes by component at the step's peak: the persistent terms and the largest transient phase
    (module docstring); `platform` decides what attention "auto" runs (None: an O(seq) kernel)."""
    m, a, E, T = s.model, s.a, s.model.embed, s["tensor"]
    kept, recompute, kernel = _kept(s, platform, capability)
    mb, gathers = s.tokens / s.microbatches, s.zero == 3 and _state_split(s) > 1
    # the stacked weights cast to the compute dtype (those stored in it need no copy)
    stacked = sum(s.local(p, "params") * a / p.element_bytes for p in s.params if p.stacked and p.element_bytes != a)
    persistent = {
        "parameters": sum(s.local(p, "params") for p in s.params),
        "optimizer": 0.0 if s.offload else optimizer_bytes(s),  # offloaded: host memory (Estimate.host_bytes)
        "compute_copies": (stacked if _casts_kept(s, gathers) else 0.0) + _relayouts(s),
        "activations": _residuals(s, kept),
    }
    layer = _layer_bytes(s, "grads")
    layers = 2 * _layer_bytes(s, "compute") if gathers else 0.0  # two gathered layers, cast before the all-gather
    tp = 2 * mb * E * a if T > 1 else 0.0
    scratch = attention_scratch(m, T, s.seq_len, mb / s.seq_len, kernel)
    C, U = s["context"], s.ulysses  # 2D: a ring of C / U positions over heads / (T U) heads
    forward = ring_scratch(m, T * U, C // U, s.seq_len, mb * C / s.seq_len) if kernel == "ring" else 0.0
    if m.remat_policy.kind == "dots_saveable" and kernel in ("ring", "blockwise"):  # a layer's scores, twice
        forward += 2 * mb * kernel_scores(m, kernel, T, s["context"], s.seq_len)
    grads, loss = _gradients(s), _loss_phase(s)
    split = _state_split(s) > 1 and s.zero >= 2 and not manual_region(s)  # a layer's gradient before its reduce-scatter
    phases = [
        {"comm_buffers": layers + tp, "activations": scratch + forward},  # forward: no gradients yet
        {**loss, "gradients": grads + loss["gradients"]},
        {"gradients": grads + (layer if split else 0.0), "comm_buffers": layers + tp,
         "activations": mb * recompute + scratch},
    ]  # fmt: skip
    peak = max(phases, key=lambda phase: sum(phase.values()))
    return {k: persistent.get(k, 0.0) + peak.get(k, 0.0) for k in MEMORY_KEYS}
