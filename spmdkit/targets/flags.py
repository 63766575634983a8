"""The XLA:GPU flags spmdkit sets: overlap collectives with compute, and combine small collectives into large ones.

From MaxText's GPU scripts, NVIDIA JAX-Toolbox's "GPU performance" guide and JAX's "GPU performance tips". On a
GPU host they go into `XLA_FLAGS` before the backend starts (`spmdkit bench`); a compile for a GPU target passes
them to the one compilation as `compiler_options` (`gpu_compiler_options()`), so the compiled program is the one
a GPU job with these flags runs. Every `spmdkit` command that computes sets them on a GPU host (`add_xla_flags`).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from typing import Any

VERIFIED_JAXLIB = ("0.10.2",)  # every flag below parses there (checked by the tests); XLA_FLAGS for others: none
GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
)
# `--overlap-tp`: XLA:GPU's windowed einsum (collective matmul). The SPMD partitioner turns a tensor-parallel
# all-gather + matmul (and matmul + reduce-scatter) into a loop of collective-permutes overlapping partial matmuls
# when the gathered (or scattered) operand is at least the threshold. 32 MiB: on 8-way TP each ring hop then
# moves >= 4 MiB, ~10 us at an H100's ~450 GB/s NVLink per direction, above the ~5 us a permute and a GEMM launch
# cost, so the split hides more than it adds; smaller operands keep one all-gather + GEMM (XLA's default,
# 100000 MiB, never splits). Multi-streamed windowed einsum stays off: with jaxlib 0.10.2 it fails XLA's HLO
# verifier when a per-device matmul dimension exceeds ~1024 (jax-ml/jax#39200); the latency-hiding scheduler still
# overlaps the loop's async collective-permutes with its GEMMs. Local permutes go by copy engine (no SMs taken
# from the GEMMs). XLA 0.10.2 also caps the loop's iterations at a value its deviceless path
# (`GpuCompiler::CompileAheadOfTime`) leaves 0 and no flag reaches (VLOG "Set SPMD max windowed einsum iteration
# to 0"), so `spmdkit compile` never shows the loops; a GPU host's compile is where they appear
# (docs/benchmarks.md says how to check).
OVERLAP_TP_THRESHOLD_MIB = 32
OVERLAP_TP_FLAGS = (
    f"--xla_gpu_threshold_for_windowed_einsum_mib={OVERLAP_TP_THRESHOLD_MIB}",
    "--xla_gpu_multi_streamed_windowed_einsum=false",
    "--xla_gpu_use_memcpy_local_p2p=true",
)


def run_flags(overlap_tp: bool = False) -> tuple[str, ...]:
    """The XLA:GPU flags of a run: spmdkit's own, plus the windowed-einsum ones with `--overlap-tp`."""
    return GPU_XLA_FLAGS + (OVERLAP_TP_FLAGS if overlap_tp else ())


def gpu_compiler_options(flags: tuple[str, ...] = GPU_XLA_FLAGS) -> dict[str, bool | int | str]:
    """`--name=value` flags as `jit(...).lower(...).compile(compiler_options=...)` takes them."""
    options: dict[str, bool | int | str] = {}
    for flag in flags:
        name, _, value = flag.removeprefix("--").partition("=")
        options[name] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    return options


def add_xla_flags(flags: tuple[str, ...] = GPU_XLA_FLAGS) -> bool:
    """Append each flag to `XLA_FLAGS` unless the user already set that flag (theirs wins); before JAX starts.

    Only with a jaxlib whose XLA is known to parse every flag (`VERIFIED_JAXLIB`): XLA aborts the process at
    start-up on an unknown flag in `XLA_FLAGS`, and flags come and go between versions (jaxlib 0.11.2 no longer
    takes the three `pipelined_*` flags as compile options, though its `XLA_FLAGS` parser still accepts them).
    Returns whether the flags were added."""
    if _jaxlib_version() not in VERIFIED_JAXLIB:
        return False
    current = os.environ.get("XLA_FLAGS", "")
    names = {f.split("=")[0] for f in current.split()}
    extra = [f for f in flags if f.split("=")[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
    return True


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ""


def compile_with_options(lowered: Any, options: dict[str, Any]) -> tuple[Any, list[str]]:
    """`lowered.compile(compiler_options=options)`, leaving out the options this XLA does not have (it names them
    one at a time: "No such compile option"); returns (the compiled program, the names left out)."""
    options, dropped = dict(options), []
    while True:
        try:
            return lowered.compile(compiler_options=options), dropped
        except Exception as error:  # XLA's INVALID_ARGUMENT; anything else is re-raised
            unknown = re.search(r"No such compile option: '([\w.]+)'", str(error))
            if unknown is None or unknown.group(1) not in options:
                raise
            options.pop(unknown.group(1))
            dropped.append(unknown.group(1))
