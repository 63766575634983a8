"""What the attention choice needs to know of a device, real or compile-only: the one place that reads it.

- `device_platform`: "cuda" for an NVIDIA GPU (a compile-only one's client version names no CUDA: its
  `device_kind` names NVIDIA), else JAX's platform name ("cpu", "gpu", "tpu").
- `compute_capability`: the GPU's major version (9 for Hopper), 0 when unknown or not a GPU.
- `cudnn_checks_for(device)`: JAX's Python-side cuDNN checks (head_dim up to 256 on Hopper, ...) read the GPU of
  the *default* backend, which is the CPU when compiling for a GPU target without one; inside this context they
  read `device`'s compute capability instead, so a compile for an H100 target allows what an H100 runs.

The model never reads a device: `spmdkit.train.step.program.build_program`, the benchmark and the GPU compile read these
facts of their mesh's devices and pass them to `spmdkit.models.attention_choice.choose_attention`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax


def device_platform(device: jax.Device) -> str:
    """The platform the attention choice reads: "cuda" for NVIDIA GPUs, else `device.platform`."""
    if device.platform == "gpu":
        version = getattr(device.client, "platform_version", "").lower()
        if "cuda" in version or "nvidia" in device.device_kind.lower():
            return "cuda"
    return device.platform


def compute_capability(device: jax.Device) -> int:
    """The GPU's major compute capability (`device.compute_capability`, "9.0" -> 9); 0 when it has none."""
    text = getattr(device, "compute_capability", "") if device.platform == "gpu" else ""
    try:
        return int(str(text).split(".")[0])
    except ValueError:
        return 0


@contextlib.contextmanager
def cudnn_checks_for(device: jax.Device) -> Iterator[None]:
    """Within the block, JAX's cuDNN capability checks answer for `device` when the default backend is not a CUDA
    GPU (compiling for a target without one); unchanged on a machine with the GPU itself."""
    from jax._src import xla_bridge
    from jax._src.cudnn import fused_attention_stablehlo as fused

    deviceless = "cuda" not in xla_bridge.get_backend().platform_version.lower()
    if not deviceless or device_platform(device) != "cuda" or not hasattr(fused, "check_compute_capability"):
        yield
        return
    have = tuple(int(x) for x in str(getattr(device, "compute_capability", "0.0")).split("."))
    saved = fused.check_compute_capability, fused.is_cuda_compute_capability_equal
    fused.check_compute_capability = lambda c: have >= tuple(int(x) for x in c.split("."))
    fused.is_cuda_compute_capability_equal = lambda c: have == tuple(int(x) for x in c.split("."))
    try:
        yield
    finally:
        fused.check_compute_capability, fused.is_cuda_compute_capability_equal = saved
