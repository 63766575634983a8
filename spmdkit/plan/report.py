"""The `spmdkit plan` report: explain the recommended layout in a paragraph, and print a table (or a PNG)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from spmdkit.errors import SpmdkitError
from spmdkit.models.remat import parse_remat
from spmdkit.plan.devices import node_local_axes
from spmdkit.plan.estimate import Estimate
from spmdkit.sharding.mesh_config import AXES, format_sizes


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
        text.append(f"Context parallelism over {mesh['context']} splits the {best.seq_len}-token sequences: "
                    f"{context_algorithm(best)}.")  # fmt: skip
    if parse_remat(best.remat).recomputes:
        text.append(f"Remat '{best.remat}' is the least recomputation that fits.")
    if runner_up is not None:
        text.append(f"Next: {format_sizes(runner_up.mesh)} ({runner_up.step_s / best.step_s - 1:+.0%} step time).")
    return " ".join(text)


def context_choice(e: Estimate) -> tuple[str, int]:
    """(--context-parallel, Ulysses factor) of a layout with a context axis: ("ulysses", C), ("2d", U) or
    ("ring", 1)."""
    if e.attention.startswith("ulysses"):
        return "ulysses", e.mesh["context"]
    return ("2d", e.ulysses) if e.ulysses > 1 else ("ring", 1)


def context_flag(e: Estimate) -> str:
    """The `--context-parallel` value (with `--ulysses` under 2D) of a layout with a context axis."""
    name, factor = context_choice(e)
    return f"2d --ulysses {factor}" if name == "2d" else name


def context_algorithm(e: Estimate) -> str:
    """The context-parallel algorithm of a layout, and why it moves what it moves."""
    name, factor = context_choice(e)
    if name == "ulysses":
        kernel = e.attention.removeprefix("ulysses_")
        return (f"Ulysses (all-to-alls trade the sequence split for a head split; {kernel} attends per device; "
                "its bytes per device stay constant as the context axis grows)")  # fmt: skip
    if name == "2d":
        return (f"2D, a ring of {e.mesh['context'] // factor} positions over Ulysses groups of {factor} "
                "(all-to-alls inside a group, K/V around the ring)")  # fmt: skip
    return "ring attention (K/V travel the ring, zigzag-balanced; the blockwise kernel per chunk pair)"


def _mesh_cell(e: Estimate) -> str:
    """The mesh column: the axis sizes, and the context algorithm where there is a context axis."""
    if e.mesh["context"] == 1:
        return format_sizes(e.mesh)
    name, factor = context_choice(e)
    return f"{format_sizes(e.mesh)} ({f'2d/u{factor}' if name == '2d' else name})"


def format_table(estimates: list[Estimate]) -> str:
    """One row per layout: mesh, settings, memory against HBM, step time and its parts, tokens/s, MFU."""
    head = f"{'#':>2} {'mesh':<34}{'zero':>5}{'sp':>4} {'remat':<20}{'M':>5} {'schedule':<12}{'mem/HBM GB':>13}"
    head += f"{'step s':>9}{'compute':>9}{'comm':>8}{'bubble':>8}{'tokens/s':>11}{'MFU':>6}"
    rows = [head]
    for i, e in enumerate(estimates, 1):
        sched = (
            "-" if e.mesh["pipeline"] == 1 else e.schedule + (f"x{e.virtual_stages}" if e.virtual_stages > 1 else "")
        )
        rows.append(
            f"{i:>2} {_mesh_cell(e):<34}{e.zero if e.mesh['fsdp'] * e.mesh['context'] > 1 else '-':>5}"
            f"{'y' if e.sequence_parallel else 'n':>4} {e.remat.replace('with_no_batch_dims_saveable', 'no_batch'):<20}"
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
    if e.host_bytes:
        moved = f", optimizer state moved in and out in {e.offload_s * 1e3:.1f} ms per step" if e.offload_s else ""
        lines.append(f"  {'host memory':<16}{e.host_bytes / 1e9:>10.2f} GB (pinned, not in the total){moved}")
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
    # Through a temporary file and a rename: a failed write never leaves a half-written image at `path`.
    target = Path(path)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(temporary, dpi=100, format=target.suffix.lstrip(".").lower() or "png")
        os.replace(temporary, target)
    except ValueError as error:  # matplotlib: an image format it does not write
        raise SpmdkitError(f"--plot {path}: {error}") from None
    except OSError as error:
        raise SpmdkitError(f"--plot {path}: cannot write it ({error.strerror or error})") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
