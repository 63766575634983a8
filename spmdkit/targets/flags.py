"""The XLA:GPU flags spmdkit sets: overlap collectives with compute, and combine small collectives into large ones.

From MaxText's GPU scripts, NVIDIA JAX-Toolbox's "GPU performance" guide and JAX's "GPU performance tips". On a
GPU host they go into `XLA_FLAGS` before the backend starts (`add_xla_flags`: every `spmdkit` command that
computes); a compile for a GPU target passes them to the one compilation as `compiler_options`
(`gpu_compiler_options()`), so the compiled program is the one a GPU job with these flags runs.

Flags come and go between XLA versions, and XLA ends the process at start-up on an `XLA_FLAGS` entry it does not
parse. So each set is checked against the XLA that will run it: `XLA_FLAGS` by starting this jaxlib's XLA in a
child process (`check_env_flags`), compile options by the compile itself (`compile_with_options`); what this XLA
lacks is left out and named, never fatal. `tests/test_gpu_levers.py` asserts that the installed jaxlib parses
every flag in both forms, so a jaxlib that drops one fails CI instead of a user's job.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
    # FSDP's per-layer all-gathers and reduce-scatters moved out of the layer loop's iteration into the one
    # before/after it, so they overlap a whole layer's compute (XLA 0.11 renamed `enable_pipelined_*=true`)
    "--xla_gpu_pipeline_all_gather=on",
    "--xla_gpu_pipeline_reduce_scatter=on",
    "--xla_gpu_pipeline_all_reduce=on",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    # Two async collectives in flight at once, not one (XLA's default). With one, Ulysses' q all-to-all waited
    # for k's and v's to finish, found nothing left to run beside it and was made synchronous (4 of the 8B's 48 per
    # step at 128k); with two, all 48 overlap, and the compiled memory is the same (docs/jax-limits.md).
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
)
# Enum-valued options: `XLA_FLAGS` takes the value's short name ("on"), a compile option the proto's enum name.
ENUM_OPTIONS = {
    f"xla_gpu_pipeline_{c}": "COLLECTIVE_PIPELINING_MODE_" for c in ("all_gather", "reduce_scatter", "all_reduce")
}
# `--overlap-tp`: XLA:GPU's windowed einsum (collective matmul). The SPMD partitioner turns a tensor-parallel
# all-gather + matmul (and matmul + reduce-scatter) into a loop of collective-permutes overlapping partial matmuls
# when the gathered (or scattered) operand is at least the threshold. 32 MiB: on 8-way TP each ring hop then
# moves >= 4 MiB, ~10 us at an H100's ~450 GB/s NVLink per direction, above the ~5 us a permute and a GEMM launch
# cost, so the split hides more than it adds; smaller operands keep one all-gather + GEMM (XLA's default,
# 100000 MiB, never splits). Multi-streamed: XLA unrolls the loop and runs the partial GEMMs on their own streams,
# so hops go asynchronous; without it every hop sits in a conditional XLA makes synchronous (nothing beside it).
# It failed XLA's verifier on jaxlib 0.10.2 (jax-ml/jax#39200); it compiles on 0.11.2 and 0.12 (docs/jax-limits.md).
# Local permutes go by copy engine (no SMs taken from the GEMMs).
OVERLAP_TP_THRESHOLD_MIB = 32
OVERLAP_TP_FLAGS = (
    f"--xla_gpu_threshold_for_windowed_einsum_mib={OVERLAP_TP_THRESHOLD_MIB}",
    "--xla_gpu_multi_streamed_windowed_einsum=true",
    "--xla_gpu_use_memcpy_local_p2p=true",
)
# Compile options for a compile-only GPU target alone. No GPU is there to time the autotuner's candidates, so it
# compiles the candidate fusion emitters of every fusion and keeps none: the program is the same (its instructions,
# schedule and buffers; only empty emitter configs differ) at 2-6x the compile time without it. Not with
# `--overlap-tp`: the windowed einsum's partial GEMMs need the autotuner's configs ("Failed to get configs"), nor on
# jaxlib 0.11, whose XLA then finds no default Triton config for some GEMM fusions ("No supported config found").
DEVICELESS_OPTIONS: dict[str, bool | int | str] = {"xla_gpu_autotune_level": 0}
DEVICELESS_SINCE = (0, 12)  # the first jaxlib that compiles every program of the suite without the autotuner
# How XLA names a flag it refuses: an unknown name, or a value it cannot parse (a value of a flag with its own
# parser, such as the pipelining modes, is refused without a name: `check_env_flags` then bisects).
_UNKNOWN_ENV = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)$", re.M)
_BAD_VALUE_ENV = re.compile(r"Couldn't interpret value .* for flag (\w+)\.")
_BAD_OPTION = re.compile(r"No such compile option: '(\w+)'|While setting option (\w+),")


def run_flags(overlap_tp: bool = False) -> tuple[str, ...]:
    """The XLA:GPU flags of a run: spmdkit's own, plus the windowed-einsum ones with `--overlap-tp`."""
    return GPU_XLA_FLAGS + (OVERLAP_TP_FLAGS if overlap_tp else ())


