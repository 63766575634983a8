"""Opening one step of a checkpoint directory for reading: which step, and the config saved with it.

Every reader of a saved run (`ckpt` tools, generation, evaluation) picks a step the same way: the newest unless one
is asked for, and a missing directory, step or config item is one line saying what to pass instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spmdkit.checkpoint.manager import Checkpointer
from spmdkit.errors import SpmdkitError


def check_not_a_step(directory: str | Path, choose: str = " with --step {step}") -> None:
    """SpmdkitError when `directory` is one step of a checkpoint directory (`CKPT/4`), saying what to pass instead;
    `choose`: how the command picks a step (formatted with `step`)."""
    path = Path(directory).expanduser().absolute()
    if path.name.isdigit() and ((path / "_CHECKPOINT_METADATA").is_file() or (path / "state").is_dir()):
        raise SpmdkitError(
            f"{path} is step {path.name} of the checkpoint directory {path.parent}: pass {path.parent}"
            + choose.format(step=path.name)
        )


def open_step(
    directory: str | Path, step: int | None = None, choose: str = " with --step {step}"
) -> tuple[Checkpointer, int]:
    """A read-only `Checkpointer` on `directory` and the step to read: `step`, or the newest (the caller closes
    the checkpointer); `choose`: as `check_not_a_step` takes it."""
    check_not_a_step(directory, choose)
    checkpointer = Checkpointer(directory, read_only=True)
    steps = checkpointer.steps()
    if steps and (step is None or step in steps):
        return checkpointer, steps[-1] if step is None else step
    checkpointer.close()
    if not steps:
        raise SpmdkitError(f"no checkpoint steps in {checkpointer.directory}: pass a directory written by training")
    raise SpmdkitError(f"step {step} is not in {checkpointer.directory}: it holds steps {', '.join(map(str, steps))}")


def saved_config(checkpointer: Checkpointer, step: int) -> dict[str, Any]:
    """The run config saved with `step` (the JSON object `TrainConfig.to_json` wrote)."""
    try:
        return checkpointer.read_config(step)
    except Exception:  # noqa: BLE001 - a missing or unreadable config item: say what is needed
        raise SpmdkitError(
            f"step {step} of {checkpointer.directory} holds no config item: only checkpoints written by "
            "'spmdkit train' or 'spmdkit ckpt import-hf' know their model"
        ) from None
