"""Every strategy compiled for 8 x H100 by XLA:GPU's own compiler, on this machine without a GPU.

The compile-only devices come from `spmdkit.targets` (the `gpu-aot` extra: the CUDA plugin and cuDNN); the train
step is the one `spmdkit train` runs (`build_program`), lowered on ShapeDtypeStructs, compiled with spmdkit's
XLA:GPU flags. Each strategy's GPU program must hold the collectives that strategy stands for, every one an async
start/done pair or one XLA scheduled as a pair and made synchronous because nothing could run beside it ("is_sync"
in its backend config: the last layer's gradient reduction, a tensor-parallel sum whose result the next
instruction reads); FSDP's are all async. cuDNN's fused attention where the attention is cuDNN, pipeline stages and
accumulation over replica axes included. Small shapes (`tiny`, seq 128): each compile takes a few seconds, once
per strategy for the module.
"""

import functools
import json
import re
from dataclasses import replace

import pytest
from support import error_lines, in_parallel, run_spmdkit

from spmdkit.cli.train import parse_flags
from spmdkit.errors import SpmdkitError
from spmdkit.inspect.flops import hlo_flops
from spmdkit.inspect.hlo import collective_report
from spmdkit.parallel.pipeline.schedule import TICK_SCOPE
from spmdkit.sharding.strategy import Strategy
from spmdkit.targets import TARGETS, gpu_target, require_aot, target_devices
from spmdkit.targets.flags import gpu_compiler_options
from spmdkit.tools.gpu_compile import (
    attention_in_hlo,
    attention_windows,
    format_report,
    lower_train_step,
    memory_bytes,
    planner_estimate,
    roofline_report,
)
from spmdkit.tools.strategies import STRATEGIES as TABLE
from spmdkit.train.config import TrainConfig
from spmdkit.train.step.program import build_program

SMALL = "--model tiny --seq-len 128 --batch-size 16"
# README's strategy table, from the one table of layouts (`spmdkit.tools.strategies`): name -> (the flags of
# `spmdkit train`, collectives its compiled GPU step must hold)
T, MOE = TABLE, "--model tiny-moe "
STRATEGIES = {
    "dp": (T["dp"].flags(), {"all-reduce"}),
    "zero1": (T["zero1"].flags(), {"all-reduce", "all-gather"}),
    "zero2": (T["zero2"].flags(), {"reduce-scatter", "all-gather"}),
    "fsdp": (T["fsdp"].flags(), {"all-gather", "reduce-scatter"}),
    "hsdp": (T["hsdp"].flags(), {"all-gather", "reduce-scatter", "all-reduce"}),
    "tp": (T["tp"].flags(), {"all-reduce"}),
    "tp_sp": (T["tp_sp"].flags(), {"reduce-scatter", "all-gather"}),
    "cp": (T["cp"].flags(), {"all-to-all"}),  # auto on an H100: Ulysses around cuDNN
    "cp_ring": (replace(T["cp"], context_parallel="ring").flags(), {"collective-permute"}),
    "cp_2d": (replace(T["cp"], context_parallel="2d", ulysses=2).flags(), {"collective-permute", "all-to-all"}),
    "pp_1f1b": (replace(T["pp"], microbatches=8).flags(), {"collective-permute"}),
    "pp_interleaved": (
        Strategy("pipeline=2,data=4", microbatches=4, schedule="interleaved", virtual_stages=2).flags(),
        {"collective-permute"},
    ),
    "ep": (MOE + T["ep"].flags(), {"all-to-all"}),
    # gradient accumulation: over replica axes in a partly manual region (blockwise there); a mixture of experts
    # accumulates under automatic sharding (cuDNN). The kernel chosen must be the one compiled in either case.
    "hsdp_accum": (replace(T["hsdp"], microbatches=2).flags(), {"all-gather", "reduce-scatter", "all-reduce"}),
    "ep_accum": (MOE + replace(T["ep"], microbatches=2).flags(), {"all-to-all"}),
}
# The other programs the tests below read, compiled with the strategies: name -> the flags of `spmdkit train`
PACKED_HD256 = "--mesh fsdp=4,tensor=2 --packing documents --model.heads 2 --model.kv-heads 1 --model.head-dim 256"
LOCAL = "--model.sliding-window 16 --model.window-pattern LG --model.head-dim 16"
PROGRAMS = {
    "cudnn_fsdp8": "--mesh fsdp=8 --attention cudnn",
    "cudnn_packed_hd256": PACKED_HD256,
    "local_window": LOCAL,
    "softcapped_window": f"{LOCAL} --model.attention-softcap 30",
}
H200_TWO_HOSTS = "--mesh data=2,fsdp=8 --batch-size 32"
# ... and the `spmdkit compile` runs they read: name -> its arguments
MOE_DROPLESS = f"{SMALL} --model tiny-moe --moe-dispatch dropless --mesh tensor=8"
LLAMA3_8B = "--model llama3-8b --mesh fsdp=8 --seq-len 8192 --batch-size 8 --model.remat full"
LLAMA3_8B_128K = "--model llama3-8b --mesh context=8 --seq-len 131072 --batch-size 1 --model.remat full"
COMMANDS = {
    "llama3_8b": f"{LLAMA3_8B} --json --roofline",
    "llama3_8b_128k": f"{LLAMA3_8B_128K} --json",
    "llama3_8b_128k_tp": f"{LLAMA3_8B_128K} --mesh context=4,tensor=2 --json",
    "llama3_70b": "--model llama3-70b --mesh fsdp=8 --seq-len 512 --batch-size 8 --json",
    "json": f"{SMALL} --mesh fsdp=4,tensor=2 --json",
    "moe_dropless": f"{MOE_DROPLESS} --json",
    "decode": "--decode --model tiny --mesh tensor=4,data=2 --seq-len 64 --batch-size 8 --json",
    "bad_target": "--target x100",
    "bad_devices": "--devices 12",
    "bad_mesh": "--devices 8 --mesh fsdp=16",
}
_COMPILED: dict[str, tuple] = {}
_RUNS: dict[str, object] = {}


