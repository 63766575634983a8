"""The LM head and the next-token loss over sequence chunks: the float32 logits [batch, seq, vocab] never exist.

`lm_loss(x, norm_scale, head, targets, config, mask)` cuts the sequence into `loss_chunks(seq, config.loss_chunk)`
strided chunks (chunk i holds positions i, i + n, ...: a sequence sharded over `context` stays sharded the same way
in every chunk) and, chunk by chunk, runs the final RMSNorm, the LM head [embed, vocab] and the float32
log-softmax. A `jax.custom_vjp` keeps only the per-token log-sum-exp [batch, seq] for the backward pass, which
recomputes each chunk's logits and sends d logits = g (softmax - one_hot) (+ the z-loss term) back through the
head. Memory: one chunk's logits [batch, seq / n, vocab] float32 (and their gradient), not the sequence's. A
sequence in one chunk keeps its logits instead of recomputing them (the same peak memory, one matmul fewer).

Loss: the mean over the tokens `mask` weights (0/1, [batch, seq]; None: all) of -log p(target); z-loss: the mean
of log(Z)^2 over the same tokens (Z the softmax normaliser), weighted by `config.z_loss` in the objective.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from spmdkit.models.config import TransformerConfig, loss_chunks
from spmdkit.models.layers import HIDDEN, rms_norm
from spmdkit.sharding.logical import active_rules, constrain, live_axes

F32 = jnp.float32
LOGITS = ("batch", "seq", "vocab")


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """The static part of the head (a custom_vjp non-differentiable argument): the final norm's epsilon and
    form, the compute dtype, and what happens to the logits (divided by `divisor`, then soft-capped)."""

    norm_eps: float
    dtype: str
    norm_plus_one: bool = False
    divisor: float = 1.0
    softcap: float = 0.0

    @classmethod
    def of(cls, config: TransformerConfig) -> HeadSpec:
        c = config
        return cls(c.norm_eps, c.dtype, c.norm_plus_one, c.logit_divisor, c.logit_softcap)


def head_logits(x: jax.Array, norm_scale: jax.Array, head: jax.Array, spec: HeadSpec) -> jax.Array:
    """Final RMSNorm and LM head: x [batch, seq, embed] -> float32 logits [batch, seq, vocab] (vocab split over
    `tensor` under TP): z = norm(x) head / divisor, then c tanh(z / c) when soft-capped (Granite, Gemma 2)."""
    x = rms_norm(x, norm_scale, spec.norm_eps, plus_one=spec.norm_plus_one)
    logits = jnp.einsum("bse,ev->bsv", x, head.astype(spec.dtype)).astype(F32)
    if spec.divisor != 1.0:
        logits = logits / spec.divisor
    if spec.softcap:
        logits = spec.softcap * jnp.tanh(logits / spec.softcap)
    return constrain(logits, LOGITS)


def _strided(x: jax.Array, n: int) -> jax.Array:
    """[batch, seq, ...] -> [n, batch, seq / n, ...]: chunk i holds positions i, i + n, ..."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // n, n, *x.shape[2:]), 2, 0)


def _take(x: jax.Array, i) -> jax.Array:
    return lax.dynamic_index_in_dim(x, i, keepdims=False)


