"""Compile a run's exact training step for a GPU cluster that is not here, and read what XLA:GPU made of it.

`compile_for_target(config, target="h100", devices=8, per_host=8)` builds the run's program (`build_program`: the
same mesh, rules, kernel and schedule `spmdkit train` uses) over compile-only devices of the target, lowers the
train step on `ShapeDtypeStruct`s (nothing is allocated, no weight exists), compiles it with spmdkit's XLA:GPU
flags and returns a report: per-device bytes against the target's HBM, the attention kernel found in the compiled
program, the collectives (kind, count, bytes, async), the FLOPs with loop trip counts multiplied, the speed
levers' marks (FP8 GEMMs, windowed einsums: `spmdkit.inspect.levers`) and the planner's prediction of the same
layout. With `--overlap-tp` the compile takes the windowed-einsum flags too (`spmdkit.targets.flags.run_flags`).
"""

from __future__ import annotations

import dataclasses
import re
import resource
import time
from typing import Any

import jax
import jaxlib

from spmdkit.distributed.platform import cuda_plugin
from spmdkit.inspect.flops import hlo_flops
from spmdkit.inspect.hlo import collective_report
from spmdkit.inspect.levers import expert_gemms, fp8_gemms, windowed_einsums
from spmdkit.inspect.roofline import kind_table, roofline
from spmdkit.parallel.experts import EXPERT_OPS
from spmdkit.parallel.pipeline.schedule import TICK_SCOPE, Schedule
from spmdkit.plan.devices import make_device, wire_bytes
from spmdkit.plan.estimate import REMAT_ORDER, evaluate  # least recompute first: tried after the run's own
from spmdkit.sharding.mesh_config import format_sizes
from spmdkit.sharding.strategy import Strategy, mesh_text
from spmdkit.targets import gpu_target, target_devices
from spmdkit.targets.device_facts import cudnn_checks_for
from spmdkit.targets.flags import compile_with_options, gpu_compiler_options, run_flags
from spmdkit.targets.topology import host_count
from spmdkit.tools.host_memory import annotate_host_arrays, host_positions
from spmdkit.train.config import TrainConfig
from spmdkit.train.step.program import TrainProgram, build_program

CACHE_SCORES = "btkgd,bskd->bkgts"  # generation's attention over the KV cache (`spmdkit.inference.attention`)
BLOCK_SCORES = "...hgqd,...hkd->...hgqk"  # the score einsum of `spmdkit.kernels.attention_block`
DOT_SCORES = "bqkgd,bskd->bkgqs"  # the score einsum of `spmdkit.models.attention.dot_attention`
USABLE_HBM = 0.95  # of the device's memory: the CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers take the rest


def attention_in_hlo(text: str, context: int = 1) -> str:
    """The attention kernel the compiled program holds, read from its instructions and their source names:
    `cudnn` (cuDNN's fused-attention custom calls), `ring` (the block kernel's score einsum and K/V hopping by
    collective-permute), `blockwise` (the block kernel's score einsum, `spmdkit.kernels.attention_block`) or `dot`
    (the reference's full score einsum), prefixed `ulysses_` where all-to-alls of Ulysses' scope exchange the
    sequence for heads; `none` when none is there."""
    ulysses = (
        "ulysses_" if context > 1 and any("all-to-all" in x and "/ulysses/" in x for x in text.splitlines()) else ""
    )
    if "__cudnn$fmha" in text:
        return ulysses + "cudnn"
    if BLOCK_SCORES in text:
        return "ring" if context > 1 and not ulysses and "collective-permute" in text else ulysses + "blockwise"
    return ulysses + "dot" if DOT_SCORES in text or CACHE_SCORES in text else "none"


def attention_windows(text: str) -> dict[int, int]:
    """{sliding window: how many of cuDNN's fused-attention calls (forward and backward) run it} in the compiled
    program (0: global attention): where a model's local layers reach the GPU kernel."""
    windows: dict[int, int] = {}
    for line in text.splitlines():
        if "__cudnn$fmha" in line and "custom-call(" in line:
            found = re.search(r'"sliding_window_length":\s*"?(\d+)', line)
            window = int(found.group(1)) if found else 0
            windows[window] = windows.get(window, 0) + 1
    return dict(sorted(windows.items()))


