"""Expert parallelism: routed tokens travel to the device that owns their expert and back, in `jax.shard_map`.

Routing groups are sequences: a sequence of S tokens sends at most C tokens to each expert, with
C = min(S, ceil(capacity_factor x S x top_k / E)). The priority rule inside a group: every token's first
choice in sequence order, then every token's second choice, ... ; an assignment that finds its expert full is
dropped (its token keeps only the residual for that choice). Because a group never spans devices, the result
is the same on any mesh, and equals `sequential_drops` (the plain-Python statement of the rule).

Capacity dispatch, per device (B local sequences, X = size of the `expert` axis, E = X x El experts):

    slots    [B, S, k]        position of each assignment in its expert's queue (cumsum in priority order)
    dispatch [B, E, C, D]     tokens scattered into their expert's slots (dropped ones nowhere)
    all_to_all over expert:   [B, X, El, C, D] -> [B, X_source, El, C, D]    (forward all-to-all 1)
    experts  [El, B*X*C, D]   each local expert's SwiGLU on the tokens every device sent it
    all_to_all back           -> [B, E, C, D]                                  (forward all-to-all 2)
    combine  [B, S, D]        y_t = sum_j weight_tj * kept_tj * out[expert_tj, slot_tj]

Backward: autodiff transposes each all-to-all into one all-to-all (four in all per MoE layer). Dropless under
expert parallelism is the same program with C = S (an expert can't get more than S tokens of one sequence),
so nothing drops but the buffers are E/top_k times the routed tokens; without an `expert` axis, dropless
sorts the assignments by expert and runs `jax.lax.ragged_dot` (a grouped matmul, no padding).

The shard_map is manual over the batch axes (`data`, `fsdp`, `expert`: tokens are sharded over all three)
and leaves `tensor` automatic, so expert weights may also be split over `tensor` (their `mlp` dim) and, under
ZeRO-3, over `fsdp` (gathered at the shard_map's edge, like any FSDP weight).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmdkit.errors import SpmdkitError
from spmdkit.parallel.capacity import capacity
from spmdkit.sharding.logical import active_rules


class ExpertWeights(NamedTuple):
    """SwiGLU experts: gate, up [experts, embed, mlp]; down [experts, mlp, embed] (experts over `expert`); biases
    (GPT-OSS; None: none) gate_bias, up_bias [experts, mlp] and down_bias [experts, embed]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Glu:
    """The experts' gated activation of (gate, up): silu(gate) up, or with `limit` L > 0 GPT-OSS's clamped form
    (up + 1) g sigmoid(alpha g), g = min(gate, L), up clipped to [-L, L] (transformers' `GptOssExperts`)."""

    limit: float = 0.0
    alpha: float = 1.0

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if not self.limit:
            return jax.nn.silu(gate) * up
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def _biased(y: jax.Array, b: jax.Array | None) -> jax.Array:
    """y [experts, tokens, width] plus a bias [experts, width] (y itself without one: no add in the program)."""
    return y if b is None else y + b.astype(y.dtype)[:, None, :]


# The JAX operations the experts' GEMMs come from (their `op_name` in a compiled program, `spmdkit compile`'s
# `moe_gemm`): the grouped matmul of `ragged_moe` and the per-expert einsums of `swiglu_experts`.
EXPERT_IN, EXPERT_OUT = "etd,edh->eth", "eth,ehd->etd"
EXPERT_OPS = ("ragged_dot", EXPERT_IN, EXPERT_OUT)


def swiglu_experts(x: jax.Array, w: ExpertWeights, glu: Glu = Glu()) -> jax.Array:
    """Each expert's SwiGLU on its own tokens: x [experts, tokens, embed] -> [experts, tokens, embed]."""
    dt = x.dtype
    gate = _biased(jnp.einsum(EXPERT_IN, x, w.gate.astype(dt)), w.gate_bias)
    up = _biased(jnp.einsum(EXPERT_IN, x, w.up.astype(dt)), w.up_bias)
    return _biased(jnp.einsum(EXPERT_OUT, glu(gate, up), w.down.astype(dt)), w.down_bias)


def slots(expert_index: jax.Array, num_experts: int, slots_per_expert: int) -> tuple[jax.Array, jax.Array]:
    """Queue position of each assignment and whether it fits: expert_index [B, S, k] -> (slot, kept) [B, S, k].

    Priority: choice-major, then sequence order (all first choices before any second choice).
    """
    b, s, k = expert_index.shape
    order = jnp.swapaxes(expert_index, 1, 2).reshape(b, k * s)  # [B, k*S] in priority order
    onehot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32)  # [B, k*S, E]
    position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)  # [B, k*S]
    position = jnp.swapaxes(position.reshape(b, k, s), 1, 2)  # [B, S, k]
    return position, position < slots_per_expert


