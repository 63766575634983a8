"""The `spmdkit` command: one module per subcommand, each with `main(argv) -> int` and `parse(argv)` (or an
argparse `parser()`, whose `parse_args` it is).

`train` is built from the `TrainConfig` dataclasses by tyro (`spmdkit.cli.train`); the others are argparse parsers
of `spmdkit.cli.args.ArgumentParser`. The contract of every command: a user error is one line on stderr
(`spmdkit: error: ...`) and exit 2, without a usage dump or a traceback; Ctrl-C is exit 130; in a multi-process job,
another process's death (a collective that fails) is one line and exit 76 (`spmdkit.distributed.initialize.lost_peer`).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from spmdkit.errors import SpmdkitError, SpmdkitWarning

SUMMARIES = {  # name -> one line for `spmdkit --help` and the command's own help
    "train": "train a model",
    "data": "prepare a dataset from text (tokenize, shard, index); inspect or verify one",
    "ckpt": "inspect, verify, reshard or convert (Hugging Face) checkpoints",
    "plan": "predict memory, traffic, bubble and MFU of a layout; recommend one",
    "compile": "compile the training step for a GPU cluster that is not here (H100, H200, ...): memory, fits, kernels",
    "launch": "run a command as the processes of one JAX job (here, or as a SLURM job)",
    "bench": "benchmark every strategy: speed, memory, traffic vs the planner",
    "generate": "complete prompts with a trained model: KV-cache decoding, sampling, sharded",
    "eval": "loss, perplexity and bits per byte of a checkpoint on held-out data",
}
# name -> its module (loaded only when the command runs: `spmdkit plan` never imports JAX)
COMMANDS = {name: f"spmdkit.cli.{name}" for name in SUMMARIES}
DESCRIPTION = "SPMD sharding toolkit for training transformers with JAX."
JAX_FREE = {"plan", "launch", "data"}  # commands that never start JAX (the planner answers in well under two seconds)


def command(name: str) -> ModuleType:
    """The module of subcommand `name`."""
    if name not in COMMANDS:
        raise SpmdkitError(f"unknown command {name!r}: choose one of {', '.join(COMMANDS)} (see spmdkit --help)")
    return importlib.import_module(COMMANDS[name])


def usage() -> str:
    """`spmdkit --help`: the commands and what each does."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {SUMMARIES[name]}" for name in COMMANDS]
    return "\n".join(
        ["usage: spmdkit COMMAND [ARGS...]", "", DESCRIPTION, "", "commands:", *lines, "", "spmdkit COMMAND --help"]
    )


def parse(argv: Sequence[str]) -> Any:
    """Parse a command line without running anything (for checking the commands the docs cite)."""
    if not argv:
        raise SpmdkitError("no command given: see spmdkit --help")
    module = command(argv[0])
    return module.parse(argv[1:]) if hasattr(module, "parse") else module.parser().parse_args(list(argv[1:]))


def _one_line_warnings() -> None:
    """Print `SpmdkitWarning`s as `spmdkit: warning: ...` (one line, no source line); others as Python does."""
    python_format = warnings.formatwarning
    if getattr(python_format, "spmdkit", False):
        return

    def format_warning(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> str:
        if issubclass(category, SpmdkitWarning):
            return f"spmdkit: warning: {message}\n"
        return python_format(message, category, *args, **kwargs)

    format_warning.spmdkit = True  # type: ignore[attr-defined]
    warnings.formatwarning = format_warning


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _one_line_warnings()
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(usage())
            return 0 if argv else 2
        if argv[0] in COMMANDS and argv[0] not in JAX_FREE:  # before the command's module, which may import JAX
            from spmdkit.distributed.platform import gpu_present, start_jax
            from spmdkit.targets.flags import add_xla_flags

            if gpu_present():  # the XLA:GPU flags `spmdkit compile` compiles with, so a run is what was compiled
                add_xla_flags()
            start_jax()  # the CPU when no GPU is present; the CUDA plugin's driver-missing noise filtered
        return command(argv[0]).main(argv[1:])
    except SpmdkitError as error:
        print(f"spmdkit: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spmdkit: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as error:  # JaxRuntimeError is one: a peer's death is one line, not a 40-line traceback
        from spmdkit.distributed.initialize import PEER_LOST_STATUS, lost_peer

        if (line := lost_peer(error)) is None:
            raise
        print(f"spmdkit: error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # not JAX's exit barrier, which waits for the lost process and aborts with pages of logs
        os._exit(PEER_LOST_STATUS)
    except BrokenPipeError:  # the reader of stdout went away (`spmdkit plan | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
