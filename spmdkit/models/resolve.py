"""How the run's model settings (`[model]`: a preset or a path, `--init-from`, `--model.FIELD` overrides) resolve
into the `TransformerConfig` every command runs: `build_model`, the one place that decides what `--model` means.

Reading a path (a Hugging Face directory, an spmdkit checkpoint) is the interop layer's: the caller passes its
reader (`spmdkit.interop.sources.source_model`), so this module stays pure Python and below it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig
from spmdkit.models.presets import PRESETS, model_preset

ReadSource = Callable[[str], TransformerConfig]  # a model path -> the model it holds
# ModelSettings' own fields (the rest override TransformerConfig's); TransformerConfig fields that are the run's
# numerics, not the model's function: they may differ from what --init-from holds.
OWN_SETTINGS = ("name", "init_from", "dtype", "remat", "attention")
RUN_NUMERICS = frozenset({
    "param_dtype", "max_positions", "ulysses_parts", "dispatch", "capacity_factor", "load_balance_weight",
    "router_z_weight", "balance_rate", "mtp_weight",
})  # fmt: skip
DEFAULT_MODEL = "tiny"  # `--model`'s default: with --init-from, it means "the source's shape"
OVERRIDES = tuple(f.name for f in dataclasses.fields(TransformerConfig) if f.name not in OWN_SETTINGS)


def _base(settings: Mapping[str, Any], overrides: dict[str, Any], read_source: ReadSource) -> TransformerConfig:
    """The model the settings start from: --init-from's, a preset's, or a path's."""
    name, init_from = settings.get("name"), settings.get("init_from")
    if init_from:
        if name not in (None, DEFAULT_MODEL, init_from):
            raise SpmdkitError(
                f"--model {name} conflicts with --init-from {init_from}: the model's shape comes from --init-from; "
                "drop --model"
            )
        base = read_source(init_from)
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
        return read_source(name)
    raise SpmdkitError(
        f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}, or pass a Hugging Face model directory "
        "or config.json"
    )


def build_model(settings: Mapping[str, Any], read_source: ReadSource) -> TransformerConfig:
    """The `TransformerConfig` of the run's model settings (ModelSettings' fields as a mapping); `read_source`
    reads the model a path holds (`spmdkit.interop.sources.source_model`).

    The base is `init_from`'s model (`name` must then be the default `tiny` or that same path), else the preset
    or path `name` names; every override that is set replaces the base's field. Settings with every override set
    are complete: no source is read. `attention` stays as given: a training program resolves "auto" for its
    devices (`spmdkit.train.step.program.build_program`, by `spmdkit.models.attention_choice.choose_attention`).
    """
    overrides = {k: settings[k] for k in OVERRIDES if settings.get(k) is not None}
    base = TransformerConfig() if len(overrides) == len(OVERRIDES) else _base(settings, overrides, read_source)
    own = {k: settings[k] for k in ("dtype", "remat", "attention") if settings.get(k) is not None}
    return base.replace(**overrides, **own)


def resolved_settings(settings: Mapping[str, Any], read_source: ReadSource) -> dict[str, Any]:
    """`settings` with every override set to the model's value, so that a saved config is complete on its own (it
    no longer needs the preset table or the source path to say what the model is); `name` says where it came from
    (the preset, or the path of the model or of --init-from's weights)."""
    model = build_model(settings, read_source)
    name = settings.get("name") or DEFAULT_MODEL
    if settings.get("init_from") and name == DEFAULT_MODEL:
        name = settings["init_from"]  # what the model is called in reports: where its weights came from
    return {**settings, "name": name, **{k: getattr(model, k) for k in OVERRIDES}}