def dispatch(x: jax.Array, expert_index: jax.Array, slot: jax.Array, kept: jax.Array, c: int, e: int) -> jax.Array:
    """Scatter tokens into expert slots: x [B, S, D] -> [B, E, C, D] (empty slots zero, dropped tokens nowhere)."""
    b, s, k = expert_index.shape
    flat = jnp.where(kept, expert_index * c + slot, e * c)  # e*c is out of range: mode="drop" discards it

    def one(xb: jax.Array, fb: jax.Array) -> jax.Array:
        rows = jnp.repeat(xb, k, axis=0)  # [S*k, D]: token t's j-th assignment at row t*k + j
        return jnp.zeros((e * c, xb.shape[-1]), xb.dtype).at[fb.reshape(-1)].add(rows, mode="drop")

    return jax.vmap(one)(x, flat).reshape(b, e, c, x.shape[-1])


def combine(out: jax.Array, expert_index: jax.Array, slot: jax.Array, kept: jax.Array, weight: jax.Array) -> jax.Array:
    """Gather each token's expert outputs back: out [B, E, C, D] -> y [B, S, D], weighted by the router."""
    b, e, c, d = out.shape
    flat = jnp.where(kept, expert_index * c + slot, 0)  # [B, S, k]
    picked = jax.vmap(lambda ob, fb: ob[fb])(out.reshape(b, e * c, d), flat)  # [B, S, k, D]
    scale = (weight * kept).astype(out.dtype)
    return jnp.einsum("bskd,bsk->bsd", picked, scale)


def capacity_moe(
    x: jax.Array,
    expert_index: jax.Array,
    weight: jax.Array,
    w: ExpertWeights,
    slots_per_expert: int,
    axis_name: str | None = None,
    glu: Glu = Glu(),
) -> tuple[jax.Array, jax.Array]:
    """Capacity-limited MoE of the local sequences: (y [B, S, D], kept assignments: scalar count).

    With `axis_name` (inside shard_map), `w` holds only this device's El = E / X experts and tokens are
    exchanged with two all-to-alls over that axis; without, all E experts are local.
    """
    b, _, d = x.shape
    x_size = jax.lax.axis_size(axis_name) if axis_name else 1
    local = w.gate.shape[0]
    e, c = local * x_size, slots_per_expert
    slot, kept = slots(expert_index, e, c)
    buffer = dispatch(x, expert_index, slot, kept, c, e).reshape(b, x_size, local, c, d)
    if axis_name:
        buffer = jax.lax.all_to_all(buffer, axis_name, split_axis=1, concat_axis=1, tiled=True)
    # [B, X_source, El, C, D] -> [El, B*X*C, D]: each local expert sees every device's slots for it.
    tokens = jnp.transpose(buffer, (2, 0, 1, 3, 4)).reshape(local, b * x_size * c, d)
    out = jnp.transpose(swiglu_experts(tokens, w, glu).reshape(local, b, x_size, c, d), (1, 2, 0, 3, 4))
    if axis_name:
        out = jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=1, tiled=True)
    return combine(out.reshape(b, e, c, d), expert_index, slot, kept, weight), jnp.sum(kept)


