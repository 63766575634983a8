"""The building blocks of a Llama-style decoder in Flax NNX: RMSNorm, rotary embeddings, grouped-query attention,
the SwiGLU MLP, and the token embedding. `transformer.py` stacks them; `moe.py` reuses the MLP as its shared expert.

Every parameter and activation carries logical axis names (`embed`, `heads`, `batch`, `act_seq`, ...), never a
mesh axis: `spmdkit.sharding.rules` maps the names, and `constrain` is a no-op when no rules are active, so the same
modules run on one device unchanged. Parameters are `param_dtype` (float32) and cast to `dtype` (bfloat16 by
default) where they are used; the softmax, norms and logits are computed in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.models.attention import attend
from spmdkit.models.config import TransformerConfig
from spmdkit.models.fp8 import Fp8Scales, project
from spmdkit.models.layer_plan import LayerKind, layer_kind
from spmdkit.models.remat_policy import named
from spmdkit.parallel.collective_matmul import column_parallel, ring_mesh, row_parallel
from spmdkit.parallel.context.ulysses import HeadParts
from spmdkit.sharding.logical import constrain

# Activation layouts, by logical name. The residual stream carries `act_seq` (sequence parallelism shards it
# over `tensor` in the norm/residual regions); inside attention and the MLP the sequence is `seq`.
RESIDUAL = ("batch", "act_seq", "act_embed")
HIDDEN = ("batch", "seq", "act_embed")


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype: str) -> jax.Array:
    """normal(0, 1/sqrt(fan_in)) values: the initialisation of every matrix."""
    return jax.random.normal(rngs.params(), shape, dtype) / jnp.sqrt(fan_in).astype(dtype)


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], fan_in: int, dtype: str) -> nnx.Param:
    """A `normal` parameter carrying its logical axis names."""
    return nnx.Param(normal(rngs, shape, fan_in, dtype), out_sharding=names)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale over the trailing dims of `scale`, in float32; scale (1 + scale with
    `norm_plus_one`, Gemma: then stored as zeros). Shapes: [embed] (`norm`), [head_dim] for per-head q/k norms,
    [heads, head_dim] (`heads`, `head_dim`) for a q/k norm over the whole projection (OLMo 2)."""

    def __init__(self, config: TransformerConfig, shape: tuple[int, ...] | None = None, names: tuple = ("norm",)):
        init = jnp.zeros if config.norm_plus_one else jnp.ones
        self.scale = nnx.Param(init(shape or (config.embed,), config.param_dtype), out_sharding=names)
        self.eps, self.plus_one = config.norm_eps, config.norm_plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, plus_one=self.plus_one)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, *, plus_one: bool = False) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * scale (or * (1 + scale)) over x's trailing `scale.ndim` dims, in float32,
    returned in x's dtype."""
    x32, axes = x.astype(jnp.float32), tuple(range(-scale.ndim, 0))
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    weight = scale.astype(jnp.float32) + 1.0 if plus_one else scale.astype(jnp.float32)
    return (normed * weight).astype(x.dtype)


