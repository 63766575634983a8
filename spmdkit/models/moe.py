"""Mixture-of-experts feed-forward: a softmax top-k router, E SwiGLU experts, optional shared expert, aux losses.

The module is plain: the experts' leading dim is the logical axis `experts` (the rules put it on the `expert`
mesh axis) and the routed computation is `spmdkit.parallel.experts.expert_ffn`, which picks the dispatch.

Router (float32): p = softmax(x W_r) over E experts; each token takes its top_k experts, weighted by their
probabilities, renormalised to sum to 1 when `router_renormalize` (Mixtral; Qwen-MoE's `norm_topk_prob`) and
top_k > 1 (for top_k = 1 the raw probability, as in Switch: renormalised it would be 1 and the router would get no
gradient from the loss). Experts are `routed_mlp` wide; the shared expert (Qwen2-MoE) is `shared_expert_mlp`
wide and, with `shared_expert_gate`, scaled per token by sigmoid(x w_g), w_g [embed, 1]. GPT-OSS adds a router
bias (`router_bias`), expert biases (`expert_bias`) and its clamped SwiGLU (`swiglu_limit`, `Glu`); its softmax
over the top-k logits is the renormalised top-k of the softmax over all. DeepSeek-V3 scores by sigmoid, chooses
by the scores plus a correction bias within the best groups of experts, and scales the weights (`route`).

The correction bias is a `RoutingBias`: a parameter (saved, imported and exported as one) that no gradient
trains, since it only chooses. Imported from DeepSeek-V3 it stays fixed; with `balance_rate` > 0 the train step moves
it after each update toward balanced loads (`spmdkit.train.step.balance`: auxiliary-loss-free balancing).

Aux losses, over all tokens of the batch (computed outside the shard_map, so they are global on any mesh):
- load balance (Switch): E x sum_i f_i P_i, f_i = share of the token->expert assignments that chose expert i,
  P_i = mean router probability of expert i. 1 when perfectly balanced; its gradient (through P) pushes
  probability away from overloaded experts.
- router z-loss (ST-MoE): mean over tokens of logsumexp(router logits)^2, keeping the logits small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit.models.config import TransformerConfig
from spmdkit.models.layers import HIDDEN, MLP, RESIDUAL, normal_param, zeros_param
from spmdkit.parallel.experts import ExpertWeights, Glu, expert_ffn
from spmdkit.sharding.logical import constrain

ROUTED = ("batch", "seq", None)


class RoutingBias(nnx.Param):
    """The router's correction bias [experts] (per layer: [layers, experts] in the stack). A parameter to checkpoints,
    `--init-from` and exports, but not to the optimizer (`spmdkit.models.lora.trained_variables` leaves it out: no
    gradient, moments or decay): it chooses experts only, so its gradient is zero; the balancing rule moves it."""


def route(
    logits: jax.Array, top_k: int, renormalize: bool = True, *, sigmoid: bool = False,
    correction: jax.Array | None = None, groups: int = 1, top_groups: int = 1, scaling: float = 1.0,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Top-k experts per token and their weights: logits [B, S, E] float32 -> (index, weight) [B, S, k].

    Scores are softmax(logits) or, with `sigmoid`, sigmoid of each (DeepSeek-V3). The experts are chosen by the
    scores plus `correction` [E] (DeepSeek's e_score_correction_bias: it moves the choice, never the weights),
    within the `top_groups` of `groups` equal groups of experts whose two best corrected scores sum highest; the
    weights are the uncorrected scores, renormalised (sigmoid: over the top k, + 1e-20 as transformers does), times
    `scaling`.
    """
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores if correction is None else scores + correction.astype(jnp.float32)
    if groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], groups, -1)  # [B, S, groups, E / groups]
        best = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [B, S, groups]
        kept = jax.nn.one_hot(jax.lax.top_k(best, top_groups)[1], groups, dtype=jnp.bool_).any(-2)
        choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
    index = jax.lax.top_k(choice, top_k)[1]
    weight = jnp.take_along_axis(scores, index, axis=-1)
    if renormalize and sigmoid:
        weight = weight / (jnp.sum(weight, axis=-1, keepdims=True) + 1e-20)
    elif top_k > 1 and renormalize:
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    return index, weight * scaling if scaling != 1.0 else weight