@pytest.fixture(scope="module")
def h100():
    """8 compile-only H100s. Everything this module compiles is compiled here, two at a time: the `spmdkit compile`
    runs of `COMMANDS` (into `_RUNS`), every strategy of `STRATEGIES` and the programs of `PROGRAMS` on these
    devices, and hybrid data x FSDP on two hosts of H200 (into the cache `compile_flags` reads)."""
    devices = target_devices("h100", 8, 8)
    flags = {**{name: flags for name, (flags, _) in STRATEGIES.items()}, **PROGRAMS}
    programs = {name: build_program(parse_flags(f"{SMALL} {f}".split(), TrainConfig()), devices)
                for name, f in flags.items()}  # fmt: skip
    h200 = target_devices("h200", 16, 8)
    programs["h200_two_hosts"] = build_program(parse_flags(f"{SMALL} {H200_TWO_HOSTS}".split(), TrainConfig()), h200)
    options = gpu_compiler_options()
    runs = [functools.partial(run_spmdkit, "compile", *args.split()) for args in COMMANDS.values()]
    steps = [functools.partial(lower_train_step(p).compile, compiler_options=options) for p in programs.values()]
    done = in_parallel(runs + steps)  # the longest first
    _RUNS.update(zip(COMMANDS, done[: len(runs)], strict=True))
    for (name, program), one in zip(programs.items(), done[len(runs) :], strict=True):
        _COMPILED[name] = (program, one.as_text(), memory_bytes(one))
    return devices


def compile_run(name: str) -> dict:
    """The JSON report of `spmdkit compile COMMANDS[name]` (the `h100` fixture ran it), its exit status checked."""
    result = _RUNS[name]
    assert result.returncode == (1 if name == "llama3_70b" else 0), result.stderr[-2000:]
    return json.loads(result.stdout)


