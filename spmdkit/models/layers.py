"""The building blocks of a Llama-style decoder in Flax NNX: RMSNorm, rotary embeddings, grouped-query attention,
the SwiGLU MLP, and the token embedding. `transformer.py` stacks them; `moe.py` reuses the MLP as its shared expert.

Every parameter and activation carries logical axis names (`embed`, `heads`, `batch`, `act_seq`, ...), never a
mesh axis: `spmdkit.sharding.rules` maps the names, and `constrain` is a no-op when no rules are active, so the same
modules run on one device unchanged. Parameters are `param_dtype` (float32) and cast to `dtype` (bfloat16 by
default) where they are used; the softmax, norms and logits are computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit.models.attention import attend
from spmdkit.models.config import TransformerConfig
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
    """y = x / rms(x) * scale, over the last dim; computed in float32. scale: [embed] (`norm`)."""

    def __init__(self, config: TransformerConfig):
        self.scale = nnx.Param(jnp.ones((config.embed,), config.param_dtype), out_sharding=("norm",))
        self.eps = config.norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * scale over the last dim, in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half form). x: [batch, seq, heads, head_dim]; positions: [batch, seq].

    Pairs (x_i, x_{i+d/2}) rotate by angle position * theta^(-2i/d). Positions are explicit so that a
    permuted sequence (zigzag context parallelism) keeps each token's true position.
    """
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freq  # [batch, seq, 1, half]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention. Weights: q [embed, heads, head_dim], k/v [embed, kv_heads, head_dim],
    o [heads, head_dim, embed]. Under TP, heads are split over `tensor` (column-parallel q/k/v, row-parallel o:
    one all-reduce, or reduce-scatter under SP, per block forward)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c, pd = config, config.param_dtype
        self.q = normal_param(rngs, (c.embed, c.heads, c.head_dim), ("embed", "heads", "head_dim"), c.embed, pd)
        self.k = normal_param(rngs, (c.embed, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), c.embed, pd)
        self.v = normal_param(rngs, (c.embed, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), c.embed, pd)
        self.o = normal_param(
            rngs, (c.heads, c.head_dim, c.embed), ("heads", "head_dim", "embed"), c.heads * c.head_dim, pd
        )
        self.config = config

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [batch, seq, embed] -> q [batch, seq, heads, head_dim], k, v [batch, seq, kv_heads, head_dim], with
        the rotary embedding of `positions` [batch, seq] applied to q and k (heads split over `tensor` under TP)."""
        c, dt = self.config, self.config.dtype
        x = constrain(x, HIDDEN)
        q = constrain(jnp.einsum("bse,ehd->bshd", x, self.q[...].astype(dt)), ("batch", "seq", "heads", None))
        k = constrain(jnp.einsum("bse,ehd->bshd", x, self.k[...].astype(dt)), ("batch", "seq", "kv_heads", None))
        v = constrain(jnp.einsum("bse,ehd->bshd", x, self.v[...].astype(dt)), ("batch", "seq", "kv_heads", None))
        return rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta), v

    def out(self, attended: jax.Array) -> jax.Array:
        """The output projection: [batch, seq, heads, head_dim] -> [batch, seq, embed] (row-parallel under TP)."""
        attended = constrain(attended, ("batch", "seq", "heads", None))
        return constrain(jnp.einsum("bshd,hde->bse", attended, self.o[...].astype(self.config.dtype)), RESIDUAL)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """x: [batch, seq, embed] -> [batch, seq, embed]: `qkv`, the attention kernel the config names, `out`.
        segment_ids: int32 [batch, seq] (0 padding, 1, 2, ... documents packed in a row) or None (one document)."""
        q, k, v = self.qkv(x, positions)
        return self.out(attend(q, k, v, self.config.attention, segment_ids, block=self.config.attention_block))


class MLP(nnx.Module):
    """SwiGLU: down(silu(x gate) * (x up)). gate/up [embed, mlp] (column-parallel), down [mlp, embed] (row)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c, pd = config, config.param_dtype
        self.gate = normal_param(rngs, (c.embed, c.mlp), ("embed", "mlp"), c.embed, pd)
        self.up = normal_param(rngs, (c.embed, c.mlp), ("embed", "mlp"), c.embed, pd)
        self.down = normal_param(rngs, (c.mlp, c.embed), ("mlp", "embed"), c.mlp, pd)
        self.dtype = config.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [batch, seq, embed] -> [batch, seq, embed]; the hidden [batch, seq, mlp] is split over `mlp`."""
        dt = self.dtype
        x = constrain(x, HIDDEN)
        gate = jnp.einsum("bse,em->bsm", x, self.gate[...].astype(dt))
        up = jnp.einsum("bse,em->bsm", x, self.up[...].astype(dt))
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
        return constrain(jnp.einsum("bsm,me->bse", hidden, self.down[...].astype(dt)), RESIDUAL)


def embed_tokens(table: jax.Array, tokens: jax.Array, dtype: str) -> jax.Array:
    """table [vocab, embed], tokens [batch, seq] -> [batch, seq, embed] in `dtype`."""
    # Gather the table's `embed` dim first (as FSDP does for every weight): a lookup into an fsdp-sharded
    # table with (batch, seq)-sharded ids otherwise makes GSPMD all-gather the embedded sequence.
    table = constrain(table.astype(dtype), ("vocab", None))
    return constrain(jnp.take(table, tokens, axis=0), RESIDUAL)
