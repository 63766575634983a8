"""The parent side of a local multi-process job: `spmdkit launch --processes N` starts N processes of one JAX job
on 127.0.0.1 (each told its place through `SPMDKIT_*` variables that `spmdkit.distributed.initialize` reads), copies
their output prefixed `[i]`, and stops them all when one fails or on Ctrl-C. All of them run on one host (what
`--dcn` counts) unless `--processes-per-host K` makes each K consecutive processes an emulated host (`SPMDKIT_HOST`).

The launcher owns its children: each runs in its own session (so that the launcher can signal its process group)
and, on Linux, asks the kernel to SIGKILL it when the launcher dies (`PR_SET_PDEATHSIG`), so a launcher killed
with SIGKILL leaves no process behind. A child that dies ends the others: the launcher stops them, and without a
launcher JAX's heartbeat timeout does.

When the job fails, the launcher names the process that stopped first: a process still running whose heartbeat
file (`SPMDKIT_HEARTBEAT_DIR`, kept by the trainer's watchdog) stood still for more than 5 s (frozen, e.g. by
SIGSTOP, while the others' watchdogs ended them) rather than the first that exited.

With `--max-restarts N` a failed job is started again, whole (all processes, a fresh coordinator port), and resumes
from its newest checkpoint, by the rule and back-off of `spmdkit.distributed.restarts`. Ctrl-C or SIGTERM to the
launcher stops the job and never restarts it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import BinaryIO

from spmdkit.distributed.initialize import CPU_DEVICES, FORCED_COUNT, HOST, NUM_PROCESSES, PEER_LOST_STATUS, PROCESS_ID
from spmdkit.distributed.restarts import (
    ATTEMPT,
    HEARTBEAT_DIR,
    PROGRESS_FILE,
    USAGE_ERROR,
    SameStep,
    backoff,
    check_max_restarts,
    read_step,
    stalled,
)
from spmdkit.distributed.slurm import COORDINATOR
from spmdkit.distributed.slurm import check_command as check_whole_command
from spmdkit.errors import SpmdkitError

# ----------------------------------------------------------------------------------------------- local processes


def free_port(port: int | None = None) -> int:
    """`port` if it is free on 127.0.0.1 (else an error); None: a free port the OS picks."""
    if port is not None and not 1 <= port <= 65535:
        raise SpmdkitError(f"--port {port} is not a TCP port: pick one in 1-65535, or leave it out (a free one)")
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


def process_hosts(processes: int, per_host: int | None) -> list[str]:
    """The host each local process says it runs on (`SPMDKIT_HOST`): this machine's name for all; with `per_host`,
    emulated hosts of `per_host` consecutive processes each (`NAME/host0`, `NAME/host1`, ...)."""
    if per_host is not None and (per_host < 1 or processes % per_host):
        raise SpmdkitError(
            f"--processes-per-host {per_host} does not divide --processes {processes}: every emulated host runs "
            "the same number of processes"
        )
    name = socket.gethostname()
    return [name if per_host is None else f"{name}/host{i // per_host}" for i in range(processes)]


def process_environments(
    processes: int,
    devices_per_process: int | None,
    port: int,
    platform: str,
    env: Mapping[str, str],
    per_host: int | None = None,
) -> list[dict[str, str]]:
    """Each local process's environment: coordinator, count, id, host, and its devices (a CPU count or GPU ids)."""
    base = dict(env, PYTHONUNBUFFERED="1", **{COORDINATOR: f"127.0.0.1:{port}", NUM_PROCESSES: str(processes)})
    hosts = process_hosts(processes, per_host)
    if platform == "cpu":
        xla_flags = FORCED_COUNT.sub("", base.get("XLA_FLAGS", "")).strip()
        base.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags, **{CPU_DEVICES: str(devices_per_process or 1)})
        devices: list[dict[str, str]] = [{}] * processes
    else:
        gpus = visible_gpus(env)
        per = devices_per_process or len(gpus) // processes
        if per < 1 or per * processes > len(gpus) or (devices_per_process is None and len(gpus) % processes):
            raise SpmdkitError(
                f"mismatched device counts: {processes} processes x {devices_per_process or 'equal shares of'} "
                f"GPU(s) do not fit the {len(gpus)} GPU(s) here: use --processes {len(gpus) or 1} (one per GPU), "
                "--processes 1, or --platform cpu"
            )
        devices = [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per : (i + 1) * per])} for i in range(processes)]
    return [dict(base, **{PROCESS_ID: str(i), HOST: hosts[i]}, **devices[i]) for i in range(processes)]


