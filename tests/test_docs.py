"""The docs match the code: docs/cli.md is generated, and docs/guide.md cites only what exists."""

import re
import shlex
from pathlib import Path

import pytest

from spmdkit.cli import parse
from spmdkit.cli.reference import render
from spmdkit.errors import SpmdkitError

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide.md"


def test_cli_reference_is_current():
    text = (ROOT / "docs" / "cli.md").read_text()
    assert text == render(), "docs/cli.md is stale: run python scripts/gen_docs.py"


def test_guide_cites_existing_examples():
    cited = sorted(set(re.findall(r"examples/[\w\-]+\.py", GUIDE.read_text())))
    assert cited, "the guide cites no example"
    missing = [path for path in cited if not (ROOT / path).is_file()]
    assert not missing, f"docs/guide.md cites missing examples: {missing}"


def spmdkit_commands(markdown: str) -> list[str]:
    """Every `spmdkit ...` command line in a markdown text: lines of code blocks and inline code spans."""
    candidates = [line for block in re.findall(r"```\w*\n(.*?)```", markdown, re.S) for line in block.splitlines()]
    candidates += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", markdown, flags=re.S))
    return [line.strip() for line in candidates if line.strip().startswith("spmdkit ")]


def test_guide_commands_are_accepted_by_the_cli(capsys):
    commands = spmdkit_commands(GUIDE.read_text())
    assert any(c.startswith("spmdkit plan") for c in commands) and any(c.startswith("spmdkit train") for c in commands)
    for command in commands:
        try:
            parse(shlex.split(command)[1:])  # parses only: nothing runs
        except SpmdkitError as error:
            pytest.fail(f"docs/guide.md cites `{command}`, which spmdkit rejects: {error}")
        except SystemExit as error:  # `--help` exits 0
            assert not error.code, capsys.readouterr().err
