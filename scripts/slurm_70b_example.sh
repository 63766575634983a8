#!/bin/bash
# A 70B Llama-style model on 8 nodes x 8 H100 (64 GPUs, one JAX process per GPU), as written by
#
#   spmdkit launch --slurm --nodes 8 --gpus-per-node 8 --partition h100 --time 48:00:00 \
#       --account YOUR_ACCOUNT --job-name llama70b --env-setup 'source /shared/venvs/spmdkit/bin/activate' \
#       --dry-run -- spmdkit train --model 70b --mesh fsdp=32,tensor=2 (the srun line's flags below)
#
# The layout is what `spmdkit plan --model 70b --devices 64 --device-type h100` recommends (its defaults: a
# 256 x 4096-token batch, bfloat16; tests/test_readme.py checks the flags below against it):
#   mesh fsdp=32,tensor=2 with sequence parallelism, ZeRO-3, remat save_dot_except_mlp, 2 accumulation steps:
#   ~73.3 of 80 GB per GPU, ~17.9 s per step, ~58,700 tokens/s, ~40% MFU (the planner's estimate; XLA:GPU
#   compiles the step to 66.0 GB per GPU: `spmdkit compile --devices 64` with these flags).
# SLURM's default block distribution puts ranks 0-7 on the first node, 8-15 on the second, ...: each tensor pair is
# two GPUs of one node (NVLink) and each FSDP group of 32 spans all 8 nodes, so FSDP's traffic crosses InfiniBand.
# The 70b vocabulary (128,256 ids) needs uint32 tokens. Edit the partition, account, paths and the environment
# line (`spmdkit launch --slurm` writes the activation of the environment it runs in, or --env-setup's lines),
# then: sbatch scripts/slurm_70b_example.sh (a rerun resumes from the newest checkpoint in RUN_DIR/checkpoints).
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --job-name=llama70b
#SBATCH --partition=h100
#SBATCH --time=48:00:00
#SBATCH --account=YOUR_ACCOUNT
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -eo pipefail
# The environment spmdkit is installed in (`spmdkit launch --env-setup` to give other lines):
source /shared/venvs/spmdkit/bin/activate
set -u
command -v spmdkit >/dev/null || { echo "spmdkit: not found after the environment set-up" >&2; exit 127; }

# Every task joins the coordinator on the first node; rank and count come from SLURM_PROCID / SLURM_NTASKS.
# A task that dies ends the others: heartbeats (SPMDKIT_HEARTBEAT_TIMEOUT s) and srun --kill-on-bad-exit.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE under pipefail
export SPMDKIT_COORDINATOR="$head_node:$((20000 + SLURM_JOB_ID % 20000))"
export SPMDKIT_HEARTBEAT_TIMEOUT=${SPMDKIT_HEARTBEAT_TIMEOUT:-30}

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

# srun's tasks get the CPUs asked for above (since SLURM 22.05 srun does not read them from sbatch itself).
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --cpu-bind=none spmdkit train \
    --model 70b --mesh fsdp=32,tensor=2 --zero 3 --sequence-parallel \
    --remat save_dot_except_mlp --grad-accum 2 --dtype bfloat16 \
    --batch-size 256 --seq-len 4096 \
    --data /shared/data/tokens.bin --token-dtype uint32 \
    --steps 10000 --checkpoint-every 200 --run-dir /shared/runs/llama70b --no-progress
