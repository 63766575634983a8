"""A Llama-style decoder in Flax NNX: the layers of `spmdkit.models.layers` stacked into pre-norm blocks, scanned
over depth, with (`experts` > 0) mixture-of-experts blocks (`spmdkit.models.moe`) every `moe_every`-th layer.

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
from spmdkit.models.latent_attention import LatentAttention
from spmdkit.models.layer_plan import LayerKind, layer_runs, stack_sizes
from spmdkit.models.layers import MLP, RESIDUAL, Attention, RMSNorm, embed_tokens, normal_param
from spmdkit.models.loss import HeadSpec, lm_loss
from spmdkit.models.loss import head_logits as loss_head_logits
from spmdkit.models.moe import MoE
from spmdkit.models.mtp import MultiTokenPrediction, block_kind, shifted_targets
from spmdkit.models.remat import RematPolicy
from spmdkit.models.remat_policy import checkpoint_policy, naming
from spmdkit.sharding.logical import constrain


class Block(nnx.Module):
    """Decoder block: x + attn(norm(x)), then + mlp(norm(x)); the MLP is a `MoE` when `moe`.

    The norms are the config's: before attention and the MLP (`pre_norm`: `attention_norm`, `mlp_norm`), after
    them (`post_norm`: `attention_post_norm`, `mlp_post_norm`; Gemma 2/3 have both, OLMo 2 only these), and
    each output is multiplied by `residual_scale` before it joins the residual stream (Granite).
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, moe: bool = False):
        if config.pre_norm:
            self.attention_norm = RMSNorm(config)
        self.attention = (LatentAttention if config.kv_lora_rank else Attention)(config, rngs=rngs)
        if config.post_norm:
            self.attention_post_norm = RMSNorm(config)
        if config.pre_norm:
            self.mlp_norm = RMSNorm(config)
        self.mlp = MoE(config, rngs=rngs) if moe else MLP(config, rngs=rngs)
        if config.post_norm:
            self.mlp_post_norm = RMSNorm(config)
        self.config = config

    def _norm(self, name: str, x: jax.Array) -> jax.Array:
        return getattr(self, name)(x) if hasattr(self, name) else x

    def attention_input(self, x: jax.Array) -> jax.Array:
        """What attention reads: the residual x [batch, seq, embed], normalised when `pre_norm`."""
        return self._norm("attention_norm", x)

    def add(self, x: jax.Array, out: jax.Array, post_norm: str) -> jax.Array:
        """x + residual_scale x post_norm(out): a sub-block's output `out` [batch, seq, embed] joins the stream."""
        out = self._norm(post_norm, out)
        if self.config.residual_scale != 1.0:
            out = out * jnp.asarray(self.config.residual_scale, out.dtype)
        return constrain(x + out, RESIDUAL)

    def mlp_half(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The MLP (or MoE) sub-block with its norms and residual: (x, aux; {} for a dense MLP)."""
        out = self.mlp(self._norm("mlp_norm", x))
        out, aux = out if isinstance(out, tuple) else (out, {})
        return self.add(x, out, "mlp_post_norm"), aux

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None, kind: LayerKind | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [batch, seq, embed] -> (x, aux); aux holds the MoE layer's losses and loads ({} for a dense MLP);
        kind: the layer's static kind (window, RoPE; None: layer 0's)."""
        attended = self.attention(self.attention_input(x), positions, segment_ids, kind)
        return self.mlp_half(self.add(x, attended, "attention_post_norm"))


class Transformer(nnx.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab] (float32).

    The `layers` blocks are stacked on a leading `layers` dim (built with `nnx.vmap`) and run with `nnx.scan`,
    so compile time stays flat in depth and the pipeline can split the stack into stages. A mixture-of-experts
    model keeps its dense blocks in `blocks` and its MoE blocks in `moe_blocks` (two stacks: their parameters
    differ); `forward` also returns the MoE layers' aux losses and loads. With `mtp_depth` > 0, `mtp` holds the
    multi-token-prediction modules (`spmdkit.models.mtp`), which only `mtp_loss` runs: `forward` and generation
    never read them.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        # The parameters carry logical names (`out_sharding=("vocab", "embed")`) that spmdkit maps to mesh axes itself
        # (`spmdkit.sharding.partition`); Flax's eager sharding would read them as mesh axes and, without a mesh,
        # refuse. Off here: `Transformer(config, rngs=...)` is a plain model on one device; `init_sharded` shards.
        with nnx.use_eager_sharding(False):
            self._build(config, rngs)

    def _build(self, config: TransformerConfig, rngs: nnx.Rngs) -> None:
        c = config
        self.config = config
        table = jax.random.normal(rngs.params(), (c.vocab_size, c.embed), c.param_dtype)
        if c.tie_embeddings:  # the table is the head too: logits of unit-RMS inputs start near unit scale
            table = table / jnp.sqrt(c.embed).astype(c.param_dtype)
        self.embedding = nnx.Param(table, out_sharding=("vocab", "embed"))

        if c.layers > c.moe_layers:
            self.blocks = _stacked_blocks(config, c.layers - c.moe_layers, False, rngs)
        if c.moe_layers:
            self.moe_blocks = _stacked_blocks(config, c.moe_layers, True, rngs)
        self.final_norm = RMSNorm(config)
        if not c.tie_embeddings:  # tied: one parameter, `embedding`, is both the lookup table and the head
            self.lm_head = normal_param(rngs, (c.embed, c.vocab_size), ("embed", "vocab"), c.embed, c.param_dtype)
        if c.mtp_depth:  # after the main model's: its initial values are those of the same seed without MTP
            blocks = _stacked_blocks(config, c.mtp_depth, block_kind(c).moe, rngs)
            self.mtp = MultiTokenPrediction(config, blocks, rngs=rngs)

    def lm_head_weight(self) -> jax.Array:
        """The LM head [embed, vocab] in the parameter dtype (embed over fsdp under ZeRO-3, vocab over tensor):
        `lm_head`, or the embedding table [vocab, embed] transposed when the embeddings are tied."""
        if self.config.tie_embeddings:
            return self.embedding[...].T
        return self.lm_head[...]

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [batch, seq] -> residual stream [batch, seq, embed] in the compute dtype."""
        return embed_tokens(self.embedding[...], tokens, self.config.dtype, self.config.embed_scale)

    def run_layers(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Every block in order: (x, aux of the MoE layers, each stacked on a leading [moe_layers] dim).

        The layers run as `spmdkit.models.layer_plan.layer_runs` cuts them: one scan per run of consecutive layers
        of one kind (dense: one scan; MoE every k-th block or local/global patterns: a scan per run). One scan over
        the repeats of a pattern, its kinds unrolled in the body, was measured and dropped: for gemma3-12b on 8 x
        H100 it compiled no faster (51 s against 49 s) and held 4.6 GB more per device (the body's six layers
        gather their weights together).
        """
        c, auxes = self.config, []
        sizes = stack_sizes(c)
        for run in layer_runs(c):
            stack = getattr(self, run.stack)
            if (run.start, run.stop) != (0, sizes[run.stack]):
                stack = _layer_slice(stack, run.start, run.stop)
            x, aux = scan_blocks(stack, x, positions, c.remat_policy, segment_ids, run.kind)
            if run.kind.moe:
                auxes.append(aux)
        return x, (jax.tree.map(lambda *a: jnp.concatenate(a), *auxes) if auxes else {})

    def hidden(
        self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, dict]:
        """(the last block's output [batch, seq, embed], aux of the MoE layers) for tokens [batch, seq];
        segment_ids int32 [batch, seq]: documents packed in a row (0: padding), None: one document per row."""
        if positions is None:
            positions = default_positions(tokens.shape)
        return self.run_layers(self.embed(tokens), positions, segment_ids)

    def forward(
        self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, dict]:
        """(logits [batch, seq, vocab], aux of the MoE layers) for tokens [batch, seq] (see `hidden`)."""
        x, aux = self.hidden(tokens, positions, segment_ids)
        return self.head(x), aux

    def head(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: [batch, seq, embed] -> float32 logits [batch, seq, vocab]."""
        return head_logits(x, self.final_norm.scale[...], self.lm_head_weight(), self.config)

    def loss(
        self,
        x: jax.Array,
        targets: jax.Array,
        mask: jax.Array | None = None,
        denominator: jax.Array | float | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """(cross-entropy, z-loss) of the last block's output x [batch, seq, embed] against targets [batch, seq],
        means over the tokens `mask` weights (or sums over `denominator`); chunked over the sequence
        (`spmdkit.models.loss.lm_loss`)."""
        head = self.lm_head_weight()
        return lm_loss(x, self.final_norm.scale[...], head, targets, self.config, mask, denominator)

    def mtp_loss(
        self,
        x: jax.Array,
        tokens: jax.Array,
        targets: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None = None,
        mask: jax.Array | None = None,
        denominator: jax.Array | float | None = None,
    ) -> tuple[jax.Array, dict]:
        """(the mean over the `mtp_depth` modules of their cross-entropies, aux of their MoE blocks stacked on a
        leading [mtp_depth] dim) for the last block's output x [batch, seq, embed] of tokens [batch, seq] with
        targets, mask and segment_ids as `loss` and `hidden` take them; each depth's sum is divided by the main
        loss's count of scored tokens (or `denominator`): `spmdkit.models.mtp`."""
        c, h, losses, auxes = self.config, x, [], []
        scored = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
        count = jnp.maximum(scored.sum(), 1.0) if denominator is None else denominator
        head = self.lm_head_weight()
        for k in range(c.mtp_depth):
            ahead_tokens, ahead_targets, weights = shifted_targets(tokens, targets, mask, segment_ids, k + 1)
            h = self.mtp.block_input(k, self.embed(ahead_tokens), h)
            h, aux = scan_blocks(
                _layer_slice(self.mtp.blocks, k, k + 1), h, positions, c.remat_policy, segment_ids, block_kind(c)
            )
            scale = self.mtp.head_norm_scale(k)
            losses.append(lm_loss(h, scale, head, ahead_targets, c, weights, count)[0])
            auxes.append(aux)
        aux = jax.tree.map(lambda *a: jnp.concatenate(a), *auxes) if auxes[0] else {}
        return jnp.mean(jnp.stack(losses)), aux

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        return self.forward(tokens, positions, segment_ids)[0]


# The three stages of the forward pass as functions of arrays, so that the pipeline can run them apart.


def default_positions(shape: tuple[int, int]) -> jax.Array:
    """[batch, seq] positions 0..seq-1."""
    return jnp.broadcast_to(jnp.arange(shape[1]), shape)


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


def apply_blocks(
    blocks: Block, x: jax.Array, positions: jax.Array, remat: RematPolicy, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Run a stack of blocks (parameters with a leading layer dim, every layer alike) over x [batch, seq, embed]
    with a scan, under the remat policy `remat` (`TransformerConfig.remat_policy`)."""
    return scan_blocks(blocks, x, positions, remat, segment_ids)[0]


def scan_blocks(
    blocks: Block,
    x: jax.Array,
    positions: jax.Array,
    remat: RematPolicy,
    segment_ids: jax.Array | None = None,
    kind: LayerKind | None = None,
) -> tuple[jax.Array, dict]:
    """`apply_blocks` over blocks all of `kind` (None: layer 0's), also returning each block's aux stacked on a
    leading layer dim."""

    def body(x: jax.Array, block: Block, positions: jax.Array, segment_ids: jax.Array | None):
        return block(x, positions, segment_ids, kind)

    # `none` too (it recomputes elementwise ops only), and without the CSE barrier: the scan already keeps XLA from
    # merging the backward's recompute with the forward, and the barrier kept XLA from pipelining FSDP's gathers
    # past it (the other policies keep it: without it XLA:GPU offloads other bytes than the planner counts).
    body = nnx.remat(body, policy=checkpoint_policy(remat), prevent_cse=remat.recomputes)
    scan = nnx.scan(
        body,
        in_axes=(nnx.Carry, 0, None, None),
        out_axes=(nnx.Carry, 0),
        transform_metadata={nnx.PARTITION_NAME: "layers"},
    )
    with naming(remat):  # the activations carry their names under a named policy only
        return scan(x, blocks, positions, segment_ids)


def head_logits(x: jax.Array, norm_scale: jax.Array, lm_head: jax.Array, config: TransformerConfig) -> jax.Array:
    """Final RMSNorm and LM head: x [batch, seq, embed] -> float32 logits [batch, seq, vocab] (all of them: the
    loss runs chunked, `Transformer.loss`)."""
    return loss_head_logits(x, norm_scale, lm_head, HeadSpec.of(config))


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """The reference next-token cross-entropy in float32 on full logits [batch, seq, vocab], targets [batch, seq]:
    the mean over the tokens `mask` (0/1 [batch, seq]) weights, or over all tokens."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        return losses.mean()
    mask = mask.astype(jnp.float32)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)