def compile_flags(flags: str, devices: list, key: str | None = None) -> tuple:
    """(program, optimized GPU HLO text, memory) of the train step `spmdkit train FLAGS` runs, for `devices`."""
    if key in _COMPILED:
        return _COMPILED[key]
    program = build_program(parse_flags(f"{SMALL} {flags}".split(), TrainConfig()), devices)
    compiled = lower_train_step(program).compile(compiler_options=gpu_compiler_options())
    result = (program, compiled.as_text(), memory_bytes(compiled))
    if key:
        _COMPILED[key] = result
    return result


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_compiles_for_h100_with_its_async_collectives(name, h100):
    flags, expected = STRATEGIES[name]
    program, text, memory = compile_flags(flags, h100, key=name)
    report = collective_report(text)
    assert {c.opcode for c in report.collectives} >= expected, report.table()
    assert report.collectives and all(c.asynchronous or c.nothing_to_overlap for c in report.collectives), [
        c.name for c in report.collectives if not c.asynchronous
    ]
    if name == "fsdp":  # every gather and reduce-scatter overlaps a layer's compute
        assert all(c.asynchronous for c in report.collectives), report.table()
    assert attention_in_hlo(text, program.context) == program.attention
    if program.attention.endswith("cudnn"):
        assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text
    assert 0 < memory["total"] < gpu_target("h100").hbm_bytes


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_has_a_roofline_by_kind(name, h100):
    """`spmdkit compile --roofline` of every strategy: GEMMs, the attention and the collectives each a kind of their
    own, the kinds' FLOPs those `hlo_flops` counts (a pipeline: its busiest stage's at most), a step time and an
    MFU below 1 at the H100's peaks."""
    program, text, _ = compile_flags(STRATEGIES[name][0], h100, key=name)
    run = program.config.run
    model = program.model_config.flops_per_token(run.seq_len) * run.batch_size * run.seq_len / 8
    report = roofline_report(text, "h100", 8, program.pipeline, model)
    kinds = report["kinds"]
    assert {"gemm", "attention", "collective"} <= set(kinds), kinds
    assert report["step_seconds"] > 0 and 0 < report["mfu"] < 1
    branches = {TICK_SCOPE: program.pipeline.branch_runs()} if program.pipeline else None
    counted, flops = kinds["gemm"]["flops"] + kinds["attention"]["flops"], hlo_flops(text, branches=branches)
    assert counted <= flops["busiest"] if program.pipeline else counted == flops["total"]


def test_auto_attention_is_cudnn_on_h100_and_ulysses_or_ring_under_context(h100):
    kernels = {name: compile_flags(STRATEGIES[name][0], h100, key=name)[0].attention for name in STRATEGIES}
    assert {kernels[n] for n in ("dp", "zero1", "zero2", "fsdp", "hsdp", "tp", "tp_sp", "ep")} == {"cudnn"}
    assert kernels["cp"] == "ulysses_cudnn" and kernels["cp_ring"] == kernels["cp_2d"] == "ring"
    # pipeline stages and accumulation over replica axes run in a partly manual shard_map: cuDNN there too
    assert {kernels[n] for n in ("pp_1f1b", "pp_interleaved", "hsdp_accum", "ep_accum")} == {"cudnn"}


def test_cudnn_on_fsdp_8_compiles(h100):
    """The regression: cuDNN attention in a shard_map over a strict subset of the mesh axes (fsdp alone; data,
    tensor, ... of size 1 left out) failed in XLA:GPU's SPMD partitioner (custom_partitioner ...
    get_num_ways_dim_sharded AssertionError)."""
    program, text, _ = compile_flags(PROGRAMS["cudnn_fsdp8"], h100, key="cudnn_fsdp8")
    assert program.attention == "cudnn" and text.count("__cudnn$fmhaSoftmax") >= 1


