"""Which Hugging Face tensor each spmdkit parameter is, and how its layout differs (pure numpy, no JAX).

The families share the Llama names (`model.layers.{i}.self_attn.q_proj.weight`, ...) with their own additions:
q/k norms (`self_attn.q_norm.weight`: [head_dim] per head, or [heads x head_dim] over the layer, OLMo 2), norms
after attention and the MLP (Gemma 2/3, OLMo 2: `post_attention_layernorm` is then the norm *after* attention, and
Gemma's pre-MLP norm is `pre_feedforward_layernorm`), experts (`block_sparse_moe.experts.{e}.w1` for Mixtral,
`mlp.experts.{e}.gate_proj` for Qwen-MoE, with the router `gate` and Qwen2-MoE's `shared_expert` and its gate;
GPT-OSS's one tensor of all experts, `mlp.experts.gate_up_proj` [experts, embed, 2 x mlp] with gate and up in
alternate columns, its biases, `mlp.router` with a bias, and `self_attn.sinks`), Phi-3's fused `qkv_proj` and
`gate_up_proj` (each spmdkit parameter a block of rows of one tensor), and DeepSeek-V3's latent attention
(`q_a_proj`, `q_a_layernorm`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`: each head's
dims in spmdkit's order, [nope | rope] for q, [k_nope | v] for kv_b), router `gate.e_score_correction_bias` and
`shared_experts`.

Hugging Face stores a linear layer as [out, in]; spmdkit keeps the input dim first and splits the head dims: q
[embed, heads, head_dim] is `q_proj.weight` [heads x head_dim, embed] transposed, o [heads, head_dim, embed] is
`o_proj.weight` [embed, heads x head_dim] transposed. All use rotate-half RoPE, so q and k need no permutation
(DeepSeek's interleaved pairs are reordered at run time).
Block parameters are stacked on a leading dim in spmdkit (dense and MoE blocks in two stacks, in layer order) and
are one tensor per layer (`model.layers.{i}.`), and per expert, in Hugging Face.

A `TensorMap` says how spmdkit's dims group into the Hugging Face tensor's dims (q: (embed), (heads, head_dim)),
so that a slice of a spmdkit parameter (what one device holds) reads only the rows and columns it needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from spmdkit.interop.families import FAMILIES
from spmdkit.models.config import TransformerConfig
from spmdkit.models.layer_plan import layer_order

Read = Callable[[str, tuple[slice, ...]], np.ndarray]  # (Hugging Face name, slices of it) -> array


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One parameter: its spmdkit `path`, its Hugging Face `name` (`{i}`: the layer, `{e}`: the expert), the
    global `layers` of its stack's entries (empty: not stacked), its spmdkit `shape` (one layer's), `experts` (the
    shape's first dim is the experts, one Hugging Face tensor each; 0: none), `groups` (how many of the remaining
    spmdkit dims make each Hugging Face dim, in spmdkit's order), `transpose` (Hugging Face's dims are the groups
    reversed), `fused` ((first row, rows) of a tensor it shares with others, Phi-3; rows 0: its own) and
    `interleave` ((i, n): its columns are every n-th of the tensor's last dim from the i-th, GPT-OSS's gate_up);
    `copy_of`: the tensor of another map this one copies once per layer of `layers` (the multi-token-prediction
    layers' `embed_tokens` and `shared_head.head`: spmdkit holds one embedding and one head), written on export,
    compared on import, never read into the parameter."""

    path: tuple[str, ...]
    name: str
    layers: tuple[int, ...]
    shape: tuple[int, ...]
    groups: tuple[int, ...]
    transpose: bool
    experts: int = 0
    fused: tuple[int, int] = (0, 0)
    interleave: tuple[int, int] = (0, 1)
    copy_of: str = ""

    @property
    def stacked(self) -> bool:
        return bool(self.layers)

    def hf_name(self, entry: int | None = None, expert: int | None = None) -> str:
        """The tensor of stack entry `entry` (and `expert`)."""
        return self.name.format(i=None if entry is None else self.layers[entry], e=expert)

    def value_in(self, tree: Any) -> Any:
        """This parameter's leaf of a pure dict shaped like the parameters (of values or of shardings)."""
        for key in self.path:
            tree = tree[key]
        return tree

    def hf_names(self) -> list[str]:
        entries = range(len(self.layers)) if self.stacked else [None]
        experts = range(self.experts) if self.experts else [None]
        return [self.hf_name(i, e) for i in entries for e in experts]

    @property
    def _inner(self) -> tuple[int, ...]:
        return self.shape[1:] if self.experts else self.shape

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The Hugging Face shape of this parameter's part (one layer, one expert)."""
        sizes, start = [], 0
        for g in self.groups:
            sizes.append(math.prod(self._inner[start : start + g]))
            start += g
        return tuple(reversed(sizes)) if self.transpose else tuple(sizes)

    @property
    def file_shape(self) -> tuple[int, ...]:
        """The shape of the whole tensor in the file (a fused tensor: all its parts' rows; an interleaved one: all
        their columns)."""
        shape = (self.fused[1], *self.hf_shape[1:]) if self.fused[1] else self.hf_shape
        return (*shape[:-1], shape[-1] * self.interleave[1])

    @property
    def shared(self) -> bool:
        """Whether the tensor holds other parameters too (fused rows or interleaved columns)."""
        return bool(self.fused[1]) or self.interleave[1] > 1

    def put(self, whole: np.ndarray, part: np.ndarray) -> None:
        """Write this parameter's `part` into the shared tensor `whole`."""
        if self.fused[1]:
            whole[self.fused[0] : self.fused[0] + part.shape[0]] = part
        else:
            whole[..., self.interleave[0] :: self.interleave[1]] = part

    @property
    def row_dim(self) -> int:
        """The spmdkit dim that is the Hugging Face tensor's outermost (row) dim: slices of it are contiguous bytes
        in the file."""
        return (sum(self.groups[:-1]) if self.transpose else 0) + bool(self.experts)

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        """One layer's (and expert's) spmdkit array -> its Hugging Face part (C-contiguous)."""
        value = np.asarray(value).reshape([s for s in self.hf_shape[:: -1 if self.transpose else 1]])
        return np.ascontiguousarray(value.T if self.transpose else value)

    def read(self, read: Read, index: tuple[slice, ...], entry: int | None = None) -> np.ndarray:
        """The block `index` (slices over `shape`, one layer) of this parameter, read from the Hugging Face
        tensors: each group's first dim is sliced in the file; the rest of a group are read whole (they never are
        split: `head_dim` has no mesh axis) and sliced here. Experts are read one tensor each."""
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, self.shape, strict=True))
        if self.experts:
            experts = range(index[0].start, index[0].stop)
            return np.stack([self._read_one(read, index[1:], self.hf_name(entry, e)) for e in experts])
        return self._read_one(read, index, self.hf_name(entry))

    def _read_one(self, read: Read, index: tuple[slice, ...], name: str) -> np.ndarray:
        ranges, block_shape, inner_index, start = [], [], [], 0
        for g in self.groups:
            dims, slices = self._inner[start : start + g], index[start : start + g]
            inner = math.prod(dims[1:])
            ranges.append(slice(slices[0].start * inner, slices[0].stop * inner))
            block_shape += [slices[0].stop - slices[0].start, *dims[1:]]
            inner_index += [slice(None), *slices[1:]]
            start += g
        ranges = ranges[::-1] if self.transpose else ranges
        ranges[0] = slice(ranges[0].start + self.fused[0], ranges[0].stop + self.fused[0])
        first, every = self.interleave
        ranges[-1] = slice(ranges[-1].start * every, ranges[-1].stop * every)
        block = read(name, tuple(ranges))[..., first::every]
        block = block.T if self.transpose else block
        return block.reshape(block_shape)[tuple(inner_index)]