def _logit_sums(logits, targets, w):
    """(sum of w (lse - logit of the target), sum of w lse^2, lse [batch, c]) of one chunk's logits."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(w * (lse - target)), jnp.sum(w * lse * lse), lse


def _chunk_stats(spec: HeadSpec, xs, scale, head, ts, ws, i):
    return _logit_sums(head_logits(_take(xs, i), scale, head, spec), _take(ts, i), _take(ws, i))


def _forward(spec: HeadSpec, xs, scale, head, ts, ws):
    """Loop over the chunks; the first runs outside the loop, so the carry takes its types (inside a shard_map the
    sums vary over the axes the activations vary over)."""
    ce, z, lse0 = _chunk_stats(spec, xs, scale, head, ts, ws, 0)
    lses = lax.dynamic_update_index_in_dim(jnp.zeros_like(ts, dtype=F32), lse0, 0, axis=0)

    def body(i, carry):
        ce, z, lses = carry
        ce_i, z_i, lse_i = _chunk_stats(spec, xs, scale, head, ts, ws, i)
        return ce + ce_i, z + z_i, lax.dynamic_update_index_in_dim(lses, lse_i, i, axis=0)

    return lax.fori_loop(1, xs.shape[0], body, (ce, z, lses))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss_sums(spec: HeadSpec, xs, scale, head, ts, ws):
    return _forward(spec, xs, scale, head, ts, ws)[:2]


def _fwd(spec: HeadSpec, xs, scale, head, ts, ws):
    if xs.shape[0] == 1:  # one chunk: keep its logits (see `_one_chunk_fwd`)
        return _one_chunk_fwd(spec, xs, scale, head, ts, ws)
    ce, z, lses = _forward(spec, xs, scale, head, ts, ws)
    return (ce, z), (xs, scale, head, ts, ws, lses)


def _one_chunk_fwd(spec: HeadSpec, xs, scale, head, ts, ws):
    """The loss of a sequence in one chunk, keeping the logits and the head's vjp for the backward pass. The loss's
    backward runs first in the backward pass, while every activation is still held: recomputed there, the logits
    would be live at the same moment, so keeping them costs no peak memory and saves the head's matmul
    (2 x tokens x embed x vocab FLOPs, 13% of a step of the 20M-parameter peer model)."""
    logits, vjp = jax.vjp(functools.partial(head_logits, spec=spec), _take(xs, 0), scale, head)
    ce, z, lse = _logit_sums(logits, _take(ts, 0), _take(ws, 0))
    return (ce, z), (vjp, logits, lse[None], ts, ws)


def _d_logits(logits, lse, targets, weights, g_ce, g_z):
    """d loss / d logits of one chunk: w (g_ce (softmax - one_hot) + g_z 2 lse softmax), float32 [b, c, vocab]."""
    lse, w = lse[..., None], weights[..., None]
    probs = jnp.exp(logits - lse)
    vocab = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    d_ce = jnp.where(vocab == targets[..., None], probs - 1.0, probs)  # softmax - one_hot
    return constrain(w * (g_ce * d_ce + g_z * 2.0 * lse * probs), LOGITS)


def _bwd(spec: HeadSpec, residuals, cotangents):
    g_ce, g_z = cotangents
    if callable(residuals[0]):  # one chunk: the logits and the head's vjp were kept
        vjp, logits, lses, ts, ws = residuals
        dx, d_scale, d_head = vjp(_d_logits(logits, _take(lses, 0), _take(ts, 0), _take(ws, 0), g_ce, g_z))
        return dx[None], d_scale, d_head, None, None
    xs, scale, head, ts, ws, lses = residuals
    logits_of = functools.partial(head_logits, spec=spec)

    def chunk_grads(i):
        logits, vjp = jax.vjp(logits_of, _take(xs, i), scale, head)
        return vjp(_d_logits(logits, _take(lses, i), _take(ts, i), _take(ws, i), g_ce, g_z))

    dx0, d_scale, d_head = chunk_grads(0)
    dxs = lax.dynamic_update_index_in_dim(jnp.zeros_like(xs), dx0, 0, axis=0)

    def body(i, carry):
        dxs, d_scale, d_head = carry
        dx, ds, dh = chunk_grads(i)
        return lax.dynamic_update_index_in_dim(dxs, dx, i, axis=0), d_scale + ds, d_head + dh

    dxs, d_scale, d_head = lax.fori_loop(1, xs.shape[0], body, (dxs, d_scale, d_head))
    return dxs, d_scale, d_head, None, None


_loss_sums.defvjp(_fwd, _bwd)


def lm_loss(
    x: jax.Array,
    norm_scale: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    config: TransformerConfig,
    mask: jax.Array | None = None,
    denominator: jax.Array | float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(cross-entropy, z-loss): float32 means over the tokens `mask` weights, of the final norm + LM head on x.

    x: [batch, seq, embed] (the last block's output); norm_scale: [embed]; head: [embed, vocab]; targets: int
    [batch, seq]; mask: 0/1 weights [batch, seq] or None (every token). The z-loss is mean(log(Z)^2), for the
    objective to weight by `config.z_loss`. Differentiable in x, norm_scale and head. `denominator` replaces the
    count of weighted tokens: a piece of a batch (a microbatch, one replica's rows) divides its sums by the
    batch's count over the number of pieces, so the mean over pieces is the batch's token mean.
    """
    spec = HeadSpec.of(config)
    weights = jnp.ones(targets.shape, F32) if mask is None else mask.astype(F32)
    x = constrain(x, HIDDEN)
    batch, seq = live_axes("batch"), live_axes("seq")
    n = loss_chunks(x.shape[1], config.loss_chunk, math.prod(active_rules()[1].shape[a] for a in seq))

    def sums(x, scale, head, targets, weights):
        return _loss_sums(spec, _strided(x, n), scale, head, _strided(targets, n), _strided(weights, n))

    if n > 1 and batch + seq:
        sums = _per_device(sums, batch, seq)
    ce, z = sums(x, norm_scale, head, targets, weights)
    count = jnp.maximum(weights.sum(), 1.0) if denominator is None else denominator
    return ce / count, z / count


def _per_device(sums, batch: tuple[str, ...], seq: tuple[str, ...]):
    """`sums` in a shard_map manual over the axes that split the tokens: each device accumulates its own
    gradient of the head and norm over the chunks, reduced once by the transpose of the pcast below (under
    automatic sharding XLA would reduce the head's gradient after every chunk)."""
    mesh, axes = active_rules()[1], (*batch, *seq)
    tokens = PartitionSpec(batch or None, seq or None)

    def local(x, scale, head, targets, weights):
        scale, head = jax.lax.pcast((scale, head), axes, to="varying")
        return jax.tree.map(lambda a: jax.lax.psum(a, axes), sums(x, scale, head, targets, weights))

    specs = (PartitionSpec(batch or None, seq or None, None), PartitionSpec(), PartitionSpec(), tokens, tokens)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=PartitionSpec(), axis_names=set(axes))
