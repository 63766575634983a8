"""The speed levers' marks in programs compiled for H100 by XLA:GPU on this machine without a GPU (deviceless).

- FP8: one FP8 einsum (Flax's `fp8_scaled_dot_general`: e4m3 forward, e5m2 gradients), forward and gradients,
  holds 3 FP8 GEMMs: Triton GEMM fusions by default, cuBLASLt `__cublas$lt$matmul$f8` calls with Triton GEMMs
  off; `fp8_gemms` counts both forms. A bf16 training step holds none.
- Overlapped TP: `--overlap-tp`'s windowed-einsum flags go into `XLA_FLAGS` on a GPU host only (on the CPU they
  would do nothing: a CPU run's losses are the same with the switch as without), all exist in this XLA and reach
  the compile. XLA (0.11 on) emits its windowed-einsum loops deviceless; multi-streamed (spmdkit's setting) their
  hops run asynchronously, where without it each sits in a conditional XLA makes synchronous (docs/jax-limits.md).
  `windowed_einsums` reads XLA's loops by their body names (a hand-written module in XLA's form too) and spmdkit's
  shard_map ring (`spmdkit.parallel.collective_matmul`): 2 x (n - 1) hops.
- The flags: every one spmdkit sets parses in this jaxlib, in `XLA_FLAGS` (XLA started in a child process) and
  as compile options.
- `spmdkit compile --json` reports the keys. Small shapes: each compile takes seconds, once per test.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support import compile_in_parallel, in_parallel, run_spmdkit

from spmdkit.cli.train import add_run_flags, parse_flags
from spmdkit.inspect import levers
from spmdkit.inspect.hlo import collective_report
from spmdkit.inspect.levers import fp8_gemms, windowed_einsums
from spmdkit.parallel import collective_matmul
from spmdkit.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from spmdkit.targets import target_devices
from spmdkit.targets.flags import (
    GPU_XLA_FLAGS,
    OVERLAP_TP_FLAGS,
    OVERLAP_TP_THRESHOLD_MIB,
    check_env_flags,
    compile_with_options,
    flag_name,
    gpu_compiler_options,
    run_flags,
)
from spmdkit.tools.gpu_compile import compile_for_target, format_report, lower_train_step
from spmdkit.train.config import TrainConfig
from spmdkit.train.step.program import build_program

SMALL = "--model tiny --seq-len 128 --batch-size 16"


def _fp8_loss(x, w, scales, histories):
    dot_general = functools.partial(
        fp8_ops.fp8_scaled_dot_general, lhs_scale=scales[0], rhs_scale=scales[1], grad_scale=scales[2],
        lhs_amax_history=histories[0], rhs_amax_history=histories[1], grad_amax_history=histories[2],
        quantize_compute_type=jnp.bfloat16,
    )  # fmt: skip
    y = jnp.einsum("bse,ehd->bshd", x, w, _dot_general=dot_general, preferred_element_type=jnp.bfloat16)
    return jnp.sum(y.astype(jnp.float32) ** 2)


@pytest.fixture(scope="module")
def fp8_step():
    """Forward and gradients of one FP8 einsum, lowered for one H100."""
    mesh = Mesh(np.array(target_devices("h100", 1, 1)), ("data",))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    args = (
        spec((2, 64, 128), jnp.bfloat16), spec((128, 4, 32), jnp.bfloat16),
        [spec((1,), jnp.float32)] * 3, [spec((16,), jnp.float32)] * 3,
    )  # fmt: skip
    return jax.jit(jax.grad(_fp8_loss, argnums=(0, 1))).lower(*args)


@pytest.mark.parametrize("triton", [True, False], ids=["triton-fusions", "cublaslt-calls"])
def test_fp8_gemms_are_counted_in_both_gemm_forms(fp8_step, triton):
    compiled = fp8_step.compile({**gpu_compiler_options(), "xla_gpu_enable_triton_gemm": triton})
    found = fp8_gemms(compiled)
    assert found["instructions"] == found["executions"] == 3, found  # forward, and the gradients of x and w
    assert found["fusions" if triton else "cublas"] == 3, found
    assert (levers.CUBLAS_FP8 in compiled.as_text()) is not triton


def test_every_flag_spmdkit_sets_parses_in_this_jaxlib():
    """In `XLA_FLAGS` (this jaxlib's XLA started with them, in a child process) and as compile options (a CPU
    compile takes the same names): none left out, and the set is not empty."""
    flags = run_flags(overlap_tp=True)
    assert len(GPU_XLA_FLAGS) >= 8 and len(flags) == len(GPU_XLA_FLAGS) + len(OVERLAP_TP_FLAGS)
    assert check_env_flags(flags) == (flags, [])
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((4,), jnp.float32))
    compiled, dropped = compile_with_options(lowered, gpu_compiler_options(flags))
    assert dropped == [] and compiled is not None
    assert gpu_compiler_options(flags)["xla_gpu_pipeline_all_gather"] == "COLLECTIVE_PIPELINING_MODE_ON"


def test_flags_this_xla_refuses_are_left_out_and_named():
    """A name XLA does not know, and a value it cannot parse (a bool; an enum, which XLA refuses without naming
    the flag): left out and named, the rest kept; as compile options, the same."""
    good = GPU_XLA_FLAGS[0]
    bad = ("--xla_gpu_no_such_flag=true", "--xla_gpu_enable_while_loop_double_buffering=maybe",
           "--xla_gpu_pipeline_all_reduce=sometimes")  # fmt: skip
    kept, dropped = check_env_flags((bad[0], good, *bad[1:]))
    assert kept == (good,) and sorted(dropped) == sorted(flag_name(f) for f in bad)
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((4,), jnp.float32))
    _, dropped = compile_with_options(lowered, {**gpu_compiler_options((good,)), "xla_gpu_no_such_flag": True,
                                                "xla_gpu_pipeline_all_reduce": "SOMETIMES"})  # fmt: skip
    assert dropped == ["xla_gpu_no_such_flag", "xla_gpu_pipeline_all_reduce"]


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu-host", "cpu-host"])
def test_overlap_tp_puts_its_flags_in_xla_flags_on_a_gpu_host_only(monkeypatch, gpu):
    monkeypatch.setattr("spmdkit.distributed.platform.gpu_present", lambda: gpu)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_use_memcpy_local_p2p=false")  # the user's setting wins
    assert add_run_flags(parse_flags(["--mesh", "fsdp=4,tensor=2"], TrainConfig())) is False
    assert add_run_flags(parse_flags(["--overlap-tp"], TrainConfig())) is gpu
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[0] == "--xla_gpu_use_memcpy_local_p2p=false" and len(flags) == (3 if gpu else 1), flags
    assert set(flags[1:]) == ({*OVERLAP_TP_FLAGS} - {"--xla_gpu_use_memcpy_local_p2p=true"} if gpu else set())


_OVERLAPPED: list = []


@pytest.fixture(scope="module")
def tp_report() -> dict:
    """`spmdkit compile --json` of the small fsdp=4,tensor=2 step, without `--overlap-tp`; beside it (two at a time,
    `in_parallel`) the same step with `--overlap-tp`'s flags compiled here, into `_OVERLAPPED`, the windowed-einsum
    threshold lowered to 0 MiB so that every TP matmul qualifies."""
    config = parse_flags(f"{SMALL} --mesh fsdp=4,tensor=2 --overlap-tp".split(), TrainConfig())
    lowered = lower_train_step(build_program(config, target_devices("h100")))
    forced = {**gpu_compiler_options(run_flags(config.mesh.overlap_tp)), "xla_gpu_threshold_for_windowed_einsum_mib": 0}
    compile_json = functools.partial(run_spmdkit, "compile", *f"{SMALL} --mesh fsdp=4,tensor=2 --json".split())
    result, overlapped = in_parallel([compile_json, functools.partial(compile_with_options, lowered, forced)])
    _OVERLAPPED.append(overlapped)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_overlap_tp_flags_reach_the_compile_and_xla_emits_windowed_loops_deviceless(tp_report):
    overlapped, dropped = _OVERLAPPED[0]  # --overlap-tp's flags, every TP matmul windowed (the fixture compiled it)
    assert dropped == [] and len(OVERLAP_TP_FLAGS) == 3  # every windowed-einsum flag exists in this XLA
    found = windowed_einsums(overlapped)
    # each loop's hops (one per iteration, over tensor=2) are found inside its conditional, and counted
    assert found["loops"] > 0 and found["collective_permutes"] >= found["loops"], found
    assert found["executions"] >= found["collective_permutes"], found
    permutes = collective_report(overlapped).by_opcode()["collective-permute"]
    assert found["collective_permutes"] <= permutes["instructions"]  # the step has no other permute to count
    # multi-streamed: hops run asynchronously; XLA's reason where one does not: nothing to overlap it with
    assert found["asynchronous"] > 0, found
    assert permutes["asynchronous"] + permutes["nothing_to_overlap"] == permutes["instructions"], permutes
    assert tp_report["windowed_einsums"]["loops"] == 0  # the switch off: none
    assert tp_report["collectives"]["all-gather"]["instructions"] > 0  # TP's gathers stay whole


def test_spmdkit_compile_compiles_with_the_overlap_flags(monkeypatch):
    seen = []

    def stop(lowered, options):
        seen.append(options)
        raise StopIteration

    monkeypatch.setattr("spmdkit.tools.gpu_compile.compile_with_options", stop)
    for flags in ("--mesh fsdp=4,tensor=2", "--mesh fsdp=4,tensor=2 --overlap-tp"):
        with pytest.raises(StopIteration):
            compile_for_target(parse_flags(f"{SMALL} {flags}".split(), TrainConfig()))
    assert seen[0] == gpu_compiler_options() and seen[1] == gpu_compiler_options(run_flags(overlap_tp=True))
    assert seen[1]["xla_gpu_threshold_for_windowed_einsum_mib"] == OVERLAP_TP_THRESHOLD_MIB


def test_the_shard_map_ring_is_found_as_collective_matmuls_and_plain_tp_has_none():
    assert levers.RING_SCOPE == collective_matmul.RING_SCOPE
    mesh = Mesh(np.array(target_devices("h100")).reshape(1, 8), ("fsdp", "tensor"))
    seq, up, down, mlp = P("fsdp", "tensor", None), P(None, "tensor"), P("tensor", None), P("fsdp", None, "tensor")

    def ring(x, w_up, w_down):
        ag = jax.shard_map(lambda x, w: all_gather_matmul(x, w, "tensor"), mesh=mesh, in_specs=(seq, up), out_specs=mlp)
        rs = jax.shard_map(
            lambda h, w: matmul_reduce_scatter(h, w, "tensor"), mesh=mesh, in_specs=(mlp, down), out_specs=seq
        )
        return rs(ag(x, w_up), w_down)

    def plain(x, w_up, w_down):
        hidden = jax.lax.with_sharding_constraint(x @ w_up, NamedSharding(mesh, mlp))
        return jax.lax.with_sharding_constraint(hidden @ w_down, NamedSharding(mesh, seq))

    spec = lambda shape, s: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, s))  # noqa: E731
    args = (spec((8, 256, 128), seq), spec((128, 512), up), spec((512, 128), down))
    found = windowed_einsums(jax.jit(ring).lower(*args).compile(gpu_compiler_options()))
    assert found["executions"] == 2 * (8 - 1) and 0 < found["collective_permutes"] <= found["executions"], found
    assert windowed_einsums(jax.jit(plain).lower(*args).compile(gpu_compiler_options()))["executions"] == 0


# XLA's windowed-einsum loops as its SPMD partitioner names them (the form of XLA's windowed_einsum_handler tests),
# inside a 3-step layer loop: 2 loops, their 2 collective-permutes, each run 3 times. $T: the loops' state.
XLA_WINDOWED = """HloModule windowed, num_partitions=2

