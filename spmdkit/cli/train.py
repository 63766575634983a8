"""`spmdkit train`: the command line tyro builds from the `TrainConfig` dataclasses.

Every config field is a flag `--SECTION.KEY` (`--run.steps 60`, `--optimizer.b2 0.99`, `--model.layers 6`); the
short flags each field's `tyro.conf.arg` names (`--steps`, `--mesh`, `--no-progress`, ...) are aliases. Choice fields
are `Literal`s, checked at parse time. `--config FILE.toml` is loaded into the dataclasses (`config_from_toml`: an
unknown key or a value of the wrong type is refused naming the file) and handed to tyro as the defaults; flags
override them. Every parse error is one line, exit 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import tyro
import tyro._errors

from spmdkit.cli.args import ArgumentParser, use_cpu_devices
from spmdkit.errors import SpmdkitError
from spmdkit.train.config import TrainConfig, config_from_toml

DESCRIPTION = (
    "Train a Llama-style model with the parallelism the mesh describes. With no flags: the tiny model on the "
    "embedded stdlib data, on every device present. Also: --config FILE.toml (defaults from a TOML file: one "
    "[section] table per group below, the same keys), --cpu-devices N (simulate N devices on the CPU)."
)
PROG = "spmdkit train"


def _refuse(event: tyro._errors.ParseErrorEvent) -> None:
    """tyro's parse-error hook: raise the failure as one line, before tyro would draw its box and exit. The hook
    (`tyro._errors.on_parse_error`) is tyro's only way to the error itself: `console_outputs=False` drops it."""
    argument = getattr(event, "argument", None)
    name = "/".join(argument.lowered.name_or_flags) if argument is not None else "the arguments"
    if isinstance(event, tyro._errors.InvalidChoice):
        problem = f"invalid choice {event.value!r} for {name}: expected one of {', '.join(event.choices)}"
    elif isinstance(event, tyro._errors.UnrecognizedArgs):
        problem = f"unrecognized arguments: {' '.join(event.tokens)}"
    elif isinstance(event, tyro._errors.InstantiationFailure):
        problem = f"{name}: {event.message.splitlines()[0]}"
    elif isinstance(event, tyro._errors.BadValue):
        problem = f"{name}: " + ("expects a value" if event.offending_value is None else "takes no value")
    else:
        problem = f"{name}: {type(event).__name__}"
    raise SpmdkitError(f"{problem} (see {PROG} --help)")


def parse_flags(args: Sequence[str], default: TrainConfig) -> TrainConfig:
    """`default` with `args` (flags) applied; a parse error is a one-line `SpmdkitError`."""
    with tyro._errors.on_parse_error(_refuse):
        return tyro.cli(TrainConfig, args=list(args), default=default, prog=PROG, description=DESCRIPTION)


def parse(argv: Sequence[str]) -> tuple[TrainConfig, int | None]:
    """(the config, the --cpu-devices count) of `spmdkit train ARGV`."""
    early = ArgumentParser(prog=PROG, add_help=False)
    early.add_argument("--config")
    early.add_argument("--cpu-devices", type=int)
    known, rest = early.parse_known_args(list(argv))
    return parse_flags(rest, config_from_toml(known.config) if known.config else TrainConfig()), known.cpu_devices


def add_run_flags(config: TrainConfig) -> bool:
    """On a GPU host, the XLA flags the config asks for (`--overlap-tp`: windowed einsum) into `XLA_FLAGS`, beside
    the ones every command adds; XLA reads them when its backend starts, which is still ahead. On the CPU they
    would change nothing, and nothing is added. Returns whether flags were added."""
    from spmdkit.distributed.platform import gpu_present
    from spmdkit.targets.flags import OVERLAP_TP_FLAGS, add_xla_flags

    return bool(config.mesh.overlap_tp and gpu_present() and add_xla_flags(OVERLAP_TP_FLAGS))


def main(argv: Sequence[str]) -> int:
    config, cpu_devices = parse(argv)
    use_cpu_devices(cpu_devices)
    add_run_flags(config)
    from spmdkit.distributed.initialize import initialize_distributed

    # joins a multi-process job (spmdkit launch, SLURM, Open MPI) before JAX computes; JAX's heartbeat above the
    # watchdog's deadlines, so that the watchdog names a frozen process before JAX's abort ends the job
    initialize_distributed(heartbeat_above=max(config.health.step_timeout, config.health.phase_timeout))
    from spmdkit.train.loop import train

    train(config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
