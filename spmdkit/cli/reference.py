"""The CLI reference (`docs/cli.md`), generated from the code: the commands' help and the train config keys.

The argparse commands render their `--help` at a fixed width (so the text does not depend on the terminal); the
`train` command is rendered from the `TrainConfig` dataclasses it is built from: one table per section with each
key's flags, type, default and help. `scripts/gen_docs.py` writes the result; `tests/test_docs.py` fails when the
file is stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from typing import Any

from spmdkit.cli import COMMANDS, DESCRIPTION, SUMMARIES, command

WIDTH = 100  # columns of the rendered --help text

HEADER = """# spmdkit command-line reference

Generated from the code by `python scripts/gen_docs.py` (the parsers of `spmdkit/cli/` and the `TrainConfig`
dataclasses of `spmdkit/train/config.py`); do not edit by hand. `python scripts/gen_docs.py --check` exits non-zero
when this file is stale.
"""


def help_text(parser: argparse.ArgumentParser) -> str:
    """`parser.format_help()` at `WIDTH` columns, whatever the terminal."""
    parser.formatter_class = functools.partial(argparse.HelpFormatter, width=WIDTH)
    return parser.format_help().rstrip()


def _parsers() -> list[tuple[str, str, argparse.ArgumentParser | None]]:
    """(command line, one-line help, parser) of every command; `train` has no argparse parser (None)."""
    found: list[tuple[str, str, argparse.ArgumentParser | None]] = []
    for name in COMMANDS:
        module = command(name)
        found.append((f"spmdkit {name}", SUMMARIES[name], module.parser() if hasattr(module, "parser") else None))
        if hasattr(module, "SUBCOMMANDS"):  # ckpt, data: each subcommand's own --help too
            found += [
                (f"spmdkit {name} {sub}", spec[0], module.subcommand_parser(sub))
                for sub, spec in module.SUBCOMMANDS.items()
            ]
    return found


def type_name(hint: Any) -> str:
    """A field type as the docs show it: `int`, `int or None`, `'a' | 'b'`, `tuple[int, ...]`."""
    if typing.get_origin(hint) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        named = " or ".join(type_name(a) for a in args if a is not type(None))
        return named + (" or None" if type(None) in args else "")
    return getattr(hint, "__name__", str(hint)) if typing.get_origin(hint) is None else str(hint)


def render_config() -> str:
    """One table per `TrainConfig` section: key, flags, type, default, help; the section's docstring above it."""
    import inspect

    from spmdkit.models.fields import field_docs
    from spmdkit.train.config import SECTIONS

    lines = [
        "## `spmdkit train`: config keys and flags",
        "",
        "Every key is a flag `--SECTION.KEY` (underscores as dashes: `--run.batch-size 32`, `--optimizer.b2 0.99`); "
        "the short flags beside it are the same setting. Booleans are pairs (`--run.progress` / "
        "`--run.no-progress`). `spmdkit train --config FILE.toml` reads the same keys, one TOML table per section; "
        "flags override it. `--cpu-devices N` simulates N devices on the CPU. The resolved config is saved as "
        "`config.json` in the run directory and in every checkpoint.",
    ]
    for section, cls in SECTIONS.items():
        lines += ["", f"### `[{section}]` ({cls.__name__})", ""]
        if doc := inspect.getdoc(cls):
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | flags | type | default | help |", "|---|---|---|---|---|"]
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            help, short = docs[f.name]
            spelled = ", ".join(f"`{flag}`" for flag in [f"--{section}.{f.name.replace('_', '-')}", *short])
            row = [f"`{f.name}`", spelled, type_name(hints[f.name]), f"`{f.default!r}`", help]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render_commands() -> str:
    """A contents list and one section per argparse command with its `--help` text."""
    parsers = _parsers()
    lines = ["## Commands", "", DESCRIPTION, ""]
    lines += [f"- `{name}`: {text}" for name, text, _ in parsers]
    for name, _, parser in parsers:
        if parser is not None:
            lines += ["", f"### `{name}`", "", "```text", help_text(parser), "```"]
    return "\n".join(lines)


def render() -> str:
    """The whole of `docs/cli.md`."""
    return "\n".join([HEADER, render_commands(), "", render_config(), ""])