%windowed_dot_general_body_ag.1 (param: $T) -> $T {
  %param = $T parameter(0)
  %gte = bf16[8,4]{1,0} get-tuple-element(%param), index=0
  %cp-start = (bf16[8,4]{1,0}, bf16[8,4]{1,0}) collective-permute-start(%gte), source_target_pairs={{0,1},{1,0}}
  %cp-done = bf16[8,4]{1,0} collective-permute-done(%cp-start)
  %dot.2 = bf16[8,8]{1,0} dot(%gte, %gte), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %gte.1 = u32[] get-tuple-element(%param), index=1
  ROOT %tuple = $T tuple(%cp-done, %gte.1)
}

%unrolled_windowed_dot_general_body_rs (param.1: $T) -> $T {
  %param.1 = $T parameter(0)
  %gte.3 = bf16[8,4]{1,0} get-tuple-element(%param.1), index=0
  %cp.1 = bf16[8,4]{1,0} collective-permute(%gte.3), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %gte.4 = u32[] get-tuple-element(%param.1), index=1
  ROOT %tuple.1 = $T tuple(%cp.1, %gte.4)
}

%layer (p: $T) -> $T {
  %p = $T parameter(0)
  %while.ag = $T while(%p), condition=%cond, body=%windowed_dot_general_body_ag.1
  ROOT %while.rs = $T while(%while.ag), condition=%cond, body=%unrolled_windowed_dot_general_body_rs
}

