"""Joining one JAX job from inside a process: `spmdkit.distributed.join()`, first thing in a script that
`spmdkit launch`, srun or mpirun starts (before JAX computes anything); `spmdkit train` calls it itself. Its
former name, `initialize_distributed`, is the same call.

It reads, in order: `SPMDKIT_NUM_PROCESSES` / `SPMDKIT_PROCESS_ID` / `SPMDKIT_COORDINATOR` (what `spmdkit launch`
sets); srun's `SLURM_PROCID` / `SLURM_NTASKS` (coordinator: `SPMDKIT_COORDINATOR`, else the first node of the node
list); Open MPI's `OMPI_COMM_WORLD_RANK` / `_SIZE` (coordinator: `SPMDKIT_COORDINATOR`). None of them: a single
process. `SPMDKIT_CPU_DEVICES=M` gives the process M simulated CPU devices. A process that sends no heartbeat for
`SPMDKIT_HEARTBEAT_TIMEOUT` s (default 30) ends all others of the job with a non-zero status (JAX aborts them: no
word of which process or where); a caller with a watchdog of its own (`spmdkit train`) passes its longest deadline
as `heartbeat_above`, and the heartbeat is kept 60 s above it, so that its watchdog names a frozen process and its
phase first (`heartbeat_timeout`). A process's host
(what `--dcn` counts) is `SPMDKIT_HOST`, else srun's `SLURMD_NODENAME`, else the machine's name
(`spmdkit.sharding.mesh.this_host`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import socket
import time
from collections.abc import Mapping

from spmdkit.distributed.slurm import COORDINATOR
from spmdkit.errors import SpmdkitError

NUM_PROCESSES, PROCESS_ID = "SPMDKIT_NUM_PROCESSES", "SPMDKIT_PROCESS_ID"
CPU_DEVICES, LOCAL_DEVICE_IDS = "SPMDKIT_CPU_DEVICES", "SPMDKIT_LOCAL_DEVICE_IDS"
HOST = "SPMDKIT_HOST"  # this process's host (node), what `--dcn` counts; read by spmdkit.sharding.mesh.this_host
TIMEOUTS = {  # variable -> (jax.distributed.initialize keyword, default seconds)
    "SPMDKIT_INIT_TIMEOUT": ("initialization_timeout", 120),
    "SPMDKIT_HEARTBEAT_TIMEOUT": ("heartbeat_timeout_seconds", 30),
    "SPMDKIT_SHUTDOWN_TIMEOUT": ("shutdown_timeout_seconds", 60),
}
HEARTBEAT_MARGIN = 60  # s: JAX's heartbeat above a watchdog's longest deadline (it fires, asks the store, exits)
FORCED_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
# The status a process exits with when a collective failed because another process of the job died: the launcher
# names the process that died, not this one (76: EX_PROTOCOL; 75, EX_TEMPFAIL, is the watchdog's).
PEER_LOST_STATUS = 76
# What a collective or the coordination service says when another process of the job died or stopped
PEER_LOST = re.compile(r"Gloo|NCCL|[Cc]onnection (closed|reset|refused)|[Bb]roken pipe|UNAVAILABLE|heartbeat")


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
        if not coordinator:  # the step's (else the job's) first node, port SPMDKIT_COORDINATOR_PORT or the job id's
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            port = _int_var(env, "SPMDKIT_COORDINATOR_PORT", 20000 + _int_var(env, "SLURM_JOB_ID", 0) % 20000)
            hosts = expand_nodelist(nodelist or "")
            coordinator = f"{hosts[0]}:{port}" if hosts else ""
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


def wait_for_coordinator(address: str, timeout: float) -> None:
    """Until process 0's coordination service accepts connections at `address`: a process that asks JAX to connect
    before it is up waits for JAX's retry (about a second); a TCP probe every 20 ms does not."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SpmdkitError(
                    f"the coordinator {address} (process 0) did not answer within {timeout:g} s: is process 0 "
                    f"running, and {COORDINATOR} its host and a free port?"
                ) from None
            time.sleep(0.02)


