"""Accelerators, meshes over them and their links, for the layout planner (`spmdkit.plan`).

No JAX here (the planner answers without an accelerator in well under two seconds): meshes are parsed by
`spmdkit.sharding.mesh.MeshConfig`, which is plain Python (that module and `spmdkit.sharding` load JAX lazily).

Bandwidths are per device and per direction, nominal: NVLink (or TPU ICI) inside a node, the InfiniBand NIC
(or DCN) share of one device across nodes. The planner applies an efficiency factor to them (NCCL reaches about
80% of nominal on large messages). A "node" is the fast-link domain: 8 GPUs on an HGX board; for TPU v5p the
ICI domain is the whole slice, so set `--gpus-per-node` to the slice size.
"""

from __future__ import annotations

import dataclasses
import math

from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh_config import AXES, MeshConfig


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: HBM bytes, dense bf16 peak FLOP/s, bytes/s per direction inside a node and across nodes,
    HBM bandwidth and the latency of a small in-node collective (the inference planner's `spmdkit.plan.inference`).

    `kinds`: substrings of JAX's `device_kind` that name this accelerator (the longest match wins), so a running
    job finds its peak FLOP/s for MFU in this same table."""

    name: str
    hbm_bytes: float
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int = 8
    backend: str = "gpu"  # "cpu": XLA's CPU pipeline, which lacks AllReduceReassociate and ReduceScatterCreator
    kinds: tuple[str, ...] = ()
    hbm_bw: float = 0.0  # HBM bytes/s (nominal): decode reads every weight and the KV cache per token from it
    link_latency: float = 10e-6  # seconds of one small collective in a node (latency-bound: decode's all-reduces)
    compute_capability: int = 0  # the GPU's major version (9: Hopper): what cuDNN attention may run there
    # host <-> device bytes/s per direction, effective (what `--optimizer.offload` moves the moments over): PCIe Gen4
    # x16 is 31.5 GB/s raw per direction (16 GT/s x 16 lanes, 128b/130b), ~25 GB/s in pinned-memory copies
    host_bw: float = 25e9
    # dense FP8 tensor-core FLOP/s (0: none, FP8 runs at the bf16 peak): H100/H200 SXM 1,979 TFLOP/s (3,958 with
    # sparsity, NVIDIA's H100 datasheet), B200 4.5 PFLOP/s, GB200 5 PFLOP/s, L40S 733 TFLOP/s (half the sparse figures)
    fp8_peak_flops: float = 0.0


def mixed_peak(device: Device, fp8_share: float = 0.0) -> float:
    """The peak FLOP/s of a step whose FLOPs run `fp8_share` in FP8 and the rest in bf16: every FLOP at its own
    peak, 1 / (share / fp8_peak + (1 - share) / peak) (the bf16 peak without FP8 tensor cores)."""
    fp8 = device.fp8_peak_flops or device.peak_flops
    return 1.0 / (fp8_share / fp8 + (1.0 - fp8_share) / device.peak_flops)


# H100 SXM: 80 GB HBM3, 989 TFLOP/s bf16 dense, NVLink4 900 GB/s both ways, one 400 Gb/s NDR NIC per GPU.
# host_bw: PCIe Gen5 x16, 63 GB/s raw per direction (32 GT/s x 16 lanes, 128b/130b; PCI-SIG PCIe 5.0 base
# specification), ~50 GB/s effective in pinned host <-> device copies (H200, B200: the same link).
_H100 = Device(
    "h100", 80e9, 989e12, 450e9, 50e9, kinds=("H100", "H800"), hbm_bw=3.35e12, link_latency=8e-6,
    compute_capability=9, host_bw=50e9, fp8_peak_flops=1979e12,
)  # fmt: skip

# HBM bandwidth (hbm_bw) is the datasheet's: H100 SXM 3.35 TB/s, H200 4.8, A100 80GB 2.04, L40S 0.864 (GDDR6),
# B200/GB200 8, TPU v4 1.2, v5e 0.82, v5p 2.77, v6e 1.64. link_latency: a small NCCL all-reduce over NVLink
# (NVSwitch) takes ~8-10 us, over PCIe ~20 us; TPU ICI ~10 us.
DEVICES: dict[str, Device] = {d.name: d for d in (
    _H100,
    # H200: an H100 with 141 GB of HBM3e at 4.8 TB/s.
    dataclasses.replace(_H100, name="h200", hbm_bytes=141e9, kinds=("H200", "GH200"), hbm_bw=4.8e12),
    # A100 SXM 80 GB: 312 TFLOP/s, NVLink3 600 GB/s both ways, 200 Gb/s HDR per GPU.
    Device("a100", 80e9, 312e12, 300e9, 25e9, kinds=("A100", "A800"), hbm_bw=2.039e12, compute_capability=8),
    # L40S: 48 GB GDDR6, 362 TFLOP/s bf16 dense, no NVLink (PCIe Gen4 x16, ~32 GB/s per direction).
    Device("l40s", 48e9, 362e12, 32e9, 25e9, kinds=("L40S",), hbm_bw=0.864e12, link_latency=20e-6,
           compute_capability=8, fp8_peak_flops=733e12),
    # B200 (DGX B200: 180 GB usable of 192), 2.25 PFLOP/s dense bf16, NVLink5 1.8 TB/s, 400 Gb/s per GPU.
    Device("b200", 180e9, 2250e12, 900e9, 50e9, kinds=("B200",), hbm_bw=8e12, link_latency=8e-6,
           compute_capability=10, host_bw=50e9, fp8_peak_flops=4500e12),
    # GB200 NVL72: 186 GB usable, 2.5 PFLOP/s dense bf16, NVLink5 1.8 TB/s in a 72-GPU domain.
    Device("gb200", 186e9, 2500e12, 900e9, 50e9, gpus_per_node=72, kinds=("GB200",), hbm_bw=8e12,
           compute_capability=10, fp8_peak_flops=5000e12),
    # TPU v4: 32 GB HBM, 275 TFLOP/s; ICI ~ 2 x 45 GB/s per link, 6 links. TPU v5e: 16 GB, 197 TFLOP/s.
    Device("tpu-v4", 32e9, 275e12, 135e9, 25e9, gpus_per_node=4096, backend="tpu", kinds=("TPU v4",), hbm_bw=1.2e12),
    Device("tpu-v5e", 16e9, 197e12, 100e9, 25e9, gpus_per_node=256, backend="tpu", kinds=("TPU v5 lite", "TPU v5e"),
           hbm_bw=0.819e12),
    # TPU v5p: 95 GB HBM, 459 TFLOP/s; a bidirectional ring along one torus axis ~2 x 100 GB/s; DCN ~25 GB/s.
    Device("tpu-v5p", 95e9, 459e12, 200e9, 25e9, gpus_per_node=256, backend="tpu", kinds=("TPU v5",), hbm_bw=2.765e12),
    # TPU v6e (Trillium): 32 GB HBM, 918 TFLOP/s bf16, ICI ~ 2 x 200 GB/s.
    Device("tpu-v6e", 32e9, 918e12, 400e9, 25e9, gpus_per_node=256, backend="tpu", kinds=("TPU v6",), hbm_bw=1.64e12),
    # Simulated host devices (--xla_force_host_platform_device_count): the compiler-proof target. Its bytes are
    # real; its FLOP/s and bandwidths are placeholders (no `kinds`: MFU on a CPU is reported as unknown;
    # `scripts/bench_generate.py` measures this machine's copy bandwidth instead).
    Device("cpu", 16e9, 1e12, 10e9, 10e9, backend="cpu", hbm_bw=10e9, link_latency=20e-6),
)}  # fmt: skip


def device_for_kind(device_kind: str) -> Device | None:
    """The table's accelerator for a JAX `device_kind` (e.g. "NVIDIA H100 80GB HBM3"), or None if unknown."""
    matches = [(len(k), d) for d in DEVICES.values() for k in d.kinds if k.lower() in device_kind.lower()]
    return max(matches, key=lambda match: match[0])[1] if matches else None


DEVICE_TYPES: tuple[str, ...] = (*DEVICES, "custom")
# make_device's keywords, named as `spmdkit plan`'s flags (hbm_gb: --hbm-gb): the Device field each sets, its unit
DEVICE_FLAGS = {
    "hbm_gb": ("hbm_bytes", 1e9), "peak_tflops": ("peak_flops", 1e12), "intra_node_gbs": ("intra_node_bw", 1e9),
    "inter_node_gbs": ("inter_node_bw", 1e9), "gpus_per_node": ("gpus_per_node", 1), "hbm_gbs": ("hbm_bw", 1e9),
}  # fmt: skip
CUSTOM_FLAGS = ("hbm_gb", "peak_tflops", "intra_node_gbs", "inter_node_gbs")  # what a custom device must give


def make_device(kind: str, **flags: float | None) -> Device:
    """A named device (a key of `DEVICES`) with optional overrides, or `custom` (`CUSTOM_FLAGS` given); `flags`:
    keywords of `DEVICE_FLAGS` in their flags' units (None: not given)."""
    if unknown := sorted(set(flags) - set(DEVICE_FLAGS)):
        raise TypeError(f"make_device() got unexpected keyword arguments {unknown}")
    given = {flag: value for flag, value in flags.items() if value is not None}
    if kind == "custom":
        missing = [f"--{flag.replace('_', '-')}" for flag in CUSTOM_FLAGS if flag not in given]
        if missing:
            raise SpmdkitError(f"--device-type custom needs {', '.join(missing)}")
        base = Device("custom", 0.0, 0.0, 0.0, 0.0)
    elif kind in DEVICES:
        base = DEVICES[kind]
    else:
        raise SpmdkitError(f"unknown device type {kind!r}: choose one of {', '.join(DEVICE_TYPES)}")
    device = dataclasses.replace(base, **{DEVICE_FLAGS[f][0]: v * DEVICE_FLAGS[f][1] for f, v in given.items()})
    for field in (*(DEVICE_FLAGS[flag][0] for flag in CUSTOM_FLAGS), "gpus_per_node"):
        if getattr(device, field) <= 0:
            raise SpmdkitError(f"device {field.replace('_', ' ')} must be positive (got {getattr(device, field)})")
    return device


def parse_mesh(text: str, devices: int | None = None) -> dict[str, int]:
    """ "data=2,tensor=4" -> sizes of all six axes, as `MeshConfig` reads it (unnamed axes 1; one axis may be -1,
    the rest of `devices`). Without `devices` the sizes are taken as given (empty text: one device)."""
    config = MeshConfig.parse(text) if text.strip() else MeshConfig(fsdp=1 if devices is None else -1)
    if devices is not None:
        return config.resolve(devices)
    if -1 in config.sizes().values():
        raise SpmdkitError(f"--mesh {text!r} has an axis of -1 ('the rest'): give --devices too")
    return config.resolve(math.prod(config.sizes().values()))


def node_local_axes(sizes: dict[str, int], gpus_per_node: int) -> set[str]:
    """Axes whose rings stay inside a node: filling from the innermost (tensor) outwards, as `make_mesh` lays out
    devices, an axis is node-local while the product of it and every inner axis is at most `gpus_per_node`."""
    local, inner = set(), 1
    for axis in reversed(AXES):
        inner *= sizes[axis]
        if inner <= gpus_per_node or sizes[axis] == 1:
            local.add(axis)
    return local


def wire_bytes(opcode: str, n: int, operand: float) -> float:
    """Bytes one device sends in a ring collective over n devices, from its operand bytes: all-reduce
    2(n-1)/n x, reduce-scatter and all-to-all (n-1)/n x, all-gather (n-1) x (its operand is the shard), ppermute 1 x."""
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": n - 1, "collective-permute": 1}.get(opcode, (n - 1) / n)
    return operand * factor