def test_cudnn_takes_packed_documents_and_head_dim_256_on_hopper(h100):
    flags = PACKED_HD256
    program, text, _ = compile_flags(flags, h100, key="cudnn_packed_hd256")
    assert program.attention == "cudnn" and "segment_ids" in program.batch_keys()
    # the documents' mask goes in as a bias: cuDNN's scale-bias-softmax kernels, forward and backward
    assert "__cudnn$fmhaScaleBiasSoftmax" in text and "__cudnn$fmhaScaleBiasSoftmaxBackward" in text
    a100 = target_devices("a100", 8, 8)  # before Hopper cuDNN stops at head_dim 128: auto is blockwise there
    assert build_program(parse_flags(f"{SMALL} {flags}".split(), TrainConfig()), a100).attention == "blockwise"
    with pytest.raises(SpmdkitError, match="up to 128"):
        build_program(parse_flags(f"{SMALL} {flags} --attention cudnn".split(), TrainConfig()), a100)


def test_local_layers_reach_cudnn_with_their_window(h100):
    """A Gemma-like pattern (one local, one global layer): every cuDNN call of a local layer carries the window,
    forward and backward; the global layers' calls carry none."""
    _, text, _ = compile_flags(LOCAL, h100, key="local_window")
    assert attention_in_hlo(text) == "cudnn"
    windows = attention_windows(text)
    assert set(windows) == {0, 16} and windows[16] == windows[0] == 4  # 2 layers each: 2 forward + 2 backward


def test_a_soft_capped_windowed_model_compiles_the_blockwise_kernel(h100):
    """Gemma 2's soft-capping keeps cuDNN out: the blockwise kernel runs, its window splitting the diagonal block
    into sub-block steps (seq 128 is one block; the window 16 cuts it down to 16-position pairs)."""
    _, text, _ = compile_flags(PROGRAMS["softcapped_window"], h100, key="softcapped_window")
    assert attention_in_hlo(text) == "blockwise" and not attention_windows(text)


def test_cudnn_in_pipeline_stages_runs_its_forward_and_backward_kernels(h100):
    """The stages' cuDNN calls, in the regions nested inside the pipeline's shard_map: a forward per layer for the
    forward ticks and the backward's recompute, a backward kernel per layer."""
    program, text, _ = compile_flags(STRATEGIES["pp_1f1b"][0], h100, key="pp_1f1b")
    assert program.attention == "cudnn" and text.count("__cudnn$fmhaSoftmaxBackward") >= 1
    blockwise = build_program(
        parse_flags(f"{SMALL} {STRATEGIES['pp_1f1b'][0]} --attention blockwise".split(), TrainConfig()), h100
    )
    assert blockwise.attention == "blockwise"  # the explicit choice still runs


def _compute_between_start_and_done(text: str, opcode: str) -> list[int]:
    """For each `OPCODE-start` of the scheduled program: the fusions and custom calls scheduled before its done."""
    counts = []
    for body in re.split(r"\n\}\n", text):
        lines = body.splitlines()
        for i, line in enumerate(lines):
            if m := re.match(rf"\s*(?:ROOT )?%?([\w.\-]+) = .* {opcode}-start\(", line):
                done = next((j for j in range(i + 1, len(lines)) if f"{opcode}-done(%{m.group(1)})" in lines[j]), i)
                between = lines[i + 1 : done]
                counts.append(sum(bool(re.search(r" (fusion|custom-call)\(", b)) for b in between))
    return counts


def test_latency_hiding_scheduler_overlaps_fsdp_all_gathers_with_compute(h100):
    """With spmdkit's GPU flags (latency-hiding scheduler, pipelined all-gathers) the compiled FSDP step schedules
    work between an all-gather's start and its done: the parameter gathers of the next layer hide behind the
    current layer's matmuls."""
    _, text, _ = compile_flags(STRATEGIES["fsdp"][0], h100, key="fsdp")
    assert "is_scheduled=true" in text
    overlapped = _compute_between_start_and_done(text, "all-gather")
    assert overlapped and max(overlapped) >= 1 and sum(c > 0 for c in overlapped) >= len(overlapped) // 2, overlapped