ENTRY %main (a: $T) -> $T {
  %a = $T parameter(0)
  ROOT %layers = $T while(%a), condition=%cond, body=%layer, backend_config={"known_trip_count":{"n":"3"}}
}
""".replace("$T", "(bf16[8,4]{1,0}, u32[])")


def test_xla_windowed_einsum_loops_are_counted_by_their_body_names():
    assert windowed_einsums(XLA_WINDOWED) == {"loops": 2, "collective_permutes": 2, "asynchronous": 1, "executions": 6}
    assert windowed_einsums(XLA_WINDOWED.replace("windowed_dot_general_body", "scan_body"))["loops"] == 0


def test_compile_json_reports_the_levers(tp_report):
    assert tp_report["fp8_gemms"] == {"instructions": 0, "executions": 0, "cublas": 0, "fusions": 0}  # a bf16 step
    assert tp_report["windowed_einsums"] == {"loops": 0, "collective_permutes": 0, "asynchronous": 0, "executions": 0}
    assert "levers       FP8 GEMMs 0 (x0 per call), windowed einsums 0 loops" in format_report(tp_report)


SP = f"{SMALL} --mesh fsdp=4,tensor=2 --sequence-parallel"


def test_overlap_tp_under_sequence_parallelism_runs_every_projection_as_a_ring():
    """fsdp=4,tensor=2 with SP compiled for 8 x H100: with `--overlap-tp` the 7 projections of a block (5 column-,
    2 row-parallel) run as spmdkit's collective matmuls, forward and backward (one hop each over 2 devices); off,
    there is none."""
    extras, devices = ("", " --overlap-tp"), target_devices("h100")
    lowered = [lower_train_step(build_program(parse_flags(f"{SP}{e}".split(), TrainConfig()), devices)) for e in extras]
    compiled = compile_in_parallel(lowered, gpu_compiler_options())
    found = {extra: windowed_einsums(c) for extra, c in zip(extras, compiled, strict=True)}
    assert found[""]["collective_permutes"] == 0
    assert found[" --overlap-tp"]["collective_permutes"] >= 3 * 7, found  # forward, and two per backward


def test_overlap_tp_gives_the_losses_of_plain_sequence_parallelism_on_cpu(tmp_path):
    """The same 3 float32 steps with and without the rings: equal to float32 rounding (a ring sums its partials in
    another order than XLA's reduce-scatter)."""
    from spmdkit.train.loop import train

    losses = []
    for extra in ("", " --overlap-tp"):
        flags = f"{SP}{extra} --dtype float32 --seq-len 64 --batch-size 8 --steps 3 --log-every 1 --eval-every 0"
        config = parse_flags([*flags.split(), "--run-dir", str(tmp_path / str(len(losses))), "--no-progress"],
                             TrainConfig())  # fmt: skip
        losses.append(train(config).losses)
    assert losses[0].keys() == losses[1].keys() == {1, 2, 3}
    for step in losses[0]:
        assert losses[1][step] == pytest.approx(losses[0][step], rel=1e-5)
