"""What a model path is (a Hugging Face model or an spmdkit checkpoint), the model shape it holds, and how the run's
model settings (`[model]`: a preset or a path, `--init-from`, overrides) resolve into a `TransformerConfig`.

Pure Python on import: reading an spmdkit checkpoint's saved config imports the checkpoint layer (Orbax) only when
such a path is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from spmdkit.errors import SpmdkitError
from spmdkit.interop.hf_config import read_hf_config, read_json
from spmdkit.interop.hf_files import CONFIG, is_hf_directory
from spmdkit.models.config import PRESETS, TransformerConfig, model_preset

# ModelSettings' own fields (the rest override TransformerConfig's); TransformerConfig fields that are the run's
# numerics, not the model's function: they may differ from what --init-from holds.
OWN_SETTINGS = ("name", "init_from", "dtype", "remat", "attention")
RUN_NUMERICS = frozenset(
    {"param_dtype", "max_positions", "dispatch", "capacity_factor", "load_balance_weight", "router_z_weight"}
)
DEFAULT_MODEL = "tiny"  # `--model`'s default: with --init-from, it means "the source's shape"
OVERRIDES = tuple(f.name for f in dataclasses.fields(TransformerConfig) if f.name not in OWN_SETTINGS)


def source_kind(path: str | Path) -> Literal["hf", "spmdkit"]:
    """ "hf" for a model directory, `.safetensors` file, index or config JSON; "spmdkit" for a checkpoint or run
    directory. SpmdkitError when `path` is neither."""
    path = Path(path).expanduser()
    if not path.exists():
        raise SpmdkitError(f"{path} does not exist: pass a Hugging Face model directory or an spmdkit checkpoint")
    if path.is_file():
        if path.suffix in (".safetensors", ".json"):
            return "hf"
        raise SpmdkitError(f"{path} is not a .safetensors file, an index or config JSON, or a model directory")
    if is_hf_directory(path):
        return "hf"
    if (path / "checkpoints").is_dir() or any(p.name.isdigit() for p in path.iterdir() if p.is_dir()):
        return "spmdkit"
    if (path / CONFIG).is_file():
        return "hf"  # reading its config.json says what is wrong with it
    if any(path.glob("*.safetensors")):
        raise SpmdkitError(f"{path} holds safetensors files but no {CONFIG}: a Hugging Face model needs its config")
    raise SpmdkitError(f"{path} is neither a Hugging Face model directory nor an spmdkit checkpoint or run directory")


def hf_config_path(path: str | Path) -> Path:
    """The config.json of a Hugging Face source: in a directory, beside a file, or the JSON file itself."""
    path = Path(path).expanduser().absolute()
    if path.is_dir():
        return path / CONFIG
    if path.suffix == ".json" and "weight_map" not in read_json(path, "a config or index JSON"):
        return path
    return path.parent / CONFIG


def saved_run_config(path: str | Path, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """(the step: `step` or the newest, the run config saved with it) of an spmdkit checkpoint or run directory."""
    from spmdkit.checkpoint.steps import open_step, saved_config

    checkpointer, step = open_step(path, step)
    try:
        return step, saved_config(checkpointer, step)
    finally:
        checkpointer.close()


def source_model(path: str | Path, step: int | None = None) -> TransformerConfig:
    """The model (shape and function) a Hugging Face source or an spmdkit checkpoint (its `step`, default the
    newest) holds."""
    if source_kind(path) == "hf":
        return read_hf_config(hf_config_path(path))[1]
    _, saved = saved_run_config(path, step)
    return build_model(saved.get("model") or {})


def _base(settings: Mapping[str, Any], overrides: dict[str, Any]) -> TransformerConfig:
    """The model the settings start from: --init-from's, a preset's, or a path's."""
    name, init_from = settings.get("name"), settings.get("init_from")
    if init_from:
        if name not in (None, DEFAULT_MODEL, init_from):
            raise SpmdkitError(
                f"--model {name} conflicts with --init-from {init_from}: the model's shape comes from --init-from; "
                "drop --model"
            )
        base = source_model(init_from)
        for key, value in overrides.items():
            if key not in RUN_NUMERICS and getattr(base, key) != value:
                raise SpmdkitError(
                    f"--model.{key.replace('_', '-')} {value} conflicts with --init-from {init_from}, whose {key} is "
                    f"{getattr(base, key)}: drop it (the weights fix the model's shape)"
                )
        return base
    if name is None or name in PRESETS:
        return model_preset(name or DEFAULT_MODEL)
    if "/" in name or name.endswith(".json") or Path(name).expanduser().exists():
        return source_model(name)
    raise SpmdkitError(
        f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}, or pass a Hugging Face model directory "
        "or config.json"
    )


def build_model(settings: Mapping[str, Any]) -> TransformerConfig:
    """The `TransformerConfig` of the run's model settings (ModelSettings' fields as a mapping).

    The base is `init_from`'s model (`name` must then be the default `tiny` or that same path), else the preset
    or path `name` names; every override that is set replaces the base's field. Settings with every override set
    are complete: no source is read. `attention` stays as given: a training program resolves "auto" for its
    devices (`spmdkit.train.program.build_program`, by `spmdkit.models.attention_choice.choose_attention`).
    """
    overrides = {k: settings[k] for k in OVERRIDES if settings.get(k) is not None}
    base = TransformerConfig() if len(overrides) == len(OVERRIDES) else _base(settings, overrides)
    own = {k: settings[k] for k in ("dtype", "remat", "attention") if settings.get(k) is not None}
    return base.replace(**overrides, **own)


def resolved_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` with every override set to the model's value, so that a saved config is complete on its own (it
    no longer needs the preset table or the source path to say what the model is); `name` says where it came from
    (the preset, or the path of the model or of --init-from's weights)."""
    model = build_model(settings)
    name = settings.get("name") or DEFAULT_MODEL
    if settings.get("init_from") and name == DEFAULT_MODEL:
        name = settings["init_from"]  # what the model is called in reports: where its weights came from
    return {**settings, "name": name, **{k: getattr(model, k) for k in OVERRIDES}}