def test_two_hosts_of_h200_compile_hybrid_data_fsdp(h100):
    devices = target_devices("h200", 16, 8)
    assert sorted({d.process_index for d in devices}) == [0, 1]
    program, text, _ = compile_flags(H200_TWO_HOSTS, devices, key="h200_two_hosts")
    hosts = [[d.process_index for d in row.flat] for row in program.mesh.devices.reshape(2, 8)]
    assert hosts == [[0] * 8, [1] * 8]  # data spans the hosts; fsdp stays inside each
    assert {c.opcode for c in collective_report(text).collectives} >= {"all-gather", "reduce-scatter", "all-reduce"}


@pytest.mark.parametrize("target", TARGETS)
def test_every_shipped_target_parses(target):
    info = gpu_target(target)
    devices = target_devices(target, 16, 8)
    assert len(devices) == 16 and devices[0].device_kind == info.device_kind
    assert 40e9 < info.hbm_bytes < 200e9


def test_missing_extra_is_one_line(monkeypatch):
    monkeypatch.setattr("spmdkit.targets.topology.aot_installed", lambda: False)
    with pytest.raises(SpmdkitError, match=r"spmdkit\[gpu-aot\]"):
        require_aot()


def test_compile_command_json_and_bad_input(h100):
    report = compile_run("json")
    assert report["target"] == "h100" and report["devices"] == 8 and report["fits"] is True
    assert report["attention_kernel"] == "cudnn" and report["per_device_bytes"]["total"] > 0
    for key in ("hbm_bytes", "collectives", "planner_bytes", "compile_seconds"):
        assert key in report
    reduce = report["collectives"]["all-reduce"]
    assert reduce["asynchronous"] + reduce["nothing_to_overlap"] == reduce["instructions"] and reduce["asynchronous"]
    assert report["compiler"].startswith("jaxlib ") and "jax-cuda1" in report["compiler"]  # what compiled it
    for name, needle in [
        ("bad_target", "h100, h200, a100, b200"),
        ("bad_devices", "--devices-per-host 8"),
        ("bad_mesh", "16 devices"),
    ]:
        bad = _RUNS[name]
        assert bad.returncode == 2 and len(error_lines(bad.stderr)) == 1 and needle in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr and "absl::InitializeLog" not in bad.stderr


def test_a_layout_that_does_not_fit_is_a_result_not_a_traceback(h100):
    report, result = compile_run("llama3_70b"), _RUNS["llama3_70b"]
    assert report["fits"] is False and report["per_device_bytes"]["total"] > report["usable_hbm_bytes"]
    assert report["remat_that_fits"] is None  # 70B's state alone is ~140 GB per device on 8 GPUs
    assert "does not fit" in result.stderr and "Traceback" not in result.stderr


def test_decode_step_compiles_for_h100_with_tensor_parallel_all_reduces(h100):
    report = compile_run("decode")
    assert report["program"] == "decode" and report["fits"] and report["attention_kernel"] == "dot"
    assert report["collectives"]["all-reduce"]["asynchronous"] > 0  # TP's per-layer sums, async pairs
    assert 0.5 < report["planner_ratio"] < 1.5  # weights + KV cache, as the inference planner counts them


def test_the_dropless_moe_step_reports_how_its_expert_gemms_compiled(h100):
    """`moe_gemm` of the tiny-moe dropless step on 8 x H100 with every expert local and no batch axis (tensor=8):
    `jax.lax.ragged_dot`, which this XLA lowers to a dense matmul of every routed row with every expert, E times the
    routed FLOPs, counted from the compiled dots. (With the batch split, dropless is the capacity dispatch with a
    sequence of slots per expert: E / k times, also dense; docs/jax-limits.md.)"""
    report = compile_run("moe_dropless")
    gemm, model = report["moe_gemm"], parse_flags(MOE_DROPLESS.split(), TrainConfig()).model.build()
    expected = model.experts
    assert gemm["kind"] == "dense" and gemm["grouped"] == 0 and gemm["dense"] > 0, gemm
    assert gemm["ratio"] == pytest.approx(expected, rel=0.01), gemm
    assert f"MoE GEMMs    dense: {expected:.2f} x the routed FLOPs" in format_report(report)


