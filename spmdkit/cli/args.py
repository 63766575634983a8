"""What every subcommand shares: one-line parse errors, and simulated CPU devices.

The contract of every `spmdkit` command: a user error (a bad flag included) is one line on stderr and exit 2, with
no usage dump and no traceback. `ArgumentParser.error` raises `SpmdkitError`, which `spmdkit.cli.main` prints.
"""

from __future__ import annotations

import argparse

from spmdkit.errors import SpmdkitError


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line (a `SpmdkitError`) instead of usage text and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SpmdkitError(f"{self.prog}: {message} (see {self.prog} --help)")


def add_cpu_devices(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-devices", type=int, metavar="N", help="simulate N devices on the CPU")


def use_cpu_devices(count: int | None) -> None:
    """Run on `count` simulated CPU devices (before JAX starts its backend); None: the devices JAX finds."""
    if count is None:
        return
    if count < 1:
        raise SpmdkitError(f"--cpu-devices {count} must be at least 1")
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as error:  # the backend is already running (JAX was used before the command)
        raise SpmdkitError(f"--cpu-devices {count} comes too late: {error}") from None