@functools.cache
def rope_frequencies(config: TransformerConfig, local: bool = False) -> np.ndarray:
    """The [rotary_dims / 2] float32 inverse frequencies theta^(-2i/d) (d = `rotary_dims`), scaled as `rope_type`
    says; `local`: the local layers' plain frequencies of base `local_rope_theta` (Gemma 3).

    Computed in float32 in the order transformers' `modeling_rope_utils` computes them, so that imported models
    rotate by the same angles: `linear` divides every frequency by `rope_factor`; `llama3` divides the low
    frequencies (wavelength above original_max_positions / low_freq_factor) by `rope_factor`, keeps the high ones
    (wavelength below original_max_positions / high_freq_factor) and blends the band between; `yarn` blends
    each frequency between itself (extrapolation) and itself / `rope_factor` (interpolation) by a linear ramp over
    the dims whose rotations in original_max_positions fall between beta_fast and beta_slow (`rope_scaling` is its
    attention factor).
    """
    c, f32, d = config, np.float32, config.rotary_dims
    theta = c.local_rope_theta if local else c.rope_theta
    inv = f32(1.0) / (f32(theta) ** (np.arange(0, d, 2, dtype=f32) / f32(d)))
    if local:
        return inv.astype(f32)
    if c.rope_type == "linear":
        inv = inv / f32(c.rope_factor)
    elif c.rope_type == "llama3":
        old, factor = f32(c.rope_original_max_positions), f32(c.rope_factor)
        low, high = c.rope_low_freq_factor, c.rope_high_freq_factor
        wavelen = f32(2 * math.pi) / inv
        scaled = np.where(wavelen > old / f32(low), inv / factor, inv)
        smooth = (old / wavelen - f32(low)) / f32(high - low)
        smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / f32(high)) & ~(wavelen > old / f32(low))
        inv = np.where(medium, smoothed, scaled)
    elif c.rope_type == "yarn":
        inv = _yarn(c)
    return inv.astype(f32)


def _yarn(c: TransformerConfig) -> np.ndarray:
    """YaRN's frequencies (transformers' `_compute_yarn_parameters`, in its float32 order)."""
    f32, d = np.float32, c.rotary_dims

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times in the original context
        return d * math.log(c.rope_original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(c.rope_theta))

    low, high = dim_of(c.rope_beta_fast), dim_of(c.rope_beta_slow)
    if c.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high  # no zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    extrapolation = f32(1) - ramp  # the share of each dim's plain frequency
    base = f32(c.rope_theta) ** (np.arange(0, d, 2, dtype=f32) / f32(d))
    return f32(1) / (f32(c.rope_factor) * base) * (f32(1) - extrapolation) + f32(1) / base * extrapolation


def rope_scaling(config: TransformerConfig, local: bool = False) -> float:
    """The factor on cos and sin (so on q k^T, squared): YaRN's attention factor (`rope_attention_factor`, or
    0.1 ln(rope_factor) + 1 when that is 0 and the factor > 1); 1 for the other RoPE types and local layers."""
    c = config
    if local or c.rope_type != "yarn":
        return 1.0
    if c.rope_attention_factor:
        return c.rope_attention_factor
    return 0.1 * math.log(c.rope_factor) + 1.0 if c.rope_factor > 1 else 1.0


def attention_scale(config: TransformerConfig) -> float:
    """The factor on q k^T: `attention_scale` (0: head_dim^-1/2), times DeepSeek's YaRN mscale^2 where
    `rope_mscale_all_dim` m is set and RoPE is scaled: (0.1 m ln(rope_factor) + 1)^2 (1 when rope_factor <= 1)."""
    c = config
    scale = c.attention_scale or c.head_dim**-0.5
    if c.rope_mscale_all_dim and c.rope_type != "default" and c.rope_factor > 1:
        scale *= (0.1 * c.rope_mscale_all_dim * math.log(c.rope_factor) + 1.0) ** 2
    return scale


def rotary(x: jax.Array, positions: jax.Array, frequencies: np.ndarray | float, scaling: float = 1.0) -> jax.Array:
    """Rotary position embedding (rotate-half form). x: [batch, seq, heads, head_dim]; positions: [batch, seq].

    Over the leading d = 2 x len(frequencies) dims of each head (the rest pass unrotated: partial RoPE), pairs
    (x_i, x_{i+d/2}) rotate by angle position * frequencies[i] (`rope_frequencies`; a float is a plain RoPE base
    theta over the whole head: theta^(-2i/d)). Positions are explicit so that a permuted sequence (zigzag context
    parallelism) keeps each token's true position. `scaling` multiplies cos and sin (YaRN's attention factor,
    `rope_scaling`).
    """
    if isinstance(frequencies, (int, float)):
        half = x.shape[-1] // 2
        frequencies = frequencies ** (-np.arange(half, dtype=np.float32) / half)
    half = len(frequencies)
    freq = jnp.asarray(frequencies, jnp.float32)
    angle = positions[..., None, None].astype(jnp.float32) * freq  # [batch, seq, 1, half]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    if scaling != 1.0:  # as transformers scales them: in float32, before the rotation
        sin, cos = sin * jnp.float32(scaling), cos * jnp.float32(scaling)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half : 2 * half].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return rotated if 2 * half == x.shape[-1] else jnp.concatenate([rotated, x[..., 2 * half :]], axis=-1)