def check_command(command: Sequence[str]) -> None:
    """The command is whole, exists, and leaves the device count to the launcher."""
    check_whole_command(command, "spmdkit launch --processes 2 -- spmdkit train")
    if any(arg.split("=")[0] == "--cpu-devices" for arg in command):
        raise SpmdkitError("mismatched device counts: give --devices-per-process to launch, not --cpu-devices")


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGKILL when its parent dies (Linux; None elsewhere). It runs in
    the child between fork and exec: only a foreign call and system calls, no locks taken."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, in the parent: nothing to load after fork
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request was in place
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


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
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for child in children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, sig)
        if sig == signal.SIGTERM:
            settle(children, grace)
    for child in children:
        child.wait()


SETTLE = 0.5  # s the others get to end by themselves after one failed (each then says why, in one line)


def settle(children: Sequence[subprocess.Popen], seconds: float) -> None:
    """Wait until every child has exited, or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(c.poll() is None for c in children):
        time.sleep(0.05)


def _statuses(children: Sequence[subprocess.Popen], skip: int | None = None) -> str:
    return "; ".join(f"process {i} {_describe(c.returncode)}" for i, c in enumerate(children) if i != skip)


def supervise(
    children: Sequence[subprocess.Popen], grace: float, stopped: Callable[[list[int]], str | None] = lambda _: None
) -> tuple[int, str, str]:
    """Wait for all children: (0, '', ''); on the first failure stop the others and say who failed (status, the
    failure 'process 1 exited with status 1', then the others' statuses); on Ctrl-C / SIGTERM stop them all (130,
    '', what became of each). `stopped(running)`: which of the processes still running stopped responding before
    the first exit (the failure then names it, `restarts.stalled`), or None."""
    try:
        while (codes := [c.poll() for c in children]) != [0] * len(children):
            failed = _first_failure(codes)
            if failed is not None:
                frozen = stopped([i for i, code in enumerate(codes) if code is None])
                settle(children, SETTLE)  # a survivor's own line (a lost peer) before it is told to stop
                stop_all(children, grace=5.0)
                failure = frozen or f"process {failed} {_describe(codes[failed])}"
                code = codes[failed] if codes[failed] > 0 else 128 - codes[failed]
                return code, failure, f"{failure}; then {_statuses(children, None if frozen else failed)}"
            time.sleep(0.1)
        return 0, "", ""
    except KeyboardInterrupt:
        print(f"spmdkit launch: stopping all processes ({grace:g} s to save; Ctrl-C again kills)", file=sys.stderr)
        try:
            stop_all(children, grace=grace)
        except KeyboardInterrupt:
            stop_all(children, grace=0)
        return 130, "", f"interrupted: {_statuses(children)}"


def _first_failure(codes: Sequence[int | None]) -> int | None:
    """The process that failed (None: none has): one that ended on its own account before one that only saw a
    peer die (`PEER_LOST_STATUS`: by the time a survivor has said so, the dead process has ended too)."""
    failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
    return min(failed, key=lambda i: codes[i] == PEER_LOST_STATUS, default=None)


def run_attempt(command: Sequence[str], environments: Sequence[Mapping[str, str]], grace: float, what: str):
    """Start one process per environment, copy their output prefixed `[i]`, and `supervise` them; whatever
    happens, none is left running. `what`: the line that says what was started, before its pids."""
    children: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    try:
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        owned = dict(start_new_session=True, preexec_fn=die_with_parent())
        for env in environments:  # every child before any thread starts: `preexec_fn` runs in a forked copy
            children.append(subprocess.Popen(list(command), env=dict(env), **pipes, **owned))
        for i, child in enumerate(children):
            for source, sink in ((child.stdout, sys.stdout.buffer), (child.stderr, sys.stderr.buffer)):
                pumps.append(threading.Thread(target=_pump, args=(source, sink, b"[%d] " % i, lock), daemon=True))
                pumps[-1].start()
        print(f"spmdkit launch: {what}, pids {', '.join(str(c.pid) for c in children)}", file=sys.stderr)
        heartbeats, attempt = environments[0].get(HEARTBEAT_DIR), int(environments[0].get(ATTEMPT, 0))
        return supervise(children, grace, lambda running: heartbeats and stalled(heartbeats, running, attempt))
    finally:
        stop_all(children, grace=0)
        for pump in pumps:
            pump.join(timeout=2)


def launch_local(
    command: Sequence[str],
    processes: int,
    devices_per_process: int | None = None,
    port: int | None = None,
    platform: str = "auto",
    grace: float = 60.0,
    per_host: int | None = None,
    max_restarts: int = 0,
) -> int:
    """Run `command` as `processes` processes of one JAX job on 127.0.0.1, output prefixed `[i]`; exit status.
    `per_host`: processes per emulated host (None: all on this one). `max_restarts`: after a failure start the
    whole job again, at most this many times in a row at one step, backing off (`spmdkit.distributed.restarts`)."""
    if processes < 1 or (devices_per_process is not None and devices_per_process < 1):
        raise SpmdkitError(f"--processes {processes} and --devices-per-process {devices_per_process} must be >= 1")
    check_max_restarts(max_restarts)
    platform = resolve_platform(platform, os.environ)
    check_command(command)

    def environments(port: int, attempt: int = 0, progress: str = "") -> list[dict[str, str]]:
        """Each process's environment in attempt `attempt` (0 first), the coordinator at `port`."""
        extra = {ATTEMPT: str(attempt)}
        if progress:  # the progress file and the heartbeat files in one directory the launcher owns
            extra.update({PROGRESS_FILE: progress, HEARTBEAT_DIR: os.path.dirname(progress)})
        layout = process_environments(processes, devices_per_process, port, platform, os.environ, per_host)
        return [dict(env, **extra) for env in layout]

    environments(free_port(port))  # bad input is refused before anything starts
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
    progress_dir = tempfile.mkdtemp(prefix="spmdkit-launch-")
    try:
        progress = os.path.join(progress_dir, "progress.json")
        code, text = run_attempts(command, environments, platform, grace, port, max_restarts, progress)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(progress_dir, ignore_errors=True)
    if text:
        print(text, file=sys.stderr, flush=True)
    return code


