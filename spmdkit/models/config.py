"""`TransformerConfig`: the shape of a Llama-style decoder, with presets from `tiny` to `405b`.

Presets are starting points: every field can be set (the `[model]` table, `--model.FIELD`), and the features of the
Hugging Face families spmdkit runs (Llama 2/3, Qwen2, Qwen3, SmolLM) are fields too: q/k/v and output biases, MLP
biases, per-head q/k RMSNorms, tied input/output embeddings, RoPE scaling (`linear`, `llama3`) and the MLP's
activation. The big presets are shapes only: the planner uses them; nobody initialises 405B parameters on a laptop.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal

from spmdkit.errors import SpmdkitError

Remat = Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"]
Attention = Literal["auto", "dot", "blockwise", "cudnn", "ring"]
Dispatch = Literal["capacity", "dropless", "dense"]
Dtype = Literal["float32", "bfloat16", "float16"]
Activation = Literal["silu", "gelu", "gelu_pytorch_tanh"]
RopeType = Literal["default", "linear", "llama3"]
REMAT_POLICIES: tuple[str, ...] = typing.get_args(Remat)
ATTENTION_KINDS: tuple[str, ...] = typing.get_args(Attention)
DISPATCH_KINDS: tuple[str, ...] = typing.get_args(Dispatch)
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
ACTIVATIONS: tuple[str, ...] = typing.get_args(Activation)
ROPE_TYPES: tuple[str, ...] = typing.get_args(RopeType)


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
    remat: Remat = _field("none", "what the backward pass recomputes")
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

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # the types the fields declare: layers=2.5 is not a model
            value, kind = getattr(self, field.name), type(field.default)
            if not _has_type(value, kind):
                raise SpmdkitError(f"model {field.name}={value!r} must be of type {kind.__name__}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0 and self.norm_eps > 0):
            raise SpmdkitError(f"rope_theta={self.rope_theta} and norm_eps={self.norm_eps} must be positive")
        for name in ("vocab_size", "embed", "layers", "heads", "kv_heads", "head_dim", "mlp"):
            if getattr(self, name) < 1:
                raise SpmdkitError(f"model {name}={getattr(self, name)} must be positive")
        if self.heads % self.kv_heads:
            raise SpmdkitError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.remat not in REMAT_POLICIES:
            raise SpmdkitError(f"unknown remat policy {self.remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
        if self.attention not in ATTENTION_KINDS:
            raise SpmdkitError(f"unknown attention {self.attention!r}: choose one of {', '.join(ATTENTION_KINDS)}")
        if self.loss_chunk < 0 or not (math.isfinite(self.z_loss) and self.z_loss >= 0):
            raise SpmdkitError(f"loss_chunk={self.loss_chunk} and z_loss={self.z_loss} must be >= 0")
        if self.attention_block < 1:
            raise SpmdkitError(f"attention_block={self.attention_block} must be positive")
        if self.experts:
            self._check_experts()
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise SpmdkitError(f"unknown {name} {getattr(self, name)!r}: choose one of {', '.join(DTYPES)}")
        if self.activation not in ACTIVATIONS:
            raise SpmdkitError(f"unknown activation {self.activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        self._check_rope()

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

    def _check_experts(self) -> None:
        if self.experts < 0 or not 1 <= self.top_k <= self.experts:
            raise SpmdkitError(f"top_k={self.top_k} must be between 1 and experts={self.experts}")
        if self.moe_every < 1 or self.layers % self.moe_every:
            raise SpmdkitError(f"layers={self.layers} is not a multiple of moe_every={self.moe_every}")
        if self.dispatch not in DISPATCH_KINDS:
            raise SpmdkitError(f"unknown dispatch {self.dispatch!r}: choose one of {', '.join(DISPATCH_KINDS)}")
        if self.capacity_factor <= 0:
            raise SpmdkitError(f"capacity_factor={self.capacity_factor} must be positive")
        if self.mlp_bias or self.activation != "silu":
            raise SpmdkitError("mixture-of-experts models have SwiGLU experts without biases: drop mlp_bias/activation")

    @property
    def moe_layers(self) -> int:
        """How many blocks are mixture-of-experts blocks (every `moe_every`-th one)."""
        return self.layers // self.moe_every if self.experts else 0

    def replace(self, **changes: object) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, active: bool = False) -> int:
        """Parameter count: embedding + layers x (attention + MLP + 2 norms) + final norm + LM head (none when
        tied), biases and q/k norm scales included.

        A mixture-of-experts block has `experts` MLPs (+ the shared one) and a router [embed, experts];
        `active=True` counts only the `top_k` experts a token runs through (what its FLOPs see).
        """
        attention = self.embed * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + self._attention_vectors
        mlp = 3 * self.embed * self.mlp + self.mlp_bias * (2 * self.mlp + self.embed)
        dense = attention + mlp + 2 * self.embed
        routed = self.top_k if active else self.experts
        moe = attention + (routed + self.shared_expert) * mlp + self.embed * self.experts + 2 * self.embed
        layers = (self.layers - self.moe_layers) * dense + self.moe_layers * moe
        head = 0 if self.tie_embeddings else self.vocab_size * self.embed
        return self.vocab_size * self.embed + head + layers + self.embed

    @property
    def _attention_biases(self) -> int:
        return self.qkv_bias * self.head_dim * (self.heads + 2 * self.kv_heads) + self.o_bias * self.embed

    @property
    def _attention_vectors(self) -> int:
        """Per layer: the attention's biases and its q/k norm scales (not matmul weights)."""
        return self._attention_biases + 2 * self.qk_norm * self.head_dim

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token: 6 x (matmul parameters) + attention scores and values.

        Every matmul weight costs 2 FLOPs per token forward and 4 backward (6N; the embedding lookup is a
        gather, not a matmul, so an untied table is left out, as are norm scales and biases). Attention adds QK^T
        and PV: 2 x 2 x seq x heads x head_dim per layer forward, times 3 with backward, halved for causal masking.
        """
        vectors = (2 * self.layers + 1) * self.embed + self.layers * self._attention_vectors
        vectors += (self.layers - self.moe_layers) * self.mlp_bias * (2 * self.mlp + self.embed)
        table = 0 if self.tie_embeddings else self.vocab_size * self.embed
        matmul_params = self.num_params(active=True) - table - vectors
        attention = 12 * self.layers * self.heads * self.head_dim * seq_len
        return 6 * matmul_params + (attention / 2 if causal else attention)


def loss_chunks(seq_len: int, chunk: int, shards: int = 1) -> int:
    """How many chunks the loss cuts a sequence into: the fewest n with at most `chunk` positions each (chunk 0:
    one chunk) that divide each of the `shards` equal pieces a sharded sequence is cut into. Chunk i holds
    positions i, i + n, i + 2n, ... (strided: every device keeps its share of every chunk)."""
    if chunk <= 0 or seq_len <= chunk or seq_len % shards:
        return 1
    local = seq_len // shards
    return next((n for n in range(math.ceil(seq_len / chunk), local + 1) if local % n == 0), local)


PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(),
    "125m": TransformerConfig(vocab_size=32_000, embed=768, layers=12, heads=12, kv_heads=12, head_dim=64, mlp=2048),
    "1b": TransformerConfig(vocab_size=128_256, embed=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=8192),
    "7b": TransformerConfig(vocab_size=32_000, embed=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp=11008),
    "70b": TransformerConfig(
        vocab_size=128_256, embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28672, rope_theta=500_000.0
    ),
    "405b": TransformerConfig(
        vocab_size=128_256,
        embed=16384,
        layers=126,
        heads=128,
        kv_heads=8,
        head_dim=128,
        mlp=53248,
        rope_theta=500_000.0,
    ),
}

PRESETS["tiny-moe"] = TransformerConfig(experts=8, top_k=2, mlp=128, moe_every=2)
PRESETS["mixtral-8x7b"] = TransformerConfig(
    vocab_size=32_000,
    embed=4096,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    mlp=14336,
    rope_theta=1_000_000.0,
    experts=8,
    top_k=2,
)


# The families users fine-tune (shapes for the planner; `spmdkit train --init-from` takes real weights' shapes).
_LLAMA3 = dict(vocab_size=128_256, rope_theta=500_000.0, rope_type="llama3", rope_low_freq_factor=1.0,
               rope_high_freq_factor=4.0, rope_original_max_positions=8192, max_positions=131_072)  # fmt: skip
PRESETS["llama3-8b"] = TransformerConfig(
    embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336, rope_factor=8.0, **_LLAMA3
)
PRESETS["llama3-70b"] = TransformerConfig(
    embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28672, rope_factor=8.0, **_LLAMA3
)
PRESETS["llama3.2-1b"] = TransformerConfig(
    embed=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=8192, rope_factor=32.0, tie_embeddings=True, **_LLAMA3
)
PRESETS["llama3.2-3b"] = TransformerConfig(
    embed=3072,
    layers=28,
    heads=24,
    kv_heads=8,
    head_dim=128,
    mlp=8192,
    rope_factor=32.0,
    tie_embeddings=True,
    **_LLAMA3,
)
PRESETS["qwen2.5-0.5b"] = TransformerConfig(
    vocab_size=151_936, embed=896, layers=24, heads=14, kv_heads=2, head_dim=64, mlp=4864, rope_theta=1_000_000.0,
    norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, max_positions=32_768,
)  # fmt: skip
PRESETS["qwen3-8b"] = TransformerConfig(
    vocab_size=151_936, embed=4096, layers=36, heads=32, kv_heads=8, head_dim=128, mlp=12288, rope_theta=1_000_000.0,
    norm_eps=1e-6, qk_norm=True, max_positions=40_960,
)  # fmt: skip
PRESETS["smollm-135m"] = TransformerConfig(
    vocab_size=49_152, embed=576, layers=30, heads=9, kv_heads=3, head_dim=64, mlp=1536, tie_embeddings=True,
    max_positions=2048,
)  # fmt: skip


def model_preset(name: str) -> TransformerConfig:
    if name not in PRESETS:
        raise SpmdkitError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