def zeros_param(shape: tuple[int, ...], names: tuple[str, ...], dtype: str) -> nnx.Param:
    """A zero-initialised parameter (a bias) carrying its logical axis names."""
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=names)


class Attention(nnx.Module):
    """Grouped-query self-attention. Weights: q [embed, heads, head_dim], k/v [embed, kv_heads, head_dim],
    o [heads, head_dim, embed]; with `qkv_bias`, q_bias [heads, head_dim] and k/v_bias [kv_heads, head_dim]; with
    `o_bias`, o_bias [embed] (split like the weights' embed: over fsdp under ZeRO-3, whole on `tensor`, added once
    after the row-parallel sum); with `attention_sinks`, sinks [heads] (split like the heads); with `qk_norm`,
    q_norm and k_norm (`RMSNorm` over head_dim, shared by the heads; scope "layer": over [heads, head_dim], split
    like q and k).
    Under TP, heads are split over `tensor` (column-parallel q/k/v, row-parallel o: one all-reduce, or
    reduce-scatter under SP, per block forward)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c, pd = config, config.param_dtype
        self.q = normal_param(rngs, (c.embed, c.heads, c.head_dim), ("embed", "heads", "head_dim"), c.embed, pd)
        self.k = normal_param(rngs, (c.embed, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), c.embed, pd)
        self.v = normal_param(rngs, (c.embed, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), c.embed, pd)
        self.o = normal_param(
            rngs, (c.heads, c.head_dim, c.embed), ("heads", "head_dim", "embed"), c.heads * c.head_dim, pd
        )
        if c.qkv_bias:
            self.q_bias = zeros_param((c.heads, c.head_dim), ("heads", "head_dim"), pd)
            self.k_bias = zeros_param((c.kv_heads, c.head_dim), ("kv_heads", "head_dim"), pd)
            self.v_bias = zeros_param((c.kv_heads, c.head_dim), ("kv_heads", "head_dim"), pd)
        if c.o_bias:
            self.o_bias = zeros_param((c.embed,), ("embed",), pd)
        if c.qk_norm and c.qk_norm_scope == "head":
            self.q_norm, self.k_norm = RMSNorm(c, (c.head_dim,)), RMSNorm(c, (c.head_dim,))
        elif c.qk_norm:
            self.q_norm = RMSNorm(c, (c.heads, c.head_dim), ("heads", "head_dim"))
            self.k_norm = RMSNorm(c, (c.kv_heads, c.head_dim), ("kv_heads", "head_dim"))
        if c.attention_sinks:  # a logit per query head that joins each softmax's denominator (GPT-OSS)
            self.sinks = zeros_param((c.heads,), ("heads",), pd)
        if c.fp8:  # each projection's delayed FP8 scales (`spmdkit.models.fp8`)
            self.q_fp8, self.k_fp8, self.v_fp8, self.o_fp8 = (Fp8Scales() for _ in range(4))
        self.config = config

    def qkv(
        self, x: jax.Array, positions: jax.Array, kind: LayerKind | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [batch, seq, embed] -> q [batch, seq, heads, head_dim], k, v [batch, seq, kv_heads, head_dim], with
        the rotary embedding of `positions` [batch, seq] applied to q and k where the layer's `kind` rotates
        (None: layer 0's kind); heads split over `tensor` under TP."""
        c, dt = self.config, self.config.dtype
        ring = not c.fp8 and ring_mesh() is not None  # --overlap-tp: x stays sequence-sharded, the ring gathers it
        x = constrain(x, RESIDUAL if ring else HIDDEN)

        def projected(name: str, heads: str) -> jax.Array:
            weight = getattr(self, name)
            if ring:
                y = column_parallel(x, weight[...].astype(dt), ("embed", heads, "head_dim"))
            else:
                y = project("bse,ehd->bshd", x, weight, getattr(self, f"{name}_fp8", None), dtype=dt)
            if c.qkv_bias:  # the bias comes before the rotation, as in Hugging Face's q_proj/k_proj
                y = y + getattr(self, f"{name}_bias")[...].astype(dt)
            return named(constrain(y, ("batch", "seq", heads, None)), f"{name}_proj")

        q, k, v = projected("q", "heads"), projected("k", "kv_heads"), projected("v", "kv_heads")
        if c.qk_norm:  # normalised after the projection, before the rotation (Qwen3, OLMo 2, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        kind = kind or layer_kind(c, 0)
        if not kind.rope:
            return q, k, v
        frequencies, scaling = rope_frequencies(c, kind.local_rope), rope_scaling(c, kind.local_rope)
        return rotary(q, positions, frequencies, scaling), rotary(k, positions, frequencies, scaling), v

    def out(self, attended: jax.Array | HeadParts) -> jax.Array:
        """The output projection: [batch, seq, heads, head_dim] -> [batch, seq, embed] (row-parallel under TP).
        Ulysses' `HeadParts` (`ulysses_parts` > 1): each part times its rows of o, summed, so that a part's GEMM
        runs while the next part is exchanged (the partial sums add before TP's one all-reduce)."""
        dt = self.config.dtype
        if isinstance(attended, HeadParts):  # build_program allows parts only where o is one plain einsum
            rows = attended.rows(self.o[...].astype(dt))
            y = sum(jnp.einsum("bshd,hde->bse", self._context(p), w) for p, w in zip(attended.parts, rows, strict=True))
            return self._biased(y)
        attended = self._context(attended)
        if not self.config.fp8 and ring_mesh() is not None:  # --overlap-tp: the sum reduce-scattered in a ring
            y = row_parallel(attended, self.o[...].astype(dt), ("heads", "head_dim", "embed"))
        else:
            y = project("bshd,hde->bse", attended, self.o, getattr(self, "o_fp8", None), dtype=dt)
        return self._biased(y)

    def _context(self, attended: jax.Array) -> jax.Array:
        """The attention output (or a part of its heads) as the projection reads it, named for the remat policies."""
        attended = attended[..., : self.config.value_head_dim]  # latent attention: values were padded to head_dim
        return named(constrain(attended, ("batch", "seq", "heads", None)), "context")

    def _biased(self, y: jax.Array) -> jax.Array:
        if self.config.o_bias:
            y = y + self.o_bias[...].astype(self.config.dtype)
        return named(constrain(y, RESIDUAL), "out_proj")

    def spec(self, kind: LayerKind | None = None) -> AttentionSpec:
        """What every attention kernel takes for this layer besides q, k, v: its window (a local layer's; 0:
        global), the config's scale, soft cap and block size."""
        c, kind = self.config, kind or layer_kind(self.config, 0)
        return AttentionSpec.of_layer(kind.window, attention_scale(c), c.attention_softcap, c.attention_block)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None, kind: LayerKind | None = None
    ) -> jax.Array:
        """x: [batch, seq, embed] -> [batch, seq, embed]: `qkv`, the attention kernel the config names, `out`.
        segment_ids: int32 [batch, seq] (0 padding, 1, 2, ... documents packed in a row) or None (one document);
        kind: the layer's static kind (its window, its RoPE; None: layer 0's)."""
        c = self.config
        q, k, v = self.qkv(x, positions, kind)
        parts = max(c.ulysses_parts, 1)  # build_program resolved 0 (auto); a model traced outside runs whole
        return self.out(attend(q, k, v, c.attention, segment_ids, self.spec(kind), self.sink_logits(), parts))

    def sink_logits(self) -> jax.Array | None:
        """The sinks [heads] float32 (split like the heads), or None without `attention_sinks`."""
        return self.sinks[...].astype(jnp.float32) if self.config.attention_sinks else None


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # erf GELU: Hugging Face's "gelu"
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