def memory_bytes(compiled: Any) -> dict[str, int]:
    """Per-device bytes of the compiled step; `total` = arguments + outputs - aliased (donated) + temporaries, in the
    device's memory only: XLA counts arrays in host memory (`--optimizer.offload`) apart, in its host_* sizes, and
    `host` is their total the same way (host arguments + outputs - aliased + temporaries)."""
    m = compiled.memory_analysis()
    out = {
        "argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "alias": m.alias_size_in_bytes,
        "temp": m.temp_size_in_bytes, "generated_code": m.generated_code_size_in_bytes,
        "host_temp": m.host_temp_size_in_bytes,
    }  # fmt: skip
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["generated_code"]
    host = m.host_argument_size_in_bytes + m.host_output_size_in_bytes - m.host_alias_size_in_bytes
    out["host"] = host + m.host_temp_size_in_bytes
    return out


def planner_estimate(program: TrainProgram, target: str) -> Any:
    """`spmdkit.plan.estimate` of the program's layout on the target."""
    return evaluate(program.layout(), make_device(target))  # the layout build_program checked


def remat_that_fits(config: TrainConfig, devices: list[Any], usable: int, state_bytes: float) -> str | None:
    """The first remat policy, least recomputation first, whose compiled step fits in `usable` bytes per device
    (each one compiled: the answer is XLA's, not the planner's). None at once when the state alone (`state_bytes`:
    parameters, gradients and optimizer, which no remat policy changes) does not fit."""
    if state_bytes > usable:
        return None
    current = config.model.remat
    lighter = REMAT_ORDER[REMAT_ORDER.index(current) + 1 :] if current in REMAT_ORDER else REMAT_ORDER
    for policy in lighter:
        trial = dataclasses.replace(config, model=dataclasses.replace(config.model, remat=policy))
        options = gpu_compiler_options(run_flags(config.mesh.overlap_tp))
        compiled, _ = compile_with_options(lower_train_step(build_program(trial, devices, abstract=True)), options)
        if memory_bytes(compiled)["total"] <= usable:
            return policy
    return None


def planner_layout(program: TrainProgram, target: str, devices: int, per_host: int) -> str | None:
    """The flags of the fastest layout the planner says fits these devices (`spmdkit plan`'s search), or None."""
    from spmdkit.plan.search import candidate_meshes, search

    run = program.config.run
    # the attention *setting* (auto: ring where a candidate has a context axis), not the kernel of this mesh
    model = program.model_config.replace(attention=program.config.model.attention)
    meshes = list(candidate_meshes(model, devices, per_host, run.batch_size, run.seq_len))
    lora = program.config.lora if program.config.lora.enabled else None
    device = make_device(target, gpus_per_node=per_host)
    fitting, _ = search(model, meshes, device, run.batch_size, run.seq_len, lora=lora)
    if not fitting:
        return None
    best = fitting[0]
    mesh = mesh_text({k: v for k, v in best.mesh.items() if v > 1}) or "fsdp=1"
    microbatches = best.microbatches if best.microbatches > 1 else None
    strategy = Strategy(mesh, best.zero, best.sequence_parallel, microbatches, best.schedule, best.virtual_stages)
    return f"{strategy.flags()} --model.remat {best.remat}"


def lower_train_step(program: TrainProgram) -> Any:
    """The program's train step lowered on `ShapeDtypeStruct`s (state and batch as the trainer shards them), JAX's
    cuDNN checks answering for the target GPU (`cudnn_checks_for`: they run while the whole step is traced)."""
    state, keys = program.abstract_state(), program.batch_keys()
    with cudnn_checks_for(program.mesh.devices.flat[0]):
        lowered = program.train_step(state, keys).lower(state.state, program.abstract_batch(keys))
    if program.config.optimizer.offload:  # compile-only devices drop memory kinds: put them back (host_memory)
        kept = lowered._lowering.compile_args["kept_var_idx"]
        annotate_host_arrays(lowered, *host_positions(state.state, len(keys), kept))
    return lowered


