"""Which Hugging Face tensor each spmdkit parameter is, and how its layout differs (pure numpy, no JAX).

Llama, Qwen2 and Qwen3 share their tensor names (Qwen3 adds the [head_dim] scales `self_attn.q_norm.weight` and
`k_norm.weight`). Hugging Face stores a linear layer as [out, in]; spmdkit keeps the input dim first and splits the
head dims: q [embed, heads, head_dim] is `q_proj.weight` [heads x head_dim, embed] transposed, o [heads, head_dim,
embed] is `o_proj.weight` [embed, heads x head_dim] transposed. All use rotate-half RoPE, so q and k need no
permutation. Block parameters are stacked on a leading [layers] dim in
spmdkit and are one tensor per layer (`model.layers.{i}.`) in Hugging Face.

A `TensorMap` says how spmdkit's dims group into the Hugging Face tensor's dims (q: (embed), (heads, head_dim)),
so that a slice of a spmdkit parameter (what one device holds) reads only the rows and columns it needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig

Read = Callable[[str, tuple[slice, ...]], np.ndarray]  # (Hugging Face name, slices of it) -> array


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One parameter: its spmdkit `path`, its Hugging Face `name` (`{i}`: the layer), whether it is `stacked` over
    layers, its spmdkit `shape` (one layer's), `groups` (how many spmdkit dims make each Hugging Face dim, in
    spmdkit's order) and `transpose` (Hugging Face's dims are the groups reversed)."""

    path: tuple[str, ...]
    name: str
    stacked: bool
    shape: tuple[int, ...]
    groups: tuple[int, ...]
    transpose: bool

    def hf_name(self, layer: int | None = None) -> str:
        return self.name.format(i=layer)

    def hf_names(self, layers: int) -> list[str]:
        return [self.hf_name(i) for i in range(layers)] if self.stacked else [self.hf_name()]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        sizes, start = [], 0
        for g in self.groups:
            sizes.append(math.prod(self.shape[start : start + g]))
            start += g
        return tuple(reversed(sizes)) if self.transpose else tuple(sizes)

    @property
    def row_dim(self) -> int:
        """The spmdkit dim that is the Hugging Face tensor's outermost (row) dim: slices of it are contiguous bytes
        in the file."""
        return sum(self.groups[:-1]) if self.transpose else 0

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        """One layer's spmdkit array -> the Hugging Face tensor (C-contiguous)."""
        value = np.asarray(value).reshape([s for s in self.hf_shape[:: -1 if self.transpose else 1]])
        return np.ascontiguousarray(value.T if self.transpose else value)

    def read(self, read: Read, index: tuple[slice, ...], layer: int | None = None) -> np.ndarray:
        """The block `index` (slices over `shape`, one layer) of this parameter, read from the Hugging Face
        tensor: each group's first dim is sliced in the file; the rest of a group are read whole (they never are
        split: `head_dim` has no mesh axis) and sliced here."""
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, self.shape, strict=True))
        ranges, block_shape, inner_index, start = [], [], [], 0
        for g in self.groups:
            dims, slices = self.shape[start : start + g], index[start : start + g]
            inner = math.prod(dims[1:])
            ranges.append(slice(slices[0].start * inner, slices[0].stop * inner))
            block_shape += [slices[0].stop - slices[0].start, *dims[1:]]
            inner_index += [slice(None), *slices[1:]]
            start += g
        block = read(self.hf_name(layer), tuple(reversed(ranges)) if self.transpose else tuple(ranges))
        block = block.T if self.transpose else block
        return block.reshape(block_shape)[tuple(inner_index)]


def tensor_maps(model: TransformerConfig) -> list[TensorMap]:
    """Every parameter of `model` as a `TensorMap`, in the order Hugging Face lists them."""
    if model.experts:
        raise SpmdkitError("a mixture-of-experts model has no Llama/Qwen Hugging Face layout: use a dense model")
    E, H, K, D, F, V = model.embed, model.heads, model.kv_heads, model.head_dim, model.mlp, model.vocab_size
    layer = "model.layers.{i}."

    def block(path: str, name: str, shape: tuple[int, ...], groups: tuple[int, ...], transpose: bool) -> TensorMap:
        return TensorMap(("blocks", *path.split(".")), layer + name, True, shape, groups, transpose)

    maps = [TensorMap(("embedding",), "model.embed_tokens.weight", False, (V, E), (1, 1), False)]
    maps += [
        block("attention_norm.scale", "input_layernorm.weight", (E,), (1,), False),
        block("attention.q", "self_attn.q_proj.weight", (E, H, D), (1, 2), True),
        block("attention.k", "self_attn.k_proj.weight", (E, K, D), (1, 2), True),
        block("attention.v", "self_attn.v_proj.weight", (E, K, D), (1, 2), True),
        block("attention.o", "self_attn.o_proj.weight", (H, D, E), (2, 1), True),
    ]
    if model.qkv_bias:
        maps += [block(f"attention.{n}_bias", f"self_attn.{n}_proj.bias", (h, D), (2,), False) for n, h in
                 (("q", H), ("k", K), ("v", K))]  # fmt: skip
    if model.o_bias:
        maps.append(block("attention.o_bias", "self_attn.o_proj.bias", (E,), (1,), False))
    if model.qk_norm:
        maps += [block(f"attention.{n}_norm.scale", f"self_attn.{n}_norm.weight", (D,), (1,), False) for n in "qk"]
    maps += [
        block("mlp_norm.scale", "post_attention_layernorm.weight", (E,), (1,), False),
        block("mlp.gate", "mlp.gate_proj.weight", (E, F), (1, 1), True),
        block("mlp.up", "mlp.up_proj.weight", (E, F), (1, 1), True),
        block("mlp.down", "mlp.down_proj.weight", (F, E), (1, 1), True),
    ]
    if model.mlp_bias:
        maps += [block(f"mlp.{n}_bias", f"mlp.{n}_proj.bias", (size,), (1,), False) for n, size in
                 (("gate", F), ("up", F), ("down", E))]  # fmt: skip
    maps.append(TensorMap(("final_norm", "scale"), "model.norm.weight", False, (E,), (1,), False))
    if not model.tie_embeddings:
        maps.append(TensorMap(("lm_head",), "lm_head.weight", False, (E, V), (1, 1), True))
    return maps


def expected_tensors(model: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor a checkpoint of `model` holds."""
    return {name: m.hf_shape for m in tensor_maps(model) for name in m.hf_names(model.layers)}
