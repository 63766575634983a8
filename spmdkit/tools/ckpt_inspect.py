"""`spmdkit ckpt inspect` and `spmdkit ckpt verify`: what a checkpoint directory holds, and whether it is intact.

`inspect_checkpoint` reads metadata only (no arrays): the steps, and for one step the saved config, every
array's path, shape, dtype and size, and the data-iterator files. `verify_checkpoint` reads every step in full
(onto the host CPU, one step at a time) and applies the rules resume applies (`Checkpointer.verify`): items
complete, every array readable, its checksum as saved, and finite; it reports each step as intact or damaged,
naming the damaged arrays.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from spmdkit.checkpoint.integrity import data_files
from spmdkit.checkpoint.steps import open_step
from spmdkit.errors import SpmdkitError
from spmdkit.inspect.params import human_bytes


def inspect_checkpoint(directory: str | Path, step: int | None = None) -> dict[str, Any]:
    """Metadata of `step` (default: the newest) of the checkpoint directory, as a JSON-ready dict."""
    checkpointer, step = open_step(directory, step)
    with contextlib.closing(checkpointer):
        steps = checkpointer.steps()
        try:
            shapes = checkpointer.saved_shapes(step)
        except Exception as error:  # noqa: BLE001 - unreadable metadata: report, don't crash
            raise SpmdkitError(
                f"step {step} of {checkpointer.directory} is unreadable ({type(error).__name__}): run "
                "'spmdkit ckpt verify' on the directory"
            ) from None
        try:
            config = checkpointer.read_config(step)
        except Exception:  # noqa: BLE001 - the config item is optional (saved by training, not by the library)
            config = None
        arrays = [
            {"path": path, "shape": list(shape), "dtype": dtype, "bytes": math.prod(shape) * np.dtype(dtype).itemsize}
            for path, (shape, dtype) in shapes.items()
        ]
        model = [a for a in arrays if a["path"].startswith("model/")]
        directory = checkpointer.directory
        names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        return {
            "directory": str(directory),
            "steps": steps,
            "step": step,
            "parameters": sum(math.prod(a["shape"]) for a in model),
            "parameter_bytes": sum(a["bytes"] for a in model),
            "total_bytes": sum(a["bytes"] for a in arrays),
            "arrays": arrays,
            "data_files": data_files(directory / str(step) / "data"),
            "config": config,
            "unfinished": [n for n in names if ".orbax-checkpoint-tmp" in n],
            "set_aside": [n for n in names if ".damaged-" in n],
        }


def format_inspection(info: dict[str, Any]) -> str:
    lines = [
        f"checkpoint  {info['directory']}",
        f"steps       {', '.join(map(str, info['steps']))} (showing {info['step']})",
    ]
    config = info["config"]
    if config:
        model, mesh, run = config.get("model", {}), config.get("mesh", {}), config.get("run", {})
        lines.append(
            f"saved by    model {model.get('name')} ({model.get('dtype')} compute), mesh "
            f"{mesh.get('mesh') or 'all devices on fsdp'}, {run.get('steps')} steps planned, batch "
            f"{run.get('batch_size')} x {run.get('seq_len')}"
        )
    lines += [
        f"parameters  {info['parameters']:,} ({human_bytes(info['parameter_bytes'])}); all arrays "
        f"{human_bytes(info['total_bytes'])}",
        f"data        {', '.join(info['data_files']) or 'no data-iterator state'}",
    ]
    if info["unfinished"]:
        lines.append(f"unfinished  {', '.join(info['unfinished'])} (interrupted saves; ignored)")
    if info["set_aside"]:
        lines.append(f"set aside   {', '.join(info['set_aside'])} (found damaged on resume)")
    width = max(len(a["path"]) for a in info["arrays"])
    lines.append("")
    for a in info["arrays"]:
        shape = str(tuple(a["shape"]))
        lines.append(f"  {a['path']:<{width}}  {shape:<18} {a['dtype']:<8} {human_bytes(a['bytes']):>10}")
    return "\n".join(lines)


ROTATED = "rotated away while reading, skipped"


def _files(step_dir: Path) -> set[str]:
    """The files of a step directory (paths within it; none when it is gone): what a rotation deletes."""
    return {str(Path(root, name).relative_to(step_dir)) for root, _, names in os.walk(step_dir) for name in names}


def verify_checkpoint(directory: str | Path) -> list[dict[str, Any]]:
    """[{"step", "ok", "problem"}] for every step, by the rules resume applies (see `Checkpointer.verify`).

    The steps are listed once. A run still training deletes its oldest steps while they are read: a step that
    fails and has lost any of the files it had when its reading began was rotated away (or set aside), not
    damaged: "ok" is None and the problem says so (a damaged step keeps its files: it is only wrong)."""
    checkpointer, _ = open_step(directory, choose=" (verify reads every step)")
    with contextlib.closing(checkpointer):
        report = []
        for step in checkpointer.steps():
            step_dir = checkpointer.directory / str(step)
            before = _files(step_dir)
            try:
                problems = checkpointer.verify(step)
            except Exception:  # noqa: BLE001 - a step deleted under the reader may fail in any way
                problems = [ROTATED]
                if before and before <= _files(step_dir):
                    raise
            if problems and (not before or not before <= _files(step_dir)):
                report.append({"step": step, "ok": None, "problem": ROTATED})
            else:
                report.append({"step": step, "ok": not problems, "problem": "; ".join(problems) or None})
        return report


def format_verification(directory: str | Path, report: list[dict[str, Any]]) -> str:
    lines = [f"step {r['step']}: " + {True: "ok", None: ROTATED}.get(r["ok"], f"DAMAGED ({r['problem']})")
             for r in report]  # fmt: skip
    intact, bad = sum(r["ok"] is True for r in report), sum(r["ok"] is False for r in report)
    gone = len(report) - intact - bad
    lines.append(
        f"{intact} of {len(report)} steps intact in {Path(directory).absolute()}"
        + (f"; {gone} rotated away while reading (a run is saving there), not checked" if gone else "")
        + (f"; {bad} damaged: delete them (resume skips them with a warning)" if bad else "")
    )
    return "\n".join(lines)
