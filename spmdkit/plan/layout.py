"""What the layout planner (`spmdkit.plan`) lays out: the parameter inventory, how the rules split each parameter
over the mesh, a `Layout` (model, mesh, batch, ZeRO stage, SP, microbatches, schedule), and the
mixture-of-experts dispatch sizes. Pure arithmetic (no JAX).

Parameters as `spmdkit.models.transformer` builds them, named by their model path: `embedding`, `final_norm`,
`lm_head` (absent when the embeddings are tied), the dense blocks stacked over layers - moe_layers (`blocks.*`)
and the MoE blocks stacked over moe_layers (`moe_blocks.*`: attention as in a dense block, a router [embed,
experts], expert gate/up [experts, embed, mlp] and down [experts, mlp, embed], and `moe_blocks.mlp.shared.*` when
`shared_expert`); the biases and q/k norms the config asks for sit beside their weights (`attention.q_bias`,
`attention.q_norm`, `mlp.down_bias`); with `mtp_depth` D, the multi-token-prediction modules (`mtp.*`: D blocks of
the last layer's kind, their norms and eh_proj).

LoRA (`--lora.rank`, `spmdkit.models.lora`): each targeted projection W [layers, *in, *out] of a stack gets, beside
it, A `W_lora_a` [layers, *in, rank] (W's input names, the rank dim None) and B `W_lora_b` [layers, rank, *out] (its
output names), stored in the parameter dtype; only they train (gradients and AdamW moments). The frozen base keeps
no gradient and no moment, and is stored as `BASE_BYTES` says of its storage (`base_storage`: the parameter dtype, or
a QLoRA quantization).

MoE dispatch (`spmdkit.parallel.experts`): a sequence of S tokens sends at most C = min(S, ceil(capacity_factor x
S x top_k / E)) tokens to each of the E experts, so the experts compute E x C slots per sequence (padding
included) instead of top_k x S tokens. Dropless runs the same program with C = S whenever the batch is split
(any of data, fsdp, expert > 1); on one batch shard it is a grouped matmul without padding (top_k x S). The
`dense` reference runs every expert on every token (E x S).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig
from spmdkit.models.lora_config import PROJECTIONS, LoraConfig
from spmdkit.models.matrices import matrix_axes
from spmdkit.parallel.capacity import capacity
from spmdkit.parallel.pipeline.schedule import check_arguments, check_layers, check_pipelinable
from spmdkit.plan.devices import parse_mesh
from spmdkit.sharding.rules import REPLICATE_IF_INDIVISIBLE, make_rules
from spmdkit.sharding.strategy import Strategy, mesh_text

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BATCH_AXES = make_rules().params["batch"]  # every axis the sequences are split over
UNSTACKED = ("embedding", "final_norm", "lm_head")
# Bytes per element of a frozen LoRA base as stored, by its storage (`base_storage`): the parameter dtypes, and
# QLoRA's quantized projections (`spmdkit.models.lora`: int8 codes with one scale per output channel, nf4 codes
# packed two to a byte with one scale per `NF4_BLOCK` inputs; `frozen_bytes` adds the scales).
BASE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0, "nf4": 0.5}
NF4_BLOCK = 64  # `spmdkit.models.lora.NF4_BLOCK` (the plan layer does not import the model's JAX code)
QUANTIZED = {"attention.q", "attention.k", "attention.v", "attention.o", "mlp.gate", "mlp.up", "mlp.down"}
IN_DIMS = {"o": 2}  # a projection's input dims (A's): o [heads, head_dim, embed] contracts two, the others one

Param = tuple[str, tuple[int, ...], tuple[str | None, ...]]


def _mlp(E: int, F: int, bias: bool) -> list[Param]:
    mlp = [("gate", (E, F), ("embed", "mlp")), ("up", (E, F), ("embed", "mlp")), ("down", (F, E), ("mlp", "embed"))]
    if bias:
        mlp += [("gate_bias", (F,), ("mlp",)), ("up_bias", (F,), ("mlp",)), ("down_bias", (E,), ("embed",))]
    return mlp


def _attention_vectors(m: TransformerConfig) -> list[Param]:
    """The attention's biases and q/k norm scales."""
    E, H, K, d = m.embed, m.heads, m.kv_heads, m.head_dim
    out: list[Param] = []
    if m.kv_lora_rank and m.qkv_bias:  # latent attention: biases on its down projections
        out += [("attention.q_a_bias", (m.q_lora_rank,), ("latent",))] if m.q_lora_rank else []
        out += [("attention.kv_a_bias", (m.kv_lora_rank + m.qk_rope_head_dim,), ("latent",))]
    elif m.qkv_bias:
        out += [("attention.q_bias", (H, d), ("heads", "head_dim"))]
        out += [(f"attention.{n}_bias", (K, d), ("kv_heads", "head_dim")) for n in "kv"]
    if m.o_bias:
        out += [("attention.o_bias", (E,), ("embed",))]
    if m.attention_sinks:
        out += [("attention.sinks", (H,), ("heads",))]
    if m.qk_norm and m.qk_norm_scope == "head":
        out += [("attention.q_norm", (d,), ("norm",)), ("attention.k_norm", (d,), ("norm",))]
    elif m.qk_norm:
        out += [("attention.q_norm", (H, d), ("heads", "head_dim"))]
        out += [("attention.k_norm", (K, d), ("kv_heads", "head_dim"))]
    return out


