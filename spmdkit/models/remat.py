"""Remat policies: what each scanned block keeps for the backward pass, recomputes, or offloads to host memory.

`--model.remat` takes one of the presets or a custom policy over the activations the model names with
`jax.ad_checkpoint.checkpoint_name` (`ACTIVATION_NAMES`, per token and layer; H, K query/kv heads of width d,
E embed, F mlp width):

  q_proj, k_proj, v_proj  the q/k/v projections after their biases, before q/k norms and RoPE: [b, s, H|K, d]
  context                 attention's output before the output projection: [b, s, H, d]
  out_proj                the output projection after its bias: [b, s, E]
  mlp_gate, mlp_up        the MLP's gate and up projections after their biases: [b, s, F]
  mlp_hidden              act(gate) * up: [b, s, F]
  mlp_down                the MLP's down projection after its bias: [b, s, E] (the backward reads it only with
                          post_norm)

The names are also set in the shared expert of a mixture-of-experts layer (it is an `MLP`); the routed experts are
not named. Presets (`PRESETS`; MaxText's in spirit): `none` (recompute no GEMM, attention or collective: only the
elementwise ops between them, `remat_policy.ELEMENTWISE`, but float32's narrowing casts), `full` (keep the block
input only), JAX's `dots_saveable` and `dots_with_no_batch_dims_saveable`, and the named ones: `minimal` (every
projection: q/k/v, out, gate, up, down), `save_dot_except_mlp` (q/k/v and out), `save_qkv_proj`, `save_out_proj`,
`offload_qkv_proj` and `offload_minimal` (those names offloaded to pinned host memory instead of kept on the
device). Custom: `save:NAMES`, `offload:NAMES` or both joined by `+`, NAMES comma-separated, e.g.
`save:q_proj,k_proj+offload:mlp_up`. Whatever a policy neither saves nor offloads is recomputed. Saving `context`
does not spare the attention forward's recompute: the kernel's softmax statistics are not named. Offloading moves
the names to the `pinned_host` memory space on GPU and TPU; XLA:CPU lowers the move as a no-op (JAX's
`device_put` to host has no CPU lowering), so there an offload policy keeps its names on the device and computes
the same numbers.

This module is pure Python (the planner reads it); `spmdkit.models.remat_policy` builds the `jax.checkpoint`
policy and names the activations.
"""

from __future__ import annotations

import dataclasses
import functools

from spmdkit.errors import SpmdkitError

ACTIVATION_NAMES = (
    "q_proj", "k_proj", "v_proj", "context", "out_proj", "mlp_gate", "mlp_up", "mlp_hidden", "mlp_down",
)  # fmt: skip
QKV = ("q_proj", "k_proj", "v_proj")
PROJECTIONS = (*QKV, "out_proj", "mlp_gate", "mlp_up", "mlp_down")
JAX_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
NAMED_PRESETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # preset -> (saved, offloaded)
    "minimal": (PROJECTIONS, ()),
    "save_dot_except_mlp": ((*QKV, "out_proj"), ()),
    "save_qkv_proj": (QKV, ()),
    "save_out_proj": (("out_proj",), ()),
    "offload_qkv_proj": ((), QKV),
    "offload_minimal": ((), PROJECTIONS),
}
PRESETS = (*JAX_POLICIES, *NAMED_PRESETS)
SYNTAX = "save:NAMES, offload:NAMES or save:NAMES+offload:NAMES (NAMES comma-separated)"
HELP = f"what the backward pass recomputes: {', '.join(PRESETS)}, or {SYNTAX}; names: {', '.join(ACTIVATION_NAMES)}"


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """A parsed `--model.remat`: `kind` is a JAX policy of `JAX_POLICIES` or "names" (save `saved`, offload
    `offloaded` to pinned host memory, recompute the rest)."""

    kind: str
    saved: frozenset[str] = frozenset()
    offloaded: frozenset[str] = frozenset()

    @property
    def kept(self) -> frozenset[str]:
        """The names the backward does not recompute (saved on the device or offloaded)."""
        return self.saved | self.offloaded

    @property
    def recomputes(self) -> bool:
        """Whether the backward recomputes any GEMM or attention (every policy but `none`, which recomputes only
        elementwise ops)."""
        return self.kind != "none"

    @property
    def full(self) -> bool:
        """Whether the backward keeps only each block's input (`full`)."""
        return self.kind == "full"

    @property
    def named(self) -> bool:
        """Whether the policy saves or offloads named activations (the named presets and the custom syntax)."""
        return self.kind == "names"


@functools.cache
def parse_remat(text: str) -> RematPolicy:
    """The policy `text` names (a preset or the custom syntax); a SpmdkitError of one line naming the bad value
    and the valid ones."""
    if text in JAX_POLICIES:
        return RematPolicy(text)
    if text in NAMED_PRESETS:
        saved, offloaded = NAMED_PRESETS[text]
        return RematPolicy("names", frozenset(saved), frozenset(offloaded))
    lists: dict[str, frozenset[str]] = {}
    for part in text.split("+"):
        verb, colon, names = part.partition(":")
        if verb not in ("save", "offload") or not colon or verb in lists:
            raise SpmdkitError(f"unknown remat policy {text!r}: choose one of {', '.join(PRESETS)}, or {SYNTAX}")
        given = [n.strip() for n in names.split(",") if n.strip()]
        bad = [n for n in given if n not in ACTIVATION_NAMES] or ([] if given else ["(none)"])
        if bad:
            raise SpmdkitError(
                f"unknown activation name {bad[0]!r} in remat policy {text!r}: the names are "
                f"{', '.join(ACTIVATION_NAMES)}"
            )
        lists[verb] = frozenset(given)
    saved, offloaded = lists.get("save", frozenset()), lists.get("offload", frozenset())
    if saved & offloaded:
        raise SpmdkitError(f"remat policy {text!r} both saves and offloads {', '.join(sorted(saved & offloaded))}")
    return RematPolicy("names", saved, offloaded)
