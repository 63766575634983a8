"""Which platform this process computes on, chosen before JAX starts, and JAX started without the CUDA stubs' noise.

With the CUDA plugin installed (the `gpu-aot` extra, to compile for GPU targets) on a machine without an NVIDIA
driver, JAX prints absl's "log messages before absl::InitializeLog()" banner and "Could not find cuda drivers"
lines when it is imported and when it registers its plugins, and, unless `JAX_PLATFORMS=cpu`, a traceback ("Unable
to load CUDA") before falling back to the CPU. `start_jax()` makes installing the extra change nothing for a CPU
user: no GPU present and no `JAX_PLATFORMS` given -> CPU; JAX imported and its plugins registered with those lines
filtered out of stderr (every other line is passed on).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator

# What JAX's CUDA plugin prints on a machine without a driver (absl's banner and the stubs' log lines): dropped.
_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IW]\d{4} .*(cudart_stub|cuda_executor|cuda_diagnostics|cuda_dnn|cuda_blas|cuda_fft)\.cc)"
)


def gpu_present() -> bool:
    """A CUDA device and driver are visible (checked without importing JAX); `JAX_PLATFORMS=cpu` says no."""
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        return False
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def filter_noise(text: str) -> str:
    """`text` without the CUDA plugin's driver-missing lines."""
    return "".join(line for line in text.splitlines(keepends=True) if not _NOISE.match(line))


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Run the block with file descriptor 2 captured; afterwards write what it printed, less `_NOISE`, to stderr.
    (The lines come from C++ at the file-descriptor level, so `sys.stderr` redirection does not see them.)"""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = filter_noise(captured.read().decode("utf-8", "replace"))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")  # JAX's CUDA PJRT plugins (the `gpu-aot` extras)


def cuda_plugin() -> str | None:
    """The installed CUDA PJRT plugin as "name version" ("jax-cuda13-plugin 0.12.0.1"), read from the installed
    distributions without importing JAX; None without one (a plain `pip install spmdkit`)."""
    for name in CUDA_PLUGINS:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def start_jax() -> None:
    """Choose the CPU when no GPU is present (unless `JAX_PLATFORMS` says otherwise), then import JAX and register
    its plugins quietly where the CUDA plugin is installed without a driver. The backend itself is not started, so
    `--cpu-devices` can still set the device count."""
    if gpu_present():
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "jax" in sys.modules or cuda_plugin() is None:
        return
    with quiet_stderr():
        import jax  # noqa: F401
        from jax._src import xla_bridge  # the plugins' initialize() prints too: run it here, once

        register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
        if register is not None:
            register()
