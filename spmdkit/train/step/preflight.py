"""What a run checks before it builds or writes anything: that its directories can be written, and that the
checkpoint it resumes was saved with the same data settings (else the batches would differ from the saved run's)
and the same model function and optimizer (else the run would silently continue another one).
"""

from __future__ import annotations

import dataclasses
import json
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


def _flags(section: str, names: list[str]) -> list[tuple[str, str, str]]:
    """(section, key, flag) of each name, the flag being the field's first short flag or `--section.key`."""
    docs = field_docs(SECTIONS[section])
    return [(section, name, (*docs[name][1], f"--{section}.{name.replace('_', '-')}")[0]) for name in names]


def data_settings(config: TrainConfig) -> list[tuple[str, str, str]]:
    """(section, key, flag) of the settings that decide which batches a run reads: the batch size, sequence length,
    seed and every data setting (source, token dtype, eval share, ...)."""
    run = [f.name for f in dataclasses.fields(config.run) if f.name in ("batch_size", "seq_len", "seed")]
    return _flags("run", run) + _flags("data", [f.name for f in dataclasses.fields(config.data)])


# What a resumed run may change freely: where the model comes from and how it is computed (the kernel, remat and
# chunking compute the same function), and how the optimizer is run (its offload, its bad-step limit).
_HOW = {"model": {"name", "init_from", "remat", "attention", "attention_block", "loss_chunk", "ulysses_parts"},
        "optimizer": {"max_bad_steps", "offload"}}  # fmt: skip


def function_settings(config: TrainConfig) -> list[tuple[str, str, str]]:
    """(section, key, flag) of the settings that change what the model computes (every model field but `_HOW`'s:
    activation, RoPE, norms, windows, soft-caps, losses, dtypes, ...) or what the optimizer does (its schedule and
    AdamW's constants): a resume that changes one continues another function from the saved state."""
    return [
        flag
        for section in ("model", "optimizer")
        for flag in _flags(section, [f.name for f in dataclasses.fields(getattr(config, section))])
        if flag[1] not in _HOW[section] and (section, flag[1]) != ("optimizer", "name")  # `_check_optimizer`'s
    ]


def _check_optimizer(config: TrainConfig, step: int, saved: dict[str, Any], directory: Path) -> None:
    """Refuse a resume with another optimizer (AdamW <-> Muon): the saved state holds the other one's moments, no
    `--allow-config-change` can carry them over (a saved config without the setting is an AdamW run's)."""
    theirs, ours = saved.get("optimizer", {}).get("name", "adamw"), config.optimizer.name
    if theirs != ours:
        raise SpmdkitError(
            f"checkpoint step {step} in {directory} holds {theirs}'s optimizer state, this run asks for {ours}: pass "
            f"--optimizer.name {theirs} to continue it, or a fresh --checkpoint-dir with --init-from {directory} to "
            f"start {ours} from its weights"
        )


def _allowed(config: TrainConfig) -> set[tuple[str, str]]:
    """(section, key) of each setting `--allow-config-change` names (as `key`, `section.key` or its flag, `-` or
    `_`); SpmdkitError naming one that is no setting a resume compares."""
    settings = function_settings(config)
    allowed = set()
    for name in filter(None, (config.checkpoint.allow_config_change or "").split(",")):
        given = name.strip().lstrip("-").replace("-", "_")
        found = [(s, k) for s, k, flag in settings if given in (k, f"{s}.{k}", flag.lstrip("-").replace("-", "_"))]
        if not found:
            raise SpmdkitError(
                f"--allow-config-change {name}: not a model or optimizer setting a resume compares; name fields as "
                "key or section.key, e.g. activation,model.rope_theta,lr"
            )
        allowed.update(found)
    return allowed


def check_config_changes(config: TrainConfig) -> None:
    """SpmdkitError when `--allow-config-change` names something that is not a compared setting (before a run
    builds anything)."""
    _allowed(config)


def check_lora_base(config: TrainConfig, step: int, saved: dict[str, Any], directory: Path) -> None:
    """Refuse to resume a LoRA run's `step` on other adapters' settings or another base than it trained on (the
    saved `lora.base_checksum` of its `--init-from` weights)."""
    theirs, ours = saved.get("lora") or {}, dataclasses.asdict(config.lora)
    if theirs.get("rank", 0) == ours["rank"] == 0:
        return
    for key in ("rank", "alpha", "targets", "quantize"):
        if theirs.get(key, {"rank": 0, "quantize": "none"}.get(key)) != ours[key]:
            raise SpmdkitError(
                f"checkpoint step {step} in {directory} was saved with --lora.{key} {theirs.get(key)}, this run has "
                f"{ours[key]}: pass the saved value to continue it, or a fresh --checkpoint-dir"
            )
    if theirs.get("base_checksum") != ours["base_checksum"]:
        raise SpmdkitError(
            f"checkpoint step {step} in {directory} trained adapters on other base weights (--init-from "
            f"{saved.get('model', {}).get('init_from')}, checksum {theirs.get('base_checksum')}) than this run's "
            f"--init-from {config.model.init_from} (checksum {ours['base_checksum']}): give the run's base weights"
        )


def check_resume(
    config: TrainConfig, step: int, saved: dict[str, Any] | None, directory: Path
) -> dict[str, tuple[Any, Any]]:
    """Refuse to resume `step` (saved with config `saved`) when a data setting differs, unless
    `checkpoint.allow_data_change`, or when a setting of the model's function or the optimizer's differs, unless
    `checkpoint.allow_config_change` names it; the changes allowed, flag -> (saved, new). Mesh, device count, steps,
    kernels, remat and the rest may change; a step without a saved config, and step 0 (an imported checkpoint: no
    data read yet), are not checked, nor a setting the saved config lacks (an earlier spmdkit's)."""
    if saved is None or step == 0:
        return {}
    _check_optimizer(config, step, saved, directory)
    check_lora_base(config, step, saved, directory)
    for section, key, flag in [] if config.checkpoint.allow_data_change else data_settings(config):
        ours, theirs = getattr(getattr(config, section), key), saved.get(section, {}).get(key)
        if theirs != ours:
            raise SpmdkitError(
                f"checkpoint step {step} in {directory} was saved with {flag} {theirs}, this run has {ours}: resuming "
                f"would read other batches than the saved run; pass {flag} {theirs} to continue it, "
                "--allow-data-change to resume with the new setting, or a fresh --checkpoint-dir"
            )
    changed = {
        (section, key, flag): (theirs, ours)
        for section, key, flag in function_settings(config)
        if key in saved.get(section, {})
        and (theirs := saved[section][key]) != (ours := json.loads(json.dumps(getattr(getattr(config, section), key))))
    }
    allowed = _allowed(config)
    refused = [
        f"{flag} {theirs} -> {ours}" for (s, k, flag), (theirs, ours) in changed.items() if (s, k) not in allowed
    ]
    if refused:
        raise SpmdkitError(
            f"checkpoint step {step} in {directory} was saved with other model or optimizer settings "
            f"({'; '.join(refused)}): pass the saved values to continue it, --allow-config-change FIELD,... to resume "
            "with the change (recorded in metrics.jsonl), or a fresh --checkpoint-dir"
        )
    return {flag: change for (_, _, flag), change in changed.items()}