def _norm_names(model: TransformerConfig) -> dict[str, str]:
    """spmdkit block norm -> Hugging Face name: with norms after attention and the MLP (Gemma 2/3, OLMo 2)
    `post_attention_layernorm` is the one after attention; otherwise it is the one before the MLP."""
    if model.post_norm:
        return {"attention_norm": "input_layernorm", "attention_post_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}  # fmt: skip
    return {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def _latent_attention(model: TransformerConfig, add) -> None:
    """DeepSeek's latent attention: q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj ([heads x (nope + v), kv_lora_rank]), o_proj, and the biases of attention_bias."""
    E, H, D, V, Q, KV = (
        model.embed,
        model.heads,
        model.head_dim,
        model.value_head_dim,
        model.q_lora_rank,
        model.kv_lora_rank,
    )
    A = KV + model.qk_rope_head_dim
    if Q:
        add("attention.q_a", "self_attn.q_a_proj.weight", (E, Q), (1, 1), True)
        add("attention.q_a_norm.scale", "self_attn.q_a_layernorm.weight", (Q,), (1,), False)
        add("attention.q_b", "self_attn.q_b_proj.weight", (Q, H, D), (1, 2), True)
    else:
        add("attention.q", "self_attn.q_proj.weight", (E, H, D), (1, 2), True)
    add("attention.kv_a", "self_attn.kv_a_proj_with_mqa.weight", (E, A), (1, 1), True)
    add("attention.kv_a_norm.scale", "self_attn.kv_a_layernorm.weight", (KV,), (1,), False)
    add("attention.kv_b", "self_attn.kv_b_proj.weight", (KV, H, model.qk_nope_head_dim + V), (1, 2), True)
    add("attention.o", "self_attn.o_proj.weight", (H, V, E), (2, 1), True)
    if model.qkv_bias:
        if Q:
            add("attention.q_a_bias", "self_attn.q_a_proj.bias", (Q,), (1,), False)
        add("attention.kv_a_bias", "self_attn.kv_a_proj_with_mqa.bias", (A,), (1,), False)
    if model.o_bias:
        add("attention.o_bias", "self_attn.o_proj.bias", (E,), (1,), False)


def _attention(model: TransformerConfig, family: str, add) -> None:
    if model.kv_lora_rank:
        return _latent_attention(model, add)
    E, H, K, D = model.embed, model.heads, model.kv_heads, model.head_dim
    fused = FAMILIES[family].fused
    for n, h, offset in (("q", H, 0), ("k", K, H * D), ("v", K, (H + K) * D)):
        name = "self_attn.qkv_proj.weight" if fused else f"self_attn.{n}_proj.weight"
        add(f"attention.{n}", name, (E, h, D), (1, 2), True, fused=(offset, (H + 2 * K) * D) if fused else (0, 0))
    add("attention.o", "self_attn.o_proj.weight", (H, D, E), (2, 1), True)
    if model.attention_sinks:
        add("attention.sinks", "self_attn.sinks", (H,), (1,), False)
    if model.qkv_bias:
        for n, h in (("q", H), ("k", K), ("v", K)):
            add(f"attention.{n}_bias", f"self_attn.{n}_proj.bias", (h, D), (2,), False)
    if model.o_bias:
        add("attention.o_bias", "self_attn.o_proj.bias", (E,), (1,), False)
    if model.qk_norm and model.qk_norm_scope == "head":
        for n in "qk":
            add(f"attention.{n}_norm.scale", f"self_attn.{n}_norm.weight", (D,), (1,), False)
    elif model.qk_norm:
        for n, h in (("q", H), ("k", K)):
            add(f"attention.{n}_norm.scale", f"self_attn.{n}_norm.weight", (h, D), (2,), False)


def _mlp(model: TransformerConfig, family: str, add, prefix: str = "mlp", hf: str = "mlp", width: int = 0) -> None:
    E, F = model.embed, width or model.mlp
    fused = FAMILIES[family].fused
    for n, offset in (("gate", 0), ("up", F)):
        name = f"{hf}.gate_up_proj.weight" if fused else f"{hf}.{n}_proj.weight"
        add(f"{prefix}.{n}", name, (E, F), (1, 1), True, fused=(offset, 2 * F) if fused else (0, 0))
    add(f"{prefix}.down", f"{hf}.down_proj.weight", (F, E), (1, 1), True)
    if model.mlp_bias:
        for n, size in (("gate", F), ("up", F), ("down", E)):
            add(f"{prefix}.{n}_bias", f"{hf}.{n}_proj.bias", (size,), (1,), False)


def _gpt_oss_experts(model: TransformerConfig, add) -> None:
    """GPT-OSS: each tensor holds every expert ([in, out] per expert, gate and up in alternate columns)."""
    E, X, F = model.embed, model.experts, model.routed_mlp
    add("mlp.router", "mlp.router.weight", (E, X), (1, 1), True)
    add("mlp.router_bias", "mlp.router.bias", (X,), (1,), False)
    for i, n in enumerate(("gate", "up")):
        add(f"mlp.{n}", "mlp.experts.gate_up_proj", (X, E, F), (1, 1, 1), False, interleave=(i, 2))
        add(f"mlp.{n}_bias", "mlp.experts.gate_up_proj_bias", (X, F), (1, 1), False, interleave=(i, 2))
    add("mlp.down", "mlp.experts.down_proj", (X, F, E), (1, 1, 1), False)
    add("mlp.down_bias", "mlp.experts.down_proj_bias", (X, E), (1, 1), False)


def _experts(model: TransformerConfig, family: str, add) -> None:
    if FAMILIES[family].experts == "gpt_oss":
        return _gpt_oss_experts(model, add)
    E, X, F = model.embed, model.experts, model.routed_mlp
    mixtral = FAMILIES[family].experts == "mixtral"
    base = "block_sparse_moe" if mixtral else "mlp"
    add("mlp.router", f"{base}.gate.weight", (E, X), (1, 1), True)
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for n, hf, shape in zip(("gate", "up", "down"), names, ((X, E, F), (X, E, F), (X, F, E)), strict=True):
        add(f"mlp.{n}", f"{base}.experts.{{e}}.{hf}.weight", shape, (1, 1), True, experts=X)
    if model.router_correction_bias:
        add("mlp.router_correction_bias", f"{base}.gate.e_score_correction_bias", (X,), (1,), False)
    if model.shared_expert:
        shared = "mlp.shared_experts" if FAMILIES[family].experts == "deepseek" else "mlp.shared_expert"
        _mlp(model, family, add, "mlp.shared", shared, model.shared_expert_mlp or model.mlp)
    if model.shared_expert_gate:
        add("mlp.shared_gate", "mlp.shared_expert_gate.weight", (E, 1), (1, 1), True)


def _block_maps(model: TransformerConfig, family: str, maps: list, stack: tuple[str, ...], layers: tuple[int, ...],
                moe: bool) -> None:  # fmt: skip
    """Append the maps of a stack of blocks (`stack`: its path) that are Hugging Face layers `layers`."""

    def add(path, name, shape, groups, transpose, *, experts=0, fused=(0, 0), interleave=(0, 1)):
        full = "model.layers.{i}." + name
        maps.append(TensorMap((*stack, *path.split(".")), full, layers, shape, groups, transpose, experts, fused,
                              interleave))  # fmt: skip

    E, norms = model.embed, _norm_names(model)
    for norm in ("attention_norm", "attention_post_norm"):
        if norm in norms and (model.pre_norm or norm != "attention_norm"):
            add(f"{norm}.scale", f"{norms[norm]}.weight", (E,), (1,), False)
    _attention(model, family, add)
    for norm in ("mlp_norm", "mlp_post_norm"):
        if norm in norms and (model.pre_norm or norm != "mlp_norm"):
            add(f"{norm}.scale", f"{norms[norm]}.weight", (E,), (1,), False)
    (_experts if moe else _mlp)(model, family, add)


def _mtp_maps(model: TransformerConfig, family: str, maps: list) -> None:
    """DeepSeek-V3's multi-token-prediction layers `model.layers.{layers + k}` (k < mtp_depth): `enorm`, `hnorm`,
    `eh_proj` ([embed, 2 x embed]: the embedding's half first), a block, `shared_head.norm`, and the copies of the
    embedding (`embed_tokens`) and head (`shared_head.head`) DeepSeek's checkpoints carry (`spmdkit.models.mtp`)."""
    E, V = model.embed, model.vocab_size
    layers = tuple(range(model.layers, model.layers + model.mtp_depth))
    for name, hf in (("enorm", "enorm"), ("hnorm", "hnorm"), ("head_norm", "shared_head.norm")):
        maps.append(TensorMap(("mtp", name), f"model.layers.{{i}}.{hf}.weight", layers, (E,), (1,), False))
    maps.append(TensorMap(("mtp", "eh_proj"), "model.layers.{i}.eh_proj.weight", layers, (2, E, E), (2, 1), True))
    moe = model.is_moe_layer(model.layers - 1)  # the MTP blocks are of the last layer's kind (`models.mtp`)
    _block_maps(model, family, maps, ("mtp", "blocks"), layers, moe)
    embedding = "model.embed_tokens.weight"
    maps.append(TensorMap(("embedding",), "model.layers.{i}.embed_tokens.weight", layers, (V, E), (1, 1), False,
                          copy_of=embedding))  # fmt: skip
    head = ((("embedding",), (V, E), False, embedding) if model.tie_embeddings else
            (("lm_head",), (E, V), True, "lm_head.weight"))  # fmt: skip
    maps.append(TensorMap(head[0], "model.layers.{i}.shared_head.head.weight", layers, head[1], (1, 1), head[2],
                          copy_of=head[3]))  # fmt: skip


def tensor_maps(model: TransformerConfig, family: str) -> list[TensorMap]:
    """Every parameter of `model` as a `TensorMap` in Hugging Face `family`'s names, in the order it lists them
    (the multi-token-prediction modules in a family that stores them; elsewhere they are not written)."""
    E, V = model.embed, model.vocab_size
    order = layer_order(model)
    maps = [TensorMap(("embedding",), "model.embed_tokens.weight", (), (V, E), (1, 1), False)]
    for stack in ("blocks", "moe_blocks"):
        layers = tuple(i for i, (s, _) in enumerate(order) if s == stack)
        if layers:
            _block_maps(model, family, maps, (stack,), layers, stack == "moe_blocks")
    maps.append(TensorMap(("final_norm", "scale"), "model.norm.weight", (), (E,), (1,), False))
    if not model.tie_embeddings:
        maps.append(TensorMap(("lm_head",), "lm_head.weight", (), (E, V), (1, 1), True))
    if model.mtp_depth and FAMILIES[family].mtp_key:
        _mtp_maps(model, family, maps)
    return maps


def expected_tensors(model: TransformerConfig, family: str) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor a checkpoint of `model` in `family` holds."""
    return {name: m.file_shape for m in tensor_maps(model, family) for name in m.hf_names()}
