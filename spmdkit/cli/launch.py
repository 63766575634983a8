"""`spmdkit launch`: run a command as the processes of one JAX job here, or write and submit an sbatch script."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from spmdkit.cli.args import ArgumentParser, flag_values
from spmdkit.distributed.launcher import launch_local, resolve_platform, visible_gpus
from spmdkit.distributed.slurm import sbatch_script, submit_slurm
from spmdkit.errors import SpmdkitError


def parser() -> ArgumentParser:
    """`spmdkit launch` (its handler is `main`)."""
    parser = ArgumentParser(
        prog="spmdkit launch",
        description="Run COMMAND as N local processes of one JAX job (spmdkit launch --processes 2 "
        "--devices-per-process 4 -- spmdkit train ...), or write and submit an sbatch script (--slurm).",
    )
    add = parser.add_argument
    add("--processes", type=int, metavar="N", help="local processes (default: one per GPU, else 1)")
    add("--devices-per-process", type=int, metavar="M", help="CPU: simulated devices each (default 1); GPU: GPUs each")
    add("--platform", choices=("auto", "cpu", "gpu"), default="auto", help="auto: gpu where GPUs are visible")
    add("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    add("--grace", type=float, default=60.0, help="seconds processes get to save after Ctrl-C (default: 60)")
    add(
        "--processes-per-host",
        type=int,
        metavar="K",
        help="emulate hosts of K processes each, for --dcn (default: all on this one)",
    )
    add(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="start the whole job again after a failure (it resumes from its newest checkpoint); at most N (<= 100) "
        "restarts in a row at one step, the first at once, then after 1 s, 2 s, 4 s, ... up to 60 s; a usage error "
        "(status 2) is never restarted (default: 0, a failure ends the job)",
    )
    add("--slurm", action="store_true", help="write an sbatch script and submit it")
    add("--nodes", type=int, metavar="K", help="--slurm: nodes")
    add("--gpus-per-node", type=int, default=8, metavar="G", help="--slurm: GPUs per node (default: 8)")
    add("--process-per", choices=("gpu", "node"), default="gpu", help="--slurm: one task per GPU (default) or per node")
    add("--cpus-per-task", type=int, metavar="C", help="--slurm: CPUs per task (default: 8 per GPU it drives)")
    add(
        "--env-setup",
        metavar="LINES",
        help="--slurm: shell lines that set up the environment (default: activate this one)",
    )
    add("--partition", help="--slurm: partition")
    add("--time", help="--slurm: time limit, e.g. 24:00:00")
    add("--account", help="--slurm: account")
    add("--job-name", default="spmdkit", help="--slurm: job name (default: spmdkit)")
    add("--script", default="spmdkit.sbatch", help="--slurm: where to write the script (default: spmdkit.sbatch)")
    add("--dry-run", action="store_true", help="--slurm: print the script, submit nothing")
    add("launch_command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="what each process runs")
    return parser


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    command = args.launch_command[1:] if args.launch_command[:1] == ["--"] else args.launch_command
    if args.slurm:
        if args.processes is not None or args.processes_per_host is not None or args.nodes is None:
            raise SpmdkitError("--slurm takes --nodes K, --gpus-per-node G and --process-per gpu|node, not --processes")
        names = ("cpus_per_task", "env_setup", "job_name", "partition", "time", "account", "max_restarts")
        script = sbatch_script(
            command, args.nodes, args.gpus_per_node, per=args.process_per, **flag_values(args, *names)
        )
        return submit_slurm(script, args.script, args.dry_run)
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
