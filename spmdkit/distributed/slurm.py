"""SLURM: the sbatch script `spmdkit launch --slurm` writes (one srun task per GPU) and its submission.

Every task runs the same command; `spmdkit.distributed.initialize.initialize_distributed` then reads `SLURM_PROCID` /
`SLURM_NTASKS` and the coordinator address the script exports, so the tasks join one JAX job.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Sequence

from spmdkit.errors import SpmdkitError

COORDINATOR = (
    "SPMDKIT_COORDINATOR"  # host:port of process 0, read by every process (spmdkit.distributed.initialize too)
)

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


def sbatch_script(command: Sequence[str], nodes: int, gpus_per_node: int, **options: str | None) -> str:
    """An sbatch script: one srun task per GPU, each joining the coordinator on the allocation's first node.

    `options`: more #SBATCH options by name (job_name="x" -> --job-name=x); None leaves one out.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise SpmdkitError(f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must be at least 1")
    if not command:
        raise SpmdkitError("no command to run: give it after '--', e.g. spmdkit launch --slurm ... -- spmdkit train")
    sbatch: dict[str, object] = {"nodes": nodes, "ntasks-per-node": gpus_per_node, "gpus-per-node": gpus_per_node}
    sbatch.update(options)
    header = "".join(f"#SBATCH --{k.replace('_', '-')}={v}\n" for k, v in sbatch.items() if v is not None)
    return f"""#!/bin/bash
# Written by `spmdkit launch --slurm`: {nodes} nodes x {gpus_per_node} GPUs, one task per GPU.
{header}#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail
# source /path/to/venv/bin/activate       # the environment spmdkit is installed in

# Every task joins the coordinator on the first node; rank and count come from SLURM_PROCID / SLURM_NTASKS.
# A task that dies ends the others: heartbeats (SPMDKIT_HEARTBEAT_TIMEOUT s) and srun --kill-on-bad-exit.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export {COORDINATOR}="$head_node:$((20000 + SLURM_JOB_ID % 20000))"
export SPMDKIT_HEARTBEAT_TIMEOUT=${{SPMDKIT_HEARTBEAT_TIMEOUT:-30}}

{NCCL_OPTIONS}
srun --kill-on-bad-exit=1 --cpu-bind=none {shlex.join(command)}
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
