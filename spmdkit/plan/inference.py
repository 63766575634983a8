"""Inference cost (`spmdkit plan --inference`): decode latency and throughput on a mesh of tensor x data, from the
bytes a decode step reads; prefill time from its FLOPs. Pure arithmetic (no JAX).

Notation as in `spmdkit.plan.estimate`: L layers, E embed, H/K query/KV heads of width d, V vocab; w bytes per
weight, a bytes per cache element (the compute dtype); mesh T = tensor, D = data; B sequences decoded together
(B/D per replica), c positions in each sequence's cache.

Per device and decode step (every sequence advances one token):
  weights read  = each parameter / the mesh axes its logical names map to under the inference rules (heads,
                  kv_heads, mlp, vocab over tensor; nothing over data; norms replicated), in w bytes. A mixture-of-
                  experts layer reads only the experts its B/D tokens route to: E_moe (1 - (1 - k/E_moe)^(B/D)).
  KV read       = 2 L (B/D) c K d a / T  (K / T when T divides K, else the KV heads are replicated: / 1);
                  latent attention (R = kv_lora_rank, P = qk_rope_head_dim) caches the latent and the rope key:
                  L (B/D) c (R + P) a, replicated over T (`spmdkit.inference.cache`)
  memory time   = (weights read + KV read) / (HBM bandwidth x 0.8 achieved)
  compute time  = (2 N_mm + 4 L H d c) (B/D) / T / (peak x efficiency); N_mm: matmul parameters a token runs
                  through (the active experts, the LM head; not the embedding gather); float32 at half the peak;
                  latent attention 2 L H (2R + P) c for the attention (kv_b absorbed: its matmuls are in N_mm)
  TP traffic    = 2 all-reduces of [B/D, 1, E] per layer + 1 (vocab-parallel embedding) + the logits gathered for
                  sampling [B/D, V] float32, each a link latency + ring wire bytes / link bandwidth; none when T = 1
  step          = max(memory, compute) + TP traffic: one token per sequence. Latency per token = step;
                  throughput = B / step tokens/s.
Decode is memory-bound while the weights dominate what a step reads: batching amortises them (tokens/s grows with
B at almost the same step time) until compute time catches up with memory time, the compute-bound batch
B* = weights / bandwidth / (per-sequence FLOP time - per-sequence KV time) (no B* when the KV cache grows as fast as
the FLOPs). Tensor parallelism divides the bytes (and the FLOPs) of every step by T: lower latency, paid for with
2L all-reduces per token; replicas (data) divide the batch: more tokens/s at the same latency, no communication.
Prefill of a P-token prompt is compute-bound: (2 N_mm P + 2 L H d P^2) / T / (peak x efficiency).
Memory per device: weights + the KV cache of B/D sequences of c positions (`decode_memory`: what
`memory_analysis()` of a compiled decode step holds, `tests/test_generate.py` checks it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig
from spmdkit.plan.devices import Device, wire_bytes
from spmdkit.plan.layout import DTYPE_BYTES, sharded
from spmdkit.sharding.mesh_config import AXES, format_sizes

MEMORY_EFFICIENCY = 0.8  # share of nominal HBM bandwidth a decode step's large reads achieve
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _sizes(mesh: Mapping[str, int]) -> dict[str, int]:
    sizes = {axis: int(mesh.get(axis, 1)) for axis in AXES}
    other = [axis for axis in AXES if axis not in ("data", "tensor") and sizes[axis] != 1]
    if other:
        raise SpmdkitError(f"inference meshes use tensor and data only, not {', '.join(other)} (fsdp would all-gather "
                           "every weight per token)")  # fmt: skip
    return sizes


def weight_bytes(m: TransformerConfig, mesh: Mapping[str, int], local_batch: float | None = None) -> float:
    """Weight bytes per device (in `m.param_dtype`); with `local_batch`, only the routed experts its tokens use."""
    scale, used = DTYPE_BYTES[m.param_dtype] / 4, 1.0
    if m.moe_layers and local_batch is not None:
        used = 1 - (1 - m.top_k / m.experts) ** local_batch  # share of experts some token routes to
    params = sharded(m, tuple(_sizes(mesh).items()), 0)
    return sum(p.nbytes * scale / p.divisor["params"][0] * (used if p.routed else 1.0) for p in params)


def kv_bytes(m: TransformerConfig, mesh: Mapping[str, int], batch: int, context: int) -> float:
    """KV cache bytes per device: 2 x L x (B / D) x c x K x d x a / T (T when it divides K); latent attention's
    L x (B / D) x c x (R + P) x a, whole on every tensor rank."""
    sizes = _sizes(mesh)
    tokens = m.layers * (batch / sizes["data"]) * context * DTYPE_BYTES[m.dtype]
    if m.kv_lora_rank:  # the latent and the rope key: no heads to split over tensor
        return tokens * (m.kv_lora_rank + m.qk_rope_head_dim)
    split = sizes["tensor"] if m.kv_heads % sizes["tensor"] == 0 else 1  # else the KV heads are replicated
    return tokens * 2 * m.kv_heads * m.head_dim / split


def decode_memory(
    m: TransformerConfig, mesh: Mapping[str, int], device: Device, *, batch: int, context: int
) -> dict[str, float]:
    """{weights, kv_cache} bytes per device of decoding `batch` sequences with caches of `context` positions."""
    del device  # the same on every accelerator; kept for symmetry with `decode_estimate`
    return {"weights": weight_bytes(m, mesh), "kv_cache": kv_bytes(m, mesh, batch, context)}


def matmul_params(m: TransformerConfig) -> int:
    """N_mm: parameters a token's matmuls use (active experts, LM head), without the embedding table and norms."""
    return m.num_params(active=True) - m.vocab_size * m.embed - (2 * m.layers + 1) * m.embed


