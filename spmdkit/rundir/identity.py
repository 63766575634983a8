"""A run's identity: an id made at the run's first start and kept in `RUN_DIR/.spmdkit-run-id`.

Every checkpoint step a run saves, on either tier, records it (`checkpoint.owner`), so that a run restores, and
rotates away, only its own steps: a node-local directory reused by a second run, or a `--checkpoint-dir` pointed at
another run's steps, is refused in one line instead of being adopted. A run directory without the file (a first
start, or a run from before ids) takes the id of its checkpoint directory's newest step when that records one (a
run continued in a new run directory), else a new one.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from spmdkit.errors import SpmdkitError

RUN_ID_FILE = ".spmdkit-run-id"


def new_run_id() -> str:
    """A fresh id: 16 random hex digits."""
    return uuid.uuid4().hex[:16]


def read_run_id(run_dir: str | Path) -> str | None:
    """The id kept in `run_dir` (None without one); SpmdkitError when the file is there but unreadable or empty."""
    path = Path(run_dir) / RUN_ID_FILE
    if not path.exists():
        return None
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise SpmdkitError(f"cannot read the run's id from {path} ({error}): restore the file or delete it") from None
    if not text or not text.isalnum():
        raise SpmdkitError(f"{path} holds no run id (it must be one word of letters and digits): restore or delete it")
    return text


def write_run_id(run_dir: str | Path, run_id: str) -> None:
    """Keep `run_id` in `run_dir` (written whole or not at all: a temporary file, then a rename)."""
    path = Path(run_dir) / RUN_ID_FILE
    staging = path.with_name(f"{RUN_ID_FILE}.{os.getpid()}.tmp")
    staging.write_text(run_id + "\n", encoding="ascii")
    os.replace(staging, path)