def aux_losses(logits: jax.Array, index: jax.Array) -> dict[str, jax.Array]:
    """load_balance_loss, router_z_loss and expert_load [E] (share of assignments per expert) of one layer."""
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    load = jnp.mean(jnp.sum(jax.nn.one_hot(index, e, dtype=jnp.float32), axis=-2), axis=(0, 1)) / index.shape[-1]
    z = jax.nn.logsumexp(logits, axis=-1)
    return {
        "load_balance_loss": e * jnp.sum(load * jnp.mean(probs, axis=(0, 1))),
        "router_z_loss": jnp.mean(z * z),
        "expert_load": load,
    }


class MoE(nnx.Module):
    """Routed SwiGLU experts. router [embed, experts] (with `router_correction_bias`, router_correction_bias
    [experts]: `route`); gate/up [experts, embed, routed_mlp]; down [experts,
    routed_mlp, embed]; with `router_bias`, router_bias [experts]; with `expert_bias`, gate_bias, up_bias
    [experts, routed_mlp] and down_bias [experts, embed]; with `shared_expert`, `shared` (an MLP of width
    shared_expert_mlp) and, with `shared_expert_gate`, its gate [embed, 1]."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c, pd, f = config, config.param_dtype, config.routed_mlp
        self.router = normal_param(rngs, (c.embed, c.experts), ("embed", None), c.embed, pd)
        shape_in, shape_out = (c.experts, c.embed, f), (c.experts, f, c.embed)
        names_in, names_out = ("experts", "embed", "mlp"), ("experts", "mlp", "embed")
        self.gate = normal_param(rngs, shape_in, names_in, c.embed, pd)
        self.up = normal_param(rngs, shape_in, names_in, c.embed, pd)
        self.down = normal_param(rngs, shape_out, names_out, f, pd)
        if c.router_bias:
            self.router_bias = zeros_param((c.experts,), (None,), pd)
        if c.router_correction_bias:  # chooses experts only: no gradient reaches it (`RoutingBias`)
            self.router_correction_bias = RoutingBias(jnp.zeros((c.experts,), pd), out_sharding=(None,))
        if c.expert_bias:
            self.gate_bias = zeros_param((c.experts, f), ("experts", "mlp"), pd)
            self.up_bias = zeros_param((c.experts, f), ("experts", "mlp"), pd)
            self.down_bias = zeros_param((c.experts, c.embed), ("experts", "embed"), pd)
        if c.shared_expert:  # a dense MLP run on every token
            self.shared = MLP(config, rngs=rngs, width=c.shared_expert_mlp or c.mlp)
        if c.shared_expert_gate:
            self.shared_gate = normal_param(rngs, (c.embed, 1), ("embed", None), c.embed, pd)
        self.config = config

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [batch, seq, embed] -> (y [batch, seq, embed], this layer's aux: losses, expert_load, dropped)."""
        c = self.config
        x = constrain(x, HIDDEN)
        logits = jnp.einsum("bse,ex->bsx", x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        if c.router_bias:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        correction = self.router_correction_bias[...] if c.router_correction_bias else None
        index, weight = route(
            logits, c.top_k, c.router_renormalize, sigmoid=c.router_score == "sigmoid", correction=correction,
            groups=c.router_groups, top_groups=c.router_top_groups, scaling=c.routed_scaling,
        )  # fmt: skip
        index, weight = constrain(index, ROUTED), constrain(weight, ROUTED)
        biases = (self.gate_bias[...], self.up_bias[...], self.down_bias[...]) if c.expert_bias else ()
        experts = ExpertWeights(self.gate[...], self.up[...], self.down[...], *biases)
        glu = Glu(c.swiglu_limit, c.swiglu_alpha)
        y, dropped = expert_ffn(x, index, weight, experts, dispatch_kind=c.dispatch, factor=c.capacity_factor, glu=glu)
        if c.shared_expert:
            shared = self.shared(x)
            if c.shared_expert_gate:  # sigmoid(x w_g) per token, in the compute dtype as transformers runs it
                gate = jnp.einsum("bse,eo->bso", x, self.shared_gate[...].astype(x.dtype))
                shared = shared * jax.nn.sigmoid(gate)
            y = y + shared
        return constrain(y, RESIDUAL), {**aux_losses(logits, index), "dropped": dropped}
