"""Multi-host start-up: join one JAX distributed runtime from explicit variables, SLURM or Open MPI; start N local
processes (`spmdkit launch --processes N`); write or submit an sbatch script (`spmdkit launch --slurm`).

`initialize_distributed()` runs before JAX computes anything. It reads, in order: `SPMDKIT_NUM_PROCESSES` /
`SPMDKIT_PROCESS_ID` / `SPMDKIT_COORDINATOR` (what `spmdkit launch` sets), srun's `SLURM_PROCID` / `SLURM_NTASKS`
(coordinator: `SPMDKIT_COORDINATOR`, else the first node of the step's node list), Open MPI's
`OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE` (coordinator: `SPMDKIT_COORDINATOR`). None of them: one process.
`SPMDKIT_CPU_DEVICES=M` gives each process M simulated CPU devices. A process that stops sending heartbeats for
`SPMDKIT_HEARTBEAT_TIMEOUT` seconds (default 30) ends every other process of the job with a non-zero status.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from spmdkit.errors import SpmdkitError

COORDINATOR, NUM_PROCESSES, PROCESS_ID = "SPMDKIT_COORDINATOR", "SPMDKIT_NUM_PROCESSES", "SPMDKIT_PROCESS_ID"
CPU_DEVICES, LOCAL_DEVICE_IDS = "SPMDKIT_CPU_DEVICES", "SPMDKIT_LOCAL_DEVICE_IDS"
_TIMEOUTS = {  # variable -> (jax.distributed.initialize keyword, default seconds)
    "SPMDKIT_INIT_TIMEOUT": ("initialization_timeout", 120),
    "SPMDKIT_HEARTBEAT_TIMEOUT": ("heartbeat_timeout_seconds", 30),
    "SPMDKIT_SHUTDOWN_TIMEOUT": ("shutdown_timeout_seconds", 60),
}
_FORCE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job, and which launcher said so ("spmdkit", "slurm" or "openmpi")."""

    coordinator: str
    num_processes: int
    process_id: int
    source: str
    local_device_ids: tuple[int, ...] | None = None


# ----------------------------------------------------------------------------------------------- joining a job


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list -> host names: 'node[01-03,07],gpu-a' -> ['node01', 'node02', 'node03', ...]."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        parts: list[list[str]] = []
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            parts.append([text])
            if ranges:
                parts.append(_expand_ranges(ranges))
        hosts += ["".join(p) for p in itertools.product(*parts)]
    if not hosts:
        raise SpmdkitError(f"cannot read the SLURM node list {nodelist!r}: set SPMDKIT_COORDINATOR=host:port")
    return hosts


