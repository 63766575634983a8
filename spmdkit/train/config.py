"""The run's configuration: frozen dataclasses, one per section, each field with its help and short flags. No JAX
(nor tyro) is imported here: the CLI reads it to print defaults, and `spmdkit plan` must start fast. Sections:
`model` (a preset or model path, `init_from`, the numerics, any `TransformerConfig` field to override the shape),
`mesh` (layout, ZeRO stage), `optimizer`, `data`, `run`, `checkpoint`, `health`, `lora`. A TOML file (`--config`,
`config_from_toml`) has one table per section, keyed by field name; "unset" is `None` (`decay_steps`: the run's
steps). The resolved config is saved as JSON into every run directory and checkpoint. Each field is `Annotated` with
a `tyro.conf.arg` (its one-line help and the short flags the command line also accepts, `--steps` for `run.steps`;
`field_docs` reads them); `spmdkit.cli.train` hands `TrainConfig` to `tyro.cli` as is.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from spmdkit.data.config import DataConfig
from spmdkit.errors import SpmdkitError
from spmdkit.interop.sources import source_model
from spmdkit.models.attention_choice import CONTEXT_PARALLEL_HELP, ContextParallel
from spmdkit.models.config import Attention, Dtype, Remat, TransformerConfig
from spmdkit.models.fields import arg, check_types, field_docs, require
from spmdkit.models.lora_config import LoraConfig
from spmdkit.models.presets import PRESETS
from spmdkit.models.remat import HELP as REMAT_HELP
from spmdkit.models.resolve import build_model, resolved_settings
from spmdkit.plan.limits import check_sizes
from spmdkit.sharding.strategy import Schedule
from spmdkit.train.optimizer_config import OptimizerConfig

__all__ = [
    "CheckpointSettings", "DataConfig", "HealthSettings", "MeshSettings", "ModelSettings", "OptimizerConfig",
    "RunSettings", "TrainConfig", "apply_overrides", "checkpoint_directory", "config_from_json", "config_from_toml",
]  # fmt: skip


def _model_fields() -> list[tuple[str, Any, Any]]:
    """`ModelSettings`' fields: the preset's name (or a model path), `init_from`, the run's numerics, and an override
    of every other field of `TransformerConfig` (None: the preset's value), so that any model shape can be
    described."""
    own = [
        ("name", str, "tiny", f"model preset ({', '.join(PRESETS)}), or a Hugging Face model directory or "
         "config.json whose shape is used; with --init-from leave it out: the shape comes from the weights", "--model"),
        ("init_from", str | None, None, "start from these weights: a Hugging Face model directory (or .safetensors / "
         "index JSON) or an spmdkit checkpoint or run directory; its shape is the model's and the optimizer starts "
         "fresh (ignored once the run has checkpoints: they resume it)", "--init-from"),
        ("dtype", Dtype, "bfloat16", "compute dtype (parameters stay float32)", "--dtype"),
        ("remat", Remat, "none", REMAT_HELP, "--remat"),
        ("attention", Attention, "auto", "attention kernel: auto (with context > 1 the --context-parallel algorithm, "
         "else cudnn on an NVIDIA GPU, else blockwise), dot, blockwise, cudnn or ring (under Ulysses: the kernel per "
         "device)", "--attention"),
    ]  # fmt: skip
    flags = {"dispatch": ("--moe-dispatch",), "capacity_factor": ("--capacity-factor",)}
    hints, docs = typing.get_type_hints(TransformerConfig), field_docs(TransformerConfig)
    overrides = [
        (f.name, hints[f.name] | None, None, f"{docs[f.name][0]} (None: the preset's)", *flags.get(f.name, ()))
        for f in dataclasses.fields(TransformerConfig)
        if f.name not in {name for name, *_ in own}
    ]
    return [(name, Annotated[hint, arg(*doc)], default) for name, hint, default, *doc in own + overrides]


def _build(self: Any) -> TransformerConfig:
    """The `TransformerConfig` these settings describe: `init_from`'s model, or the preset or model path `name`
    names, with every override given (see `spmdkit.models.resolve.build_model`). `attention` is the setting as
    given: `spmdkit.train.step.program.build_program` resolves "auto" for the devices and stores the kernel in it."""
    return build_model(dataclasses.asdict(self), source_model)


def _resolved(self: Any) -> Any:
    """These settings with every override set to the model's value: a saved config that needs no preset table
    and no source path to say what the model is."""
    return dataclasses.replace(self, **resolved_settings(dataclasses.asdict(self), source_model))


ModelSettings = dataclasses.make_dataclass(
    "ModelSettings",
    _model_fields(),
    frozen=True,
    namespace={
        "build": _build,
        "__post_init__": lambda self: check_types(self, "model"),
        "resolved": _resolved,
        "__doc__": "The model (a preset, a Hugging Face model path, or the weights `init_from` starts from) and the "
        "numerics to run it with; any field of `TransformerConfig` may be given to change a preset's shape (e.g. "
        "`layers`, `embed`).",
        "__module__": __name__,
    },
)


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """The device mesh and how the state is laid out on it; with `pipeline` > 1 in the mesh, the schedule."""

    mesh: Annotated[
        str, arg("mesh axis sizes, e.g. 'data=2,fsdp=2,tensor=2' (-1: the remaining devices)", "--mesh")
    ] = "fsdp=-1"
    dcn: Annotated[
        str | None, arg("across-node factor of axes, e.g. 'data=2' (None: processes fill the outer axes)", "--dcn")
    ] = None
    zero: Annotated[
        Literal[0, 1, 2, 3],
        arg("ZeRO stage over fsdp: 0 replicate, 1 optimizer, 2 +gradients, 3 +parameters", "--zero"),
    ] = 3
    sequence_parallel: Annotated[
        bool, arg("shard the residual stream's sequence over tensor (SP)", "--sequence-parallel")
    ] = False
    overlap_tp: Annotated[
        bool,
        arg(
            "overlap TP collectives with the matmuls: XLA:GPU's windowed einsum, and with --sequence-parallel the "
            "blocks' projections as collective matmuls (a ring of collective-permutes)",
            "--overlap-tp",
        ),
    ] = False
    context_parallel: Annotated[ContextParallel, arg(CONTEXT_PARALLEL_HELP, "--context-parallel")] = "auto"
    ulysses: Annotated[int | None, arg("with --context-parallel 2d: devices per Ulysses group", "--ulysses")] = None
    pipeline_schedule: Annotated[Schedule, arg("pipeline schedule", "--pipeline-schedule")] = "1f1b"
    microbatches: Annotated[
        int | None,
        arg("pipeline microbatches per step (None: twice the stages; no pipeline: --grad-accum)", "--microbatches"),
    ] = None
    virtual_stages: Annotated[
        int, arg("layer chunks per pipeline stage (interleaved schedule)", "--virtual-stages")
    ] = 1

    def __post_init__(self) -> None:
        check_types(self, "mesh")
        require(self.microbatches is None or self.microbatches >= 1, f"--microbatches {self.microbatches} must be >= 1")
        check_sizes({"--microbatches": self.microbatches, "--virtual-stages": self.virtual_stages})
        require(self.virtual_stages >= 1, f"--virtual-stages {self.virtual_stages} must be at least 1")
        two_d = "--context-parallel 2d takes --ulysses U (devices per Ulysses group), and --ulysses only goes with it"
        require((self.ulysses is None) == (self.context_parallel != "2d"), two_d)


def parse_steps(spec: str | None, steps: int | None = None) -> tuple[int, int] | None:
    """'3:5' -> (3, 5); None -> None; anything else (or a step past `steps`, the run's --steps) is one line saying
    what to write."""
    if spec is None:
        return None
    first, sep, last = spec.partition(":")
    try:
        bounds = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        bounds = (0, -1)
    if not 1 <= bounds[0] <= bounds[1]:
        raise SpmdkitError(f"--profile-steps {spec!r}: give A:B with 1 <= A <= B (e.g. 3:5), or one step N")
    if steps is not None and bounds[1] > steps:
        raise SpmdkitError(f"--profile-steps {spec} lies past --steps {steps}: profile steps within 1:{steps}")
    return bounds


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The loop. `batch_size` is global, in sequences; `fail_steps` poisons those steps' gradients with NaN (for
    testing the skip path)."""

    steps: Annotated[int, arg("optimizer steps", "--steps")] = 200
    batch_size: Annotated[int, arg("global batch, in sequences", "--batch-size")] = 16
    seq_len: Annotated[int, arg("tokens per sequence", "--seq-len")] = 128
    grad_accum: Annotated[
        int, arg("microbatches accumulated per step without a pipeline (with one: --microbatches)", "--grad-accum")
    ] = 1
    eval_every: Annotated[int, arg("evaluate on the held-out split every N steps (0: never)", "--eval-every")] = 50
    eval_batches: Annotated[int, arg("batches per evaluation", "--eval-batches")] = 4
    log_every: Annotated[int, arg("write metrics every N steps", "--log-every")] = 10
    seed: Annotated[int, arg("seed for initialisation and data order", "--seed")] = 0
    run_dir: Annotated[str, arg("directory for config.json, metrics.jsonl, loss.png, tensorboard/", "--run-dir")] = (
        "runs/default"
    )
    peak_tflops: Annotated[
        float | None, arg("peak TFLOP/s per device for MFU (None: from the device table)", "--peak-tflops")
    ] = None
    progress: Annotated[bool, arg("show a progress bar", "--progress")] = True
    fail_steps: Annotated[tuple[int, ...], arg("steps whose gradients are made NaN (testing the NaN guard)")] = ()
    profile_steps: Annotated[
        str | None,
        arg("write a jax.profiler trace of steps A to B (A:B, e.g. 3:5) into RUN_DIR/profile/", "--profile-steps"),
    ] = None
    dump_hlo: Annotated[
        bool, arg("write the compiled step's optimized HLO to RUN_DIR/train_step.hlo.txt", "--dump-hlo")
    ] = False

    def __post_init__(self) -> None:
        check_types(self, "run")
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_batches"):
            value = getattr(self, name)
            require(value >= 1, f"--{name.replace('_', '-')} must be at least 1 (got {value})")
        check_sizes({"--seq-len": self.seq_len, "--batch-size": self.batch_size, "--grad-accum": self.grad_accum})
        require(self.eval_every >= 0, f"--eval-every {self.eval_every} must be >= 0 (0: never)")
        require(self.seed >= 0, f"--seed {self.seed} must be >= 0")
        require(self.peak_tflops is None or self.peak_tflops > 0, f"--peak-tflops {self.peak_tflops} must be positive")
        parse_steps(self.profile_steps, self.steps)


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Orbax checkpoints: saved every `every` steps and at the end, the newest `keep` kept; `resume` continues from
    the newest intact step found in `directory`."""

    directory: Annotated[str | None, arg("checkpoint directory (None: RUN_DIR/checkpoints)", "--checkpoint-dir")] = None
    every: Annotated[int, arg("save every N steps (0: only at the end)", "--checkpoint-every")] = 100
    keep: Annotated[int, arg("keep the newest N checkpoints", "--keep")] = 3
    resume: Annotated[
        bool, arg("resume from the newest intact step (no: the directory must hold no steps)", "--resume")
    ] = True
    allow_data_change: Annotated[
        bool,
        arg(
            "resume even if the batch size, sequence length, seed or a data setting differs from the checkpoint's",
            "--allow-data-change",
        ),
    ] = False
    allow_config_change: Annotated[
        str | None,
        arg(
            "resume even though these model or optimizer settings differ from the checkpoint's (comma-separated "
            "field names, e.g. activation,rope_theta,lr; recorded in metrics.jsonl)",
            "--allow-config-change",
        ),
    ] = None
    local_dir: Annotated[
        str | None, arg("a node-local directory for frequent checkpoints (a fast tier beside --checkpoint-dir)")
    ] = None
    local_every: Annotated[int, arg("save to local_dir every N steps (needs local_dir)")] = 0

    def __post_init__(self) -> None:
        check_types(self, "checkpoint")
        require(self.every >= 0, f"--checkpoint-every must be >= 0 (got {self.every}; 0 saves only at the end)")
        require(self.keep >= 1, f"--keep must be at least 1 (got {self.keep})")
        require(
            self.local_dir is None or self.local_dir.strip() != "", "--checkpoint.local-dir is empty: pass a directory"
        )
        require(
            (self.local_dir is None) == (self.local_every == 0) and self.local_every >= 0,
            f"--checkpoint.local-dir {self.local_dir} and --checkpoint.local-every {self.local_every} go together: "
            "give both (a directory and N >= 1) or neither",
        )


@dataclasses.dataclass(frozen=True)
class HealthSettings:
    """Watching a long job. A watchdog ends a job that waits too long in one phase: every process logs the phase
    and the processes that have not arrived, dumps its Python stacks and exits non-zero (under `spmdkit launch
    --max-restarts` the job restarts). A process whose own time per step (data and dispatch, not the waits for the
    others) exceeds the others' median for `straggler_windows` logging windows in a row is named as a straggler."""

    step_timeout: Annotated[
        float, arg("seconds a training step may wait, after the first, before the job is declared hung (0: never)")
    ] = 600.0
    phase_timeout: Annotated[
        float, arg("seconds a restore, compile, first step or checkpoint may wait before the job is hung (0: never)")
    ] = 1800.0
    straggler_threshold: Annotated[
        float, arg("name a process whose own time per step exceeds the others' median by this fraction of a step")
    ] = 0.2
    straggler_windows: Annotated[int, arg("... for this many logging windows in a row")] = 3

    def __post_init__(self) -> None:
        check_types(self, "health")
        for name in ("step_timeout", "phase_timeout", "straggler_threshold"):
            require(getattr(self, name) >= 0, f"--health.{name.replace('_', '-')} must be >= 0")
        require(self.straggler_windows >= 1, "--health.straggler-windows must be at least 1")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run is: one section per concern."""

    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    mesh: MeshSettings = dataclasses.field(default_factory=MeshSettings)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    run: RunSettings = dataclasses.field(default_factory=RunSettings)
    checkpoint: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    health: HealthSettings = dataclasses.field(default_factory=HealthSettings)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise SpmdkitError(f"config section {name} must be a {cls.__name__}, not {getattr(self, name)!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}


def apply_overrides(config: TrainConfig, overrides: dict[str, dict[str, Any]]) -> TrainConfig:
    """Replace fields section by section: `{"run": {"steps": 60}}`. Unknown sections and keys are errors; lists
    become tuples (JSON has no tuples); each section's own checks run on the result."""
    changes = {}
    for section, values in overrides.items():
        if section not in SECTIONS:
            raise SpmdkitError(f"unknown config section [{section}]: expected one of {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise SpmdkitError(f"config section {section} must be a table of keys, not {values!r}")
        known = {f.name for f in dataclasses.fields(SECTIONS[section])}
        for key in values:
            if key not in known:
                raise SpmdkitError(f"unknown config key {section}.{key}: expected one of {', '.join(sorted(known))}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        changes[section] = dataclasses.replace(getattr(config, section), **values)
    return dataclasses.replace(config, **changes)


def checkpoint_directory(config: TrainConfig) -> Path:
    """`checkpoint.directory`, or RUN_DIR/checkpoints; always absolute (Orbax requires it)."""
    directory = config.checkpoint.directory or str(Path(config.run.run_dir) / "checkpoints")
    return Path(directory).expanduser().absolute()


def config_from_json(text: str) -> TrainConfig:
    """Inverse of `TrainConfig.to_json` (used when resuming and inspecting checkpoints)."""
    try:
        values = json.loads(text)
    except ValueError as error:
        raise SpmdkitError(f"a saved config is not valid JSON ({error})") from None
    if not isinstance(values, dict):
        raise SpmdkitError('a saved config must be a JSON object of sections, e.g. {"run": {"steps": 60}}')
    return apply_overrides(TrainConfig(), values)


def config_from_toml(path: str | Path) -> TrainConfig:
    """The config of a TOML file: one table per section, the field names as keys (the rest default). A missing or
    unreadable file, an unknown section or key, and a value of the wrong type are one line naming the file."""
    if not Path(path).is_file():
        raise SpmdkitError(f"config file {path} does not exist")
    try:
        return apply_overrides(TrainConfig(), tomllib.loads(Path(path).read_text(encoding="utf-8")))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise SpmdkitError(f"config file {path} is not valid UTF-8 TOML: {error}") from None
    except SpmdkitError as error:
        raise SpmdkitError(f"config file {path}: {error}") from None