def run_attempts(
    command: Sequence[str],
    environments: Callable[[int, int, str], list[dict[str, str]]],
    platform: str,
    grace: float,
    port: int | None,
    max_restarts: int,
    progress: str,
) -> tuple[int, str]:
    """Run attempts until one succeeds, is interrupted, fails with a usage error (status 2), or fails and `SameStep`
    says no more restarts: (exit status, the last line to print). A restart waits `backoff` s first. Each attempt
    gets a fresh free port (the same one when `port` was given: its previous holder is gone), and its processes
    `SPMDKIT_ATTEMPT`, `SPMDKIT_PROGRESS_FILE` (`progress`) and `SPMDKIT_HEARTBEAT_DIR` (its directory)."""
    rule, attempt, port_now = SameStep(max_restarts), 0, free_port(port)
    try:
        while True:
            envs = environments(port_now, attempt, progress)
            what = f"{len(envs)} process(es) at {envs[0][COORDINATOR]} ({platform})"
            code, failure, text = run_attempt(
                command, envs, grace, f"attempt {attempt + 1}: {what}" if attempt else what
            )
            if not failure:  # success, or Ctrl-C / SIGTERM: never restarted
                return code, f"spmdkit launch: {text}" if text else ""
            if not max_restarts:
                return code, f"spmdkit launch: failed: {text}"
            if code == USAGE_ERROR:
                return code, f"spmdkit launch: failed: {text} (status 2: a usage error, never restarted)"
            step = read_step(progress, attempt)
            if not rule.failed(step):
                return code, rule.give_up_line(failure, step)
            attempt += 1
            print(rule.restart_line(failure, step, attempt), file=sys.stderr, flush=True)
            time.sleep(backoff(rule.failures))
            port_now = port or free_port()
    except KeyboardInterrupt:  # between attempts: the processes are stopped already
        return 130, "spmdkit launch: interrupted between attempts"
