"""`TransformerConfig`: the shape and function of a decoder-only transformer (presets: `spmdkit.models.presets`).

Every feature of the Hugging Face families spmdkit runs is a field (so a flag and a `[model]` TOML key): q/k/v and
output biases, MLP biases, q/k RMSNorms (per head or over the whole projection), norms before and/or after each
block's attention and MLP, RMSNorm as (1 + w), tied embeddings, RoPE scaling (`linear`, `llama3`), partial RoPE,
layers without RoPE, sliding-window attention on every layer or on a pattern of layers with their own RoPE base,
the attention scale, attention- and final-logit soft-capping, attention sinks, YaRN RoPE, embedding / residual /
logit multipliers, the MLP's activation, and mixture-of-experts routing (routed experts of their own width, a gated
shared expert, the dense layers' pattern, router and expert biases, GPT-OSS's clamped SwiGLU).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Annotated, Literal

from spmdkit.errors import SpmdkitError
from spmdkit.models.config_checks import (
    check_dense,
    check_experts,
    check_latent,
    check_mtp,
    check_rope,
    check_scales,
)
from spmdkit.models.fields import arg, check_types
from spmdkit.models.remat import HELP as REMAT_HELP
from spmdkit.models.remat import RematPolicy, parse_remat

Remat = str  # a preset of `spmdkit.models.remat.PRESETS` or save:/offload: names (`parse_remat` checks it)
Attention = Literal["auto", "dot", "blockwise", "cudnn", "ring", "ulysses_dot", "ulysses_blockwise", "ulysses_cudnn"]
Dispatch = Literal["capacity", "dropless", "dense", "auto"]
Dtype = Literal["float32", "bfloat16", "float16"]
Activation = Literal["silu", "gelu", "gelu_pytorch_tanh"]
QkNormScope = Literal["head", "layer"]
RouterScore = Literal["softmax", "sigmoid"]
RopeType = Literal["default", "linear", "llama3", "yarn"]
ACTIVATIONS: tuple[str, ...] = typing.get_args(Activation)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Decoder shape and numerics (each field's help is beside it, `spmdkit.models.fields`).

    Parameters are `param_dtype` (float32) and cast to `dtype` where they are used. Mixture of experts
    (`experts` > 0): every `moe_every`-th block (1: all) replaces its MLP by `experts` SwiGLU experts of hidden width
    `mlp`, each token routed to `top_k` of them (plus a dense `shared_expert` when set). `dispatch`: "capacity"
    (each sequence sends at most ceil(capacity_factor x seq x top_k / experts) tokens to an expert; the rest pass
    through the residual), "dropless" (grouped matmul, nothing dropped), "dense" (every expert on every token:
    the reference) or "auto" (`build_program` picks capacity or dropless for the devices). The loss adds
    `load_balance_weight` x the Switch load-balancing loss and `router_z_weight` x the router z-loss;
    `balance_rate` > 0 balances the experts without a loss term, by moving the router's correction bias after each
    step (`spmdkit.train.step.balance`).
    """

    vocab_size: Annotated[int, arg("tokens in the vocabulary")] = 264
    embed: Annotated[int, arg("model width (hidden size)")] = 64
    layers: Annotated[int, arg("decoder blocks (stacked and scanned)")] = 4
    heads: Annotated[int, arg("query heads")] = 8
    kv_heads: Annotated[int, arg("key/value heads (grouped-query attention when fewer than heads)")] = 4
    head_dim: Annotated[int, arg("width of one attention head")] = 8
    mlp: Annotated[int, arg("SwiGLU hidden width (of each expert, for mixture of experts)")] = 256
    rope_theta: Annotated[float, arg("RoPE base")] = 10_000.0
    norm_eps: Annotated[float, arg("RMSNorm epsilon")] = 1e-5
    dtype: Annotated[Dtype, arg("compute dtype (parameters stay param_dtype)")] = "bfloat16"
    param_dtype: Annotated[Dtype, arg("dtype the parameters are stored and updated in")] = "float32"
    remat: Annotated[Remat, arg(REMAT_HELP)] = "none"
    attention: Annotated[
        Attention,
        arg(
            "attention kernel: auto (with context > 1 the --context-parallel algorithm, else cudnn on an NVIDIA GPU, "
            "else blockwise), dot (the reference), blockwise (O(seq) memory), cudnn, ring (context parallelism); "
            "ulysses_<kernel>: Ulysses context parallelism around that kernel"
        ),
    ] = "auto"
    attention_block: Annotated[int, arg("positions per query and key block of the blockwise attention kernel")] = 512
    ulysses_parts: Annotated[
        int,
        arg(
            "Ulysses: exchange and project attention's output in this many head parts, each part's projection beside "
            "the next part's exchange (0: auto, 2 where the heads split and o is a plain projection; 1: whole)"
        ),
    ] = 0
    loss_chunk: Annotated[int, arg("sequence positions per chunk of the LM head + cross-entropy (0: one chunk)")] = 512
    z_loss: Annotated[float, arg("weight of the z-loss mean(log(Z)^2) on the LM head's logits (0: off)")] = 0.0
    experts: Annotated[int, arg("mixture of experts: routed experts per MoE block (0: a dense model)")] = 0
    top_k: Annotated[int, arg("mixture of experts: experts each token is routed to")] = 2
    moe_every: Annotated[
        int, arg("mixture of experts: every k-th block is an MoE block, less the layers dense_layers names")
    ] = 1
    shared_expert: Annotated[bool, arg("mixture of experts: add a dense MLP that every token runs through")] = False
    dispatch: Annotated[
        Dispatch,
        arg(
            "mixture of experts: capacity, dropless, dense (the reference) or auto (dropless where it executes no "
            "more expert FLOPs than capacity on the devices, else capacity: spmdkit.plan.dispatch)"
        ),
    ] = "capacity"
    capacity_factor: Annotated[float, arg("mixture of experts: expert slots per sequence x top_k / experts")] = 1.25
    load_balance_weight: Annotated[float, arg("mixture of experts: weight of the Switch load-balancing loss")] = 0.01
    router_z_weight: Annotated[float, arg("mixture of experts: weight of the router z-loss")] = 0.001
    qkv_bias: Annotated[bool, arg("biases on the q, k and v projections (HF attention_bias; Qwen2)")] = False
    o_bias: Annotated[bool, arg("a bias on the attention output projection (HF Llama attention_bias)")] = False
    mlp_bias: Annotated[bool, arg("biases on the gate, up and down projections (HF mlp_bias)")] = False
    qk_norm: Annotated[bool, arg("RMSNorm over head_dim on each query and key head before RoPE (Qwen3 q/k_norm)")] = (
        False
    )
    tie_embeddings: Annotated[
        bool, arg("the LM head is the embedding table, one parameter (HF tie_word_embeddings)")
    ] = False
    activation: Annotated[Activation, arg("the MLP's gate activation: silu, gelu (erf) or gelu_pytorch_tanh")] = "silu"
    rope_type: Annotated[RopeType, arg("RoPE frequency scaling: default (none), linear, llama3 or yarn")] = "default"
    rope_factor: Annotated[float, arg("RoPE scaling factor (linear, llama3, yarn)")] = 1.0
    rope_low_freq_factor: Annotated[float, arg("llama3 RoPE: low_freq_factor")] = 1.0
    rope_high_freq_factor: Annotated[float, arg("llama3 RoPE: high_freq_factor")] = 4.0
    rope_original_max_positions: Annotated[int, arg("llama3 and yarn RoPE: original_max_position_embeddings")] = 8192
    rope_beta_fast: Annotated[float, arg("yarn RoPE: beta_fast, the rotations where extrapolation ends")] = 32.0
    rope_beta_slow: Annotated[float, arg("yarn RoPE: beta_slow, the rotations where interpolation starts")] = 1.0
    rope_truncate: Annotated[bool, arg("yarn RoPE: the correction range rounded out to whole dims (HF truncate)")] = (
        True
    )
    rope_attention_factor: Annotated[
        float, arg("yarn RoPE: cos and sin multiplied by this (0: 0.1 ln(rope_factor) + 1, HF attention_factor)")
    ] = 0.0
    max_positions: Annotated[
        int, arg("max_position_embeddings a Hugging Face export records (0: the run's seq_len)")
    ] = 0

    rope_fraction: Annotated[
        float, arg("share of head_dim that RoPE rotates, the leading dims (HF partial_rotary_factor)")
    ] = 1.0
    rope_pattern: Annotated[
        str, arg("which layers use RoPE: R (yes) or N (no) per layer, repeated (empty: all; SmolLM3)")
    ] = ""
    sliding_window: Annotated[int, arg("local attention: a query sees this many positions up to its own (0: all)")] = 0
    window_pattern: Annotated[
        str, arg("with sliding_window: L (local) or G (global) per layer, repeated over the layers (empty: all local)")
    ] = ""
    local_rope_theta: Annotated[float, arg("RoPE base of the local layers, unscaled (0: as the others; Gemma 3)")] = 0.0
    attention_scale: Annotated[float, arg("the factor on q.k (0: 1/sqrt(head_dim); Gemma, Granite set their own)")] = (
        0.0
    )
    attention_softcap: Annotated[float, arg("attention logits s become c tanh(s / c) (0: off; Gemma 2)")] = 0.0
    attention_sinks: Annotated[
        bool, arg("a learned logit per head in every softmax denominator, attending to nothing (GPT-OSS sinks)")
    ] = False
    logit_softcap: Annotated[float, arg("final logits z become c tanh(z / c) (0: off; Gemma 2)")] = 0.0
    logit_divisor: Annotated[float, arg("final logits divided by this (Granite logits_scaling)")] = 1.0
    embed_scale: Annotated[float, arg("the embedding's output multiplied by this (Gemma sqrt(embed), Granite)")] = 1.0
    residual_scale: Annotated[float, arg("attention's and the MLP's outputs multiplied by this (Granite)")] = 1.0
    norm_plus_one: Annotated[bool, arg("RMSNorms multiply by (1 + scale): scales stored as offsets (Gemma)")] = False
    pre_norm: Annotated[bool, arg("RMSNorm on each block's input to attention and to the MLP (off: OLMo 2)")] = True
    post_norm: Annotated[bool, arg("RMSNorm on attention's and the MLP's outputs (Gemma 2/3, OLMo 2)")] = False
    qk_norm_scope: Annotated[QkNormScope, arg("q/k norms over each head (Qwen3, Gemma 3) or the layer (OLMo 2)")] = (
        "head"
    )
    kv_lora_rank: Annotated[
        int, arg("multi-head latent attention (DeepSeek MLA): width of the compressed key/value latent (0: off)")
    ] = 0
    q_lora_rank: Annotated[int, arg("latent attention: width of the low-rank query (0: one plain q projection)")] = 0
    qk_rope_head_dim: Annotated[
        int, arg("latent attention: the trailing dims of each q/k head that RoPE rotates, the key's shared by heads")
    ] = 0
    v_head_dim: Annotated[int, arg("width of one value head (0: head_dim; latent attention: at most head_dim)")] = 0
    rope_interleave: Annotated[
        bool, arg("latent attention: RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... (HF rope_interleave)")
    ] = False
    rope_mscale_all_dim: Annotated[
        float, arg("yarn RoPE: the attention scale times (0.1 m ln(rope_factor) + 1)^2 (DeepSeek's mscale_all_dim m)")
    ] = 0.0
    expert_mlp: Annotated[int, arg("mixture of experts: hidden width of each routed expert (0: mlp)")] = 0
    shared_expert_mlp: Annotated[int, arg("mixture of experts: hidden width of the shared expert (0: mlp)")] = 0
    shared_expert_gate: Annotated[bool, arg("mixture of experts: the shared expert's output times sigmoid(x w)")] = (
        False
    )
    router_bias: Annotated[bool, arg("mixture of experts: a bias on the router's logits (GPT-OSS)")] = False
    expert_bias: Annotated[bool, arg("mixture of experts: biases on each expert's gate, up and down (GPT-OSS)")] = False
    swiglu_limit: Annotated[
        float,
        arg(
            "mixture of experts: > 0, the routed experts run GPT-OSS's SwiGLU: gate, up clamped to <= L, [-L, L], then "
            "(up + 1) gate sigmoid(a gate)"
        ),
    ] = 0.0
    swiglu_alpha: Annotated[float, arg("mixture of experts: the a of the clamped SwiGLU (with swiglu_limit)")] = 1.702
    router_renormalize: Annotated[bool, arg("mixture of experts: top-k weights (k > 1) rescaled to sum to 1")] = True
    router_score: Annotated[
        RouterScore, arg("mixture of experts: the router's scores, softmax over the experts or sigmoid of each")
    ] = "softmax"
    router_correction_bias: Annotated[
        bool, arg("mixture of experts: a bias added to the scores to choose experts, not to weight them (DeepSeek-V3)")
    ] = False
    balance_rate: Annotated[
        float,
        arg(
            "mixture of experts: > 0, auxiliary-loss-free load balancing: after each step every router correction "
            "bias (implied) moves by this toward balance, outside the gradient (DeepSeek-V3: 0.001)"
        ),
    ] = 0.0
    router_groups: Annotated[
        int, arg("mixture of experts: experts in this many groups, a token routed within its best groups (n_group)")
    ] = 1
    router_top_groups: Annotated[
        int, arg("mixture of experts: the groups a token may use, by their two best scores (topk_group)")
    ] = 1
    routed_scaling: Annotated[float, arg("mixture of experts: the routed experts' weights times this")] = 1.0
    dense_layers: Annotated[
        tuple[int, ...], arg("mixture of experts: 0-based layers that keep the dense MLP, whatever moe_every says")
    ] = ()
    fp8: Annotated[
        bool, arg("the blocks' dense matmuls (q, k, v, o, gate, up, down) in FP8 with delayed per-tensor scaling")
    ] = False
    mtp_depth: Annotated[
        int, arg("multi-token prediction: D modules after the last layer, module k predicting token i + k + 1 (0: off)")
    ] = 0
    mtp_weight: Annotated[
        float, arg("multi-token prediction: the objective adds this x the mean of the D modules' losses")
    ] = 0.3

    def __post_init__(self) -> None:
        check_types(self, "model")  # the types the fields declare: layers=2.5 is not a model
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0 and self.norm_eps > 0):
            raise SpmdkitError(f"rope_theta={self.rope_theta} and norm_eps={self.norm_eps} must be positive")
        for name in ("vocab_size", "embed", "layers", "heads", "kv_heads", "head_dim", "mlp"):
            if getattr(self, name) < 1:
                raise SpmdkitError(f"model {name}={getattr(self, name)} must be positive")
        if self.heads % self.kv_heads:
            raise SpmdkitError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        parse_remat(self.remat)  # one line naming the bad policy and the valid ones
        if self.loss_chunk < 0 or not (math.isfinite(self.z_loss) and self.z_loss >= 0):
            raise SpmdkitError(f"loss_chunk={self.loss_chunk} and z_loss={self.z_loss} must be >= 0")
        if self.attention_block < 1 or self.ulysses_parts < 0:
            raise SpmdkitError(f"attention_block={self.attention_block} must be > 0, ulysses_parts >= 0 (0: auto)")
        if self.experts:
            check_experts(self)
            if self.balance_rate:  # the balancing moves the correction bias: the model has one (and exports it)
                object.__setattr__(self, "router_correction_bias", True)
        else:
            check_dense(self)
        if self.fp8 and self.experts:
            raise SpmdkitError(
                "fp8 covers dense models: the routed experts' grouped matmuls have no FP8 form yet; drop --model.fp8"
            )
        if self.fp8 and self.dtype == "float16":
            raise SpmdkitError(
                "fp8 needs a bfloat16 or float32 compute dtype: with float16 its scaled matmuls overflow (NaN by the "
                "second step); use --dtype bfloat16, or drop --model.fp8"
            )
        check_latent(self)
        check_mtp(self)
        check_rope(self)
        check_scales(self)

    # ------------------------------------------------------------------ what each layer is

    def is_moe_layer(self, layer: int) -> bool:
        """Layer `layer` (0-based) is a mixture-of-experts block: every `moe_every`-th, less `dense_layers`."""
        return bool(self.experts) and (layer + 1) % self.moe_every == 0 and layer not in self.dense_layers

    @property
    def moe_layers(self) -> int:
        """How many blocks are mixture-of-experts blocks."""
        return sum(self.is_moe_layer(i) for i in range(self.layers)) if self.experts else 0

    @property
    def mtp_moe_layers(self) -> int:
        """How many multi-token-prediction blocks are mixture-of-experts blocks (each is the last layer's kind)."""
        return self.mtp_depth * self.is_moe_layer(self.layers - 1)

    def window_of(self, layer: int) -> int:
        """The sliding window of layer `layer` (0: global attention)."""
        pattern = self.window_pattern or "L"
        return self.sliding_window if pattern[layer % len(pattern)] == "L" else 0

    def rope_of(self, layer: int) -> bool:
        """Whether layer `layer` rotates its queries and keys."""
        pattern = self.rope_pattern or "R"
        return pattern[layer % len(pattern)] == "R"

    @property
    def rotary_dims(self) -> int:
        """The dims of each head that RoPE rotates: the leading int(head_dim x partial_rotary_factor) (HF), or
        latent attention's trailing `qk_rope_head_dim`."""
        return self.qk_rope_head_dim if self.kv_lora_rank else int(self.head_dim * self.rope_fraction)

    @property
    def value_head_dim(self) -> int:
        """The width of one value head (and of the output projection's input per head)."""
        return self.v_head_dim or self.head_dim

    @property
    def qk_nope_head_dim(self) -> int:
        """Latent attention: the leading dims of each q/k head that RoPE leaves alone."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def remat_policy(self) -> RematPolicy:
        """`remat` parsed: what everything past the config reads (`parse_remat` caches it)."""
        return parse_remat(self.remat)

    @property
    def routed_mlp(self) -> int:
        return self.expert_mlp or self.mlp

    def replace(self, **changes: object) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ counts

    def num_params(self, active: bool = False) -> int:
        """Parameter count: embedding + layers x (attention + MLP + norms) + final norm + LM head (none when
        tied), biases and norm scales included.

        A mixture-of-experts block has `experts` MLPs of width `routed_mlp` (+ the shared one and its gate) and a
        router [embed, experts]; `active=True` counts only the `top_k` experts a token runs through. Each
        multi-token-prediction module adds a block of the last layer's kind, 3 norms and eh_proj [2, embed, embed].
        """
        e = self.embed
        attention = self._attention_matrices + self._attention_vectors
        norms = 2 * (self.pre_norm + self.post_norm) * e
        dense = attention + self._mlp_params(self.mlp, self.mlp_bias) + norms
        routed = (self.top_k if active else self.experts) * self._mlp_params(self.routed_mlp, self.expert_bias)
        shared = self.shared_expert * (self._mlp_params(self.shared_expert_mlp or self.mlp, False))
        router_biases = (self.router_bias + self.router_correction_bias) * self.experts
        router = e * (self.experts + self.shared_expert_gate) + router_biases
        moe = attention + routed + shared + router + norms
        layers = (self.layers - self.moe_layers) * dense + self.moe_layers * moe
        head = 0 if self.tie_embeddings else self.vocab_size * e
        mtp = self.mtp_depth * ((moe if self.mtp_moe_layers else dense) + 3 * e + 2 * e * e)
        return self.vocab_size * e + head + layers + e + mtp

    def _mlp_params(self, width: int, bias: bool) -> int:
        return 3 * self.embed * width + bias * (2 * width + self.embed)

    @property
    def _attention_matrices(self) -> int:
        """Per layer: the attention's matmul weights (latent: q_a, q_b or q, kv_a, kv_b, o)."""
        e, h, d, v = self.embed, self.heads, self.head_dim, self.value_head_dim
        if not self.kv_lora_rank:
            return e * d * (2 * h + 2 * self.kv_heads)
        q, kv = self.q_lora_rank, self.kv_lora_rank
        query = (e * q + q * h * d) if q else e * h * d
        return query + e * (kv + self.qk_rope_head_dim) + kv * h * (self.qk_nope_head_dim + v) + h * v * e

    @property
    def _attention_vectors(self) -> int:
        """Per layer: the attention's biases and its q/k norm scales (not matmul weights); latent attention: the
        biases of q_a and kv_a and their norms' scales."""
        if self.kv_lora_rank:
            latent = self.q_lora_rank + self.kv_lora_rank
            biases = self.qkv_bias * (latent + self.qk_rope_head_dim) + self.o_bias * self.embed
            return biases + latent + self.attention_sinks * self.heads
        biases = self.qkv_bias * self.head_dim * (self.heads + 2 * self.kv_heads) + self.o_bias * self.embed
        norms = 2 if self.qk_norm_scope == "head" else self.heads + self.kv_heads
        return biases + self.qk_norm * norms * self.head_dim + self.attention_sinks * self.heads

    def _moe_vectors(self) -> int:
        """Per MoE layer, of the parameters a token runs through: the router's bias and the active experts'."""
        biases = (self.router_bias + self.router_correction_bias) * self.experts
        return biases + self.expert_bias * self.top_k * (2 * self.routed_mlp + self.embed)

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token: 6 x (matmul parameters) + attention scores and values.

        Every matmul weight costs 2 FLOPs per token forward and 4 backward (6N; the embedding lookup is a
        gather, not a matmul, so an untied table is left out, as are norm scales and biases; a router and a shared
        expert's gate are matmuls). Attention adds QK^T and PV: 2 x 2 x keys x heads x head_dim per layer forward,
        times 3 with backward, keys = seq (seq / 2 causal; a local layer's window W < seq: W - W^2 / (2 seq)).
        Multi-token prediction: its blocks (the last layer's kind), eh_proj and the shared LM head once more each.
        """
        blocks, moe, e = self.layers + self.mtp_depth, self.moe_layers + self.mtp_moe_layers, self.embed
        norms = 2 * (self.pre_norm + self.post_norm) * e
        vectors = blocks * (norms + self._attention_vectors) + e + 3 * e * self.mtp_depth
        vectors += (blocks - moe) * self.mlp_bias * (2 * self.mlp + e) + moe * self._moe_vectors()
        table = 0 if self.tie_embeddings else self.vocab_size * e
        matmul_params = self.num_params(active=True) - table - vectors + self.mtp_depth * self.vocab_size * e
        keys = 0.0
        for layer in [*range(self.layers), *[self.layers - 1] * self.mtp_depth]:
            window = self.window_of(layer) if causal else 0
            full = seq_len / 2 if causal else seq_len
            keys += window - window * window / (2 * seq_len) if 0 < window < seq_len else full
        return 6 * matmul_params + 6 * self.heads * (self.head_dim + self.value_head_dim) * keys

    def fp8_flops_per_token(self) -> float:
        """The share of `flops_per_token` that runs in FP8 under `fp8`: 6 x the blocks' projection weights (q, k,
        v, o, gate, up, down); the attention scores, the LM head and the norms stay in the compute dtype."""
        projections = self.embed * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + 3 * self.embed * self.mlp
        return 6.0 * self.layers * projections if self.fp8 else 0.0


def loss_chunks(seq_len: int, chunk: int, shards: int = 1) -> int:
    """How many chunks the loss cuts a sequence into: the fewest n with at most `chunk` positions each (chunk 0:
    one chunk) that divide each of the `shards` equal pieces a sharded sequence is cut into. Chunk i holds
    positions i, i + n, i + 2n, ... (strided: every device keeps its share of every chunk)."""
    if chunk <= 0 or seq_len <= chunk or seq_len % shards:
        return 1
    local = seq_len // shards
    return next((n for n in range(math.ceil(seq_len / chunk), local + 1) if local % n == 0), local)
