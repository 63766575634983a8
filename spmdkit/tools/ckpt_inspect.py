"""`spmdkit ckpt inspect` and `spmdkit ckpt verify`: what a checkpoint directory holds, and whether it is intact.

`inspect_checkpoint` reads metadata only (no arrays): the steps, and for one step the saved config, every
array's path, shape, dtype and size, and the data-iterator files. `verify_checkpoint` reads every step in full
(onto the host CPU, one step at a time), checks that the arrays are finite and that the data and config items
are complete, and reports each step as intact or damaged.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np

from spmdkit.checkpoint.manager import Checkpointer, describe_error, drop_orphaned_reads
from spmdkit.errors import SpmdkitError
from spmdkit.inspect.params import human_bytes

_DATA_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def _open(directory: str | Path) -> Checkpointer:
    checkpointer = Checkpointer(directory, read_only=True)
    if not checkpointer.steps():
        checkpointer.close()
        raise SpmdkitError(f"no checkpoint steps in {checkpointer.directory}: pass a directory written by training")
    return checkpointer


def _leftovers(directory: Path) -> dict[str, list[str]]:
    names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    return {
        "unfinished": [n for n in names if ".orbax-checkpoint-tmp" in n],
        "set_aside": [n for n in names if ".damaged-" in n],
    }


def _data_files(step_dir: Path) -> list[str]:
    data = step_dir / "data"
    return sorted(p.name for p in data.iterdir() if _DATA_FILE.fullmatch(p.name)) if data.is_dir() else []


def inspect_checkpoint(directory: str | Path, step: int | None = None) -> dict[str, Any]:
    """Metadata of `step` (default: the newest) of the checkpoint directory, as a JSON-ready dict."""
    checkpointer = _open(directory)
    try:
        steps = checkpointer.steps()
        step = steps[-1] if step is None else step
        if step not in steps:
            raise SpmdkitError(
                f"step {step} is not in {checkpointer.directory}: it holds steps {', '.join(map(str, steps))}"
            )
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
        return {
            "directory": str(checkpointer.directory),
            "steps": steps,
            "step": step,
            "parameters": sum(math.prod(a["shape"]) for a in model),
            "parameter_bytes": sum(a["bytes"] for a in model),
            "total_bytes": sum(a["bytes"] for a in arrays),
            "arrays": arrays,
            "data_files": _data_files(checkpointer.directory / str(step)),
            "config": config,
            **_leftovers(checkpointer.directory),
        }
    finally:
        checkpointer.close()


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


def _check_data(step_dir: Path) -> str | None:
    """None if the data item is absent or complete; otherwise what is wrong."""
    if not (step_dir / "data").exists():
        return None
    files = _data_files(step_dir)
    if not files:
        return "data/ holds no process_*-of-*.json file"
    counts = {int(_DATA_FILE.fullmatch(f).group(2)) for f in files}
    if len(counts) != 1:
        return f"data/ mixes process counts {sorted(counts)}"
    (count,) = counts
    missing = [i for i in range(count) if f"process_{i}-of-{count}.json" not in files]
    if missing:
        return f"data/ lacks the iterator state of process(es) {missing} of {count}"
    for name in files:
        try:
            json.loads((step_dir / "data" / name).read_text())
        except ValueError:
            return f"data/{name} is not valid JSON"
    return None


def verify_checkpoint(directory: str | Path) -> list[dict[str, Any]]:
    """[{"step", "ok", "problem"}] for every step: arrays readable and finite, data and config complete."""
    checkpointer = _open(directory)
    device = jax.devices("cpu")[0]
    report = []
    try:
        for step in checkpointer.steps():
            problem = None
            try:
                state = checkpointer.read_state(step, device)
                for path, array in jax.tree_util.tree_leaves_with_path(state):
                    value = np.asarray(array)
                    if value.dtype.kind == "f" and not np.isfinite(value).all():
                        problem = f"{jax.tree_util.keystr(path)} holds NaN or Inf"
                        break
                problem = problem or _check_data(checkpointer.directory / str(step))
                if problem is None and (checkpointer.directory / str(step) / "config").exists():
                    checkpointer.read_config(step)
            except Exception as error:  # noqa: BLE001 - any failure to read is what verify reports
                problem = describe_error(error)
            report.append({"step": step, "ok": problem is None, "problem": problem})
            if problem is not None:
                drop_orphaned_reads()
    finally:
        checkpointer.close()
    return report


def format_verification(directory: str | Path, report: list[dict[str, Any]]) -> str:
    lines = [f"step {r['step']}: " + ("ok" if r["ok"] else f"DAMAGED ({r['problem']})") for r in report]
    bad = sum(not r["ok"] for r in report)
    lines.append(
        f"{len(report) - bad} of {len(report)} steps intact in {Path(directory).absolute()}"
        + (f"; {bad} damaged: delete them (resume skips them with a warning)" if bad else "")
    )
    return "\n".join(lines)
