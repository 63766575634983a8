"""What each remat policy costs the planner: the bytes a named policy keeps per token and layer (on the device and
offloaded to host memory) and the FLOPs its backward recomputes; the order the search tries the policies in.
Pure arithmetic (no JAX); the policies and names are `spmdkit.models.remat`'s. Notation as in `spmdkit.plan.memory`
(E, H, K, d, F the widths on one device, a the compute dtype's bytes, s = 1/T under sequence parallelism).

Kept per token and layer by a named policy (what JAX's autodiff saves for the scanned block under
`save_only_these_names`; tests/test_remat_policies.py compares it with the residuals of the step's vjp): the block
input aEs (the scan carry, always kept) + per saved name: q_proj aHd, k_proj and v_proj aKd, context aHd, out_proj
aEs, mlp_gate, mlp_up and mlp_hidden aF, mlp_down aEs with post_norm (without, the backward never reads it: 0).
Offloaded names count the same bytes as host memory, not device memory.

Recomputed per token and layer: the attention forward (the kernel's statistics are never named, so its backward
reruns it: 2 S H d causal, as for `dots_with_no_batch_dims_saveable`) and 2 x (weights) FLOPs of each projection
the policy neither saves nor offloads: q 2EHd, k and v 2EKd, out 2HdE, gate and up 2EF (down's output is not
read).
"""

from __future__ import annotations

from spmdkit.models.config import TransformerConfig
from spmdkit.models.remat import RematPolicy
from spmdkit.plan.layout import DTYPE_BYTES

# What `spmdkit plan` searches and `spmdkit compile` tries, least recomputation (most memory) first. Left out:
# `minimal` (the bytes and FLOPs of dots_with_no_batch_dims_saveable) and the offload presets (the search does not
# budget host memory); any of them can still be given with --remat.
REMAT_ORDER = (
    "none", "dots_saveable", "dots_with_no_batch_dims_saveable", "save_dot_except_mlp", "save_qkv_proj",
    "save_out_proj", "full",
)  # fmt: skip


def name_bytes(m: TransformerConfig, T: int, sp: bool) -> dict[str, float]:
    """Bytes per token and layer on one device of each named activation that the backward reads (module doc)."""
    a, E, H, d, F = DTYPE_BYTES[m.dtype], m.embed, m.heads / T, m.head_dim, m.mlp / T
    K = m.kv_heads / T if m.kv_heads % T == 0 else m.kv_heads
    s = 1 / T if sp else 1
    return {
        "q_proj": a * H * d, "k_proj": a * K * d, "v_proj": a * K * d, "context": a * H * d, "out_proj": a * E * s,
        "mlp_gate": a * F, "mlp_up": a * F, "mlp_hidden": a * F, "mlp_down": a * E * s if m.post_norm else 0.0,
    }  # fmt: skip


def named_kept_bytes(m: TransformerConfig, T: int, sp: bool) -> float:
    """Device bytes per token and layer a named policy (`m.remat`) keeps: the block input and its saved names."""
    sizes, policy = name_bytes(m, T, sp), m.remat_policy
    return DTYPE_BYTES[m.dtype] * m.embed * (1 / T if sp else 1) + sum(sizes[n] for n in policy.saved)


def host_kept_bytes(m: TransformerConfig, T: int, sp: bool) -> float:
    """Host bytes per token and layer that `m.remat` offloads (0 unless it offloads names)."""
    policy = m.remat_policy
    return sum(name_bytes(m, T, sp)[n] for n in policy.offloaded) if policy.named else 0.0


def mlp_named_bytes(policy: RematPolicy, a: float, width: float) -> float:
    """Device bytes per token the named policy `policy` keeps of a dense MLP of hidden `width` (an MoE's shared
    expert)."""
    return a * width * len(policy.saved & {"mlp_gate", "mlp_up", "mlp_hidden"})


def named_recompute_flops(m: TransformerConfig, seq_len: int) -> float:
    """FLOPs per token, all layers, that a named policy (`m.remat`) recomputes in the backward (module doc); the
    routed experts of MoE layers (never named) rerun their forward, 6 E F' top_k."""
    policy = m.remat_policy
    if not policy.named:
        return 0.0
    E, Hd, Kd, F = m.embed, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.mlp
    attention = 2 * E * (Hd * ("q_proj" not in policy.kept) + Kd * (2 - len(policy.kept & {"k_proj", "v_proj"})))
    attention += 2 * Hd * E * ("out_proj" not in policy.kept) + 2 * seq_len * Hd  # causal: half of q k^T and p v
    mlp = 2 * E * F * (2 - len(policy.kept & {"mlp_gate", "mlp_up"}))
    routed = 6 * E * m.routed_mlp * m.top_k if m.moe_layers else 0.0
    return m.layers * attention + (m.layers - m.moe_layers) * mlp + m.moe_layers * routed


def forward_sums(policy: RematPolicy) -> int:
    """Tensor-parallel sums (all-reduces, or reduce-scatters under SP) per layer of the forward and of what the
    backward reruns of it: attention's and the MLP's output projections, 2; `full` reruns both, 4; a named policy
    that neither saves nor offloads out_proj reruns attention's (the MLP half's input x + out_proj is rebuilt), 3."""
    if policy.full:
        return 4
    return 3 if policy.named and "out_proj" not in policy.kept else 2
