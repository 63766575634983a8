"""Multi-token prediction (DeepSeek-V3, section 2.2): `mtp_depth` D sequential modules after the main model, module
k (1..D) predicting, at position i, the token t_{i+k+1}; their loss joins the objective, nothing else reads them
(generation and eval run the main model only).

For k = 1..D, at position i, with h^0 the main model's last block output [batch, seq, embed] (before its final
norm) and t the input tokens:

    h'^k_i = M_k [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h^{k-1}_i)]    M_k: `eh_proj` [2, embed, embed], emb half first
    h^k    = TRM_k(h'^k)                                              one block, causal over the sequence
    P^k_i  = softmax(OutHead(RMSNorm_k(h^k_i)))                       the shared LM head after the module's own norm
    L^k    = (1/N) sum over scored i of -log P^k_i[t_{i+k+1}]

`Emb` and `OutHead` are the main model's embedding and LM head (one parameter each, trained by every loss); the
norms, M_k and TRM_k are the module's. N is the main loss's count of scored tokens (DeepSeek's 1/T), so a batch cut
into pieces sums exactly as the main loss does (`spmdkit.train.step.train_step`). Position i is scored for depth k
when i + k < seq, the main loss scores target i + k (its `loss_mask`) and i + k is in i's document (packed rows:
`segment_ids`): a target of the next document is never scored. The objective adds `mtp_weight` x the mean of the
L^k.

Parameters, stacked on a leading [D] `layers` dim: `enorm`, `hnorm`, `head_norm` [D, embed] (`norm`), `eh_proj`
[D, 2, embed, embed] (the input's `embed` as the blocks' weights shard it), and `blocks`, D blocks of the model's
last layer's kind (dense or mixture of experts, its window and RoPE), built and scanned as the main stacks are.
Hugging Face stores module k as `model.layers.{layers + k - 1}` (`spmdkit.interop.tensor_names`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit.models.config import TransformerConfig
from spmdkit.models.layer_plan import LayerKind, layer_kind
from spmdkit.models.layers import RESIDUAL, normal, rms_norm
from spmdkit.sharding.logical import constrain


def block_kind(config: TransformerConfig) -> LayerKind:
    """The kind of every MTP block: the model's last layer's (DeepSeek-V3's MTP block is an MoE block as its last
    layer is)."""
    return layer_kind(config, config.layers - 1)


class MultiTokenPrediction(nnx.Module):
    """The D modules' own parameters (see the module docstring) and `blocks`, their stacked transformer blocks."""

    def __init__(self, config: TransformerConfig, blocks: nnx.Module, *, rngs: nnx.Rngs):
        c, d = config, config.mtp_depth
        ones = jnp.zeros if c.norm_plus_one else jnp.ones
        for name in ("enorm", "hnorm", "head_norm"):
            setattr(self, name, nnx.Param(ones((d, c.embed), c.param_dtype), out_sharding=("layers", "norm")))
        weights = normal(rngs, (d, 2, c.embed, c.embed), 2 * c.embed, c.param_dtype)
        self.eh_proj = nnx.Param(weights, out_sharding=("layers", None, "embed", None))
        self.blocks = blocks
        self.config = config

    def _norm(self, name: str, k: int, x: jax.Array) -> jax.Array:
        c = self.config
        return rms_norm(x, getattr(self, name)[...][k], c.norm_eps, plus_one=c.norm_plus_one)

    def block_input(self, k: int, emb: jax.Array, h: jax.Array) -> jax.Array:
        """h'^{k+1} [batch, seq, embed] (0-based module k) of the embedded tokens t_{i+k+1} `emb` and the previous
        depth's output `h`, both [batch, seq, embed] in the compute dtype."""
        w = self.eh_proj[...][k].astype(self.config.dtype)
        out = jnp.einsum("bse,ef->bsf", self._norm("enorm", k, emb), w[0])
        out = out + jnp.einsum("bse,ef->bsf", self._norm("hnorm", k, h), w[1])
        return constrain(out, RESIDUAL)

    def head_norm_scale(self, k: int) -> jax.Array:
        """Module k's (0-based) norm before the shared LM head [embed]."""
        return self.head_norm[...][k]


def ahead(x: jax.Array, k: int) -> jax.Array:
    """x [batch, seq, ...] moved k positions to the left: out[:, i] = x[:, i + k], zeros past the end."""
    return jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)


def shifted_targets(
    inputs: jax.Array, targets: jax.Array, mask: jax.Array | None, segment_ids: jax.Array | None, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens t_{i+k} [batch, seq], targets t_{i+k+1} [batch, seq], float32 weights [batch, seq]) of depth k >= 1
    (1-based), from the main loss's `inputs`, `targets` (t_{i+1}), `mask` (None: every target scored) and
    `segment_ids` (None: one document per row): position i counts when i + k < seq, target i + k is scored and
    position i + k lies in i's document."""
    scored = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    weights = ahead(scored, k)  # zero past the end
    if segment_ids is not None:
        weights = weights * (ahead(segment_ids, k) == segment_ids).astype(jnp.float32)
    return ahead(inputs, k), ahead(targets, k), weights
