"""What every subcommand shares: one-line parse errors, simulated CPU devices, a quiet absl, and command groups
(`ckpt`, `data`).

The contract of every `spmdkit` command: a user error (a bad flag included) is one line on stderr and exit 2, with
no usage dump and no traceback. `ArgumentParser.error` raises `SpmdkitError`, which `spmdkit.cli.main` prints.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from spmdkit.errors import SpmdkitError
from spmdkit.plan.limits import check_sizes

# A command group's subcommands: name -> (one-line help, adds the subcommand's arguments, runs it -> exit code).
Subcommands = dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]]


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line (a `SpmdkitError`) instead of usage text and exit 2, and
    whose flags are never abbreviated (`--gpus` is refused, not read as `--gpus-per-node`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

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
    check_sizes({"--cpu-devices": count})
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as error:  # the backend is already running (JAX was used before the command)
        raise SpmdkitError(f"--cpu-devices {count} comes too late: {error}") from None


def quiet_absl() -> None:
    """Orbax and JAX log notices through absl while a model or checkpoint loads: the command prints its own lines
    (and an error as its only one)."""
    from absl import logging

    logging.set_verbosity(logging.ERROR)


def flag_values(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The values of the flags `names` (attribute names of `args`), as keyword arguments of the same names."""
    return {name: getattr(args, name) for name in names}


def sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


class CommandGroup:
    """A command group (`spmdkit ckpt`): one subparser per subcommand, whose `handler` runs it (after
    `--cpu-devices`, for the subcommands that take it, and `quiet_absl` where `quiet`: those that load checkpoints)."""

    def __init__(self, prog: str, summary: str, subcommands: Subcommands, quiet: bool = False):
        self.prog, self.summary, self.subcommands, self.quiet = prog, summary, subcommands, quiet

    def parser(self) -> ArgumentParser:
        """`PROG` with its subcommands."""
        top = ArgumentParser(prog=self.prog, description=sentence(self.summary))
        commands = top.add_subparsers(dest="subcommand", required=True, metavar="{" + ",".join(self.subcommands) + "}")
        for name, (text, add, run) in self.subcommands.items():
            sub = commands.add_parser(name, help=text, description=sentence(text))
            add(sub)
            sub.set_defaults(handler=run)
        return top

    def subcommand_parser(self, name: str) -> ArgumentParser:
        """The parser of one subcommand alone, `PROG NAME` (for the CLI reference)."""
        text, add, _ = self.subcommands[name]
        sub = ArgumentParser(prog=f"{self.prog} {name}", description=sentence(text))
        add(sub)
        return sub

    def parse(self, argv: Sequence[str]) -> argparse.Namespace:
        return self.parser().parse_args(list(argv))

    def main(self, argv: Sequence[str]) -> int:
        args = self.parse(argv)
        use_cpu_devices(getattr(args, "cpu_devices", None))
        if self.quiet:
            quiet_absl()
        return args.handler(args)
