"""Multi-host start-up: join one JAX distributed runtime (`initialize_distributed`), run N local processes
(`spmdkit launch --processes N`), or write and submit an sbatch script (`spmdkit launch --slurm`).

`initialize_distributed()` reads, in order: `SPMDKIT_NUM_PROCESSES` / `SPMDKIT_PROCESS_ID` / `SPMDKIT_COORDINATOR`
(what `spmdkit launch` sets); srun's `SLURM_PROCID` / `SLURM_NTASKS` (coordinator: `SPMDKIT_COORDINATOR`, else the
first node of the node list); Open MPI's `OMPI_COMM_WORLD_RANK` / `_SIZE` (coordinator: `SPMDKIT_COORDINATOR`).
None of them: a single process. `SPMDKIT_CPU_DEVICES=M` gives the process M simulated CPU devices. A process that
sends no heartbeat for `SPMDKIT_HEARTBEAT_TIMEOUT` s (default 30) ends all others of the job with a non-zero status.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
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
from spmdkit.slurm import COORDINATOR, sbatch_script, submit_slurm

NUM_PROCESSES, PROCESS_ID = "SPMDKIT_NUM_PROCESSES", "SPMDKIT_PROCESS_ID"
CPU_DEVICES, LOCAL_DEVICE_IDS = "SPMDKIT_CPU_DEVICES", "SPMDKIT_LOCAL_DEVICE_IDS"
TIMEOUTS = {  # variable -> (jax.distributed.initialize keyword, default seconds)
    "SPMDKIT_INIT_TIMEOUT": ("initialization_timeout", 120),
    "SPMDKIT_HEARTBEAT_TIMEOUT": ("heartbeat_timeout_seconds", 30),
    "SPMDKIT_SHUTDOWN_TIMEOUT": ("shutdown_timeout_seconds", 60),
}
_FORCED_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class DistributedEnv:
    """This process's place in the job; `source` says who described it: "spmdkit", "slurm" or "openmpi"."""

    coordinator: str
    num_processes: int
    process_id: int
    source: str
    local_device_ids: tuple[int, ...] | None = None