class MLP(nnx.Module):
    """Gated MLP: down(act(x gate) * (x up)), act = `activation` (silu: SwiGLU). gate/up [embed, mlp]
    (column-parallel), down [mlp, embed] (row); with `mlp_bias`, gate/up_bias [mlp] and down_bias [embed]; `width`
    replaces the config's `mlp` (a shared expert's own width)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, width: int | None = None):
        c, pd, f = config, config.param_dtype, width or config.mlp
        self.gate = normal_param(rngs, (c.embed, f), ("embed", "mlp"), c.embed, pd)
        self.up = normal_param(rngs, (c.embed, f), ("embed", "mlp"), c.embed, pd)
        self.down = normal_param(rngs, (f, c.embed), ("mlp", "embed"), f, pd)
        if c.mlp_bias:
            self.gate_bias = zeros_param((f,), ("mlp",), pd)
            self.up_bias = zeros_param((f,), ("mlp",), pd)
            self.down_bias = zeros_param((c.embed,), ("embed",), pd)
        if c.fp8:  # each projection's delayed FP8 scales (`spmdkit.models.fp8`)
            self.gate_fp8, self.up_fp8, self.down_fp8 = (Fp8Scales() for _ in range(3))
        self.dtype, self.activation, self.bias, self.fp8 = config.dtype, config.activation, config.mlp_bias, c.fp8

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [batch, seq, embed] -> [batch, seq, embed]; the hidden [batch, seq, mlp] is split over `mlp`."""
        dt = self.dtype
        ring = not self.fp8 and ring_mesh() is not None  # --overlap-tp (`Attention.qkv`)
        x = constrain(x, RESIDUAL if ring else HIDDEN)

        def projected(name: str, equation: str, names: tuple[str, str], h: jax.Array) -> jax.Array:
            weight = getattr(self, name)
            if ring:
                return (column_parallel if name != "down" else row_parallel)(h, weight[...].astype(dt), names)
            return project(equation, h, weight, getattr(self, f"{name}_fp8", None), dtype=dt)

        gate = projected("gate", "bse,em->bsm", ("embed", "mlp"), x)
        up = projected("up", "bse,em->bsm", ("embed", "mlp"), x)
        if self.bias:
            gate, up = gate + self.gate_bias[...].astype(dt), up + self.up_bias[...].astype(dt)
        gate, up = named(gate, "mlp_gate"), named(up, "mlp_up")
        hidden = named(constrain(ACTIVATIONS[self.activation](gate) * up, ("batch", "seq", "mlp")), "mlp_hidden")
        y = projected("down", "bsm,me->bse", ("mlp", "embed"), hidden)
        if self.bias:
            y = y + self.down_bias[...].astype(dt)
        return named(constrain(y, RESIDUAL), "mlp_down")


def embed_tokens(table: jax.Array, tokens: jax.Array, dtype: str, scale: float = 1.0) -> jax.Array:
    """table [vocab, embed], tokens [batch, seq] -> [batch, seq, embed] in `dtype`, times `scale` (Gemma's
    sqrt(embed), Granite's multiplier: a `dtype` constant, as transformers casts it)."""
    table = table.astype(dtype)
    table = constrain(table, ("vocab", None))  # its `embed` dim gathered first, as FSDP does for every weight
    x = jnp.take(table, tokens, axis=0)
    if scale != 1.0:
        x = x * jnp.asarray(scale, dtype)
    return constrain(x, RESIDUAL)
