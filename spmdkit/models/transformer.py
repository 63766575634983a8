"""A Llama-style decoder in Flax NNX: embedding, RMSNorm, rotary embeddings, grouped-query attention, SwiGLU,
and (with `experts` > 0) mixture-of-experts blocks (`spmdkit.models.moe`) every `moe_every`-th layer.

The model is plain: it names logical axes (`embed`, `heads`, `batch`, `act_seq`, ...) on every parameter and
activation and never a mesh axis. `spmdkit.sharding.rules` maps the names; `constrain` is a no-op when no
rules are active, so the same module runs on one device unchanged.

Parameters are `param_dtype` (float32) and cast to `dtype` (bfloat16 by default) where they are used; the
softmax, norms and logits are computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from spmdkit.models.config import TransformerConfig
from spmdkit.models.moe import MoE
from spmdkit.sharding import context
from spmdkit.sharding.rules import constrain

# Activation layouts, by logical name. The residual stream carries `act_seq` (sequence parallelism shards it
# over `tensor` in the norm/residual regions); inside attention and the MLP the sequence is `seq`.
RESIDUAL = ("batch", "act_seq", "act_embed")
HIDDEN = ("batch", "seq", "act_embed")


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], fan_in: int, dtype: str) -> nnx.Param:
    """A normal(0, 1/sqrt(fan_in)) parameter carrying its logical axis names."""
    value = jax.random.normal(rngs.params(), shape, dtype) / jnp.sqrt(fan_in).astype(dtype)
    return nnx.Param(value, out_sharding=names)


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


def dot_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v with grouped-query heads, K/V never repeated.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim]; heads = kv_heads x group.
    Scores and softmax in float32. Returns [batch, seq, heads, head_dim] in q's dtype.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(d)
    if causal:
        mask = jnp.tril(jnp.ones((s, k.shape[1]), bool))
        scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, s, h, d)


class Attention(nnx.Module):
    """Grouped-query self-attention. Weights: q [embed, heads, head_dim], k/v [embed, kv_heads, head_dim],
    o [heads, head_dim, embed]. Under TP, heads are split over `tensor` (column-parallel q/k/v, row-parallel o:
    one all-reduce, or reduce-scatter under SP, per block forward)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c, pd = config, config.param_dtype
        self.q = _param(rngs, (c.embed, c.heads, c.head_dim), ("embed", "heads", "head_dim"), c.embed, pd)
        self.k = _param(rngs, (c.embed, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), c.embed, pd)
        self.v = _param(rngs, (c.embed, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), c.embed, pd)
        self.o = _param(rngs, (c.heads, c.head_dim, c.embed), ("heads", "head_dim", "embed"), c.heads * c.head_dim, pd)
        self.config = config

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x: [batch, seq, embed] -> [batch, seq, embed]."""
        c, dt = self.config, self.config.dtype
        x = constrain(x, HIDDEN)
        q = constrain(jnp.einsum("bse,ehd->bshd", x, self.q[...].astype(dt)), ("batch", "seq", "heads", None))
        k = constrain(jnp.einsum("bse,ehd->bshd", x, self.k[...].astype(dt)), ("batch", "seq", "kv_heads", None))
        v = constrain(jnp.einsum("bse,ehd->bshd", x, self.v[...].astype(dt)), ("batch", "seq", "kv_heads", None))
        q, k = rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta)
        if c.attention == "ring" and context.context_size() > 1:
            out = context.context_attention(q, k, v)
        else:
            out = dot_attention(q, k, v)
        out = constrain(out, ("batch", "seq", "heads", None))
        return constrain(jnp.einsum("bshd,hde->bse", out, self.o[...].astype(dt)), RESIDUAL)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x gate) * (x up)). gate/up [embed, mlp] (column-parallel), down [mlp, embed] (row)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c, pd = config, config.param_dtype
        self.gate = _param(rngs, (c.embed, c.mlp), ("embed", "mlp"), c.embed, pd)
        self.up = _param(rngs, (c.embed, c.mlp), ("embed", "mlp"), c.embed, pd)
        self.down = _param(rngs, (c.mlp, c.embed), ("mlp", "embed"), c.mlp, pd)
        self.dtype = config.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [batch, seq, embed] -> [batch, seq, embed]; the hidden [batch, seq, mlp] is split over `mlp`."""
        dt = self.dtype
        x = constrain(x, HIDDEN)
        gate = jnp.einsum("bse,em->bsm", x, self.gate[...].astype(dt))
        up = jnp.einsum("bse,em->bsm", x, self.up[...].astype(dt))
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
        return constrain(jnp.einsum("bsm,me->bse", hidden, self.down[...].astype(dt)), RESIDUAL)


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)); the MLP is a `MoE` when `moe`."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, moe: bool = False):
        self.attention_norm = RMSNorm(config)
        self.attention = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config)
        self.mlp = MoE(config, rngs=rngs) if moe else MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [batch, seq, embed] -> (x, aux); aux holds the MoE layer's losses and loads ({} for a dense MLP)."""
        x = constrain(x + self.attention(self.attention_norm(x), positions), RESIDUAL)
        out = self.mlp(self.mlp_norm(x))
        out, aux = out if isinstance(out, tuple) else (out, {})
        return constrain(x + out, RESIDUAL), aux


