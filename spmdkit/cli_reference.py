"""The CLI reference (`docs/cli.md`), generated from the code: every subcommand's `--help` and the config keys.

`render()` builds the argparse parsers of `spmdkit.cli` and prints each one's help at a fixed width (so the
text does not depend on the terminal), then lists the `TrainConfig` sections (the tables of a `--config`
TOML file) with each key's type, default and `spmdkit train` flag. `scripts/gen_docs.py` writes the result;
`tests/test_docs.py` fails when the file is stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

WIDTH = 100  # columns of the rendered --help text

HEADER = """# spmdkit command-line reference

Generated from the code by `python scripts/gen_docs.py` (the argparse parsers of `spmdkit/cli.py` and the
`TrainConfig` dataclasses of `spmdkit/train/config.py`); do not edit by hand. `python scripts/gen_docs.py
--check` exits non-zero when this file is stale.
"""


def commands(
    parser: argparse.ArgumentParser, name: str = "spmdkit", summary: str = ""
) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """`[(command line, parser, one-line help)]` for the parser and every subcommand below it, depth first."""
    found = [(name, parser, summary or (parser.description or "").rstrip("."))]
    for action in parser._actions:  # argparse keeps subcommands only on these private lists
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for sub_name, sub in action.choices.items():
                found += commands(sub, f"{name} {sub_name}", helps.get(sub_name, ""))
    return found


def help_text(parser: argparse.ArgumentParser) -> str:
    """`parser.format_help()` at `WIDTH` columns, whatever the terminal."""
    original = parser.formatter_class
    parser.formatter_class = functools.partial(original, width=WIDTH)
    try:
        return parser.format_help().rstrip()
    finally:
        parser.formatter_class = original


def render_commands() -> str:
    """A contents list and one section per command with its `--help` text."""
    from spmdkit.cli import build_parser

    found = commands(build_parser())
    lines = ["## Commands", ""]
    lines += [f"- `{name}`" + (f": {summary}" if summary else "") for name, _, summary in found]
    for name, parser, _ in found:
        lines += ["", f"### `{name}`", "", "```text", help_text(parser), "```"]
    return "\n".join(lines)


def _flags() -> dict[tuple[str, str], str]:
    """(section, key) -> the `spmdkit train` flag that sets it."""
    from spmdkit.cli import BOOL_FLAGS, TRAIN_FLAGS

    return {(section, key): flag for flag, section, key, *_ in [*TRAIN_FLAGS, *BOOL_FLAGS]}


def _default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return "(required)"


def render_config() -> str:
    """One table per `TrainConfig` section: key, type, default, flag; the section's docstring above it."""
    import inspect

    from spmdkit.train.config import TrainConfig

    flags = _flags()
    lines = [
        "## Config keys",
        "",
        "`spmdkit train --config FILE.toml` reads one TOML table per section; keys are the field names below, and "
        "flags override them. The resolved config is saved as `config.json` in the run directory and in every "
        "checkpoint.",
    ]
    for section in dataclasses.fields(TrainConfig):
        cls = type(_default(section))
        lines += ["", f"### `[{section.name}]` ({cls.__name__})", ""]
        doc = inspect.getdoc(cls)
        if doc and not doc.startswith(f"{cls.__name__}("):
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | flag |", "|---|---|---|---|"]
        for field in dataclasses.fields(cls):
            flag = flags.get((section.name, field.name), "")
            kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
            lines.append(f"| `{field.name}` | `{kind}` | `{_default(field)!r}` | {f'`{flag}`' if flag else ''} |")
    return "\n".join(lines)


def render() -> str:
    """The whole of `docs/cli.md`."""
    return "\n".join([HEADER, render_commands(), "", render_config(), ""])
