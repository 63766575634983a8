"""GPU targets by name, and compile-only devices for them: `target_devices(name, devices, per_host)`.

A target is a `GpuTargetConfigProto` in text form (`configs/NAME.txtpb`: the device's SM count, clocks, memory,
compute capability, cuDNN and CUDA versions), which `jax.experimental.topologies.get_topology_desc` turns into
devices of platform "gpu" that XLA compiles for and never runs on. JAX must run with `JAX_PLATFORMS=cpu` (set
before it starts; the CLI does), or the CUDA plugin's start-up check fails on a machine without a driver and the
plugin is not registered. A topology is "1 x hosts x devices per host": `process_index` of a device is its host,
so a mesh over 64 devices on 8 hosts is laid out as a multi-node job's would be.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from importlib import resources

from spmdkit.distributed.platform import cuda_plugin
from spmdkit.errors import SpmdkitError

TARGETS = ("h100", "h200", "a100", "b200")
EXTRA = "pip install 'spmdkit[gpu-aot]'"  # the CUDA plugin, its PJRT library and cuDNN


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One target: its name, the config text, the device's HBM bytes and name (`device_kind`)."""

    name: str
    config: str
    hbm_bytes: int
    device_kind: str


@functools.cache
def gpu_target(name: str) -> GpuTarget:
    """The shipped target `name` (one of `TARGETS`); an unknown name is one line listing the known ones."""
    if name not in TARGETS:
        raise SpmdkitError(f"unknown --target {name!r}: choose one of {', '.join(TARGETS)}")
    text = resources.files("spmdkit.targets").joinpath("configs", f"{name}.txtpb").read_text(encoding="utf-8")
    memory = re.search(r"device_memory_size:\s*(\d+)", text)
    kind = re.search(r'device_description_str:\s*"([^"]+)"', text)
    if memory is None or kind is None:
        raise SpmdkitError(f"target config {name}.txtpb has no device_memory_size or device_description_str")
    return GpuTarget(name, text, int(memory.group(1)), kind.group(1))


def aot_installed() -> bool:
    """Is a CUDA PJRT plugin that compiles for GPU targets installed (the `gpu-aot` extra: CUDA 13; or CUDA 12)?"""
    return cuda_plugin() is not None


def require_aot() -> None:
    """One line naming the extra to install when the CUDA plugin is missing."""
    if not aot_installed():
        raise SpmdkitError(f"compiling for a GPU target needs the CUDA compiler plugin: {EXTRA}")


def host_count(devices: int, per_host: int) -> int:
    """Hosts of a topology of `devices` devices, `per_host` on each host; one line when they do not divide."""
    if devices < 1 or per_host < 1:
        raise SpmdkitError(f"--devices {devices} and --devices-per-host {per_host} must be at least 1")
    if devices % per_host and devices > per_host:
        raise SpmdkitError(
            f"--devices {devices} does not divide into hosts of --devices-per-host {per_host}: use a multiple of "
            f"{per_host}, or set --devices-per-host"
        )
    return max(1, devices // per_host)


def target_devices(name: str, devices: int = 8, per_host: int = 8) -> list:
    """`devices` compile-only devices of target `name`, `per_host` per host (fewer than `per_host`: one host)."""
    target = gpu_target(name)
    hosts = host_count(devices, per_host)
    require_aot()
    from jax.experimental import topologies

    topology = f"1x{hosts}x{min(devices, per_host)}"
    try:
        desc = topologies.get_topology_desc(platform="cuda", target_config=target.config, topology=topology)
    except NotImplementedError:
        raise SpmdkitError(
            "the CUDA plugin is not registered: set JAX_PLATFORMS=cpu before JAX starts (spmdkit compile does) on a "
            "machine without an NVIDIA driver"
        ) from None
    except Exception as error:  # XLA's parse or topology errors: one line, the first of its message
        raise SpmdkitError(f"cannot make a {topology} {name} topology: {str(error).splitlines()[0]}") from None
    return list(desc.devices)