def moe_gemm(text: str, program: TrainProgram, devices: int) -> dict[str, Any] | None:
    """How the experts' GEMMs compiled (None without experts): `kind` `grouped` (a grouped GEMM per weight) or
    `dense` (dense matmuls: `jax.lax.ragged_dot` lowered to a masked matmul over every expert, or batched GEMMs over
    the capacity slots; `loop`, a loop over experts, is what no spmdkit dispatch compiles to), the `dispatch` that
    ran and why, and their FLOPs per device: forward, `recompute` (remat reruns the forward inside the backward:
    its op_name holds `rematted_computation`) and backward (`transpose(`), each against the routed FLOPs of that
    pass (each token through its top_k experts: 6 x embed x routed_mlp x top_k per token and MoE layer forward,
    twice that backward, the forward again where the program recomputes it: the remat factor)."""
    m, run = program.model_config, program.config.run
    if not m.moe_layers:
        return None
    found = expert_gemms(text, EXPERT_OPS)
    ops = "(?:" + "|".join(re.escape(n) for n in EXPERT_OPS) + ")"
    backward_all = hlo_flops(text, where=re.compile(rf'op_name="[^"]*transpose\([^"]*{ops}'))["matmul"]
    recompute = hlo_flops(text, where=re.compile(rf'op_name="[^"]*rematted_computation[^"]*{ops}'))["matmul"]
    forward, backward = found["flops"] - backward_all, backward_all - recompute
    routed_blocks = m.moe_layers + m.mtp_moe_layers  # multi-token prediction's MoE blocks route tokens too
    per_pass = 6 * m.embed * m.routed_mlp * m.top_k * routed_blocks * run.batch_size * run.seq_len / devices
    remat_factor = 1 + (recompute > 0)  # how often the routed forward runs
    routed = per_pass * (remat_factor + 2)
    kind = "grouped" if found["grouped"] and not found["dense"] else "dense"
    return {
        "kind": kind, "dispatch": m.dispatch, "dispatch_reason": program.dispatch_reason, **found,
        "forward_flops": forward, "recompute_flops": recompute, "backward_flops": backward, "routed_flops": routed,
        "remat_factor": remat_factor, "ratio": found["flops"] / routed if routed else None,
        "forward_ratio": (forward + recompute) / (per_pass * remat_factor) if routed else None,
        "backward_ratio": backward / (2 * per_pass) if routed else None,
    }  # fmt: skip


def compile_decode(config: TrainConfig, devices: list[Any]) -> tuple[Any, Any, dict[str, float]]:
    """The decode program of `spmdkit generate` for `config`'s model on the inference mesh `--mesh` names (tensor
    and data only) over `devices`: `batch_size` rows, a cache of `seq_len` positions, its weights abstract.
    Returns (compiled, mesh, the inference planner's {weights, kv_cache} bytes per device)."""
    from flax import nnx

    from spmdkit.inference.engine import Generator
    from spmdkit.inference.loading import abstract_model, generation_config, inference_mesh, inference_rules
    from spmdkit.plan.inference import decode_memory
    from spmdkit.train.step.program import resolve_config

    resolved, run = resolve_config(config), config.run
    model = generation_config(resolved.model.build())
    mesh, rules = inference_mesh(config.mesh.mesh, devices), inference_rules()
    graphdef, abstract, shardings = abstract_model(model, mesh, rules)
    state = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), abstract, shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )  # fmt: skip
    generator = Generator(nnx.merge(graphdef, state), mesh, rules, max_len=run.seq_len)
    compiled = generator.decode_program(run.batch_size, run.seq_len)
    plan = decode_memory(model, dict(mesh.shape), None, batch=run.batch_size, context=run.seq_len)
    return compiled, mesh, plan


def base_report(
    target: str,
    devices: int,
    per_host: int,
    config: TrainConfig,
    mesh: Any,
    compiled: Any,
    seconds: float,
    planned: dict[str, float],
    context: int = 1,
    text: str | None = None,
    schedule: Schedule | None = None,
) -> dict[str, Any]:
    """The keys every compiled program's report has: where it runs, its bytes against the HBM and the planner's
    `planned` {term: bytes}, the kernel, collectives and FLOPs found in it (a pipeline's branches as often as its
    `schedule` runs them: the mean over devices, and the busiest), the compile time and peak RSS."""
    branches = {TICK_SCOPE: schedule.branch_runs()} if schedule else None
    info, text, memory = gpu_target(target), text or compiled.as_text(), memory_bytes(compiled)
    usable, total = int(USABLE_HBM * info.hbm_bytes), sum(planned.values())
    return {
        "target": target, "device_kind": info.device_kind, "devices": devices, "hosts": host_count(devices, per_host),
        "mesh": format_sizes(dict(mesh.shape)), "model": config.model.name, "batch_size": config.run.batch_size,
        "seq_len": config.run.seq_len, "fits": memory["total"] <= usable, "per_device_bytes": memory,
        "host_bytes": memory["host"], "hbm_bytes": info.hbm_bytes, "usable_hbm_bytes": usable,
        "attention_kernel": attention_in_hlo(text, context), "attention_windows": attention_windows(text),
        "fp8_gemms": fp8_gemms(text), "windowed_einsums": windowed_einsums(text),
        "collectives": collective_report(text, branches).by_opcode(),
        "flops_per_device": hlo_flops(text, branches=branches),
        "planner_bytes": total, "planner_memory": dict(planned),
        "planner_ratio": total / memory["total"] if memory["total"] else None,
        "remat_that_fits": None, "compile_seconds": round(seconds, 2),
        "compiler": f"jaxlib {jaxlib.__version__}, {cuda_plugin() or 'no CUDA plugin'}",  # "..., jax-cuda13-plugin X"
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # this process, so far
    }  # fmt: skip


