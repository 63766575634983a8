"""`spmdkit train`: the command line built from the `TrainConfig` dataclasses by tyro.

Every config field is a flag `--SECTION.KEY` (`--run.steps 60`, `--optimizer.b2 0.99`, `--model.layers 6`); the
short flags in each field's metadata (`--steps`, `--mesh`, `--no-progress`, ...) are aliases. Choice fields are
`Literal`s, checked at parse time. `--config FILE.toml` sets the defaults (one table per section, the same keys),
and flags override them; a TOML value goes through the same parser as a flag, so a wrong type or an unknown choice
is refused the same way, naming the file. Every parse error is one line, exit 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
import sys
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import tyro

from spmdkit.cli import SUMMARIES
from spmdkit.cli.args import ArgumentParser, use_cpu_devices
from spmdkit.errors import SpmdkitError
from spmdkit.train.config import SECTIONS, TrainConfig

HELP = SUMMARIES["train"]
DESCRIPTION = (
    "Train a Llama-style model with the parallelism the mesh describes. With no flags: the tiny model on the "
    "embedded stdlib data, on every device present. Also: --config FILE.toml (defaults from a TOML file: one "
    "[section] table per group below, the same keys), --cpu-devices N (simulate N devices on the CPU)."
)
PROG = "spmdkit train"


@functools.cache
def _tyro_class(cls: type) -> type:
    """`cls` with each field's help and short flags (its `metadata`) as tyro annotations; sections recursively."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        hint = _tyro_class(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else hints[f.name]
        arg = tyro.conf.arg(help=f.metadata.get("help"), aliases=f.metadata.get("flags") or None)
        fields.append((f.name, Annotated[hint, arg]))
    return dataclasses.make_dataclass(cls.__name__, fields, frozen=True)


def _to_tyro(config: TrainConfig) -> Any:
    cls = _tyro_class(TrainConfig)
    return cls(**{name: _tyro_class(SECTIONS[name])(**vars(getattr(config, name))) for name in SECTIONS})


def _from_tyro(parsed: Any) -> TrainConfig:
    """The parsed values as a `TrainConfig` (each section's own checks run here)."""
    return TrainConfig(**{name: SECTIONS[name](**vars(getattr(parsed, name))) for name in SECTIONS})


def _one_line(text: str) -> str:
    """tyro's boxed error message -> its first paragraph on one line (the box, rules and hints dropped)."""
    lines = []
    for raw in text.splitlines()[1:]:  # the first line is the box's title
        line = raw.strip().strip("│╭╮╰╯").strip()
        if not line or set(line) <= set("─-"):
            if lines:
                break
            continue
        lines.append(line)
    return re.sub(r"\s+", " ", " ".join(lines)) or text.strip()


def parse_flags(args: Sequence[str], default: TrainConfig, where: str = "") -> TrainConfig:
    """`default` with `args` (flags) applied; a parse error is a one-line `SpmdkitError` (`where` prefixes it)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed = tyro.cli(
                _tyro_class(TrainConfig), args=list(args), default=_to_tyro(default), prog=PROG, description=DESCRIPTION
            )
    except SystemExit as exit:
        if exit.code:
            raise SpmdkitError(f"{where}{_one_line(stderr.getvalue())} (see {PROG} --help)") from None
        raise
    return _from_tyro(parsed)


def toml_args(path: str | Path) -> list[str]:
    """The flags a TOML config file stands for (`[run] steps = 7` -> `--run.steps=7`)."""
    path = Path(path)
    if not path.is_file():
        raise SpmdkitError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise SpmdkitError(f"config file {path} is not valid UTF-8 TOML: {error}") from None
    args = []
    for section, values in data.items():
        if section not in SECTIONS or not isinstance(values, dict):
            raise SpmdkitError(f"config file {path}: [{section}] is not a section: use one of {', '.join(SECTIONS)}")
        fields = {
            f.name: typing.get_type_hints(SECTIONS[section])[f.name] for f in dataclasses.fields(SECTIONS[section])
        }
        for key, value in values.items():
            if key not in fields:
                raise SpmdkitError(
                    f"config file {path}: unknown key {section}.{key}: expected one of {', '.join(fields)}"
                )
            flag = f"--{section}.{key.replace('_', '-')}"
            if fields[key] is bool and isinstance(value, bool):
                args.append(flag if value else f"--{section}.no-{key.replace('_', '-')}")
            elif isinstance(value, list):
                args += [flag, *map(str, value)]
            elif isinstance(value, dict):
                raise SpmdkitError(f"config file {path}: {section}.{key} must be a value, not a table")
            else:
                args.append(f"{flag}={value}")
    return args


def parse(argv: Sequence[str]) -> tuple[TrainConfig, int | None]:
    """(the config, the --cpu-devices count) of `spmdkit train ARGV`."""
    early = ArgumentParser(prog=PROG, add_help=False)
    early.add_argument("--config")
    early.add_argument("--cpu-devices", type=int)
    known, rest = early.parse_known_args(list(argv))
    config = TrainConfig()
    if known.config:
        config = parse_flags(toml_args(known.config), config, where=f"config file {known.config}: ")
    return parse_flags(rest, config), known.cpu_devices


def help_text() -> str:
    """`spmdkit train --help`, as tyro prints it."""
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        parse_flags(["--help"], TrainConfig())
    return out.getvalue()


def main(argv: Sequence[str]) -> int:
    config, cpu_devices = parse(argv)
    use_cpu_devices(cpu_devices)
    from spmdkit.distributed.initialize import initialize_distributed

    initialize_distributed()  # joins a multi-process job (spmdkit launch, SLURM, Open MPI) before JAX computes
    from spmdkit.train.loop import train

    train(config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