def _sequence_flops(m: TransformerConfig, context: int) -> float:
    """FLOPs of one sequence's decode step at `context` positions: its matmuls and its attention over the cache
    (latent attention's absorbed form: scores over R + P and the latent context over R per head and position)."""
    per_position = 2 * m.kv_lora_rank + m.qk_rope_head_dim if m.kv_lora_rank else 2 * m.head_dim
    return 2 * matmul_params(m) + 2 * m.layers * m.heads * per_position * context


@dataclasses.dataclass(frozen=True)
class DecodeEstimate:
    """One decode step of `batch` sequences at `context` positions on `mesh` (seconds; bytes per device)."""

    mesh: dict[str, int]
    batch: int
    context: int
    weights_read: float
    kv_read: float
    memory_bytes: float  # weights + the whole KV cache held
    hbm_bytes: float
    memory_s: float
    compute_s: float
    comm_s: float

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.hbm_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "step_s": self.step_s,
            "latency_per_token_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "bound": self.bound,
            "fits": self.fits,
        }


def _peak(m: TransformerConfig, device: Device, efficiency: float) -> float:
    return device.peak_flops * efficiency * (0.5 if m.dtype == "float32" else 1.0)


def _bandwidth(device: Device) -> float:
    """The HBM bytes/s a decode step achieves on `device` (one line for a device without an HBM bandwidth)."""
    if device.hbm_bw <= 0:
        raise SpmdkitError(f"device {device.name} has no HBM bandwidth: pass --hbm-gbs for the inference planner")
    return device.hbm_bw * MEMORY_EFFICIENCY


def tp_comm_s(m: TransformerConfig, mesh: Mapping[str, int], device: Device, local_batch: float) -> float:
    """Seconds of one decode step's TP collectives: 2L + 1 all-reduces of [B/D, 1, E] and the logits gathered."""
    t = _sizes(mesh)["tensor"]
    if t == 1:
        return 0.0

    def collective(opcode: str, operand: float) -> float:  # a latency and the ring's wire bytes over NVLink
        return device.link_latency + wire_bytes(opcode, t, operand) / device.intra_node_bw

    reduces = (2 * m.layers + 1) * collective("all-reduce", local_batch * m.embed * DTYPE_BYTES[m.dtype])
    return reduces + collective("all-gather", local_batch * m.vocab_size * 4 / t)


def decode_estimate(
    m: TransformerConfig, mesh: Mapping[str, int], device: Device, *, batch: int, context: int, efficiency: float = 0.5
) -> DecodeEstimate:
    """Time and bytes of one decode step (see the module docstring)."""
    bandwidth, sizes = _bandwidth(device), _sizes(mesh)
    if batch < 1 or context < 1 or batch % sizes["data"]:
        raise SpmdkitError(f"batch {batch} must be a positive multiple of data={sizes['data']}, context positive")
    local = batch / sizes["data"]
    weights, kv = weight_bytes(m, sizes, local), kv_bytes(m, sizes, batch, context)
    flops = _sequence_flops(m, context) * local / sizes["tensor"]
    return DecodeEstimate(
        sizes, batch, context, weights_read=weights, kv_read=kv, memory_bytes=weight_bytes(m, sizes) + kv,
        hbm_bytes=device.hbm_bytes, memory_s=(weights + kv) / bandwidth, compute_s=flops / _peak(m, device, efficiency),
        comm_s=tp_comm_s(m, sizes, device, local),
    )  # fmt: skip