def _attention(m: TransformerConfig) -> list[Param]:
    """The attention's matrices: q, k, v, o, or latent attention's (`spmdkit.models.latent_attention`)."""
    E, H, K, d = m.embed, m.heads, m.kv_heads, m.head_dim
    if not m.kv_lora_rank:
        return [
            ("attention.q", (E, H, d), ("embed", "heads", "head_dim")),
            *[(f"attention.{n}", (E, K, d), ("embed", "kv_heads", "head_dim")) for n in "kv"],
            ("attention.o", (H, d, E), ("heads", "head_dim", "embed")),
        ]
    Q, KV, V, A = m.q_lora_rank, m.kv_lora_rank, m.value_head_dim, m.kv_lora_rank + m.qk_rope_head_dim
    query: list[Param] = [
        ("attention.q_a", (E, Q), ("embed", "latent")), ("attention.q_a_norm", (Q,), ("latent",)),
        ("attention.q_b", (Q, H, d), ("latent", "heads", "head_dim")),
    ] if Q else [("attention.q", (E, H, d), ("embed", "heads", "head_dim"))]  # fmt: skip
    return [
        *query, ("attention.kv_a", (E, A), ("embed", "latent")), ("attention.kv_a_norm", (KV,), ("latent",)),
        ("attention.kv_b", (KV, H, m.qk_nope_head_dim + V), ("latent", "heads", "head_dim")),
        ("attention.o", (H, V, E), ("heads", "head_dim", "embed")),
    ]  # fmt: skip


def _experts(m: TransformerConfig) -> list[Param]:
    E, F, X = m.embed, m.routed_mlp, m.experts
    mlp: list[Param] = [
        ("router", (E, X), ("embed", None)),
        ("gate", (X, E, F), ("experts", "embed", "mlp")),
        ("up", (X, E, F), ("experts", "embed", "mlp")),
        ("down", (X, F, E), ("experts", "mlp", "embed")),
    ]
    mlp += [(f"{n}_bias", (X,), (None,)) for n in ("router", "router_correction") if getattr(m, f"{n}_bias")]
    if m.expert_bias:
        mlp += [(f"{n}_bias", (X, F), ("experts", "mlp")) for n in ("gate", "up")]
        mlp += [("down_bias", (X, E), ("experts", "embed"))]
    if m.shared_expert:
        mlp += [(f"shared.{n}", shape, names) for n, shape, names in _mlp(E, m.shared_expert_mlp or m.mlp, False)]
    if m.shared_expert_gate:
        mlp += [("shared_gate", (E, 1), ("embed", None))]
    return mlp


def _block(m: TransformerConfig, moe: bool) -> list[Param]:
    """One block's parameters (name relative to the block, shape, logical names), as `Block` builds them."""
    E = m.embed
    mlp = _experts(m) if moe else _mlp(E, m.mlp, m.mlp_bias)
    norm = ((E,), ("norm",))
    return [
        *([("attention_norm", *norm)] if m.pre_norm else []),
        *_attention(m),
        *_attention_vectors(m),
        *([("attention_post_norm", *norm)] if m.post_norm else []),
        *([("mlp_norm", *norm)] if m.pre_norm else []),
        *[(f"mlp.{name}", shape, names) for name, shape, names in mlp],
        *([("mlp_post_norm", *norm)] if m.post_norm else []),
    ]


