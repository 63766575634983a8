"""What a run checks before it builds or writes anything: that its directories can be written, and that the
checkpoint it resumes was saved with the same data settings (else the batches would differ from the saved run's).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from spmdkit.errors import SpmdkitError
from spmdkit.models.fields import field_docs
from spmdkit.train.config import SECTIONS, TrainConfig


def check_writable(directory: str | Path, flag: str) -> None:
    """SpmdkitError unless `directory` is a writable directory or can be created as one (nothing is created)."""
    path = Path(directory).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"lies under {existing}, which is a file"
        raise SpmdkitError(f"{flag} {path} {what}: pass a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing} cannot hold new directories)"
        raise SpmdkitError(f"{flag} {path} is not writable{where}: pass a directory you can write to")


def data_settings(config: TrainConfig) -> list[tuple[str, str, str]]:
    """(section, key, flag) of the settings that decide which batches a run reads: the batch size, sequence length,
    seed and every data setting (source, token dtype, eval share, ...)."""
    fields = [("run", f) for f in dataclasses.fields(config.run) if f.name in ("batch_size", "seq_len", "seed")]
    fields += [("data", f) for f in dataclasses.fields(config.data)]
    return [
        (section, f.name, (*field_docs(SECTIONS[section])[f.name][1], f"--{section}.{f.name.replace('_', '-')}")[0])
        for section, f in fields
    ]


def check_resume(config: TrainConfig, step: int, saved: dict[str, Any] | None, directory: Path) -> None:
    """Refuse to resume `step` (saved with config `saved`) when a data setting differs, unless
    `checkpoint.allow_data_change`. Mesh, device count, steps and everything else may change; a step without a
    saved config, and step 0 (an imported checkpoint: no data read yet), are not checked."""
    if saved is None or step == 0 or config.checkpoint.allow_data_change:
        return
    for section, key, flag in data_settings(config):
        ours, theirs = getattr(getattr(config, section), key), saved.get(section, {}).get(key)
        if theirs != ours:
            raise SpmdkitError(
                f"checkpoint step {step} in {directory} was saved with {flag} {theirs}, this run has {ours}: resuming "
                f"would read other batches than the saved run; pass {flag} {theirs} to continue it, "
                "--allow-data-change to resume with the new setting, or a fresh --checkpoint-dir"
            )