@pytest.mark.parametrize("name", ["llama3_8b_128k", "llama3_8b_128k_tp"])
def test_llama3_8b_at_128k_tokens_on_8_h100_fits_under_ulysses_with_cudnn(name, h100):
    """131,072 tokens of Llama-3-8B on one node, context=8 and context=4,tensor=2, remat full (#38): auto runs
    Ulysses around cuDNN (both fused kernels in the program), the state is sharded over context (12 GB of arguments
    per device, not 8 x), it fits, the output is exchanged in 2 head parts, every all-to-all is an async pair XLA
    overlaps with compute (none made synchronous on jaxlib 0.12: two collectives may be in flight,
    `targets/flags.py`; before the parts, the out exchange sat alone between attention and o_proj: 9 of 48 under
    tensor=2), and the planner's memory and all-to-all bytes are XLA's within 10%."""
    report = compile_run(name)
    assert report["fits"] and report["attention_kernel"] == "ulysses_cudnn"
    assert report["per_device_bytes"]["argument"] < 16e9  # 16 GB of float32 parameters and moments / 8, + batch
    exchange = report["collectives"]["all-to-all"]
    # q, k, v and the output's 2 parts: forward, again under full remat, backward; 32 layers
    assert report["ulysses_parts"] == 2 and exchange["executions"] == 5 * 3 * 32
    # jaxlib 0.12 overlaps all 60; 0.11.2's scheduler may leave one backward exchange with nothing beside it
    import jaxlib

    synchronous = 0 if tuple(int(p) for p in jaxlib.__version__.split(".")[:2]) >= (0, 12) else 1
    assert exchange["nothing_to_overlap"] <= synchronous, exchange
    assert exchange["asynchronous"] + exchange["nothing_to_overlap"] == exchange["instructions"], exchange
    assert 0.9 < report["planner_ratio"] < 1.1, (report["planner_ratio"], report["planner_memory"])
    planned = report["planner_collective_bytes"]["all-to-all"]
    assert 0.9 < planned / exchange["operand_bytes"] < 1.1


def test_llama3_8b_on_8_h100_fits_with_cudnn_and_the_planner_within_10_percent(h100):
    """README's 8B compile (fsdp=8, seq 8192, remat full) on this jaxlib: it fits, cuDNN runs the attention, no
    flag is left out, and the planner's bytes are XLA's within 10%."""
    report = compile_run("llama3_8b")
    assert report["fits"] and report["attention_kernel"] == "cudnn" and report["flags_left_out"] == []
    roofline = report["roofline"]  # --roofline: the kinds, a step at the peaks, MFU against the model's FLOPs
    assert {"gemm", "attention", "collective", "optimizer"} <= set(roofline["kinds"])
    assert 0.3 < roofline["mfu"] < 1 and roofline["step_seconds"] > 0
    assert 0.9 < report["planner_ratio"] < 1.1, (report["planner_ratio"], report["planner_memory"])


@pytest.mark.parametrize("remat", ["full", "none"])
def test_the_planner_counts_the_2d_exchanges_as_compiled(remat, h100):
    """2D on context=8 (Ulysses pairs, a ring of 4): the planner's all-to-all bytes are XLA:GPU's, with the ring's
    backward exchanging D = rowsum(dO * O) rather than out, and full remat's second forward sharing its q, k, v
    exchanges with the backward's (the planner counted both: 1.18 x XLA's bytes)."""
    flags = f"--mesh context=8 --context-parallel 2d --ulysses 2 --model.remat {remat}"
    program, text, _ = compile_flags(flags, h100)
    compiled = collective_report(text).bytes("all-to-all")
    planned = planner_estimate(program, "h100").collective_bytes["all-to-all"]
    assert compiled > 0 and planned == pytest.approx(compiled, rel=0.01)