def parameters(m: TransformerConfig) -> list[Param]:
    """(model path, shape, logical names) of every parameter as `spmdkit.models.transformer` builds it; stacked
    blocks carry a leading [count] `layers` dim (dense: layers - moe_layers, MoE: moe_layers; an empty stack is
    not built)."""
    E, V = m.embed, m.vocab_size
    out: list[Param] = [("embedding", (V, E), ("vocab", "embed"))]
    for stack, count, moe in [("blocks", m.layers - m.moe_layers, False), ("moe_blocks", m.moe_layers, True)]:
        if count:
            out += [(f"{stack}.{n}", (count, *shape), ("layers", *names)) for n, shape, names in _block(m, moe)]
    if D := m.mtp_depth:  # the multi-token-prediction modules (`spmdkit.models.mtp`): blocks of the last layer's kind
        out += [(f"mtp.blocks.{n}", (D, *shape), ("layers", *names)) for n, shape, names in _block(m, m.mtp_moe_layers)]
        out += [(f"mtp.{n}", (D, E), ("layers", "norm")) for n in ("enorm", "hnorm", "head_norm")]
        out += [("mtp.eh_proj", (D, 2, E, E), ("layers", None, "embed", None))]
    head = [] if m.tie_embeddings else [("lm_head", (E, V), ("embed", "vocab"))]
    return [*out, ("final_norm", (E,), ("norm",)), *head]


def base_storage(m: TransformerConfig, lora: LoraConfig | None) -> str:
    """How a LoRA run stores its frozen base: QLoRA's quantization (`lora.quantize`, where the config has it) or the
    parameter dtype; the key of `BASE_BYTES`."""
    quantize = getattr(lora, "quantize", "none")
    return quantize if quantize != "none" else m.param_dtype


def frozen_bytes(m: TransformerConfig, lora: LoraConfig, name: str, shape: tuple[int, ...]) -> float:
    """Bytes per element of the frozen base parameter `name` [layers, in..., out...]: QLoRA quantizes only the
    blocks' projections (their scales, in the parameter dtype, spread over the weights they scale); the
    embedding, norms, biases and head stay in the parameter dtype."""
    storage, dtype_bytes = base_storage(m, lora), float(DTYPE_BYTES[m.param_dtype])
    if storage == m.param_dtype or name.split(".", 1)[-1] not in QUANTIZED:
        return dtype_bytes
    if storage == "int8":  # one scale per output channel: the contracted (input) dims share it
        return BASE_BYTES["int8"] + dtype_bytes / math.prod(shape[1:2] if not name.endswith(".o") else shape[1:3])
    return BASE_BYTES["nf4"] + dtype_bytes / NF4_BLOCK


def adapters(m: TransformerConfig, lora: LoraConfig) -> list[Param]:
    """(model path, shape, logical names) of the LoRA adapters qwix adds (module docstring), stacked as their
    weights; the stacks' blocks in `parameters` order, each target in `lora.target_names` order."""
    shapes = {name: (shape, names) for name, shape, names in parameters(m)}
    out: list[Param] = []
    for stack in ("blocks", "moe_blocks"):
        for target in lora.target_names:
            found = shapes.get(f"{stack}.{PROJECTIONS[target][0]}.{target}")
            if found is None:  # an MoE block's routed MLP has no dense gate/up/down (check_lora refuses MoE)
                continue
            (count, *shape), (_, *names) = found
            k, r, path = IN_DIMS.get(target, 1), lora.rank, f"{stack}.{PROJECTIONS[target][0]}.{target}"
            out.append((f"{path}_lora_a", (count, *shape[:k], r), ("layers", *names[:k], None)))
            out.append((f"{path}_lora_b", (count, r, *shape[k:]), ("layers", None, *names[k:])))
    return out


@dataclasses.dataclass(frozen=True)
class Sharded:
    """One parameter's float32 bytes, the mesh axes its value, optimizer moments and gradient are split over, and
    `divisor[kind]`: (the product of those axes, the same without the state axes fsdp, context and expert). `routed`: an
    expert weight (it has the `experts` dim and runs inside the expert shard_map)."""

    name: str
    nbytes: int
    params: tuple[str, ...]
    optimizer: tuple[str, ...]
    grads: tuple[str, ...]
    divisor: dict[str, tuple[int, int]]
    routed: bool = False
    matrix: bool = False  # a hidden matrix (`spmdkit.models.matrices`): Muon keeps one moment for it, not two
    trained: bool = True  # False: a LoRA run's frozen base (no gradient, no optimizer state)
    element_bytes: float = 4.0  # as stored (`nbytes` / elements): float32, or the frozen base's `BASE_BYTES`

    @property
    def stacked(self) -> bool:
        return self.name not in UNSTACKED

    @property
    def stack(self) -> str | None:
        """The stack ("blocks" or "moe_blocks") of a block parameter, None for embedding, final norm and head."""
        return self.name.split(".")[0] if self.stacked else None