def _expand_ranges(ranges: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] (zero padding kept)."""
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SpmdkitError(f"cannot read the SLURM node range [{ranges}]: set SPMDKIT_COORDINATOR=host:port")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
    return out


def _int_var(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except KeyError:
        raise SpmdkitError(f"{name} is not set: set it, or unset the other variables of a multi-process run") from None
    except ValueError:
        raise SpmdkitError(f"{name}={environ[name]!r} is not an integer") from None


def _gpu_device_ids(environ: Mapping[str, str], local_rank: int, tasks_here: int) -> tuple[int, ...] | None:
    """One GPU per task when several tasks share a node that shows each task all its GPUs; else JAX's default."""
    if environ.get(LOCAL_DEVICE_IDS):
        return tuple(int(x) for x in environ[LOCAL_DEVICE_IDS].split(","))
    cpu = CPU_DEVICES in environ or environ.get("JAX_PLATFORMS", "").startswith("cpu")
    narrowed = len(environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")) == 1
    return None if cpu or narrowed or tasks_here <= 1 else (local_rank,)


def detect_environment(environ: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """The distributed set-up the environment describes, or None for a single process."""
    env = os.environ if environ is None else environ
    if NUM_PROCESSES in env:
        count, pid = _int_var(env, NUM_PROCESSES), _int_var(env, PROCESS_ID)
        found = DistributedEnv(env.get(COORDINATOR, ""), count, pid, "spmdkit", _gpu_device_ids(env, 0, 1))
    elif "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        count = _int_var(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
        nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
        coordinator = env.get(COORDINATOR) or _slurm_coordinator(env)
        local = _gpu_device_ids(env, int(env.get("SLURM_LOCALID", "0")), count // max(nodes, 1))
        found = DistributedEnv(coordinator, count, _int_var(env, "SLURM_PROCID"), "slurm", local)
    elif "OMPI_COMM_WORLD_SIZE" in env:
        count, pid = _int_var(env, "OMPI_COMM_WORLD_SIZE"), _int_var(env, "OMPI_COMM_WORLD_RANK")
        coordinator = env.get(COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS", "")
        if not coordinator and count > 1:
            raise SpmdkitError(
                f"Open MPI run of {count} processes but no coordinator: export {COORDINATOR}=HOST:PORT (rank 0's "
                f"host, a free port) and pass it to every rank (mpirun -x {COORDINATOR})"
            )
        local = _gpu_device_ids(
            env, int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")), int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
        )
        found = DistributedEnv(coordinator, count, pid, "openmpi", local)
    else:
        return None
    if found.num_processes < 1 or not 0 <= found.process_id < found.num_processes:
        raise SpmdkitError(
            f"process id {found.process_id} of {found.num_processes} processes ({found.source}) is invalid"
        )
    if found.num_processes > 1 and ":" not in found.coordinator:
        raise SpmdkitError(f"coordinator address {found.coordinator!r} must be HOST:PORT (set {COORDINATOR})")
    return found


def _slurm_coordinator(env: Mapping[str, str]) -> str:
    """First host of the step's (else the job's) node list, port SPMDKIT_COORDINATOR_PORT or one from the job id."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SpmdkitError(f"SLURM run without SLURM_STEP_NODELIST / SLURM_JOB_NODELIST: set {COORDINATOR}=HOST:PORT")
    port = env.get("SPMDKIT_COORDINATOR_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return f"{expand_nodelist(nodelist)[0]}:{port}"


def _cpu_device_count(env: Mapping[str, str]) -> int | None:
    """SPMDKIT_CPU_DEVICES, checked against a device count already forced through XLA_FLAGS (--cpu-devices)."""
    if CPU_DEVICES not in env:
        return None
    count = _int_var(env, CPU_DEVICES)
    forced = _FORCE_COUNT.search(env.get("XLA_FLAGS", ""))
    if count < 1 or (forced and int(forced.group(1)) != count):
        raise SpmdkitError(
            f"mismatched device counts: {CPU_DEVICES}={count} (spmdkit launch --devices-per-process) but "
            f"--cpu-devices / XLA_FLAGS asks for {forced.group(1) if forced else count}: give the count once"
        )
    return count


def initialize_distributed(environ: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """Join the job the environment describes (see the module docstring); call before JAX computes anything.

    Returns the detected set-up (None: no variables, a single process, nothing done).
    """
    env = os.environ if environ is None else environ
    import jax

    cpu_devices = _cpu_device_count(env)
    found = detect_environment(env)
    try:
        if cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        if found is None or found.num_processes == 1 or jax.distributed.is_initialized():
            return found
        if cpu_devices is not None or env.get("JAX_PLATFORMS", "").startswith("cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        timeouts = {key: int(env.get(var, default)) for var, (key, default) in _TIMEOUTS.items()}
        jax.distributed.initialize(
            coordinator_address=found.coordinator,
            num_processes=found.num_processes,
            process_id=found.process_id,
            local_device_ids=list(found.local_device_ids) if found.local_device_ids else None,
            cluster_detection_method="deactivate",
            **timeouts,
        )
    except (RuntimeError, ValueError) as error:  # JaxRuntimeError is a RuntimeError
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpmdkitError(
            f"could not start JAX as process {found.process_id if found else 0} of "
            f"{found.num_processes if found else 1}{f' (coordinator {found.coordinator})' if found else ''}: {first}"
        ) from None
    return found


# ----------------------------------------------------------------------------------------------- local processes


def free_port(port: int | None = None) -> int:
    """`port` if nothing listens on it on 127.0.0.1 (else an error); with None, a free port the OS picks."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port or 0))
        except OSError as error:
            raise SpmdkitError(f"port {port} on 127.0.0.1 is in use ({error.strerror}): pick another --port") from None
        return sock.getsockname()[1]


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """GPU ids this host shows: CUDA_VISIBLE_DEVICES if set, else what `nvidia-smi -L` lists (none: [])."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if not shutil.which("nvidia-smi"):
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]


def process_environments(
    processes: int, devices_per_process: int | None, port: int, platform: str, environ: Mapping[str, str]
) -> list[dict[str, str]]:
    """The environment of each local process: coordinator, count, id, and its devices (CPU count or GPU ids)."""
    base = dict(environ, PYTHONUNBUFFERED="1")
    base.update({COORDINATOR: f"127.0.0.1:{port}", NUM_PROCESSES: str(processes)})
    if platform == "cpu":
        base.update(JAX_PLATFORMS="cpu", XLA_FLAGS=_FORCE_COUNT.sub("", base.get("XLA_FLAGS", "")).strip())
        base[CPU_DEVICES] = str(devices_per_process or 1)
        return [dict(base, **{PROCESS_ID: str(i)}) for i in range(processes)]
    gpus = visible_gpus(environ)
    per = devices_per_process or len(gpus) // processes
    if per < 1 or per * processes > len(gpus) or (devices_per_process is None and len(gpus) % processes):
        raise SpmdkitError(
            f"mismatched device counts: {processes} processes x {devices_per_process or 'an equal share of'} GPUs "
            f"does not fit the {len(gpus)} GPU(s) of this host: use --processes {len(gpus) or 1} (one per GPU), "
            f"1 (one per host), or --platform cpu"
        )
    return [
        dict(base, **{PROCESS_ID: str(i), "CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per : (i + 1) * per])})
        for i in range(processes)
    ]


def _pump(source: BinaryIO, sink: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
    """Copy lines from a child's pipe, each prefixed with `[i] `; of '\\r'-rewritten lines keep the last."""
    for line in iter(source.readline, b""):
        body = line.rstrip(b"\r\n").rsplit(b"\r", 1)[-1]
        with lock:
            sink.write(prefix + body + b"\n")
            sink.flush()
    source.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _signal_all(children: Sequence[subprocess.Popen], sig: int) -> None:
    for child in children:
        if child.poll() is None:
            try:
                os.killpg(child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def stop_all(children: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every running child (the trainer saves and stops), SIGKILL what still runs after `grace` s."""
    _signal_all(children, signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        while any(c.poll() is None for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        _signal_all(children, signal.SIGKILL)
        for child in children:
            child.wait()


def _note(text: str) -> None:
    print(f"spmdkit launch: {text}", file=sys.stderr, flush=True)


def supervise(children: Sequence[subprocess.Popen], grace: float) -> int:
    """Wait for the children. One that fails stops the others within seconds; Ctrl-C / SIGTERM stops all."""
    try:
        while True:
            codes = [child.poll() for child in children]
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None:
                code = codes[failed]
                running = sum(code is None for code in codes)
                _note(f"process {failed} (pid {children[failed].pid}) {_describe(code)}; stopping {running} other(s)")
                stop_all(children, grace=5.0)
                _note(f"failed: process {failed} {_describe(code)}")
                return code if code > 0 else 128 - code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        _note(f"interrupted: stopping all processes (up to {grace:g} s to save; Ctrl-C again to kill)")
        try:
            stop_all(children, grace=grace)
        except KeyboardInterrupt:
            stop_all(children, grace=0)
        return 130


def resolve_platform(platform: str) -> str:
    """ "cpu" or "gpu"; "auto" is gpu when GPUs are visible and JAX_PLATFORMS does not say cpu."""
    if platform != "auto":
        return platform
    cpu_only = os.environ.get("JAX_PLATFORMS", "").startswith("cpu")
    return "cpu" if cpu_only or not visible_gpus(os.environ) else "gpu"


def launch_local(
    command: Sequence[str],
    processes: int,
    devices_per_process: int | None = None,
    port: int | None = None,
    platform: str = "auto",
    grace: float = 60.0,
) -> int:
    """Run `command` as `processes` local processes of one JAX job on 127.0.0.1; their exit status, or the failure."""
    if processes < 1:
        raise SpmdkitError(f"--processes {processes} must be at least 1")
    if devices_per_process is not None and devices_per_process < 1:
        raise SpmdkitError(f"--devices-per-process {devices_per_process} must be at least 1")
    platform = resolve_platform(platform)
    _check_command(command, processes * (devices_per_process or 1) if platform == "cpu" else None)
    port = free_port(port)
    environments = process_environments(processes, devices_per_process, port, platform, os.environ)
    children: list[subprocess.Popen] = []
    lock, threads = threading.Lock(), []
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for i, env in enumerate(environments):
            child = subprocess.Popen(
                list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
            children.append(child)
            for source, sink in ((child.stdout, sys.stdout.buffer), (child.stderr, sys.stderr.buffer)):
                threads.append(threading.Thread(target=_pump, args=(source, sink, f"[{i}] ".encode(), lock)))
                threads[-1].daemon = True
                threads[-1].start()
        pids = ", ".join(str(c.pid) for c in children)
        _note(f"{processes} process(es) on 127.0.0.1:{port} ({platform}), pids {pids}")
        code = supervise(children, grace)
    finally:
        stop_all(children, grace=0)
        signal.signal(signal.SIGTERM, previous)
        for thread in threads:
            thread.join(timeout=2)
    return code


def _check_command(command: Sequence[str], cpu_devices: int | None) -> None:
    """The command exists, leaves device counts to the launcher, and (spmdkit train --mesh) fits the devices."""
    if not command:
        raise SpmdkitError("no command to run: give it after '--', e.g. spmdkit launch --processes 2 -- spmdkit train")
    if not shutil.which(command[0]):
        raise SpmdkitError(f"command {command[0]!r} not found (not on PATH, or not executable)")
    if any(arg == "--cpu-devices" or arg.startswith("--cpu-devices=") for arg in command):
        raise SpmdkitError("mismatched device counts: pass --devices-per-process to launch, not --cpu-devices")
    mesh = _flag_value(command, "--mesh")
    if cpu_devices is not None and mesh is not None and "train" in command:
        from spmdkit.sharding.mesh import MeshConfig

        try:
            MeshConfig.parse(mesh, _flag_value(command, "--dcn") or "").resolve(cpu_devices)
        except SpmdkitError as error:
            raise SpmdkitError(f"mismatched device counts: {error} (processes x devices-per-process)") from None


def _flag_value(command: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(command):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
    return None


# ----------------------------------------------------------------------------------------------- SLURM


NCCL_OPTIONS = """\
# NCCL on H100 nodes with InfiniBand: the defaults are usually right; uncomment what your cluster needs.
# export NCCL_DEBUG=INFO                    # once: the log shows whether IB ("NET/IB") and GPUDirect RDMA are used
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7  # the compute HCAs (ibv_devinfo)
# export NCCL_SOCKET_IFNAME=ib0             # the interface for NCCL's bootstrap (not docker0 / lo)
# export NCCL_NET_GDR_LEVEL=PHB             # GPUDirect RDMA between GPU and HCA under the same PCIe host bridge
# export NCCL_IB_GID_INDEX=3                # RoCE fabrics only
# export NCCL_NVLS_ENABLE=1                 # NVLink SHARP on NVSwitch systems (H100 SXM)
# export NCCL_CROSS_NIC=0                   # keep rings on the same NIC rail across nodes
# export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95  # JAX preallocates 75% of HBM by default
# export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"  # overlap FSDP collectives with compute
"""


def sbatch_script(
    command: Sequence[str],
    nodes: int,
    gpus_per_node: int,
    partition: str | None = None,
    time_limit: str | None = None,
    account: str | None = None,
    job_name: str = "spmdkit",
) -> str:
    """An sbatch script: one srun task per GPU, the coordinator on the allocation's first node."""
    if nodes < 1 or gpus_per_node < 1:
        raise SpmdkitError(f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must be at least 1")
    if not command:
        raise SpmdkitError("no command to run: give it after '--', e.g. spmdkit launch --slurm ... -- spmdkit train")
    options = {"job-name": job_name, "nodes": nodes, "ntasks-per-node": gpus_per_node}
    options.update({"gpus-per-node": gpus_per_node, "partition": partition, "time": time_limit, "account": account})
    header = "".join(f"#SBATCH --{key}={value}\n" for key, value in options.items() if value is not None)
    return f"""#!/bin/bash
# Written by `spmdkit launch --slurm`: {nodes} node(s) x {gpus_per_node} GPU(s) = {nodes * gpus_per_node} tasks.
{header}#SBATCH --exclusive
#SBATCH --output=%x-%j.out

set -euo pipefail
# source /path/to/venv/bin/activate         # the environment spmdkit is installed in

# Every task joins the JAX coordinator on the allocation's first node; rank and count come from SLURM_PROCID
# and SLURM_NTASKS. A task that dies ends the others (heartbeat, SPMDKIT_HEARTBEAT_TIMEOUT s; srun's kill-on-bad-exit).
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
        raise SpmdkitError(f"sbatch not found: not a SLURM login node? The script is in {path}; run sbatch {path}")
    return subprocess.run(["sbatch", path]).returncode


# ----------------------------------------------------------------------------------------------- the command


def add_launch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `spmdkit launch` subcommand (its handler is `run_launch`)."""
    parser = subparsers.add_parser(
        "launch",
        help="run a command as several JAX processes (local, or a SLURM job)",
        description="Run COMMAND as N local processes of one JAX job (spmdkit launch --processes 2 "
        "--devices-per-process 4 -- spmdkit train ...), or write and submit an sbatch script (--slurm).",
    )
    add = parser.add_argument
    add("--processes", type=int, metavar="N", help="local processes (default: 1 per GPU, else 1)")
    add("--devices-per-process", type=int, metavar="M", help="CPU: simulated devices each; GPU: GPUs each")
    add("--platform", choices=("auto", "cpu", "gpu"), default="auto", help="auto: gpu if GPUs are visible")
    add("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    add("--grace", type=float, default=60.0, help="seconds to let processes save after Ctrl-C (default: 60)")
    add("--slurm", action="store_true", help="write an sbatch script (one task per GPU) and submit it")
    add("--nodes", type=int, metavar="K", help="--slurm: nodes")
    add("--gpus-per-node", type=int, default=8, metavar="G", help="--slurm: GPUs (tasks) per node (default: 8)")
    add("--partition", help="--slurm: partition")
    add("--time", help="--slurm: time limit, e.g. 24:00:00")
    add("--account", help="--slurm: account")
    add("--job-name", default="spmdkit", help="--slurm: job name (default: spmdkit)")
    add("--script", default="spmdkit.sbatch", help="--slurm: where to write the script (default: spmdkit.sbatch)")
    add("--dry-run", action="store_true", help="--slurm: print the script, submit nothing")
    add("launch_command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command every process runs")
    parser.set_defaults(handler=run_launch)
    return parser


def run_launch(args: argparse.Namespace) -> int:
    command = args.launch_command[1:] if args.launch_command[:1] == ["--"] else args.launch_command
    if args.slurm:
        if args.processes is not None or args.nodes is None:
            raise SpmdkitError("--slurm takes --nodes K and --gpus-per-node G (one task per GPU), not --processes")
        script = sbatch_script(
            command, args.nodes, args.gpus_per_node, args.partition, args.time, args.account, args.job_name
        )
        return submit_slurm(script, args.script, args.dry_run)
    if args.nodes is not None or args.dry_run:
        raise SpmdkitError("--nodes and --dry-run go with --slurm; local runs take --processes N")
    platform = resolve_platform(args.platform)
    processes = args.processes
    if processes is None:
        processes = max(len(visible_gpus(os.environ)), 1) if platform == "gpu" else 1
    return launch_local(command, processes, args.devices_per_process, args.port, platform, args.grace)