def roofline_report(
    text: str, target: str, per_host: int, schedule: Schedule | None = None, model_flops: float | None = None
) -> dict[str, Any]:
    """`spmdkit.inspect.roofline` of the compiled program `text` at the target's peaks (the planner's device table:
    bf16 dense FLOP/s, HBM bytes/s), each collective priced by its ring's wire bytes over NVLink (a group within
    `per_host` devices) or the InfiniBand NIC, nominal; MFU against `model_flops` per device."""
    device = make_device(target)

    def link_seconds(opcode: str, group: int, operand: int) -> float:
        link = device.intra_node_bw if group <= per_host else device.inter_node_bw
        return wire_bytes(opcode, max(group, 2), operand) / link

    branches = {TICK_SCOPE: schedule.branch_runs()} if schedule else None
    return roofline(text, device.peak_flops, device.hbm_bw, link_seconds, branches).report(model_flops)


def decode_report(
    config: TrainConfig, target: str, devices: int, per_host: int, with_roofline: bool = False
) -> dict[str, Any]:
    """`spmdkit compile --decode`: the report of `compile_decode` (the keys of `compile_for_target`'s)."""
    started = time.perf_counter()
    compiled, mesh, plan = compile_decode(config, target_devices(target, devices, per_host))
    seconds = time.perf_counter() - started
    report = {"program": "decode", **base_report(target, devices, per_host, config, mesh, compiled, seconds, plan)}
    if with_roofline:
        report["roofline"] = roofline_report(compiled.as_text(), target, per_host)
    return report


def compile_for_target(
    config: TrainConfig, target: str = "h100", devices: int = 8, per_host: int = 8, with_roofline: bool = False
) -> dict[str, Any]:
    """Compile `config`'s train step for `devices` GPUs of `target` (`per_host` per host); the report as a dict
    (`with_roofline`: its "roofline" too, `roofline_report`)."""
    gpus = target_devices(target, devices, per_host)
    program = build_program(config, gpus, abstract=True)
    started = time.perf_counter()
    options = gpu_compiler_options(run_flags(config.mesh.overlap_tp))  # --overlap-tp: windowed einsum flags too
    compiled, dropped = compile_with_options(lower_train_step(program), options)
    seconds = time.perf_counter() - started
    plan, text = planner_estimate(program, target), compiled.as_text()
    report = base_report(
        target, devices, per_host, program.config, program.mesh, compiled, seconds, plan.memory, program.context, text,
        program.pipeline,
    )  # fmt: skip
    fits, usable, run = report["fits"], report["usable_hbm_bytes"], program.config.run
    # the planner's per-device parameters, gradients and optimizer state (they match the compiled arguments)
    state = sum(plan.memory.get(k, 0.0) for k in ("parameters", "gradients", "optimizer"))
    model_flops = program.model_config.flops_per_token(run.seq_len) * run.batch_size * run.seq_len  # what MFU counts
    report.update(
        remat=program.model_config.remat, zero=program.rules.zero_stage,
        ulysses_parts=program.model_config.ulysses_parts,
        model_flops_per_device=model_flops / devices,
        planner_collective_bytes=dict(plan.collective_bytes),
        remat_that_fits=None if fits else remat_that_fits(config, gpus, usable, state),
        planner_layout=None if fits else planner_layout(program, target, devices, per_host),
        flags_left_out=dropped,  # spmdkit's XLA:GPU flags this jaxlib does not have
        moe_gemm=moe_gemm(text, program, devices),
    )  # fmt: skip
    if with_roofline:
        report["roofline"] = roofline_report(text, target, per_host, program.pipeline, model_flops / devices)
    return report


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def format_report(report: dict[str, Any]) -> str:
    """The report as the lines `spmdkit compile` prints."""
    m, r = report["per_device_bytes"], report
    verdict = "fits" if r["fits"] else "does NOT fit"
    decode = r.get("program") == "decode"
    layout = "decode step" if decode else f"train step, ZeRO-{r['zero']}, remat {r['remat']}"
    flops, model = r["flops_per_device"], r.get("model_flops_per_device")
    busiest = f"; branches as the schedule runs them: the mean device, the busiest {flops['busiest'] / 1e12:.3f}"
    busiest = busiest if flops["busiest"] != flops["total"] else ""  # a pipeline's stages run different branches
    model_flops = f", model {model / 1e12:.2f} ({flops['total'] / model:.2f} x)" if model else ""
    lines = [
        f"target       {r['devices']} x {r['device_kind']} ({r['hosts']} host(s)), mesh {r['mesh']}",
        f"program      {r['model']} {layout}, batch {r['batch_size']} x {r['seq_len']}",
        f"memory       per device {_gb(m['total'])}: arguments {_gb(m['argument'])} + outputs {_gb(m['output'])} "
        f"- aliased {_gb(m['alias'])} + temporaries {_gb(m['temp'])}"
        + (f"; host memory {_gb(m['host'])} (not in the total)" if m.get("host") else ""),
        f"             {verdict} in {_gb(r['usable_hbm_bytes'])} usable of {_gb(r['hbm_bytes'])} HBM; planner "
        f"{_gb(r['planner_bytes'])} ({r['planner_ratio']:.2f} x XLA:GPU)",
        f"attention    {r['attention_kernel']} (found in the compiled program)" + _windows_text(r)
        + (f"; its output exchanged in {r['ulysses_parts']} head parts" if r.get("ulysses_parts", 1) > 1 else ""),
        f"FLOPs        {flops['total'] / 1e12:.3f} TFLOP per device per call of the program (loops "
        f"multiplied{busiest}){model_flops}",
        "collectives  " + (", ".join(
            f"{op} x{t['executions']} ({t['asynchronous']}/{t['instructions']} async{_no_overlap(t)}, "
            f"{_gb(t['operand_bytes'])})"
            for op, t in r["collectives"].items()
        ) or "none"),
        _levers_text(r),
        f"compile      {r['compile_seconds']:.1f} s ({r['compiler']})",
    ]  # fmt: skip
    if r.get("moe_gemm"):
        g = r["moe_gemm"]
        lines.insert(
            -2,
            f"MoE GEMMs    {g['kind']}: {g['ratio']:.2f} x the routed FLOPs ({g['flops'] / 1e12:.3f} TFLOP per device; "
            f"forward {g['forward_ratio']:.2f} x{' run twice (remat)' if g['remat_factor'] > 1 else ''}, backward "
            f"{g['backward_ratio']:.2f} x); dispatch {g['dispatch_reason']}",
        )
    if r.get("roofline"):
        lines += ["roofline     per device per call, each kernel at the peak FLOP/s or HBM bandwidth (whichever "
                  "binds):", *("  " + row for row in kind_table(r["roofline"]).splitlines())]  # fmt: skip
    if r["remat_that_fits"]:
        lines.append(f"hint         --model.remat {r['remat_that_fits']} fits this mesh (compiled)")
    elif r.get("planner_layout"):
        lines.append(
            f"hint         the planner's fastest layout that fits: {r['planner_layout']} (compile it to check)"
        )
    return "\n".join(lines)