def compute_bound_batch(
    m: TransformerConfig, mesh: Mapping[str, int], device: Device, *, context: int, efficiency: float = 0.5
) -> float | None:
    """B*: the global batch from which a decode step's FLOPs take longer than its reads (dense weights; None when
    the KV cache's reads grow as fast as the FLOPs, so decode stays memory-bound at any batch)."""
    bandwidth, sizes = _bandwidth(device), _sizes(mesh)
    per_sequence_flops = _sequence_flops(m, context) / sizes["tensor"]
    per_sequence_kv = kv_bytes(m, sizes, sizes["data"], context)  # one sequence on each replica
    per_sequence_s = per_sequence_flops / _peak(m, device, efficiency) - per_sequence_kv / bandwidth
    if per_sequence_s <= 0:
        return None
    return weight_bytes(m, sizes) / bandwidth / per_sequence_s * sizes["data"]


def prefill_s(
    m: TransformerConfig, mesh: Mapping[str, int], device: Device, prompt: int, efficiency: float = 0.5
) -> float:
    """Seconds to prefill one prompt of `prompt` tokens on one replica (compute-bound, causal attention)."""
    sizes = _sizes(mesh)
    flops = 2 * matmul_params(m) * prompt + 2 * m.layers * m.heads * m.head_dim * prompt * prompt
    return flops / sizes["tensor"] / _peak(m, device, efficiency) + tp_comm_s(m, sizes, device, prompt)


def inference_meshes(devices: int, m: TransformerConfig) -> list[dict[str, int]]:
    """tensor=T x data=devices/T for every power-of-two T dividing the devices and the query heads."""
    powers = (2**k for k in range(devices.bit_length()))
    return [_sizes({"tensor": t, "data": devices // t}) for t in powers if devices % t == 0 and m.heads % t == 0]


def inference_report(
    m: TransformerConfig,
    mesh: Mapping[str, int],
    device: Device,
    *,
    context: int,
    batches: tuple[int, ...] = BATCHES,
    efficiency: float = 0.5,
) -> dict[str, Any]:
    """Decode estimates of `mesh` for each batch (multiples of data that fit), B*, and prefill of `context` tokens."""
    sizes = _sizes(mesh)
    rows = [
        decode_estimate(m, sizes, device, batch=b * sizes["data"], context=context, efficiency=efficiency)
        for b in batches
    ]
    fitting = [r for r in rows if r.fits] or rows[:1]
    return {
        "mesh": format_sizes(sizes),
        "device": device.name,
        "context": context,
        "by_batch": [r.to_dict() for r in fitting],
        "compute_bound_batch": compute_bound_batch(m, sizes, device, context=context, efficiency=efficiency),
        "prefill_s": prefill_s(m, sizes, device, context, efficiency),
    }


def format_inference(model_name: str, m: TransformerConfig, device: Device, reports: list[dict[str, Any]]) -> str:
    """The text `spmdkit plan --inference` prints: per mesh, decode by batch size, then the lesson in numbers."""
    lines = [
        f"spmdkit plan --inference: {model_name} on {device.name} ({device.hbm_bw / 1e12:.2f} TB/s HBM, "
        f"{device.peak_flops / 1e12:.0f} TFLOP/s), weights {m.param_dtype}, KV cache {m.dtype}, "
        f"context {reports[0]['context']} positions"
    ]
    for r in reports:
        lines += ["", f"mesh {r['mesh']}:", f"{'batch':>7}{'ms/token':>10}{'tokens/s':>12}{'GB/device':>11}"
                  f"{'weights GB read':>17}{'KV GB read':>12}{'bound':>9}"]  # fmt: skip
        for e in r["by_batch"]:
            lines.append(
                f"{e['batch']:>7}{e['step_s'] * 1e3:>10.2f}{e['tokens_per_s']:>12,.0f}{e['memory_bytes'] / 1e9:>11.1f}"
                f"{e['weights_read'] / 1e9:>17.2f}{e['kv_read'] / 1e9:>12.2f}{e['bound']:>9}"
                + ("" if e["fits"] else "  (does NOT fit)")
            )
        star = r["compute_bound_batch"]
        lines.append(
            f"compute-bound from batch {math.ceil(star):,}"
            if star
            else "memory-bound at every batch (KV reads grow as fast as the FLOPs)"
        )
        lines.append(f"prefill of a {r['context']}-token prompt: {r['prefill_s'] * 1e3:.1f} ms (compute-bound)")
    if len(reports) > 1:
        first = [r["by_batch"][0] for r in reports]
        fastest = min(range(len(reports)), key=lambda i: first[i]["step_s"])
        widest = max(range(len(reports)), key=lambda i: reports[i]["by_batch"][-1]["tokens_per_s"])
        lines += [
            "",
            f"lowest latency: {reports[fastest]['mesh']} ({first[fastest]['step_s'] * 1e3:.2f} ms/token at the "
            f"smallest batch: tensor parallelism divides the bytes every step reads)",
            f"most tokens/s: {reports[widest]['mesh']} ({reports[widest]['by_batch'][-1]['tokens_per_s']:,.0f} at "
            f"batch {reports[widest]['by_batch'][-1]['batch']}, the largest that fits)",
        ]
    return "\n".join(lines)