def heartbeat_timeout(environ: Mapping[str, str], above: float = 0.0) -> int:
    """JAX's heartbeat timeout, s: `SPMDKIT_HEARTBEAT_TIMEOUT` (default 30), raised to `above` (a watchdog's
    longest deadline; 0: none) + `HEARTBEAT_MARGIN` where that is longer: `spmdkit train`'s defaults (600 / 1800 s)
    give 1860 s, so a frozen process is named by the watchdog, not ended by JAX's abort 30 s after it froze."""
    var, (_, default) = "SPMDKIT_HEARTBEAT_TIMEOUT", TIMEOUTS["SPMDKIT_HEARTBEAT_TIMEOUT"]
    return max(_int_var(environ, var, default), math.ceil(above) + HEARTBEAT_MARGIN if above > 0 else 0)


def lost_peer(error: BaseException, environ: Mapping[str, str] | None = None) -> str | None:
    """One line for a JAX error that says another process of this multi-process job is gone (a collective or the
    coordination service failed): its own line, the launcher's, names it; None for any other error."""
    if type(error).__name__ != "JaxRuntimeError" or not PEER_LOST.search(str(error)):
        return None
    try:
        found = detect_environment(environ)
    except SpmdkitError:
        return None
    if found is None or found.num_processes == 1:
        return None
    said = (str(error).strip() or repr(error)).splitlines()[0]
    return (
        f"process {found.process_id} of {found.num_processes} stopped: another process of the job died or stopped "
        f"(the launcher's last line names it): {said}"
    )


def join(environ: Mapping[str, str] | None = None, heartbeat_above: float = 0.0) -> DistributedEnv | None:
    """Join the JAX job the environment describes (`spmdkit launch`, srun, mpirun): call it first thing in your
    script, before JAX computes anything. Returns this process's place in the job; None: one process, nothing done.
    A launched process that skips it sees only its own devices, and `make_mesh` says to call it.
    `heartbeat_above`: the longest deadline of the caller's own watchdog (`heartbeat_timeout`)."""
    env = os.environ if environ is None else environ
    # SPMDKIT_CPU_DEVICES, checked against a count already forced through XLA_FLAGS (`--cpu-devices`)
    cpu_devices = _int_var(env, CPU_DEVICES) if CPU_DEVICES in env else None
    forced = FORCED_COUNT.search(env.get("XLA_FLAGS", ""))
    if cpu_devices is not None and (cpu_devices < 1 or (forced and int(forced.group(1)) != cpu_devices)):
        raise SpmdkitError(
            f"mismatched device counts: {CPU_DEVICES}={cpu_devices} (launch --devices-per-process) but --cpu-devices "
            f"/ XLA_FLAGS asks for {forced.group(1) if forced else cpu_devices}: give the count once, to the launcher"
        )
    found = detect_environment(env)
    import jax

    try:
        if cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        if found is None or found.num_processes == 1 or jax.distributed.is_initialized():
            return found
        if cpu_devices is not None or env.get("JAX_PLATFORMS", "").startswith("cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        timeouts = {key: _int_var(env, var, default) for var, (key, default) in TIMEOUTS.items()}
        timeouts["heartbeat_timeout_seconds"] = heartbeat_timeout(env, heartbeat_above)
        if found.process_id != 0:
            wait_for_coordinator(found.coordinator, timeouts["initialization_timeout"])
        jax.distributed.initialize(
            coordinator_address=found.coordinator,
            num_processes=found.num_processes,
            process_id=found.process_id,
            local_device_ids=list(found.local_device_ids) if found.local_device_ids else None,
            cluster_detection_method="deactivate",
            **timeouts,
        )
    except (RuntimeError, ValueError) as error:  # JaxRuntimeError is a RuntimeError
        where = f"process {found.process_id} of {found.num_processes} at {found.coordinator}" if found else "JAX"
        raise SpmdkitError(f"could not start {where}: {(str(error).strip() or repr(error)).splitlines()[0]}") from None
    return found


initialize_distributed = join  # `join` under its former name
