"""SLURM: the sbatch script `spmdkit launch --slurm` writes and its submission.

The script runs as written: it activates the environment the launcher ran from (a venv, a conda environment, or
`--env-setup`), checks that the command is found there, and starts one srun task per GPU (`--process-per gpu`,
the default) or per node (`--process-per node`, each task driving all its node's GPUs), each with
`--cpus-per-task` CPUs. Every task runs the same command; `spmdkit.distributed.join` then reads `SLURM_PROCID` /
`SLURM_NTASKS` and the coordinator address the script exports, so the tasks join one JAX job. With
`--max-restarts N` srun runs in a loop (`RESTART_LOOP`) that starts a failed step again inside the allocation, under
the same rule as the local launcher's (`spmdkit.distributed.restarts`), written in bash.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from spmdkit.distributed.restarts import check_max_restarts
from spmdkit.errors import SpmdkitError

# host:port of process 0, read by every process (spmdkit.distributed.initialize too)
COORDINATOR = "SPMDKIT_COORDINATOR"
CPUS_PER_GPU = 8  # --cpus-per-task's default: this many per GPU a task drives (64 for an 8-GPU node)

NCCL_OPTIONS = """\
# NCCL on H100 nodes with InfiniBand: the defaults usually work; uncomment what your cluster needs.
# export NCCL_DEBUG=INFO                  # once: the log says whether IB ("NET/IB") and GPUDirect RDMA are used
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7  # the compute HCAs (ibv_devinfo)
# export NCCL_SOCKET_IFNAME=ib0           # the interface for NCCL's bootstrap (not docker0 / lo)
# export NCCL_NET_GDR_LEVEL=PHB           # GPUDirect RDMA where GPU and HCA share a PCIe host bridge
# export NCCL_IB_GID_INDEX=3              # RoCE fabrics only
# export NCCL_NVLS_ENABLE=0               # NVLink SHARP (NVSwitch) is on where supported; 0 if it fails or hangs
# export NCCL_CROSS_NIC=0                 # rail-optimised fabrics: keep each ring on the same NIC rail
# export XLA_PYTHON_CLIENT_MEM_FRACTION=0.90  # JAX preallocates 75% of HBM by default
# export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"  # overlap FSDP collectives with compute
"""

RESTART_LOOP = """\
# --max-restarts {max_restarts}: a failed step (srun --kill-on-bad-exit=1 ends all its tasks when one fails) is
# started again, whole, in this allocation, and resumes from its newest checkpoint; at most {max_restarts} restarts
# in a row at one step, the first at once, then after 1 s, 2 s, 4 s, ... up to 60 s. Process 0 runs on this node
# (the allocation's first) and keeps the step it is in in SPMDKIT_PROGRESS_FILE, a node-local file that needs no
# shared file system. Each attempt gets SPMDKIT_ATTEMPT (0 first) and a coordinator port of its own (the last
# attempt's may linger). scancel or the time limit (SIGTERM), and a usage error (status 2), never restart.
progress_dir=$(mktemp -d "${{TMPDIR:-/tmp}}/spmdkit-$SLURM_JOB_ID.XXXXXX")
trap 'rm -rf "$progress_dir"' EXIT
trap 'stopping=1' INT TERM
export SPMDKIT_PROGRESS_FILE="$progress_dir/progress.json"
max_restarts={max_restarts} attempt=0 stopping=0 last_place=none failures=0
while :; do
    export SPMDKIT_ATTEMPT=$attempt {coordinator}="$head_node:$((20000 + (SLURM_JOB_ID + attempt) % 20000))"
    status=0
    {srun} || status=$?
    if [ "$status" -eq 0 ] || [ "$stopping" -eq 1 ]; then exit "$status"; fi
    step=$(sed -n 's/.*"step" *: *\\([0-9][0-9]*\\).*/\\1/p' "$SPMDKIT_PROGRESS_FILE" 2>/dev/null) || step=""
    written=$(sed -n 's/.*"attempt" *: *\\([0-9][0-9]*\\).*/\\1/p' "$SPMDKIT_PROGRESS_FILE" 2>/dev/null) || written=""
    [ "$written" = "$attempt" ] || step=""  # an earlier attempt's record: this one reached no step
    case $step in
        "") where="at an unknown step" ;;
        0) where="before the first step" ;;
        *) where="at step $step" ;;
    esac
    place=${{step:-0}}  # before the first step and unknown: one place
    if [ "$place" = "$last_place" ]; then failures=$((failures + 1)); else failures=1; fi
    last_place=$place
    if [ "$status" -eq 2 ]; then
        echo "spmdkit launch: failed: srun exited with status 2 $where (status 2: a usage error, never restarted)" >&2
        exit 2
    fi
    if [ "$failures" -gt "$max_restarts" ]; then
        echo "spmdkit launch: failed: srun exited with status $status $where, $failures times in a row" \\
            "(--max-restarts $max_restarts): not restarting" >&2
        exit "$status"
    fi
    attempt=$((attempt + 1)) delay=$((failures <= 1 ? 0 : failures > 7 ? 60 : 1 << (failures - 2))) when="at once"
    [ "$delay" -eq 0 ] || when="in $delay s"
    echo "spmdkit launch: srun exited with status $status $where; restarting the job $when (attempt" \\
        "$((attempt + 1)); $failures of $max_restarts restarts at this step)" >&2
    sleep "$delay" & wait $! || true  # a SIGTERM meanwhile ends the wait: then no restart
    if [ "$stopping" -eq 1 ]; then exit "$status"; fi
