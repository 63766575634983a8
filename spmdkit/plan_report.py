"""Layout search and the `spmdkit plan` report: enumerate meshes, keep those that fit, rank by estimated step
time, explain the winner in a paragraph, and print a table (or JSON, or a PNG). The arithmetic of one layout is
`spmdkit.plan.estimate`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import PRESETS, TransformerConfig, model_preset
from spmdkit.plan import (
    REMAT_ORDER,
    SCHEDULES,
    Estimate,
    Layout,
    check_layout,
    estimate,
    evaluate,
    memory,
)
from spmdkit.plan_devices import (
    AXES,
    DEVICE_TYPES,
    Device,
    candidate_meshes,
    make_device,
    node_local_axes,
    parse_mesh,
)
from spmdkit.sharding.mesh import format_sizes  # plain Python: no JAX


def _variants(model: TransformerConfig, mesh: dict[str, int], batch_size: int, seq_len: int, zero: int | None,
              sequence_parallel: bool | None, remat: str | None, microbatches: int | None, schedule: str | None,
              virtual_stages: int | None) -> list[list[list[Layout]]]:  # fmt: skip
    """Layouts to try on `mesh`: per (ZeRO stage, pipeline schedule), per remat policy (least recompute first), per
    microbatch count. Settings left None are searched: ZeRO 2 and 3 where fsdp > 1; SP wherever tensor > 1; 1F1B
    and interleaved (v=2) pipelines; accumulation steps (powers of two) or pipeline microbatches P, 2P, 4P, 8P and
    one sequence per data-parallel rank."""
    T, P, F = mesh["tensor"], mesh["pipeline"], mesh["fsdp"]
    local_batch, sp = (
        batch_size // (mesh["data"] * F * mesh["expert"]),
        bool(T > 1 if sequence_parallel is None else sequence_parallel),
    )
    pipes = (
        [(schedule or "1f1b", virtual_stages or (2 if schedule == "interleaved" else 1))] if P > 1 else [("1f1b", 1)]
    )
    if P > 1 and schedule is None and model.layers % (2 * P) == 0:
        pipes.append(("interleaved", virtual_stages or 2))
    out = []
    for z in [zero] if zero is not None else ([2, 3] if F > 1 else [3]):
        for sched, v in pipes:
            if microbatches:
                counts = [microbatches]
            elif P == 1:
                counts = [2**k for k in range(local_batch.bit_length()) if local_batch % 2**k == 0]
            else:
                counts = [c for c in sorted({P, 2 * P, 4 * P, 8 * P, local_batch}) if local_batch % c == 0 and c >= P]
            layout = functools.partial(Layout, mesh=tuple(mesh.items()), batch_size=batch_size, seq_len=seq_len,
                                       zero=z, sequence_parallel=sp, schedule=sched, virtual_stages=v)  # fmt: skip
            policies = [remat] if remat else REMAT_ORDER
            out.append([[layout(model.replace(remat=r), microbatches=M) for M in counts] for r in policies])
    return out


def search(
    model: TransformerConfig,
    meshes: list[dict[str, int]],
    dev: Device,
    batch_size: int,
    seq_len: int,
    *,
    zero: int | None = None,
    sequence_parallel: bool | None = None,
    remat: str | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    efficiency: float = 0.5,
    comm_efficiency: float = 0.8,
) -> tuple[list[Estimate], Estimate | None]:
    """(the layouts that fit, fastest first; the smallest one that does not fit, or None).

    Per mesh and per (ZeRO stage, schedule) of `_variants`: the least-recompute remat policy that fits, with its
    fastest microbatch count. Layouts spmdkit cannot run (indivisible sizes) are skipped."""
    fitting, smallest = [], (math.inf, None)
    settings = (zero, sequence_parallel, remat, microbatches, schedule, virtual_stages)
    for mesh in meshes:
        for by_policy in _variants(model, mesh, batch_size, seq_len, *settings):
            for layouts in by_policy:
                fit = []
                for layout in layouts:
                    try:
                        check_layout(layout)
                    except SpmdkitError:
                        continue
                    need = sum(memory(layout).values())
                    if need <= dev.hbm_bytes:
                        fit.append(evaluate(layout, dev, efficiency, comm_efficiency))
                    smallest = min(smallest, (need, layout), key=lambda x: x[0])
                if fit:
                    fitting.append(min(fit, key=lambda e: e.step_s))
                    break
    fitting.sort(key=lambda e: (e.step_s, e.total_memory))
    return fitting, (evaluate(smallest[1], dev, efficiency, comm_efficiency) if smallest[1] else None)


def explain(best: Estimate, runner_up: Estimate | None, gpus_per_node: int) -> str:
    """One paragraph: why this layout (TP and EP inside a node, PP across nodes, DP/FSDP outermost, CP for long
    context)."""
    mesh, local = best.mesh, node_local_axes(best.mesh, gpus_per_node)
    gb = lambda b: f"{b / 1e9:,.0f} GB" if b >= 1e11 else f"{b / 1e9:.3g} GB"  # noqa: E731
    wire = {x: sum(float(r["wire_bytes"]) for g, r in best.traffic.items() if x in g.split("+")) for x in AXES}
    # Gradient and parameter traffic: every group over data or fsdp, each counted once.
    replicated = sum(float(r["wire_bytes"]) for g, r in best.traffic.items() if {"data", "fsdp"} & set(g.split("+")))
    where = {x: "inside a node (NVLink)" if x in local else "across nodes (InfiniBand)" for x in AXES}
    text = [
        f"{format_sizes(mesh)} is the fastest layout that fits: {best.step_s:.3g} s per step, {best.tokens_per_s:,.0f} "
        f"tokens/s, MFU {best.mfu:.0%}, {gb(best.total_memory)} of {gb(best.hbm_bytes)} per device."
    ]
    if mesh["tensor"] > 1:
        text.append(
            f"Tensor parallelism over {mesh['tensor']} runs {where['tensor']}: its {gb(wire['tensor'])} of activation "
            f"collectives per step{' (sequence-parallel)' if best.sequence_parallel else ''} cannot hide behind "
            "compute, so they need the fastest links."
        )
    if mesh["expert"] > 1:
        # The "expert" row is the all-to-alls alone (gradients reduce over groups that include other axes).
        a2a = float(best.traffic.get("expert", {}).get("wire_bytes", 0.0))
        crowded = "" if "expert" in local else f" (expert x tensor = {mesh['expert'] * mesh['tensor']} exceeds a node)"
        text.append(
            f"Expert parallelism over {mesh['expert']} runs {where['expert']}{crowded}: each device holds "
            f"1/{mesh['expert']} of the experts, and the batch is split over expert too. Every MoE layer sends its "
            f"routed tokens to their experts and back in all-to-alls ({gb(a2a)} per step) that wait on the router "
            "and block the layer: latency- and bandwidth-hungry, they belong on the fastest links."
        )
    if mesh["pipeline"] > 1:
        virtual = f" x {best.virtual_stages} virtual stages" if best.virtual_stages > 1 else ""
        text.append(
            f"Pipeline parallelism over {mesh['pipeline']} runs {where['pipeline']}: only stage-boundary activations "
            f"travel ({gb(wire['pipeline'])} per step), and {best.schedule} with {best.microbatches} "
            f"microbatches{virtual} leaves a {best.bubble:.1%} bubble."
        )
    if mesh["fsdp"] > 1 or mesh["data"] > 1:
        state = {0: "nothing", 1: "the optimizer state", 2: "gradients and optimizer state"}.get(best.zero, "all state")
        parts = [f"FSDP over {mesh['fsdp']} (ZeRO-{best.zero}) shards {state}"] if mesh["fsdp"] > 1 else []
        parts += [f"{mesh['data']} data-parallel replicas"] if mesh["data"] > 1 else []
        text.append(
            f"Outermost, {' across '.join(parts)}: their {gb(replicated)} of gradient and parameter "
            "traffic per step overlaps the backward pass."
        )
    if mesh["context"] > 1:
        text.append(
            f"Context parallelism over {mesh['context']} splits the {best.seq_len}-token sequences (ring attention)."
        )
    if best.remat != "none":
        text.append(f"Remat '{best.remat}' is the least recomputation that fits.")
    if runner_up is not None:
        text.append(f"Next: {format_sizes(runner_up.mesh)} ({runner_up.step_s / best.step_s - 1:+.0%} step time).")
    return " ".join(text)


def format_table(estimates: list[Estimate]) -> str:
    """One row per layout: mesh, settings, memory against HBM, step time and its parts, tokens/s, MFU."""
    head = f"{'#':>2} {'mesh':<34}{'zero':>5}{'sp':>4} {'remat':<14}{'M':>5} {'schedule':<12}{'mem/HBM GB':>13}"
    head += f"{'step s':>9}{'compute':>9}{'comm':>8}{'bubble':>8}{'tokens/s':>11}{'MFU':>6}"
    rows = [head]
    for i, e in enumerate(estimates, 1):
        sched = (
            "-" if e.mesh["pipeline"] == 1 else e.schedule + (f"x{e.virtual_stages}" if e.virtual_stages > 1 else "")
        )
        rows.append(
            f"{i:>2} {format_sizes(e.mesh):<34}{e.zero if e.mesh['fsdp'] > 1 else '-':>5}"
            f"{'y' if e.sequence_parallel else 'n':>4} {e.remat.replace('with_no_batch_dims_saveable', 'no_batch'):<14}"
            f"{e.microbatches:>5} {sched:<12}{f'{e.total_memory / 1e9:.1f}/{e.hbm_bytes / 1e9:.0f}':>13}"
            f"{e.step_s:>9.3g}{e.compute_s:>9.3g}{e.exposed_comm_s:>8.3g}{e.bubble_s:>8.3g}{e.tokens_per_s:>11,.0f}"
            f"{e.mfu:>6.1%}"
        )
    return "\n".join(rows)


def format_details(e: Estimate) -> str:
    """Memory by component, traffic per mesh axis and collective bytes per opcode of one layout."""
    lines = [f"memory per device ({'fits' if e.fits else 'does NOT fit'}: {e.margin / 1e9:+.1f} GB of margin)"]
    lines += [f"  {k:<16}{v / 1e9:>10.2f} GB" for k, v in e.memory.items()]
    lines.append(f"  {'total':<16}{e.total_memory / 1e9:>10.2f} GB of {e.hbm_bytes / 1e9:.0f} GB")
    lines.append("traffic per step per device (ring formulas)")
    lines += [
        f"  {axes:<22}{r['link']:<12}{float(r['wire_bytes']) / 1e9:>10.3f} GB{float(r['seconds']) * 1e3:>10.1f} ms"
        for axes, r in e.traffic.items()
    ] or ["  (none)"]
    lines.append("collective operand bytes per step per device (as in the compiled HLO)")
    lines += [f"  {op:<22}{b / 1e9:>10.3f} GB" for op, b in sorted(e.collective_bytes.items())] or ["  (none)"]
    return "\n".join(lines)


def plot(estimates: list[Estimate], path: str) -> None:
    """PNG: stacked per-device memory against HBM, and the step-time breakdown, for each layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg without touching pyplot's global backend
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(8.0, 2.2 * len(estimates)), 5.5))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    labels = [f"#{i}\n" + format_sizes(e.mesh).replace(",", "\n") for i, e in enumerate(estimates, 1)]  # table ranks
    x = list(range(len(estimates)))
    memory_parts = {k: [e.memory[k] for e in estimates] for k in estimates[0].memory}
    time_parts = {k: [getattr(e, f"{k}_s") for e in estimates] for k in ("compute", "exposed_comm", "bubble")}
    for ax, parts, scale, unit in [(left, memory_parts, 1e9, "GB per device"), (right, time_parts, 1, "s per step")]:
        bottom = [0.0] * len(x)
        for name, values in parts.items():
            ax.bar(x, [v / scale for v in values], bottom=bottom, label=name.replace("_", " "))
            bottom = [b + v / scale for b, v in zip(bottom, values, strict=True)]
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel(unit)
    left.axhline(estimates[0].hbm_bytes / 1e9, color="black", linestyle="--", label="HBM")
    left.set_title("memory")
    right.set_title("step time")
    for ax in (left, right):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `spmdkit plan` subcommand (its handler is `run_plan`)."""
    parser = subparsers.add_parser(
        "plan",
        help="predict memory, traffic, bubble and MFU of a layout; recommend one",
        description="Estimate a layout's per-device memory, collective traffic, pipeline bubble, step time and MFU "
        "(no accelerator needed). Without --mesh, search the meshes of --devices and recommend the fastest that "
        "fits; settings not given (ZeRO stage, SP, remat, microbatches, schedule) are searched too.",
    )
    add = parser.add_argument
    add("--model", default="7b", help=f"model preset: {', '.join(PRESETS)} (default: 7b)")
    add("--devices", type=int, default=8, help="number of accelerators (default: 8)")
    add("--device-type", default="h100", help=f"{', '.join(DEVICE_TYPES)} (default: h100)")
    add("--gpus-per-node", type=int, help="devices per node / fast-link domain (default: the device's)")
    add("--hbm-gb", type=float, help="HBM per device in GB (custom devices; overrides the table)")
    add("--peak-tflops", type=float, help="dense bf16 peak TFLOP/s per device (custom devices)")
    add("--intra-node-gbs", type=float, help="NVLink/ICI GB/s per device per direction (custom devices)")
    add("--inter-node-gbs", type=float, help="InfiniBand/DCN GB/s per device per direction (custom devices)")
    add("--batch-size", type=int, help="global batch in sequences (default: about 1M tokens)")
    add("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    add("--dtype", default="bfloat16", help="compute dtype: bfloat16, float16, float32 (default: bfloat16)")
    add("--mesh", help="evaluate this mesh, e.g. 'fsdp=8,tensor=8' (default: search)")
    add("--zero", type=int, help="ZeRO stage 0-3 over fsdp (default: search 2 and 3)")
    add("--remat", help="none, full, dots_saveable, dots_with_no_batch_dims_saveable (default: search)")
    add("--sequence-parallel", action=argparse.BooleanOptionalAction, help="SP with TP (default: on when tensor > 1)")
    add("--microbatches", type=int, help="gradient-accumulation / pipeline microbatches (default: search)")
    add("--pipeline-schedule", help=f"{', '.join(SCHEDULES)} (default: search 1f1b and interleaved)")
    add("--virtual-stages", type=int, help="virtual stages per device for the interleaved schedule")
    add("--efficiency", type=float, default=0.5, help="achieved share of peak FLOP/s (default: 0.5)")
    add("--top", type=int, default=5, help="layouts to list (default: 5)")
    add("--json", action="store_true", help="print JSON instead of text")
    add("--plot", metavar="FILE.png", help="write memory and step-time bars of the listed layouts")
    parser.set_defaults(handler=run_plan)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    """One-line errors for settings that would otherwise only make every layout look impossible."""
    if args.devices < 1 or args.seq_len < 1 or (args.batch_size is not None and args.batch_size < 1):
        raise SpmdkitError("--devices, --seq-len and --batch-size must be positive")
    if args.zero is not None and args.zero not in (0, 1, 2, 3):
        raise SpmdkitError(f"--zero {args.zero} is not one of 0, 1, 2, 3")
    if args.pipeline_schedule is not None and args.pipeline_schedule not in SCHEDULES:
        raise SpmdkitError(
            f"unknown --pipeline-schedule {args.pipeline_schedule!r}: choose one of {', '.join(SCHEDULES)}"
        )
    if min(args.microbatches or 1, args.virtual_stages or 1, args.top) < 1 or not 0 < args.efficiency <= 1:
        raise SpmdkitError("--microbatches, --virtual-stages and --top must be positive, --efficiency in (0, 1]")


def run_plan(args: argparse.Namespace) -> int:
    """Handler of `spmdkit plan`: print the table (or JSON), the chosen layout's details and why."""
    model = model_preset(args.model).replace(dtype=args.dtype, remat=args.remat or "none")
    dev = make_device(
        args.device_type,
        hbm_gb=args.hbm_gb,
        peak_tflops=args.peak_tflops,
        intra_node_gbs=args.intra_node_gbs,
        inter_node_gbs=args.inter_node_gbs,
        gpus_per_node=args.gpus_per_node,
    )
    _check_args(args)
    if args.mesh:
        meshes = [parse_mesh(args.mesh, args.devices)]
        replicas = meshes[0]["data"] * meshes[0]["fsdp"] * meshes[0]["expert"]
        batch = args.batch_size or replicas * max(1, round(2**20 / args.seq_len / replicas))
    else:
        batch = args.batch_size or max(1, 2**20 // args.seq_len)
        meshes = list(candidate_meshes(model, args.devices, dev.gpus_per_node, batch, args.seq_len))
    fitting, smallest = search(
        model, meshes, dev, batch, args.seq_len, zero=args.zero, sequence_parallel=args.sequence_parallel,
        remat=args.remat, microbatches=args.microbatches, schedule=args.pipeline_schedule,
        virtual_stages=args.virtual_stages, efficiency=args.efficiency,
    )  # fmt: skip
    if args.mesh and smallest is None:  # no setting could run on this mesh: raise its own error
        estimate(model, meshes[0], device=dev, batch_size=batch, seq_len=args.seq_len, zero=3 if args.zero is None
                 else args.zero, sequence_parallel=bool(args.sequence_parallel), microbatches=args.microbatches,
                 schedule=args.pipeline_schedule or "1f1b", virtual_stages=args.virtual_stages or 1)  # fmt: skip
    if not fitting and not (args.mesh and smallest):
        raise SpmdkitError(
            f"no layout of {args.devices} x {dev.name} fits {args.model} with batch {batch} x {args.seq_len}"
            + (f" (smallest needs {smallest.total_memory / 1e9:.0f} GB)" if smallest else "")
            + ": add devices, shorten the batch or sequence, or check --mesh/--zero/--remat"
        )
    shown = fitting[: max(1, args.top)] or [smallest]
    best = shown[0]
    runner_up = next((e for e in fitting if e.mesh != best.mesh), None)
    why = explain(best, runner_up, dev.gpus_per_node) if best.fits else ""
    if args.plot:
        plot(shown, args.plot)
    if args.json:
        report = {"recommended": best.to_dict(), "explanation": why, "candidates": [e.to_dict() for e in shown]}
        print(json.dumps(report, indent=1))
        return 0
    title = f"spmdkit plan: {args.model} on {args.devices} x {dev.name} ({dev.gpus_per_node} per node), batch {batch}"
    print(f"{title} x {args.seq_len} tokens, {args.dtype}; {len(fitting)} layouts on {len(meshes)} meshes fit")
    print(format_table(shown))
    print(f"\n{'recommended' if best.fits else 'does NOT fit'}: {format_sizes(best.mesh)}\n{format_details(best)}")
    if why:
        print(f"\n{why}")
    return 0