# ----------------------------------------------------------------------------------------------- joining a job


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list, without scontrol: 'gpu[01-02,07],login' -> gpu01, gpu02, gpu07, login."""
    hosts = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        parts: list[list[str]] = []
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            parts.append([text])
            numbers: list[str] = []
            for part in ranges.split(",") if ranges else ():
                lo, _, hi = part.partition("-")
                if not lo.isdigit() or not (hi or lo).isdigit():
                    raise SpmdkitError(f"cannot read the SLURM node list {nodelist!r}: set {COORDINATOR}=HOST:PORT")
                numbers += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
            parts += [numbers] if numbers else []
        hosts += ["".join(p) for p in itertools.product(*parts)]
    return hosts


def _int_var(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in env and default is not None:
        return default
    try:
        return int(env[name])
    except KeyError:
        raise SpmdkitError(f"{name} is not set: a multi-process run needs it (or unset the others)") from None
    except ValueError:
        raise SpmdkitError(f"{name}={env[name]!r} is not an integer") from None


def _local_device_ids(env: Mapping[str, str], local_rank: int, tasks_on_node: int) -> tuple[int, ...] | None:
    """One GPU per task when several tasks share a node and each sees all its GPUs; else JAX's default (None)."""
    if env.get(LOCAL_DEVICE_IDS):
        return tuple(int(x) for x in env[LOCAL_DEVICE_IDS].split(","))
    cpu = CPU_DEVICES in env or env.get("JAX_PLATFORMS", "").startswith("cpu")
    one_gpu = len(env.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")) == 1
    return None if cpu or one_gpu or tasks_on_node <= 1 else (local_rank,)


def _slurm_coordinator(env: Mapping[str, str]) -> str:
    """The first host of the step's (else the job's) node list, port SPMDKIT_COORDINATOR_PORT or from the job id."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    port = _int_var(env, "SPMDKIT_COORDINATOR_PORT", 20000 + _int_var(env, "SLURM_JOB_ID", 0) % 20000)
    hosts = expand_nodelist(nodelist)
    return f"{hosts[0]}:{port}" if hosts else ""


def detect_environment(environ: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """The multi-process set-up the environment describes, or None (a single process)."""
    env = os.environ if environ is None else environ
    coordinator = env.get(COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS", "")
    if NUM_PROCESSES in env:
        source, count, rank = "spmdkit", _int_var(env, NUM_PROCESSES), _int_var(env, PROCESS_ID)
        local_rank, per_node = 0, 1
    elif "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        source, rank, local_rank = "slurm", _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_LOCALID", 0)
        count = _int_var(env, "SLURM_STEP_NUM_TASKS", _int_var(env, "SLURM_NTASKS", 1))
        per_node = count // max(_int_var(env, "SLURM_STEP_NUM_NODES", _int_var(env, "SLURM_NNODES", 1)), 1)
        coordinator = coordinator or _slurm_coordinator(env)
    elif "OMPI_COMM_WORLD_SIZE" in env:
        source, count, rank = "openmpi", _int_var(env, "OMPI_COMM_WORLD_SIZE"), _int_var(env, "OMPI_COMM_WORLD_RANK")
        local_rank = _int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        per_node = _int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    else:
        return None
    if not 0 <= rank < count:
        raise SpmdkitError(f"process id {rank} of {count} processes ({source}) is invalid")
    if count > 1 and not re.fullmatch(r".+:\d+", coordinator):
        raise SpmdkitError(
            f"{source} run of {count} processes without a coordinator (got {coordinator!r}): export "
            f"{COORDINATOR}=HOST:PORT (process 0's host, a free port) to every process"
        )
    return DistributedEnv(coordinator, count, rank, source, _local_device_ids(env, local_rank, per_node))


def _cpu_device_count(env: Mapping[str, str]) -> int | None:
    """SPMDKIT_CPU_DEVICES, checked against a count already forced through XLA_FLAGS (`--cpu-devices`)."""
    if CPU_DEVICES not in env:
        return None
    count, forced = _int_var(env, CPU_DEVICES), _FORCED_COUNT.search(env.get("XLA_FLAGS", ""))
    if count < 1 or (forced and int(forced.group(1)) != count):
        raise SpmdkitError(
            f"mismatched device counts: {CPU_DEVICES}={count} (launch --devices-per-process) but --cpu-devices / "
            f"XLA_FLAGS asks for {forced.group(1) if forced else count}: give the count once, to the launcher"
        )
    return count


def initialize_distributed(environ: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """Join the job the environment describes; call before JAX computes anything. None: one process, nothing done."""
    env = os.environ if environ is None else environ
    cpu_devices, found = _cpu_device_count(env), detect_environment(env)
    import jax

    try:
        if cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        if found is None or found.num_processes == 1 or jax.distributed.is_initialized():
            return found
        if cpu_devices is not None or env.get("JAX_PLATFORMS", "").startswith("cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=found.coordinator,
            num_processes=found.num_processes,
            process_id=found.process_id,
            local_device_ids=list(found.local_device_ids) if found.local_device_ids else None,
            cluster_detection_method="deactivate",
            **{key: _int_var(env, var, default) for var, (key, default) in TIMEOUTS.items()},
        )
    except (RuntimeError, ValueError) as error:  # JaxRuntimeError is a RuntimeError
        where = f"process {found.process_id} of {found.num_processes} at {found.coordinator}" if found else "JAX"
        raise SpmdkitError(f"could not start {where}: {(str(error).strip() or repr(error)).splitlines()[0]}") from None
    return found


# ----------------------------------------------------------------------------------------------- local processes


def free_port(port: int | None = None) -> int:
    """`port` if it is free on 127.0.0.1 (else an error); None: a free port the OS picks."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port or 0))
        except OSError as error:
            raise SpmdkitError(f"port {port} on 127.0.0.1 is in use ({error.strerror}): pick another --port") from None
        return sock.getsockname()[1]


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """GPU ids this host shows: CUDA_VISIBLE_DEVICES if set, else those `nvidia-smi -L` lists."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i in range(sum(line.startswith("GPU ") for line in listing.splitlines()))]


def resolve_platform(platform: str, env: Mapping[str, str]) -> str:
    """'auto' -> 'gpu' where GPUs are visible and JAX_PLATFORMS does not say cpu, else 'cpu'."""
    if platform != "auto":
        return platform
    return "cpu" if env.get("JAX_PLATFORMS", "").startswith("cpu") or not visible_gpus(env) else "gpu"


def process_environments(
    processes: int, devices_per_process: int | None, port: int, platform: str, env: Mapping[str, str]
) -> list[dict[str, str]]:
    """Each local process's environment: coordinator, count, id, and its devices (a CPU count or GPU ids)."""
    base = dict(env, PYTHONUNBUFFERED="1", **{COORDINATOR: f"127.0.0.1:{port}", NUM_PROCESSES: str(processes)})
    if platform == "cpu":
        xla_flags = _FORCED_COUNT.sub("", base.get("XLA_FLAGS", "")).strip()
        base.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags, **{CPU_DEVICES: str(devices_per_process or 1)})
        return [dict(base, **{PROCESS_ID: str(i)}) for i in range(processes)]
    gpus = visible_gpus(env)
    per = devices_per_process or len(gpus) // processes
    if per < 1 or per * processes > len(gpus) or (devices_per_process is None and len(gpus) % processes):
        raise SpmdkitError(
            f"mismatched device counts: {processes} processes x {devices_per_process or 'equal shares of'} GPU(s) "
            f"do not fit the {len(gpus)} GPU(s) here: use --processes {len(gpus) or 1} (one per GPU), --processes 1, "
            "or --platform cpu"
        )
    return [
        dict(base, **{PROCESS_ID: str(i), "CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per : (i + 1) * per])})
        for i in range(processes)
    ]


def check_command(command: Sequence[str]) -> None:
    """The command exists and leaves the device count to the launcher."""
    if not command:
        raise SpmdkitError("no command to run: give it after '--', e.g. spmdkit launch --processes 2 -- spmdkit train")
    if not shutil.which(command[0]):
        raise SpmdkitError(f"command {command[0]!r} not found (not on PATH, or not executable)")
    if any(arg.split("=")[0] == "--cpu-devices" for arg in command):
        raise SpmdkitError("mismatched device counts: give --devices-per-process to launch, not --cpu-devices")


def _pump(source: BinaryIO, sink: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
    """Copy a child's lines to `sink`, each after `prefix`; of a '\\r'-rewritten line (a progress bar) the last."""
    for line in iter(source.readline, b""):
        with lock:
            sink.write(prefix + line.rstrip(b"\r\n").rsplit(b"\r", 1)[-1] + b"\n")
            sink.flush()


def _describe(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    return f"was killed by {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"


def stop_all(children: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM each running child's process group (the trainer saves and stops); SIGKILL it after `grace` s."""
    deadline = time.monotonic() + grace
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for child in children:
            if child.poll() is None:
                try:
                    os.killpg(child.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(c.poll() is None for c in children):
            time.sleep(0.1)
    for child in children:
        child.wait()


def _statuses(children: Sequence[subprocess.Popen], skip: int | None = None) -> str:
    return "; ".join(f"process {i} {_describe(c.returncode)}" for i, c in enumerate(children) if i != skip)


def supervise(children: Sequence[subprocess.Popen], grace: float) -> tuple[int, str]:
    """Wait for all children: (0, ''), or on the first failure stop the others and say who failed (status, text)."""
    try:
        while (codes := [c.poll() for c in children]) != [0] * len(children):
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None:
                stop_all(children, grace=5.0)
                text = f"process {failed} {_describe(codes[failed])}; then {_statuses(children, failed)}"
                return codes[failed] if codes[failed] > 0 else 128 - codes[failed], text
            time.sleep(0.1)
        return 0, ""
    except KeyboardInterrupt:
        print(f"spmdkit launch: stopping all processes ({grace:g} s to save; Ctrl-C again kills)", file=sys.stderr)
        try:
            stop_all(children, grace=grace)
        except KeyboardInterrupt:
            stop_all(children, grace=0)
        return 130, f"interrupted: {_statuses(children)}"


def launch_local(
    command: Sequence[str],
    processes: int,
    devices_per_process: int | None = None,
    port: int | None = None,
    platform: str = "auto",
    grace: float = 60.0,
) -> int:
    """Run `command` as `processes` processes of one JAX job on 127.0.0.1, output prefixed `[i]`; exit status."""
    if processes < 1 or (devices_per_process is not None and devices_per_process < 1):
        raise SpmdkitError(f"--processes {processes} and --devices-per-process {devices_per_process} must be >= 1")
    platform = resolve_platform(platform, os.environ)
    check_command(command)
    port = free_port(port)
    environments = process_environments(processes, devices_per_process, port, platform, os.environ)
    children: list[subprocess.Popen] = []
    lock, pumps = threading.Lock(), []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
    try:
        for i, env in enumerate(environments):
            child = subprocess.Popen(
                list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
            children.append(child)
            for source, sink in ((child.stdout, sys.stdout.buffer), (child.stderr, sys.stderr.buffer)):
                pumps.append(threading.Thread(target=_pump, args=(source, sink, b"[%d] " % i, lock), daemon=True))
                pumps[-1].start()
        pids = ", ".join(str(c.pid) for c in children)
        print(f"spmdkit launch: {processes} process(es) at 127.0.0.1:{port} ({platform}), pids {pids}", file=sys.stderr)
        code, text = supervise(children, grace)
    finally:
        stop_all(children, grace=0)
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        for pump in pumps:
            pump.join(timeout=2)
    if text:
        print(f"spmdkit launch: {'failed: ' if code != 130 else ''}{text}", file=sys.stderr, flush=True)
    return code


# ----------------------------------------------------------------------------------------------- the command


LAUNCH_FLAGS: list[tuple[str, dict]] = [
    ("--processes", dict(type=int, metavar="N", help="local processes (default: one per GPU, else 1)")),
    (
        "--devices-per-process",
        dict(type=int, metavar="M", help="CPU: simulated devices each (default 1); GPU: GPUs each"),
    ),
    ("--platform", dict(choices=("auto", "cpu", "gpu"), default="auto", help="auto: gpu where GPUs are visible")),
    ("--port", dict(type=int, help="coordinator port on 127.0.0.1 (default: a free one)")),
    ("--grace", dict(type=float, default=60.0, help="seconds processes get to save after Ctrl-C (default: 60)")),
    ("--slurm", dict(action="store_true", help="write an sbatch script (one task per GPU) and submit it")),
    ("--nodes", dict(type=int, metavar="K", help="--slurm: nodes")),
    ("--gpus-per-node", dict(type=int, default=8, metavar="G", help="--slurm: GPUs (= tasks) per node (default: 8)")),
    ("--partition", dict(help="--slurm: partition")),
    ("--time", dict(help="--slurm: time limit, e.g. 24:00:00")),
    ("--account", dict(help="--slurm: account")),
    ("--job-name", dict(default="spmdkit", help="--slurm: job name (default: spmdkit)")),
    ("--script", dict(default="spmdkit.sbatch", help="--slurm: where to write the script (default: spmdkit.sbatch)")),
    ("--dry-run", dict(action="store_true", help="--slurm: print the script, submit nothing")),
]


def add_launch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `spmdkit launch` subcommand (its handler is `run_launch`)."""
    parser = subparsers.add_parser(
        "launch",
        help="run a command as the processes of one JAX job (here, or as a SLURM job)",
        description="Run COMMAND as N local processes of one JAX job (spmdkit launch --processes 2 "
        "--devices-per-process 4 -- spmdkit train ...), or write and submit an sbatch script (--slurm).",
    )
    for flag, kwargs in LAUNCH_FLAGS:
        parser.add_argument(flag, **kwargs)
    parser.add_argument("launch_command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="what each process runs")
    parser.set_defaults(handler=run_launch)
    return parser


def run_launch(args: argparse.Namespace) -> int:
    command = args.launch_command[1:] if args.launch_command[:1] == ["--"] else args.launch_command
    if args.slurm:
        if args.processes is not None or args.nodes is None:
            raise SpmdkitError("--slurm takes --nodes K and --gpus-per-node G (a task per GPU), not --processes")
        script = sbatch_script(
            command,
            args.nodes,
            args.gpus_per_node,
            job_name=args.job_name,
            partition=args.partition,
            time=args.time,
            account=args.account,
        )
        return submit_slurm(script, args.script, args.dry_run)
    if args.nodes is not None or args.dry_run:
        raise SpmdkitError("--nodes and --dry-run go with --slurm; a local run takes --processes N")
    platform = resolve_platform(args.platform, os.environ)
    processes = args.processes
    if processes is None:
        processes = max(len(visible_gpus(os.environ)), 1) if platform == "gpu" else 1
    return launch_local(command, processes, args.devices_per_process, args.port, platform, args.grace)
