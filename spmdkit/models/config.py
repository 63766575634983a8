"""`TransformerConfig`: the shape and function of a decoder-only transformer (presets: `spmdkit.models.presets`).

Every feature of the Hugging Face families spmdkit runs is a field (so a flag and a `[model]` TOML key): q/k/v and
output biases, MLP biases, q/k RMSNorms (per head or over the whole projection), norms before and/or after each
block's attention and MLP, RMSNorm as (1 + w), tied embeddings, RoPE scaling (`linear`, `llama3`), partial RoPE,
layers without RoPE, sliding-window attention on every layer or on a pattern of layers with their own RoPE base,
the attention scale, attention- and final-logit soft-capping, embedding / residual / logit multipliers, the MLP's
activation, and mixture-of-experts routing (routed experts of their own width, a gated shared expert, the dense
layers' pattern).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal

from spmdkit.errors import SpmdkitError
from spmdkit.models.remat import HELP as REMAT_HELP
from spmdkit.models.remat import PRESETS as REMAT_PRESETS
from spmdkit.models.remat import check_remat

Remat = str  # a preset of `spmdkit.models.remat.PRESETS` or save:/offload: names (`parse_remat` checks it)
Attention = Literal["auto", "dot", "blockwise", "cudnn", "ring"]
Dispatch = Literal["capacity", "dropless", "dense"]
Dtype = Literal["float32", "bfloat16", "float16"]
Activation = Literal["silu", "gelu", "gelu_pytorch_tanh"]
QkNormScope = Literal["head", "layer"]
RopeType = Literal["default", "linear", "llama3"]
REMAT_POLICIES: tuple[str, ...] = REMAT_PRESETS
ATTENTION_KINDS: tuple[str, ...] = typing.get_args(Attention)
DISPATCH_KINDS: tuple[str, ...] = typing.get_args(Dispatch)
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
ACTIVATIONS: tuple[str, ...] = typing.get_args(Activation)
ROPE_TYPES: tuple[str, ...] = typing.get_args(RopeType)
QK_NORM_SCOPES: tuple[str, ...] = typing.get_args(QkNormScope)


def _field(default: Any, help: str) -> Any:
    """A field with its one-line help (`metadata["help"]`: the CLI and docs/cli.md show it)."""
    return dataclasses.field(default=default, metadata={"help": help})


def _has_type(value: Any, kind: type) -> bool:
    """isinstance, where a bool is not an int and an int is a float."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float) if kind is float else kind)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Decoder shape and numerics (each field's help is in its metadata).

    Parameters are `param_dtype` (float32) and cast to `dtype` where they are used. Mixture of experts
    (`experts` > 0): every `moe_every`-th block (1: all) replaces its MLP by `experts` SwiGLU experts of hidden width
    `mlp`, each token routed to `top_k` of them (plus a dense `shared_expert` when set). `dispatch`: "capacity"
    (each sequence sends at most ceil(capacity_factor x seq x top_k / experts) tokens to an expert; the rest pass
    through the residual), "dropless" (grouped matmul, nothing dropped) or "dense" (every expert on every token:
    the reference). The loss adds `load_balance_weight` x the Switch load-balancing loss and `router_z_weight` x
    the router z-loss.
    """

    vocab_size: int = _field(264, "tokens in the vocabulary")
    embed: int = _field(64, "model width (hidden size)")
    layers: int = _field(4, "decoder blocks (stacked and scanned)")
    heads: int = _field(8, "query heads")
    kv_heads: int = _field(4, "key/value heads (grouped-query attention when fewer than heads)")
    head_dim: int = _field(8, "width of one attention head")
    mlp: int = _field(256, "SwiGLU hidden width (of each expert, for mixture of experts)")
    rope_theta: float = _field(10_000.0, "RoPE base")
    norm_eps: float = _field(1e-5, "RMSNorm epsilon")
    dtype: Dtype = _field("bfloat16", "compute dtype (parameters stay param_dtype)")
    param_dtype: Dtype = _field("float32", "dtype the parameters are stored and updated in")
    remat: Remat = _field("none", REMAT_HELP)
    attention: Attention = _field(
        "auto",
        "attention kernel: auto (ring when context > 1, else cudnn on an NVIDIA GPU, else blockwise), dot (the "
        "reference), blockwise (O(seq) memory), cudnn, ring (context parallelism)",
    )
    attention_block: int = _field(512, "positions per query and key block of the blockwise attention kernel")
    loss_chunk: int = _field(512, "sequence positions per chunk of the LM head + cross-entropy (0: one chunk)")
    z_loss: float = _field(0.0, "weight of the z-loss mean(log(Z)^2) on the LM head's logits (0: off)")
    experts: int = _field(0, "mixture of experts: routed experts per MoE block (0: a dense model)")
    top_k: int = _field(2, "mixture of experts: experts each token is routed to")
    moe_every: int = _field(1, "mixture of experts: every k-th block is an MoE block")
    shared_expert: bool = _field(False, "mixture of experts: add a dense MLP that every token runs through")
    dispatch: Dispatch = _field("capacity", "mixture of experts: capacity, dropless or dense (the reference)")
    capacity_factor: float = _field(1.25, "mixture of experts: expert slots per sequence x top_k / experts")
    load_balance_weight: float = _field(0.01, "mixture of experts: weight of the Switch load-balancing loss")
    router_z_weight: float = _field(0.001, "mixture of experts: weight of the router z-loss")
    qkv_bias: bool = _field(False, "biases on the q, k and v projections (HF attention_bias; Qwen2)")
    o_bias: bool = _field(False, "a bias on the attention output projection (HF Llama attention_bias)")
    mlp_bias: bool = _field(False, "biases on the gate, up and down projections (HF mlp_bias)")
    qk_norm: bool = _field(False, "RMSNorm over head_dim on each query and key head before RoPE (Qwen3 q/k_norm)")
    tie_embeddings: bool = _field(False, "the LM head is the embedding table, one parameter (HF tie_word_embeddings)")
    activation: Activation = _field("silu", "the MLP's gate activation: silu, gelu (erf) or gelu_pytorch_tanh")
    rope_type: RopeType = _field("default", "RoPE frequency scaling: default (none), linear or llama3")
    rope_factor: float = _field(1.0, "RoPE scaling factor (linear, llama3)")
    rope_low_freq_factor: float = _field(1.0, "llama3 RoPE: low_freq_factor")
    rope_high_freq_factor: float = _field(4.0, "llama3 RoPE: high_freq_factor")
    rope_original_max_positions: int = _field(8192, "llama3 RoPE: original_max_position_embeddings")
    max_positions: int = _field(0, "max_position_embeddings a Hugging Face export records (0: the run's seq_len)")

    rope_fraction: float = _field(
        1.0, "share of head_dim that RoPE rotates, the leading dims (HF partial_rotary_factor)"
    )
    rope_pattern: str = _field("", "which layers use RoPE: R (yes) or N (no) per layer, repeated (empty: all; SmolLM3)")
    sliding_window: int = _field(0, "local attention: a query sees this many positions up to its own (0: all)")
    window_pattern: str = _field(
        "", "with sliding_window: L (local) or G (global) per layer, repeated over the layers (empty: all local)"
    )
    local_rope_theta: float = _field(0.0, "RoPE base of the local layers, unscaled (0: as the others; Gemma 3)")
    attention_scale: float = _field(0.0, "the factor on q.k (0: 1/sqrt(head_dim); Gemma, Granite set their own)")
    attention_softcap: float = _field(0.0, "attention logits s become c tanh(s / c) (0: off; Gemma 2)")
    logit_softcap: float = _field(0.0, "final logits z become c tanh(z / c) (0: off; Gemma 2)")
    logit_divisor: float = _field(1.0, "final logits divided by this (Granite logits_scaling)")
    embed_scale: float = _field(1.0, "the embedding's output multiplied by this (Gemma sqrt(embed), Granite)")
    residual_scale: float = _field(1.0, "attention's and the MLP's outputs multiplied by this (Granite)")
    norm_plus_one: bool = _field(False, "RMSNorms multiply by (1 + scale): scales stored as offsets (Gemma)")
    pre_norm: bool = _field(True, "RMSNorm on each block's input to attention and to the MLP (off: OLMo 2)")
    post_norm: bool = _field(False, "RMSNorm on attention's and the MLP's outputs (Gemma 2/3, OLMo 2)")
    qk_norm_scope: QkNormScope = _field("head", "q/k norms over each head (Qwen3, Gemma 3) or the layer (OLMo 2)")
    expert_mlp: int = _field(0, "mixture of experts: hidden width of each routed expert (0: mlp)")
    shared_expert_mlp: int = _field(0, "mixture of experts: hidden width of the shared expert (0: mlp)")
    shared_expert_gate: bool = _field(False, "mixture of experts: the shared expert's output times sigmoid(x w)")
    router_renormalize: bool = _field(True, "mixture of experts: top-k weights (k > 1) rescaled to sum to 1")
    dense_layers: tuple[int, ...] = _field((), "mixture of experts: 0-based layers that keep the dense MLP")
    fp8: bool = _field(
        False, "the blocks' dense matmuls (q, k, v, o, gate, up, down) in FP8 with delayed per-tensor scaling"
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # the types the fields declare: layers=2.5 is not a model
            value, kind = getattr(self, field.name), type(field.default)
            if kind is tuple and isinstance(value, list):  # from TOML or a saved config.json
                object.__setattr__(self, field.name, value := tuple(value))
            if not _has_type(value, kind):
                raise SpmdkitError(f"model {field.name}={value!r} must be of type {kind.__name__}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0 and self.norm_eps > 0):
            raise SpmdkitError(f"rope_theta={self.rope_theta} and norm_eps={self.norm_eps} must be positive")
        for name in ("vocab_size", "embed", "layers", "heads", "kv_heads", "head_dim", "mlp"):
            if getattr(self, name) < 1:
                raise SpmdkitError(f"model {name}={getattr(self, name)} must be positive")
        if self.heads % self.kv_heads:
            raise SpmdkitError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        check_remat(self.remat)
        for name, value, choices in (
            ("attention", self.attention, ATTENTION_KINDS),
            ("dtype", self.dtype, DTYPES), ("param_dtype", self.param_dtype, DTYPES),
            ("activation", self.activation, ACTIVATIONS), ("qk_norm_scope", self.qk_norm_scope, QK_NORM_SCOPES),
        ):  # fmt: skip
            if value not in choices:
                raise SpmdkitError(f"unknown {name} {value!r}: choose one of {', '.join(choices)}")
        if self.loss_chunk < 0 or not (math.isfinite(self.z_loss) and self.z_loss >= 0):
            raise SpmdkitError(f"loss_chunk={self.loss_chunk} and z_loss={self.z_loss} must be >= 0")
        if self.attention_block < 1:
            raise SpmdkitError(f"attention_block={self.attention_block} must be positive")
        if self.experts:
            self._check_experts()
        elif self.dense_layers:
            raise SpmdkitError("dense_layers names layers of a mixture-of-experts model: set experts, or drop it")
        if self.fp8 and self.experts:
            raise SpmdkitError(
                "fp8 covers dense models: the routed experts' grouped matmuls have no FP8 form yet; drop --model.fp8"
            )
        self._check_rope()
        self._check_scales()

    def _check_rope(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise SpmdkitError(f"unknown rope_type {self.rope_type!r}: choose one of {', '.join(ROPE_TYPES)}")
        if not (math.isfinite(self.rope_factor) and self.rope_factor > 0):
            raise SpmdkitError(f"rope_factor={self.rope_factor} must be positive")
        if self.rope_type == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise SpmdkitError(
                f"llama3 RoPE needs 0 < rope_low_freq_factor ({self.rope_low_freq_factor}) < rope_high_freq_factor "
                f"({self.rope_high_freq_factor})"
            )
        if self.rope_original_max_positions < 1 or self.max_positions < 0:
            raise SpmdkitError("rope_original_max_positions must be positive and max_positions >= 0")
        rotated = self.rotary_dims
        if not 0 < self.rope_fraction <= 1 or rotated < 2 or rotated % 2:
            raise SpmdkitError(f"rope_fraction={self.rope_fraction} must rotate an even number of head_dim's dims")
        for name, letters in (("rope_pattern", "RN"), ("window_pattern", "LG")):
            pattern = getattr(self, name)
            if set(pattern) - set(letters):
                raise SpmdkitError(f"{name}={pattern!r} may hold only the letters {' and '.join(letters)}")
        if self.sliding_window < 0 or not (math.isfinite(self.local_rope_theta) and self.local_rope_theta >= 0):
            raise SpmdkitError(f"sliding_window={self.sliding_window} and local_rope_theta must be >= 0")
        if not self.sliding_window and (self.window_pattern or self.local_rope_theta):
            raise SpmdkitError("window_pattern and local_rope_theta describe local layers: set sliding_window too")

    def _check_scales(self) -> None:
        for name in ("attention_scale", "attention_softcap", "logit_softcap"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise SpmdkitError(f"{name}={getattr(self, name)} must be a number >= 0 (0: off)")
        for name in ("logit_divisor", "embed_scale", "residual_scale"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise SpmdkitError(f"{name}={getattr(self, name)} must be a positive number")

    def _check_experts(self) -> None:
        if self.experts < 0 or not 1 <= self.top_k <= self.experts:
            raise SpmdkitError(f"top_k={self.top_k} must be between 1 and experts={self.experts}")
        if self.moe_every < 1 or not self.moe_layers:
            raise SpmdkitError(f"moe_every={self.moe_every} and dense_layers leave no mixture-of-experts layer")
        if sorted(set(self.dense_layers)) != list(self.dense_layers) or not set(self.dense_layers) <= set(
            range(self.layers)
        ):
            raise SpmdkitError(f"dense_layers={list(self.dense_layers)} must be increasing layers 0..{self.layers - 1}")
        if self.dispatch not in DISPATCH_KINDS:
            raise SpmdkitError(f"unknown dispatch {self.dispatch!r}: choose one of {', '.join(DISPATCH_KINDS)}")
        if self.capacity_factor <= 0 or self.expert_mlp < 0 or self.shared_expert_mlp < 0:
            raise SpmdkitError("capacity_factor must be positive, expert_mlp and shared_expert_mlp >= 0")
        if self.mlp_bias or self.activation != "silu":
            raise SpmdkitError("mixture-of-experts models have SwiGLU experts without biases: drop mlp_bias/activation")
        if self.shared_expert_gate and not self.shared_expert:
            raise SpmdkitError("shared_expert_gate gates the shared expert: set shared_expert too")

    # ------------------------------------------------------------------ what each layer is

    def is_moe_layer(self, layer: int) -> bool:
        """Layer `layer` (0-based) is a mixture-of-experts block: every `moe_every`-th, less `dense_layers`."""
        return bool(self.experts) and (layer + 1) % self.moe_every == 0 and layer not in self.dense_layers

    @property
    def moe_layers(self) -> int:
        """How many blocks are mixture-of-experts blocks."""
        return sum(self.is_moe_layer(i) for i in range(self.layers)) if self.experts else 0

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
        """The leading dims of each head that RoPE rotates (HF: int(head_dim x partial_rotary_factor))."""
        return int(self.head_dim * self.rope_fraction)

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
        router [embed, experts]; `active=True` counts only the `top_k` experts a token runs through.
        """
        e = self.embed
        attention = e * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + self._attention_vectors
        norms = 2 * (self.pre_norm + self.post_norm) * e
        dense = attention + self._mlp_params(self.mlp, self.mlp_bias) + norms
        routed = (self.top_k if active else self.experts) * self._mlp_params(self.routed_mlp, False)
        shared = self.shared_expert * (self._mlp_params(self.shared_expert_mlp or self.mlp, False))
        moe = attention + routed + shared + e * (self.experts + self.shared_expert_gate) + norms
        layers = (self.layers - self.moe_layers) * dense + self.moe_layers * moe
        head = 0 if self.tie_embeddings else self.vocab_size * e
        return self.vocab_size * e + head + layers + e

    def _mlp_params(self, width: int, bias: bool) -> int:
        return 3 * self.embed * width + bias * (2 * width + self.embed)

    @property
    def _attention_vectors(self) -> int:
        """Per layer: the attention's biases and its q/k norm scales (not matmul weights)."""
        biases = self.qkv_bias * self.head_dim * (self.heads + 2 * self.kv_heads) + self.o_bias * self.embed
        norms = 2 if self.qk_norm_scope == "head" else self.heads + self.kv_heads
        return biases + self.qk_norm * norms * self.head_dim

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token: 6 x (matmul parameters) + attention scores and values.

        Every matmul weight costs 2 FLOPs per token forward and 4 backward (6N; the embedding lookup is a
        gather, not a matmul, so an untied table is left out, as are norm scales and biases; a router and a shared
        expert's gate are matmuls). Attention adds QK^T and PV: 2 x 2 x keys x heads x head_dim per layer forward,
        times 3 with backward, keys = seq (seq / 2 causal; a local layer's window W < seq: W - W^2 / (2 seq)).
        """
        norms = 2 * (self.pre_norm + self.post_norm) * self.embed
        vectors = self.layers * (norms + self._attention_vectors) + self.embed
        vectors += (self.layers - self.moe_layers) * self.mlp_bias * (2 * self.mlp + self.embed)
        table = 0 if self.tie_embeddings else self.vocab_size * self.embed
        matmul_params = self.num_params(active=True) - table - vectors
        keys = 0.0
        for layer in range(self.layers):
            window = self.window_of(layer) if causal else 0
            full = seq_len / 2 if causal else seq_len
            keys += window - window * window / (2 * seq_len) if 0 < window < seq_len else full
        return 6 * matmul_params + 12 * self.heads * self.head_dim * keys

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
