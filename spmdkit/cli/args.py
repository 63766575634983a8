"""What every subcommand shares: one-line parse errors, simulated CPU devices, and command groups (`ckpt`, `data`).

The contract of every `spmdkit` command: a user error (a bad flag included) is one line on stderr and exit 2, with
no usage dump and no traceback. `ArgumentParser.error` raises `SpmdkitError`, which `spmdkit.cli.main` prints.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from spmdkit.errors import SpmdkitError

# A command group's subcommands: name -> (one-line help, adds the subcommand's arguments, runs it -> exit code).
Subcommands = dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]]


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


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def group_parser(prog: str, summary: str, subcommands: Subcommands) -> ArgumentParser:
    """The parser of a command group (`spmdkit ckpt`): one subparser per subcommand, whose `handler` runs it."""
    top = ArgumentParser(prog=prog, description=_sentence(summary))
    commands = top.add_subparsers(dest="subcommand", required=True, metavar="{" + ",".join(subcommands) + "}")
    for name, (text, add, run) in subcommands.items():
        sub = commands.add_parser(name, help=text, description=_sentence(text))
        add(sub)
        sub.set_defaults(handler=run)
    return top


def subcommand_parser(prog: str, subcommands: Subcommands, name: str) -> ArgumentParser:
    """The parser of one subcommand of a group alone, `PROG NAME` (for the CLI reference)."""
    text, add, _ = subcommands[name]
    sub = ArgumentParser(prog=f"{prog} {name}", description=_sentence(text))
    add(sub)
    return sub
