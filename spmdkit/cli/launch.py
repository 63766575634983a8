"""`spmdkit launch`: run a command as the processes of one JAX job here, or write and submit an sbatch script."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from spmdkit.cli.args import ArgumentParser, flag_values
from spmdkit.distributed.launcher import launch_local, resolve_platform, visible_gpus
from spmdkit.distributed.slurm import sbatch_script, submit_slurm
from spmdkit.errors import SpmdkitError

LAUNCH_FLAGS: list[tuple[str, dict]] = [
    ("--processes", dict(type=int, metavar="N", help="local processes (default: one per GPU, else 1)")),
    (
        "--devices-per-process",
        dict(type=int, metavar="M", help="CPU: simulated devices each (default 1); GPU: GPUs each"),
    ),
    ("--platform", dict(choices=("auto", "cpu", "gpu"), default="auto", help="auto: gpu where GPUs are visible")),
    ("--port", dict(type=int, help="coordinator port on 127.0.0.1 (default: a free one)")),
    ("--grace", dict(type=float, default=60.0, help="seconds processes get to save after Ctrl-C (default: 60)")),
    (
        "--processes-per-host",
        dict(type=int, metavar="K", help="emulate hosts of K processes each, for --dcn (default: all on this one)"),
    ),
    (
        "--max-restarts",
        dict(
            type=int,
            default=0,
            metavar="N",
            help="start the whole job again after a failure (it resumes from its newest checkpoint); at most N "
            "restarts in a row at one step (default: 0, a failure ends the job)",
        ),
    ),
    ("--slurm", dict(action="store_true", help="write an sbatch script and submit it")),
    ("--nodes", dict(type=int, metavar="K", help="--slurm: nodes")),
    ("--gpus-per-node", dict(type=int, default=8, metavar="G", help="--slurm: GPUs per node (default: 8)")),
    (
        "--process-per",
        dict(choices=("gpu", "node"), default="gpu", help="--slurm: one task per GPU (default) or per node"),
    ),
    ("--cpus-per-task", dict(type=int, metavar="C", help="--slurm: CPUs per task (default: 8 per GPU it drives)")),
    (
        "--env-setup",
        dict(metavar="LINES", help="--slurm: shell lines that set up the environment (default: activate this one)"),
    ),
    ("--partition", dict(help="--slurm: partition")),
    ("--time", dict(help="--slurm: time limit, e.g. 24:00:00")),
    ("--account", dict(help="--slurm: account")),
    ("--job-name", dict(default="spmdkit", help="--slurm: job name (default: spmdkit)")),
    ("--script", dict(default="spmdkit.sbatch", help="--slurm: where to write the script (default: spmdkit.sbatch)")),
    ("--dry-run", dict(action="store_true", help="--slurm: print the script, submit nothing")),
]


def parser() -> ArgumentParser:
    """`spmdkit launch` (its handler is `main`)."""
    parser = ArgumentParser(
        prog="spmdkit launch",
        description="Run COMMAND as N local processes of one JAX job (spmdkit launch --processes 2 "
        "--devices-per-process 4 -- spmdkit train ...), or write and submit an sbatch script (--slurm).",
    )
    for flag, kwargs in LAUNCH_FLAGS:
        parser.add_argument(flag, **kwargs)
    parser.add_argument("launch_command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="what each process runs")
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    return parser().parse_args(list(argv))


def _slurm(args: argparse.Namespace, command: Sequence[str]) -> int:
    if args.processes is not None or args.processes_per_host is not None or args.nodes is None:
        raise SpmdkitError("--slurm takes --nodes K, --gpus-per-node G and --process-per gpu|node, not --processes")
    names = ("cpus_per_task", "env_setup", "job_name", "partition", "time", "account", "max_restarts")
    script = sbatch_script(command, args.nodes, args.gpus_per_node, per=args.process_per, **flag_values(args, *names))
    return submit_slurm(script, args.script, args.dry_run)


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    command = args.launch_command[1:] if args.launch_command[:1] == ["--"] else args.launch_command
    if args.slurm:
        return _slurm(args, command)
    slurm_only = {"--nodes": args.nodes, "--dry-run": args.dry_run or None, "--cpus-per-task": args.cpus_per_task}
    slurm_only.update({"--env-setup": args.env_setup, "--process-per": "x" if args.process_per != "gpu" else None})
    if given := [flag for flag, value in slurm_only.items() if value is not None]:
        raise SpmdkitError(
            f"{' and '.join(given)} go{'es' * (len(given) == 1)} with --slurm; a local run takes --processes N"
        )
    if args.grace < 0:
        raise SpmdkitError(f"--grace {args.grace} must be >= 0 (seconds the processes get to save)")
    platform = resolve_platform(args.platform, os.environ)
    processes = args.processes
    if processes is None:
        processes = max(len(visible_gpus(os.environ)), 1) if platform == "gpu" else 1
    return launch_local(
        command,
        processes,
        args.devices_per_process,
        args.port,
        platform,
        args.grace,
        args.processes_per_host,
        args.max_restarts,
    )