def ragged_moe(
    x: jax.Array, expert_index: jax.Array, weight: jax.Array, w: ExpertWeights, glu: Glu = Glu()
) -> jax.Array:
    """Dropless MoE with every expert local: assignments sorted by expert, one grouped matmul per weight.

    x [B, S, D], expert_index / weight [B, S, k] -> y [B, S, D].
    """
    b, s, d = x.shape
    k, e = expert_index.shape[-1], w.gate.shape[0]
    flat_expert = expert_index.reshape(-1)  # [B*S*k], assignment a belongs to token a // k
    order = jnp.argsort(flat_expert, stable=True)
    rows = x.reshape(b * s, d)[order // k]  # [B*S*k, D] grouped by expert
    sizes = jnp.bincount(flat_expert, length=e).astype(jnp.int32)
    dt, owner = x.dtype, flat_expert[order]  # owner: each sorted row's expert (for the biases)

    def biased(y: jax.Array, b: jax.Array | None) -> jax.Array:
        return y if b is None else y + b.astype(dt)[owner]

    gate = biased(jax.lax.ragged_dot(rows, w.gate.astype(dt), sizes), w.gate_bias)
    up = biased(jax.lax.ragged_dot(rows, w.up.astype(dt), sizes), w.up_bias)
    out = biased(jax.lax.ragged_dot(glu(gate, up), w.down.astype(dt), sizes), w.down_bias)
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(b, s, k, d)
    return jnp.einsum("bskd,bsk->bsd", unsorted, weight.astype(dt))


def dense_moe(
    x: jax.Array, expert_index: jax.Array, weight: jax.Array, w: ExpertWeights, glu: Glu = Glu()
) -> jax.Array:
    """The reference: every expert on every token, mixed by the router's top-k weights. x [B, S, D]."""
    b, s, d = x.shape
    everything = swiglu_experts(jnp.broadcast_to(x.reshape(1, b * s, d), (w.gate.shape[0], b * s, d)), w, glu)
    everything = jnp.moveaxis(everything, 0, 1).reshape(b, s, -1, d)  # [B, S, E, D]
    picked = jnp.take_along_axis(everything, expert_index[..., None], axis=2)  # [B, S, k, D]
    return jnp.einsum("bskd,bsk->bsd", picked, weight.astype(x.dtype))


def _batch_axes(mesh: jax.sharding.Mesh, rules_batch: tuple[str, ...]) -> tuple[str, ...]:
    axes = [a for a in rules_batch if mesh.shape.get(a, 1) > 1]
    if mesh.shape.get("expert", 1) > 1 and "expert" not in axes:
        raise SpmdkitError("expert parallelism needs the batch sharded over `expert`: map `batch` onto it")
    return tuple(axes)


def expert_ffn(
    x: jax.Array,
    expert_index: jax.Array,
    weight: jax.Array,
    w: ExpertWeights,
    *,
    dispatch_kind: str,
    factor: float,
    glu: Glu = Glu(),
) -> tuple[jax.Array, jax.Array]:
    """The routed experts of one MoE layer: (y [B, S, D], fraction of assignments dropped).

    x [batch, seq, embed] (batch sharded over data/fsdp/expert), expert_index / weight [batch, seq, k] from
    the router; `glu` the experts' activation. Under active rules on a mesh, runs in a shard_map manual over the
    batch axes with experts split over `expert` (the module docstring); otherwise locally.
    """
    b, s, _ = x.shape
    k, e = expert_index.shape[-1], w.gate.shape[0]
    if dispatch_kind not in ("capacity", "dropless", "dense"):  # "auto" is build_program's to resolve
        raise SpmdkitError(
            f"MoE dispatch {dispatch_kind!r} is not resolved: build the model through build_program (it picks "
            "for the devices), or pass capacity, dropless or dense"
        )
    if dispatch_kind == "dense":
        return dense_moe(x, expert_index, weight, w, glu), jnp.zeros((), jnp.float32)
    active = active_rules()
    mesh = active[1] if active else None
    axes = _batch_axes(mesh, active[0].params["batch"]) if mesh is not None else ()
    if not axes and dispatch_kind == "dropless":
        return ragged_moe(x, expert_index, weight, w, glu), jnp.zeros((), jnp.float32)
    c = s if dispatch_kind == "dropless" else capacity(s, k, e, factor)
    if not axes:
        y, kept = capacity_moe(x, expert_index, weight, w, c, glu=glu)
        return y, 1.0 - kept / (b * s * k)
    ep = "expert" if mesh.shape.get("expert", 1) > 1 else None
    if ep and e % mesh.shape["expert"]:
        raise SpmdkitError(f"experts={e} is not divisible by mesh axis expert={mesh.shape['expert']}")

    replicated = tuple(a for a in axes if a != ep)

    def local(x, expert_index, weight, w):
        # Vary the float32 weights over the token axes here, before any cast, so that their gradients are
        # summed over those axes in float32 (XLA:CPU also aborts on the bf16 all-reduce otherwise).
        w = jax.tree.map(lambda a: jax.lax.pcast(a, replicated, to="varying"), w) if replicated else w
        y, kept = capacity_moe(x, expert_index, weight, w, c, ep, glu)
        return y, jax.lax.psum(kept, axes)

    rows, experts = P(axes), P(ep)
    y, kept = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, ExpertWeights(*(None if a is None else experts for a in w))),
        out_specs=(rows, P()),
        axis_names=set(axes),
    )(x, expert_index, weight, w)
    return y, 1.0 - kept / (b * s * k)


def sequential_drops(expert_index: list[list[list[int]]], num_experts: int, slots_per_expert: int) -> list:
    """The capacity rule in plain Python, for checking: kept[b][t][j] for expert_index[b][t][j].

    Per sequence, visit choice 0 of every token in order, then choice 1, ...; an expert takes an assignment
    while it has fewer than `slots_per_expert`.
    """
    kept = []
    for sequence in expert_index:
        load = [0] * num_experts
        row = [[False] * len(choices) for choices in sequence]
        for j in range(len(sequence[0]) if sequence else 0):
            for t, choices in enumerate(sequence):
                if load[choices[j]] < slots_per_expert:
                    load[choices[j]] += 1
                    row[t][j] = True
        kept.append(row)
    return kept