done
"""


def check_command(command: Sequence[str], example: str, find: bool = True) -> None:
    """The command is given whole (not empty, no literal '...') and, with `find`, its first word is on PATH."""
    if not command or not command[0].strip():
        raise SpmdkitError(f"no command to run: give it after '--', e.g. {example}")
    if "..." in command:
        raise SpmdkitError(f"the command has a literal '...': write it whole after '--', e.g. {example}")
    if find and not shutil.which(command[0]):
        raise SpmdkitError(f"command {command[0]!r} not found (not on PATH, or not executable)")


def environment_setup(environ: Mapping[str, str] | None = None) -> str:
    """The shell lines that activate the Python environment this process runs in: its venv, else the active
    conda environment, else its interpreter's directory first on PATH."""
    env = os.environ if environ is None else environ
    venvs = [sys.prefix] if sys.prefix != sys.base_prefix else []
    for venv in [*venvs, env.get("VIRTUAL_ENV", "")]:
        if venv and os.path.isfile(os.path.join(venv, "bin", "activate")):
            return f"source {shlex.quote(os.path.join(venv, 'bin', 'activate'))}"
    if env.get("CONDA_PREFIX"):
        return f'eval "$(conda shell.bash hook)"\nconda activate {shlex.quote(env["CONDA_PREFIX"])}'
    return f'export PATH={shlex.quote(os.path.dirname(sys.executable))}:"$PATH"'


def _header(nodes: int, gpus_per_node: int, per: str, cpus_per_task: int | None, options: dict) -> str:
    tasks = gpus_per_node if per == "gpu" else 1
    cpus = CPUS_PER_GPU * gpus_per_node // tasks if cpus_per_task is None else cpus_per_task
    if cpus < 1:
        raise SpmdkitError(f"--cpus-per-task {cpus} must be at least 1")
    sbatch: dict[str, object] = {"nodes": nodes, "ntasks-per-node": tasks, "gpus-per-node": gpus_per_node}
    sbatch.update({"cpus-per-task": cpus, **options})
    return "".join(f"#SBATCH --{k.replace('_', '-')}={v}\n" for k, v in sbatch.items() if v is not None)


def sbatch_script(
    command: Sequence[str],
    nodes: int,
    gpus_per_node: int,
    per: str = "gpu",
    cpus_per_task: int | None = None,
    env_setup: str | None = None,
    max_restarts: int = 0,
    **options: str | None,
) -> str:
    """An sbatch script: one srun task per GPU (`per="gpu"`) or per node (`per="node"`), each joining the
    coordinator on the allocation's first node. `env_setup`: the shell lines that make the command runnable
    (default: activate this process's environment; then the command is checked here too). `cpus_per_task`:
    default `CPUS_PER_GPU` per GPU of a task. `max_restarts`: run srun in a loop that starts a failed step
    again, at most this many times in a row at one step (`RESTART_LOOP`; 0: srun once). `options`: more #SBATCH
    options (job_name="x" -> --job-name=x)."""
    if nodes < 1 or gpus_per_node < 1:
        raise SpmdkitError(f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must be at least 1")
    if per not in ("gpu", "node"):
        raise SpmdkitError(f"--process-per {per!r}: expected gpu (one task per GPU) or node (one per node)")
    check_max_restarts(max_restarts)
    check_command(command, "spmdkit launch --slurm --nodes 2 -- spmdkit train --mesh fsdp=16", env_setup is None)
    layout = "one task per GPU" if per == "gpu" else f"one task per node ({gpus_per_node} GPUs each)"
    setup = environment_setup() if env_setup is None else env_setup
    program = shlex.quote(command[0])
    srun = f'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --cpu-bind=none {shlex.join(command)}'
    if max_restarts:
        srun = RESTART_LOOP.format(max_restarts=max_restarts, coordinator=COORDINATOR, srun=srun).rstrip("\n")
    return f"""#!/bin/bash
# Written by `spmdkit launch --slurm`: {nodes} nodes x {gpus_per_node} GPUs, {layout}.
{_header(nodes, gpus_per_node, per, cpus_per_task, options)}#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -eo pipefail
# The environment spmdkit is installed in (`spmdkit launch --env-setup` to give other lines):
{setup}
set -u
command -v {program} >/dev/null || {{ echo "{program}: not found after the environment set-up" >&2; exit 127; }}

# Every task joins the coordinator on the first node; rank and count come from SLURM_PROCID / SLURM_NTASKS.
# A task that dies ends the others: heartbeats (SPMDKIT_HEARTBEAT_TIMEOUT s) and srun --kill-on-bad-exit.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE under pipefail
export {COORDINATOR}="$head_node:$((20000 + SLURM_JOB_ID % 20000))"
export SPMDKIT_HEARTBEAT_TIMEOUT=${{SPMDKIT_HEARTBEAT_TIMEOUT:-30}}

{NCCL_OPTIONS}
# srun's tasks get the CPUs asked for above (since SLURM 22.05 srun does not read them from sbatch itself).
{srun}
"""


def submit_slurm(script: str, path: str, dry_run: bool) -> int:
    """Print the script (dry run), or write it to `path` and submit it with sbatch."""
    if dry_run:
        print(script, end="")
        return 0
    with open(path, "w") as f:
        f.write(script)
    if not shutil.which("sbatch"):
        raise SpmdkitError(f"sbatch not found (not a SLURM login node?): the script is in {path}; submit it there")
    return subprocess.run(["sbatch", path]).returncode
