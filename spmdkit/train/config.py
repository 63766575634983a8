"""The run's configuration: frozen dataclasses, read from TOML, overridden from the command line.

This module imports no JAX: the CLI reads it to print defaults, and `spmdkit plan` must start fast.

Sections: `model` (a preset plus numerics), `mesh` (layout and ZeRO stage), `optimizer`, `data`, `run`,
`checkpoint`.
A TOML file has one table per section; keys are the field names. The resolved config is saved as JSON into
every run directory (and every checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path
from typing import Any

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig, model_preset


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings. `lr` is the peak; it warms up linearly over `warmup_steps`, then decays by cosine to
    `lr * final_lr_fraction` at `decay_steps` (default: the run's steps)."""

    lr: float = 3e-3
    warmup_steps: int = 10
    decay_steps: int = 0
    final_lr_fraction: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    max_bad_steps: int = 5

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise SpmdkitError(f"learning rate {self.lr} must be positive")
        if self.warmup_steps < 0:
            raise SpmdkitError(f"warmup steps {self.warmup_steps} must be >= 0")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from.

    `source`: "stdlib" | "synthetic" | a path to a `.bin` or `.npy` token file.
    `token_dtype`: dtype of a raw `.bin` file ("uint16" or "uint32"); a `.npy` file carries its own.
    `eval_fraction`: held-out share (stdlib: whole files; token file: the tail of the stream).
    """

    source: str = "stdlib"
    token_dtype: str = "uint16"
    eval_fraction: float = 0.05


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """A model preset (`tiny`, `tiny-moe`, `125m`, `1b`, `7b`, `70b`, `405b`, `mixtral-8x7b`) and the numerics
    to run it with."""

    name: str = "tiny"
    dtype: str = "bfloat16"
    remat: str = "none"
    attention: str = "auto"  # "auto": ring attention when the mesh has context > 1, else dot
    dispatch: str = ""  # mixture of experts: capacity, dropless or dense ("" = the preset's)
    capacity_factor: float = 0.0  # mixture of experts, capacity dispatch (0 = the preset's)

    def build(self, context: int = 1) -> TransformerConfig:
        attention = ("ring" if context > 1 else "dot") if self.attention == "auto" else self.attention
        config = model_preset(self.name).replace(dtype=self.dtype, remat=self.remat, attention=attention)
        if self.dispatch:
            config = config.replace(dispatch=self.dispatch)
        return config.replace(capacity_factor=self.capacity_factor) if self.capacity_factor else config


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """`mesh` like "data=2,fsdp=2,tensor=2" (empty: every device on fsdp); `dcn` the across-node factors.

    With `pipeline` > 1 in the mesh: `pipeline_schedule` (gpipe, 1f1b, interleaved), `microbatches` per step
    (0: twice the stages) and `virtual_stages` (interleaved only).
    """

    mesh: str = ""
    dcn: str = ""
    zero: int = 3
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"
    microbatches: int = 0
    virtual_stages: int = 1


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Loop settings. `batch_size` is global, in sequences; `fail_steps` poisons those steps' gradients with
    NaN (for testing the skip path)."""

    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    seed: int = 0
    run_dir: str = "runs/default"
    peak_tflops: float = 0.0
    progress: bool = True
    fail_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise SpmdkitError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Orbax checkpoints. `directory` defaults to RUN_DIR/checkpoints; save every `every` steps (0: only at the
    end) and at the end, keep the newest `keep`; `resume` continues from the newest intact step found there."""

    directory: str = ""
    every: int = 100
    keep: int = 3
    resume: bool = True

    def __post_init__(self) -> None:
        if self.every < 0:
            raise SpmdkitError(f"--checkpoint-every must be >= 0 (got {self.every}; 0 saves only at the end)")
        if self.keep < 1:
            raise SpmdkitError(f"--keep must be at least 1 (got {self.keep})")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelSettings = ModelSettings()
    mesh: MeshSettings = MeshSettings()
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    run: RunSettings = RunSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


SECTIONS = {f.name: f.type for f in dataclasses.fields(TrainConfig)}


def _section_class(name: str) -> type:
    return typing.get_type_hints(TrainConfig)[name]


def _coerce(cls: type, key: str, value: Any) -> Any:
    """Check a value's type against the dataclass field (ints where floats go are fine)."""
    hint = typing.get_type_hints(cls)[key]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typing.get_origin(hint) is tuple and isinstance(value, list):
        return tuple(value)
    base = typing.get_origin(hint) or hint
    if isinstance(base, type) and not isinstance(value, base):
        raise SpmdkitError(f"config key {cls.__name__}.{key} should be {base.__name__}, got {value!r}")
    return value


def apply_overrides(config: TrainConfig, overrides: dict[str, dict[str, Any]]) -> TrainConfig:
    """Replace fields section by section: `{"run": {"steps": 60}}`. Unknown sections and keys are errors."""
    changes = {}
    for section, values in overrides.items():
        if section not in SECTIONS:
            raise SpmdkitError(f"unknown config section [{section}]: expected one of {', '.join(SECTIONS)}")
        cls = _section_class(section)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise SpmdkitError(f"unknown config key {section}.{key}: expected one of {', '.join(sorted(known))}")
        current = getattr(config, section)
        changes[section] = dataclasses.replace(current, **{k: _coerce(cls, k, v) for k, v in values.items()})
    return dataclasses.replace(config, **changes)


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a TOML config file into section -> {key: value}."""
    path = Path(path)
    if not path.is_file():
        raise SpmdkitError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise SpmdkitError(f"config file {path} is not valid TOML: {error}") from None
    for section, values in data.items():
        if not isinstance(values, dict):
            raise SpmdkitError(f"config file {path}: top-level key {section!r} must be a [section] table")
    return data


def config_from_json(text: str) -> TrainConfig:
    """Inverse of `TrainConfig.to_json` (used when resuming and inspecting checkpoints)."""
    return apply_overrides(TrainConfig(), json.loads(text))
