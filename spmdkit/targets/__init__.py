"""Compile-only GPU targets: XLA:GPU devices for a cluster that is not here (deviceless ahead-of-time compilation).

`target_devices("h100", devices=64, per_host=8)` gives 64 compile-only H100 devices on 8 hosts; a mesh over them
and `jit(f).lower(ShapeDtypeStruct inputs).compile()` run XLA's whole GPU pipeline (SPMD partitioner, fusion,
async collectives, latency-hiding scheduler, buffer assignment, PTX) without a GPU, a driver, or any allocation.
The target configs (`configs/*.txtpb`, `stream_executor.GpuTargetConfigProto`) ship with the package; the CUDA
plugin comes with the `gpu-aot` extra.
"""

from spmdkit.targets.topology import TARGETS, GpuTarget, aot_installed, gpu_target, require_aot, target_devices

__all__ = ["TARGETS", "GpuTarget", "aot_installed", "gpu_target", "require_aot", "target_devices"]