STATE_AXES = ("fsdp", "context", "expert")  # what ZeRO shards the state over (`embed`'s rule)


def state_axes(axes: tuple[str, ...], routed: bool = False) -> tuple[str, ...]:
    """The state axes among a parameter's `axes` (its value's, optimizer's or gradient's): what gathers it. A
    routed expert weight's `expert` splits its experts (each device computes with its own), not its state."""
    return tuple(x for x in STATE_AXES if x in axes and not (routed and x == "expert"))


@functools.cache
def sharded(
    m: TransformerConfig, mesh: tuple[tuple[str, int], ...], zero: int, lora: LoraConfig | None = None
) -> tuple[Sharded, ...]:
    """Every parameter under the rules, as `logical_to_spec` lays it out: each dim takes the mesh axes of its
    logical name that are > 1 and not yet used by the array; kv_heads replicate when the axes do not divide them.
    Each kind of tensor has its rule table: the value, its optimizer moments, its gradient (ZeRO-2 lays gradients
    out like the optimizer state). With `lora` enabled the model's own parameters are a frozen base (`BASE_BYTES`
    per element) and its adapters follow them (trained, in the parameter dtype)."""
    sizes, out, rules = dict(mesh), [], make_rules(zero)
    grads = rules.optimizer if rules.gradients_like_optimizer else rules.params
    tables = {"params": rules.params, "optimizer": rules.optimizer, "grads": grads}
    tuned = lora is not None and lora.enabled
    inventory = [(p, frozen_bytes(m, lora, p[0], p[1]) if tuned else 4.0, not tuned) for p in parameters(m)]
    inventory += [(p, float(DTYPE_BYTES[m.param_dtype]), True) for p in (adapters(m, lora) if tuned else [])]
    for (name, shape, names), element, trained in inventory:
        axes, routed = {}, "experts" in names
        for kind, table in tables.items():
            axes[kind] = []
            for size, logical in zip(shape, names, strict=True):
                dim_axes = (
                    [x for x in table.get(logical, ()) if sizes[x] > 1 and x not in axes[kind]] if logical else []
                )
                split = math.prod(sizes[x] for x in dim_axes)
                if dim_axes and size % split:
                    if logical in REPLICATE_IF_INDIVISIBLE:
                        continue
                    raise SpmdkitError(
                        f"parameter {name} {shape}: {logical}={size} is not divisible by mesh axes "
                        f"{'x'.join(f'{x}={sizes[x]}' for x in dim_axes)}; change the model size or the mesh"
                    )
                axes[kind] += dim_axes
        divisor = {
            k: (math.prod(sizes[x] for x in v), math.prod(sizes[x] for x in v if x not in state_axes(v, routed)))
            for k, v in axes.items()
        }
        kinds = (tuple(axes[k]) for k in ("params", "optimizer", "grads"))
        matrix = matrix_axes(name, names) is not None
        out.append(Sharded(name, element * math.prod(shape), *kinds, divisor, routed, matrix, trained, element))
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout(Strategy):
    """A step's layout: a `Strategy` (mesh, ZeRO stage, SP, microbatches, pipeline schedule, offload) with every
    mesh size and the microbatches resolved, for the model (with its compute dtype and remat policy) and a batch of
    `batch_size` x `seq_len`."""

    model: TransformerConfig
    batch_size: int
    seq_len: int
    lora: LoraConfig | None = None  # enabled: the model is a frozen base under trained adapters

    @classmethod
    def of(
        cls,
        model: TransformerConfig,
        strategy: Strategy,
        devices: int | None,
        batch_size: int | None,
        seq_len: int,
        lora: LoraConfig | None = None,
    ) -> Layout:
        """`strategy`'s mesh resolved for `devices` (which fill a -1); `batch_size` None: about 1M tokens, a
        multiple of the batch axes; microbatches None: 1, or one sequence per batch shard per pipeline microbatch."""
        sizes = parse_mesh(strategy.mesh, devices)
        replicas = math.prod(sizes[x] for x in BATCH_AXES)
        batch_size = batch_size or replicas * max(1, round(2**20 / seq_len / replicas))
        settings = {**dataclasses.asdict(strategy), "mesh": mesh_text(sizes)}
        settings["microbatches"] = strategy.microbatches or (batch_size // replicas if sizes["pipeline"] > 1 else 1)
        return cls(**settings, model=model, batch_size=batch_size, seq_len=seq_len, lora=lora)

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        return parse_mesh(self.mesh)

    def __getitem__(self, axis: str) -> int:
        return self.sizes[axis]

    def local(self, p: Sharded, kind: str, gathered: bool = False) -> float:
        """Bytes of `p` (value, optimizer moment or gradient) on a device; `gathered`: as if not split over the
        state axes (fsdp, context). A frozen parameter has no gradient and no moments (0)."""
        if kind != "params" and not p.trained:
            return 0.0
        return p.nbytes / p.divisor[kind][gathered]

    @functools.cached_property
    def params(self) -> tuple[Sharded, ...]:
        lora = self.lora if self.lora is not None and self.lora.enabled else None
        return sharded(self.model, tuple(self.sizes.items()), self.zero, lora)

    @property
    def a(self) -> int:
        return DTYPE_BYTES[self.model.dtype]

    @property
    def replicas(self) -> int:
        """D x Fs x X: the batch axes (the batch is split over data, fsdp and expert)."""
        return math.prod(self[x] for x in BATCH_AXES)

    @property
    def tokens(self) -> float:
        """t: this device's tokens per step (batch over data x fsdp x expert, sequence over context)."""
        return self.batch_size * self.seq_len / (self.replicas * self["context"])

    @property
    def stage_layers(self) -> float:
        return self.model.layers / self["pipeline"]

    @property
    def expert_shard_map(self) -> bool:
        """Whether the routed experts run in `expert_ffn`'s shard_map (capacity or dropless, batch split)."""
        return self.model.dispatch != "dense" and self.replicas > 1

    @property
    def slots(self) -> int:
        """Expert slots computed per sequence: E x C (capacity), E x S (dense; dropless in the shard_map), or
        top_k x S (dropless on one batch shard: a grouped matmul, no padding); 0 for a dense model."""
        m, S = self.model, self.seq_len
        if not m.moe_layers:
            return 0
        if m.dispatch == "capacity":
            return m.experts * capacity(S, m.top_k, m.experts, m.capacity_factor)
        return m.experts * S if m.dispatch == "dense" or self.expert_shard_map else m.top_k * S

    @property
    def dispatch_bytes(self) -> float:
        """One all-to-all's operand per device per step and MoE layer: the dispatch buffer [B_local, E, C, embed]
        in the compute dtype, B_local = B / (D Fs X) sequences (over all microbatches)."""
        return self.batch_size / self.replicas * self.slots * self.model.embed * self.a


def check_layout(s: Layout) -> None:
    """SpmdkitError with a one-line fix for layouts spmdkit cannot run.

    The one statement of what the trainer can run: `spmdkit train` calls it before it builds or compiles anything,
    and the planner skips the layouts it refuses.
    """
    P, M, v, C, X, replicas, m = (
        s["pipeline"], s.microbatches, s.virtual_stages, s["context"], s["expert"], s.replicas, s.model
    )  # fmt: skip
    if s.zero not in (0, 1, 2, 3):
        raise SpmdkitError(f"ZeRO stage {s.zero} is not one of 0, 1, 2, 3")
    if min(s.batch_size, s.seq_len, M, v) < 1:
        raise SpmdkitError("batch size, sequence length, microbatches and virtual stages must be positive")
    if s.batch_size % (replicas * M):
        raise SpmdkitError(
            f"batch of {s.batch_size} sequences does not split into {M} microbatch(es) over data x fsdp x expert = "
            f"{replicas} devices: make the batch size a multiple of {replicas * M}"
        )
    check_arguments(s.schedule, P, M, v)
    check_layers(m.layers, P, v)
    if C > 1 and s.seq_len % (2 * C):
        raise SpmdkitError(
            f"sequence length {s.seq_len} does not split into 2 x context = {2 * C} chunks for ring attention: "
            f"make it a multiple of {2 * C}"
        )
    if X > 1 and not m.moe_layers:
        raise SpmdkitError("expert parallelism needs a mixture-of-experts model (experts > 0); this one is dense")
    if X > 1 and m.experts % X:
        raise SpmdkitError(f"experts={m.experts} is not divisible by mesh axis expert={X}")
    if X > 1 and m.dispatch == "dense":
        raise SpmdkitError("dense MoE dispatch (the reference) is not expert-parallel: use capacity or dropless")
    if P > 1:
        check_pipelinable(m.moe_layers, C)
    if P > 1 and s.lora is not None and s.lora.enabled:
        raise SpmdkitError(
            "--lora does not run with a pipeline axis (its schedule computes every parameter's gradients) yet: drop one"
        )
    s.params  # noqa: B018  (raises if an axis does not divide a parameter)
