"""Helpers the test modules share: running the `spmdkit` command as a user does."""

import os
import subprocess
import sys


def run_spmdkit(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m spmdkit ARGS` in a fresh process (it inherits the session's compile flags and cache)."""
    return subprocess.run(
        [sys.executable, "-m", "spmdkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def error_lines(stderr: str) -> list[str]:
    """The one-line errors `spmdkit` printed."""
    return [line for line in stderr.splitlines() if line.startswith("spmdkit: error:")]