def _no_overlap(totals: dict[str, int]) -> str:
    """ ", 2 with nothing to overlap": the collectives XLA made synchronous because nothing could run beside them."""
    n = totals.get("nothing_to_overlap", 0)
    return f", {n} with nothing to overlap" if n else ""


def _levers_text(report: dict[str, Any]) -> str:
    """The speed levers' marks in the compiled program: FP8 GEMMs, windowed einsums, bytes kept in host memory."""
    fp8, windowed = report.get("fp8_gemms") or {}, report.get("windowed_einsums") or {}
    text = (
        f"levers       FP8 GEMMs {fp8.get('instructions', 0)} (x{fp8.get('executions', 0)} per call), windowed "
        f"einsums {windowed.get('loops', 0)} loops ({windowed.get('collective_permutes', 0)} collective-permutes, "
        f"{windowed.get('asynchronous', 0)} async)"
    )
    host = report.get("host_bytes")
    return text + (f", host memory {_gb(host)}" if host is not None else "")


def _windows_text(report: dict[str, Any]) -> str:
    windows = {w: n for w, n in report.get("attention_windows", {}).items() if w}
    return "; sliding windows " + ", ".join(f"{w} ({n} calls)" for w, n in windows.items()) if windows else ""


def not_fit_line(report: dict[str, Any]) -> str:
    """The one line of a layout that does not fit (exit 1)."""
    m = report["per_device_bytes"]
    hint = f": try --model.remat {report['remat_that_fits']}" if report["remat_that_fits"] else ""
    if not hint and report.get("planner_layout"):
        hint = f": the planner suggests {report['planner_layout']}"
    return (
        f"does not fit: {_gb(m['total'])} per device on {report['mesh']} against {_gb(report['usable_hbm_bytes'])} "
        f"usable of {report['device_kind']}'s {_gb(report['hbm_bytes'])}{hint}"
    )
