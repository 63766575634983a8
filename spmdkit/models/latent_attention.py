"""Multi-head latent attention (DeepSeek-V2/V3 MLA): `Attention` whose queries, keys and values come through low-rank
projections, keys carrying a RoPE part shared by every head.

With H heads, head_dim D = nope + rope (`qk_nope_head_dim` + `qk_rope_head_dim`) and value width V (`v_head_dim`):

    q      = q_b(norm(q_a x))  (q_lora_rank > 0)  or  q x           -> [batch, seq, H, D]  = [q_nope | q_rope]
    latent, k_rope = split(kv_a x)                                   -> [.., kv_lora_rank], [.., rope] (one, shared)
    k_nope, v = split(kv_b(norm(latent)))                            -> [.., H, nope], [.., H, V]
    k      = [k_nope | rope(k_rope) repeated over the heads],  q = [q_nope | rope(q_rope)]

RoPE rotates only the trailing `rope` dims, with the model's frequencies (YaRN's included, `rope_frequencies`):
with `rope_interleave` (DeepSeek's checkpoints) pairs (x0, x1), (x2, x3), ... rotate together, as transformers'
`apply_rotary_pos_emb_interleave` does; it returns the evens' rotation then the odds', which is rotate-half RoPE on
the dims reordered evens first, so that reorder is all it takes. The softmax scale is head_dim^-1/2 (or
`attention_scale`) times YaRN's mscale^2 (`rope_mscale_all_dim`). Values narrower than D are padded with zeros to D
(exact: the padded dims of the output are zeros, dropped before `o`), so every attention kernel, the ring, Ulysses
and the KV cache take q, k, v of one head dim. The two RMSNorms on the latents use eps 1e-6 whatever the model's
norm_eps, as transformers' `DeepseekV3RMSNorm(rank)` does.

Weights (logical names; `latent` dims are never split, the heads are over `tensor`): q_a [embed, q_lora_rank]
(`latent`), q_a_norm [q_lora_rank], q_b [q_lora_rank, heads, head_dim] (or q [embed, heads, head_dim]), kv_a
[embed, kv_lora_rank + rope], kv_a_norm [kv_lora_rank], kv_b [kv_lora_rank, heads, nope + V], o [heads, V, embed];
with `qkv_bias`, q_a_bias [q_lora_rank] and kv_a_bias [kv_lora_rank + rope] (transformers' `attention_bias`); with
`o_bias`, o_bias [embed].

Generation caches (latent, rope(k_rope)) per token, not k and v (`compressed_kv`; `spmdkit.inference.cache`), and
decodes with kv_b absorbed into the query and the output (`absorbed`; `spmdkit.inference.latent`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit.models.config import TransformerConfig
from spmdkit.models.layer_plan import LayerKind, layer_kind
from spmdkit.models.layers import (
    HIDDEN,
    Attention,
    RMSNorm,
    normal_param,
    rope_frequencies,
    rope_scaling,
    rotary,
    zeros_param,
)
from spmdkit.models.remat_policy import named
from spmdkit.sharding.logical import constrain

_HEADS = ("batch", "seq", "heads", None)
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm(q_lora_rank / kv_lora_rank): its default, not rms_norm_eps


class LatentAttention(Attention):
    """`Attention` with DeepSeek's latent projections (module doc); `out`, `spec` and the kernels are the base's."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):  # noqa: D107 - the class doc
        c, pd = config, config.param_dtype
        H, D, V, kv, ql = c.heads, c.head_dim, c.value_head_dim, c.kv_lora_rank, c.q_lora_rank
        latent_norm = c.replace(norm_eps=LATENT_NORM_EPS, norm_plus_one=False)
        if ql:
            self.q_a = normal_param(rngs, (c.embed, ql), ("embed", "latent"), c.embed, pd)
            self.q_a_norm = RMSNorm(latent_norm, (ql,), ("latent",))
            self.q_b = normal_param(rngs, (ql, H, D), ("latent", "heads", "head_dim"), ql, pd)
        else:
            self.q = normal_param(rngs, (c.embed, H, D), ("embed", "heads", "head_dim"), c.embed, pd)
        self.kv_a = normal_param(rngs, (c.embed, kv + c.qk_rope_head_dim), ("embed", "latent"), c.embed, pd)
        self.kv_a_norm = RMSNorm(latent_norm, (kv,), ("latent",))
        self.kv_b = normal_param(rngs, (kv, H, c.qk_nope_head_dim + V), ("latent", "heads", "head_dim"), kv, pd)
        self.o = normal_param(rngs, (H, V, c.embed), ("heads", "head_dim", "embed"), H * V, pd)
        if c.qkv_bias:
            if ql:
                self.q_a_bias = zeros_param((ql,), ("latent",), pd)
            self.kv_a_bias = zeros_param((kv + c.qk_rope_head_dim,), ("latent",), pd)
        if c.o_bias:
            self.o_bias = zeros_param((c.embed,), ("embed",), pd)
        if c.attention_sinks:
            self.sinks = zeros_param((H,), ("heads",), pd)
        self.config = config

    def _down(self, x: jax.Array, name: str) -> jax.Array:
        """x [batch, seq, embed] -> [batch, seq, rank]: a down projection (q_a or kv_a) and its bias."""
        dt = self.config.dtype
        y = jnp.einsum("bse,er->bsr", x, getattr(self, name)[...].astype(dt))
        if self.config.qkv_bias:
            y = y + getattr(self, f"{name}_bias")[...].astype(dt)
        return constrain(y, ("batch", "seq", None))

    def _rope(self, x: jax.Array, positions: jax.Array, kind: LayerKind) -> jax.Array:
        """The rotary embedding of x [batch, seq, heads, rope] (interleaved pairs reordered evens first)."""
        c = self.config
        if not kind.rope:
            return x
        if c.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return rotary(x, positions, rope_frequencies(c, kind.local_rope), rope_scaling(c, kind.local_rope))

    def queries(self, x: jax.Array, positions: jax.Array, kind: LayerKind) -> jax.Array:
        """x [batch, seq, embed] -> q [batch, seq, heads, head_dim] = [q_nope | rope(q_rope)], heads over `tensor`."""
        c, dt, nope = self.config, self.config.dtype, self.config.qk_nope_head_dim
        if c.q_lora_rank:
            q = jnp.einsum("bsr,rhd->bshd", self.q_a_norm(self._down(x, "q_a")), self.q_b[...].astype(dt))
        else:
            q = jnp.einsum("bse,ehd->bshd", x, self.q[...].astype(dt))
        q = named(constrain(q, _HEADS), "q_proj")
        return jnp.concatenate([q[..., :nope], self._rope(q[..., nope:], positions, kind)], axis=-1)

    def compressed_kv(self, x: jax.Array, positions: jax.Array, kind: LayerKind) -> tuple[jax.Array, jax.Array]:
        """x [batch, seq, embed] -> (latent [batch, seq, kv_lora_rank], normalized: kv_a_norm's output; k_rope
        [batch, seq, qk_rope_head_dim], rotated): all a token's keys and values depend on, whole on every device
        (what the generation cache holds, `spmdkit.inference.cache`)."""
        compressed = self._down(x, "kv_a")
        latent, k_rope = compressed[..., : self.config.kv_lora_rank], compressed[..., self.config.kv_lora_rank :]
        return self.kv_a_norm(latent), self._rope(k_rope[:, :, None], positions, kind)[:, :, 0]

    def expand(self, latent: jax.Array, k_rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(latent [batch, seq, kv_lora_rank], k_rope [batch, seq, rope]) -> k, v [batch, seq, heads, head_dim]:
        k = [latent kv_b_k | k_rope on every head], v = latent kv_b_v zero-padded from v_head_dim."""
        c = self.config
        kv = jnp.einsum("bsr,rhd->bshd", latent, self.kv_b[...].astype(c.dtype))
        kv = named(constrain(kv, _HEADS), "k_proj")  # keys and values: remat names them as k_proj
        k_rope = jnp.broadcast_to(k_rope[:, :, None], (*kv.shape[:3], k_rope.shape[-1]))
        k, v = jnp.concatenate([kv[..., : c.qk_nope_head_dim], k_rope], axis=-1), kv[..., c.qk_nope_head_dim :]
        if v.shape[-1] < c.head_dim:  # one head dim for every kernel: `out` drops the zeros
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, c.head_dim - v.shape[-1])))
        return constrain(k, _HEADS), constrain(v, _HEADS)

    def absorbed(self) -> tuple[jax.Array, jax.Array]:
        """kv_b split into (W_UK [kv_lora_rank, heads, qk_nope_head_dim], W_UV [kv_lora_rank, heads, v_head_dim]),
        heads over `tensor`, in the compute dtype: what decode multiplies queries and outputs by instead of
        expanding the cached latent (`spmdkit.inference.latent`)."""
        w = self.kv_b[...].astype(self.config.dtype)
        return w[..., : self.config.qk_nope_head_dim], w[..., self.config.qk_nope_head_dim :]

    def qkv(
        self, x: jax.Array, positions: jax.Array, kind: LayerKind | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [batch, seq, embed] -> q, k, v [batch, seq, heads, head_dim] (v zero-padded from v_head_dim), heads
        split over `tensor`; RoPE of `positions` [batch, seq] on q's and k's trailing qk_rope_head_dim dims."""
        kind = kind or layer_kind(self.config, 0)
        x = constrain(x, HIDDEN)
        q = self.queries(x, positions, kind)
        k, v = self.expand(*self.compressed_kv(x, positions, kind))
        return constrain(q, _HEADS), k, v