def _remat_policy(name: str):
    return {
        "full": None,
        "dots_saveable": jax.checkpoint_policies.dots_saveable,
        "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }[name]


class Transformer(nnx.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab] (float32).

    The `layers` blocks are stacked on a leading `layers` dim (built with `nnx.vmap`) and run with `nnx.scan`,
    so compile time stays flat in depth and the pipeline can split the stack into stages. A mixture-of-experts
    model keeps its dense blocks in `blocks` and its MoE blocks in `moe_blocks` (two stacks: their parameters
    differ); `forward` also returns the MoE layers' aux losses and loads.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = config
        self.embedding = nnx.Param(
            jax.random.normal(rngs.params(), (c.vocab_size, c.embed), c.param_dtype), out_sharding=("vocab", "embed")
        )

        if c.layers > c.moe_layers:
            self.blocks = _stacked_blocks(config, c.layers - c.moe_layers, False, rngs)
        if c.moe_layers:
            self.moe_blocks = _stacked_blocks(config, c.moe_layers, True, rngs)
        self.final_norm = RMSNorm(config)
        self.lm_head = _param(rngs, (c.embed, c.vocab_size), ("embed", "vocab"), c.embed, c.param_dtype)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [batch, seq] -> residual stream [batch, seq, embed] in the compute dtype."""
        return embed_tokens(self.embedding[...], tokens, self.config.dtype)

    def run_blocks(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Apply every block in order with a scan; remat per block as the config says."""
        return self.run_layers(x, positions)[0]

    def run_layers(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Every block in order: (x, aux of the MoE layers, each stacked on a leading [moe_layers] dim).

        Dense: one scan. Mixture of experts every k-th block: per group, a scan over its k-1 dense blocks
        then its MoE block (MoE blocks at 0-based layers k-1, 2k-1, ...).
        """
        c = self.config
        if not c.moe_layers:
            return scan_blocks(self.blocks, x, positions, c.remat)
        if c.moe_every == 1:
            return scan_blocks(self.moe_blocks, x, positions, c.remat)
        auxes = []
        for group in range(c.moe_layers):
            dense = _layer_slice(self.blocks, group * (c.moe_every - 1), (group + 1) * (c.moe_every - 1))
            x = scan_blocks(dense, x, positions, c.remat)[0]
            x, aux = scan_blocks(_layer_slice(self.moe_blocks, group, group + 1), x, positions, c.remat)
            auxes.append(aux)
        return x, jax.tree.map(lambda *a: jnp.concatenate(a), *auxes)

    def forward(self, tokens: jax.Array, positions: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """(logits [batch, seq, vocab], aux of the MoE layers) for tokens [batch, seq]."""
        if positions is None:
            positions = default_positions(tokens.shape)
        x, aux = self.run_layers(self.embed(tokens), positions)
        return self.head(x), aux

    def head(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: [batch, seq, embed] -> float32 logits [batch, seq, vocab]."""
        return head_logits(x, self.final_norm.scale[...], self.lm_head[...], self.config)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        return self.forward(tokens, positions)[0]


# The three stages of the forward pass as functions of arrays, so that the pipeline can run them apart.


def default_positions(shape: tuple[int, int]) -> jax.Array:
    """[batch, seq] positions 0..seq-1."""
    return jnp.broadcast_to(jnp.arange(shape[1]), shape)


def embed_tokens(table: jax.Array, tokens: jax.Array, dtype: str) -> jax.Array:
    """table [vocab, embed], tokens [batch, seq] -> [batch, seq, embed] in `dtype`."""
    # Gather the table's `embed` dim first (as FSDP does for every weight): a lookup into an fsdp-sharded
    # table with (batch, seq)-sharded ids otherwise makes GSPMD all-gather the embedded sequence.
    table = constrain(table.astype(dtype), ("vocab", None))
    return constrain(jnp.take(table, tokens, axis=0), RESIDUAL)


def _stacked_blocks(config: TransformerConfig, count: int, moe: bool, rngs: nnx.Rngs) -> Block:
    """`count` blocks with their parameters stacked on a leading `layers` dim."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> Block:
        return Block(config, rngs=rngs, moe=moe)

    return make(rngs)


def _layer_slice(blocks: Block, start: int, stop: int) -> Block:
    """Blocks [start, stop) of a stack, as a stack."""
    graphdef, state = nnx.split(blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[start:stop], state))


def apply_blocks(blocks: Block, x: jax.Array, positions: jax.Array, remat: str) -> jax.Array:
    """Run a stack of blocks (parameters with a leading layer dim) over x [batch, seq, embed] with a scan."""
    return scan_blocks(blocks, x, positions, remat)[0]


def scan_blocks(blocks: Block, x: jax.Array, positions: jax.Array, remat: str) -> tuple[jax.Array, dict]:
    """`apply_blocks`, also returning each block's aux stacked on a leading layer dim."""

    def body(x: jax.Array, block: Block, positions: jax.Array) -> tuple[jax.Array, dict]:
        return block(x, positions)

    if remat != "none":
        body = nnx.remat(body, policy=_remat_policy(remat))
    scan = nnx.scan(
        body,
        in_axes=(nnx.Carry, 0, None),
        out_axes=(nnx.Carry, 0),
        transform_metadata={nnx.PARTITION_NAME: "layers"},
    )
    return scan(x, blocks, positions)


def head_logits(x: jax.Array, norm_scale: jax.Array, lm_head: jax.Array, config: TransformerConfig) -> jax.Array:
    """Final RMSNorm and LM head: x [batch, seq, embed] -> float32 logits [batch, seq, vocab]."""
    x = rms_norm(x, norm_scale, config.norm_eps)
    logits = jnp.einsum("bse,ev->bsv", x, lm_head.astype(config.dtype))
    return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32. logits [batch, seq, vocab], targets [batch, seq]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()