def flag_name(flag: str) -> str:
    """ "--xla_gpu_x=1" -> "xla_gpu_x"."""
    return flag.removeprefix("--").partition("=")[0]


def gpu_compiler_options(flags: tuple[str, ...] = GPU_XLA_FLAGS) -> dict[str, bool | int | str]:
    """`--name=value` flags as `jit(...).lower(...).compile(compiler_options=...)` takes them, for a compile-only
    GPU target (`DEVICELESS_OPTIONS` added from jaxlib `DEVICELESS_SINCE` on, but with the windowed einsum's
    flags)."""
    import jaxlib  # here, not above: commands that never compile read this module too

    recent = tuple(int(part) for part in jaxlib.__version__.split(".")[:2]) >= DEVICELESS_SINCE
    windowed = set(OVERLAP_TP_FLAGS) & set(flags)
    options: dict[str, bool | int | str] = dict(DEVICELESS_OPTIONS) if recent and not windowed else {}
    for flag in flags:
        name, _, value = flag.removeprefix("--").partition("=")
        if name in ENUM_OPTIONS:
            options[name] = ENUM_OPTIONS[name] + value.upper()
        else:
            options[name] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    return options


def compile_with_options(lowered: Any, options: dict[str, Any]) -> tuple[Any, list[str]]:
    """`lowered.compile(compiler_options=options)`, leaving out the options this XLA does not have or cannot set
    (it names them one at a time: "No such compile option", "While setting option"); returns (the compiled
    program, the names left out)."""
    options, dropped = dict(options), []
    while True:
        try:
            return lowered.compile(compiler_options=options), dropped
        except Exception as error:  # XLA's INVALID_ARGUMENT; anything else is re-raised
            found = _BAD_OPTION.search(str(error))
            name = found and (found.group(1) or found.group(2))
            if name not in options:
                raise
            options.pop(name)
            dropped.append(name)


def _start_xla(flags: list[str]) -> str | None:
    """Start this jaxlib's XLA in a child process on the CPU (a GPU is not touched) with `flags` as `XLA_FLAGS`:
    None when it starts, else what it printed."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    probe = "import jax; jax.devices('cpu')"  # XLA parses XLA_FLAGS when its first backend starts
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    return None if done.returncode == 0 else done.stderr


def check_env_flags(flags: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
    """(the flags this jaxlib's XLA parses in `XLA_FLAGS`, the names of those it refuses). XLA ends a process at
    start-up on a flag it does not parse, so each try starts it in a child process (`_start_xla`), with only these
    flags; a refused flag is left out (named in XLA's message, or found by bisection where it names none) and the
    rest tried again. About a second per try (JAX's import); one try when every flag parses."""
    kept, dropped = list(flags), []
    while kept and (failure := _start_xla(kept)) is not None:
        unknown = _UNKNOWN_ENV.search(failure)
        named = (unknown.group(1).split() if unknown else []) + _BAD_VALUE_ENV.findall(failure)
        refused = {flag_name(f) for f in named} & {flag_name(f) for f in kept} or {_first_refused(kept, failure)}
        dropped += sorted(refused)
        kept = [f for f in kept if flag_name(f) not in refused]
    return tuple(kept), dropped


def _first_refused(flags: list[str], failure: str) -> str:
    """The name of the first flag XLA refuses, by bisection over prefixes of `flags` (which fail as a whole)."""
    good, bad = 0, len(flags)  # flags[:good] start, flags[:bad] do not
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if _start_xla(flags[:middle]) is None else (good, middle)
    if bad == 1 and _start_xla([]) is not None:  # not a flag's fault: XLA does not start at all
        raise RuntimeError(f"XLA does not start in a child process: {failure.strip()[-400:]}")
    return flag_name(flags[bad - 1])


def add_xla_flags(flags: tuple[str, ...] = GPU_XLA_FLAGS) -> tuple[str, ...]:
    """Append each flag this jaxlib's XLA parses (`check_env_flags`) to `XLA_FLAGS`, unless the user already set
    that flag (theirs wins); before JAX starts. Returns the flags added; those left out because this XLA does not
    parse them are named in a one-line warning."""
    current = os.environ.get("XLA_FLAGS", "")
    names = {flag_name(f) for f in current.split()}
    wanted = tuple(f for f in flags if flag_name(f) not in names)
    if not wanted:
        return ()
    kept, dropped = check_env_flags(wanted)
    os.environ["XLA_FLAGS"] = " ".join([current, *kept]).strip()
    if dropped:
        import warnings

        from spmdkit.errors import SpmdkitWarning

        message = f"this jaxlib's XLA does not parse {len(dropped)} of spmdkit's XLA:GPU flags, left out: "
        warnings.warn(message + ", ".join(dropped), SpmdkitWarning, stacklevel=2)
    return kept
