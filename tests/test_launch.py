"""Multi-process launching: environment detection, the local launcher with real processes on 127.0.0.1 (gloo),
a lost process ending the others, the sbatch script, and bad input."""

import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from support import BIN, job_env

from spmdkit.cli import main
from spmdkit.distributed.initialize import detect_environment, expand_nodelist, initialize_distributed
from spmdkit.distributed.launcher import process_environments
from spmdkit.distributed.slurm import environment_setup, sbatch_script
from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh import make_mesh, this_host

TRAIN = "train --mesh fsdp=4,tensor=2 --steps 6 --log-every 1 --eval-every 6 --eval-batches 2 --seq-len 32 "
TRAIN += "--batch-size 8 --dtype float32 --no-progress"
# Joins the job, says so, then runs collectives ("busy") or sleeps ("idle") until it is stopped.
PEER = """
import sys, time
import numpy as np
from spmdkit.distributed.initialize import initialize_distributed
initialize_distributed()
import jax
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("ready")
# One write: the launcher runs children unbuffered, and gloo logs to stdout from its own threads.
sys.stdout.write(f"ready {jax.process_index()} {jax.device_count()}\\n")
while True:
    if sys.argv[1] == "busy":
        multihost_utils.process_allgather(np.int32(1))
    time.sleep(0.05)
"""


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records] + [r["eval_loss"] for r in records if "eval_loss" in r]


def _wait_for(path: Path, text: str | re.Pattern, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until `text` is in the file; `text` may be a compiled pattern."""
    deadline = time.monotonic() + timeout
    found = text.search if isinstance(text, re.Pattern) else lambda content: text in content
    while not found(path.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, path.read_text()[-3000:]
        time.sleep(0.2)


def _launch_peers(tmp_path: Path, mode: str, *flags: str) -> tuple[subprocess.Popen, Path, list[int]]:
    """`spmdkit launch --processes 2 --devices-per-process 2 -- python PEER mode` once both joined: (launcher,
    its stderr file, the pids of processes 0 and 1)."""
    script, out, err = tmp_path / "peer.py", tmp_path / "out.txt", tmp_path / "err.txt"
    script.write_text(PEER)
    cmd = [f"{BIN}/spmdkit", "launch", "--processes", "2", "--devices-per-process", "2", *flags, "--"]
    with open(out, "w") as o, open(err, "w") as e:
        # SIGINT as at a terminal: a shell without job control starts background jobs (a CI script's) ignoring it
        default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
        proc = subprocess.Popen(
            [*cmd, sys.executable, str(script), mode], stdout=o, stderr=e, env=job_env(), preexec_fn=default_sigint
        )
    try:
        # A line of process i, prefixed "[i] ", that says it is ready. gloo logs to the same stdout from its own
        # threads and its message and newline are separate writes, so the word may follow gloo's text on that line.
        _wait_for(out, re.compile(r"^\[0\] .*ready 0 4$", re.M), proc, 120)
        _wait_for(out, re.compile(r"^\[1\] .*ready 1 4$", re.M), proc, 30)
    except BaseException:
        proc.kill()
        raise
    return proc, err, [int(p) for p in err.read_text().split("pids ")[1].split("\n")[0].split(", ")]


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (dead, not yet reaped by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def _clean_up(procs: list[subprocess.Popen], pids: list[int]) -> None:
    """Leave nothing running whatever the test's outcome."""
    for proc in procs:
        proc.kill()
        proc.wait()
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------------------------- real processes


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    """`spmdkit train` end to end, then 2 processes x 4 devices give the losses (train and eval) of 1 process x 8
    devices; output lines carry [i]."""
    one = subprocess.run(
        [f"{BIN}/spmdkit", "train", "--cpu-devices", "8", *TRAIN.split()[1:], "--run-dir", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        timeout=300,
        env=job_env(),
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "FSDP over 4 devices x TP over 2" in one.stdout
    run_dir = tmp_path / "one"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "tflops_per_device", "mfu"):
        assert key in records[-1]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and records[-1]["loss"] < records[0]["loss"]
    assert records[0]["loss"] > 5.0  # starts near uniform over 264 tokens (ln 264 = 5.58)
    assert 0 < records[-1]["eval_loss"] < records[0]["loss"]
    # byte tokens: a scored target is one byte of text (BOS/EOS between files none), so bits per byte ~ loss / ln 2
    for record in records:
        bits_per_token = record["loss"] / math.log(2)  # float32 on device: equal within rounding when no specials
        assert bits_per_token * (1 - 1e-5) <= record["bits_per_byte"] <= 1.02 * bits_per_token
    assert records[-1]["eval_bits_per_byte"] == pytest.approx(records[-1]["eval_loss"] / math.log(2), rel=0.02)
    assert (run_dir / "checkpoints" / "hf" / "tokenizer.json").is_file()  # the bytes tokenizer travels with the run
    config = json.loads((run_dir / "config.json").read_text())
    assert config["mesh"]["mesh"] == "fsdp=4,tensor=2" and config["run"]["steps"] == 6
    assert (run_dir / "loss.png").stat().st_size > 0 and any((run_dir / "tensorboard").iterdir())

    launch = ["launch", "--processes", "2", "--devices-per-process", "4", "--"]
    two = subprocess.run(
        [f"{BIN}/spmdkit", *launch, "spmdkit", *TRAIN.split(), "--run-dir", str(tmp_path / "two")],
        capture_output=True,
        text=True,
        timeout=300,
        env=job_env(),
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "[0] mesh         fsdp=4,tensor=2 on 8 CPU device(s), 2 process(es)" in two.stdout
    assert "[0] done: 6 steps" in two.stdout
    assert all(line.startswith(("[0] ", "[1] ")) for line in two.stdout.splitlines())
    assert all(line.startswith(("[0] ", "[1] ", "spmdkit launch: ")) for line in two.stderr.splitlines())
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.slow
def test_killed_process_stops_the_launcher_and_the_others(tmp_path):
    proc, err, pids = _launch_peers(tmp_path, "busy")
    try:
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        code = proc.wait(timeout=60)
        assert time.monotonic() - started < 60
    finally:
        _clean_up([proc], pids)
    message = err.read_text()
    assert code == 128 + signal.SIGKILL, message[-2000:]
    assert "spmdkit launch: failed: process 1 was killed by SIGKILL; then process 0 " in message, message[-2000:]
    assert "process 0 exited with status 0" not in message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_sigkilled_launcher_leaves_no_child_alive(tmp_path):
    proc, _, pids = _launch_peers(tmp_path, "busy")
    try:
        assert not any(_gone(pid) for pid in pids)
        proc.kill()  # SIGKILL: the launcher cannot stop anyone; the kernel kills its children
        proc.wait()
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid)]
    finally:
        _clean_up([proc], pids)


@pytest.mark.slow
def test_lost_peer_ends_the_survivor_by_heartbeat(tmp_path):
    """No launcher: process 1 dies while process 0 idles; JAX's heartbeat timeout (default 30 s) ends process 0."""
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    port = _free_port()
    peers, logs = [], []
    for i in range(2):
        logs.append(open(tmp_path / f"peer{i}.txt", "w+"))
        env = job_env(SPMDKIT_COORDINATOR=f"127.0.0.1:{port}", SPMDKIT_NUM_PROCESSES="2", SPMDKIT_PROCESS_ID=str(i))
        env.update(SPMDKIT_CPU_DEVICES="2")
        peers.append(
            subprocess.Popen([sys.executable, str(script), "idle"], stdout=logs[i], stderr=subprocess.STDOUT, env=env)
        )
    try:
        for i in range(2):
            _wait_for(tmp_path / f"peer{i}.txt", f"ready {i} 4", peers[i], 120)
        peers[1].kill()
        started = time.monotonic()
        code = peers[0].wait(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        _clean_up(peers, [])
        for log in logs:
            log.close()
    text = (tmp_path / "peer0.txt").read_text()
    assert code != 0 and elapsed < 60, (code, elapsed, text[-2000:])
    assert "Task 1 heartbeat timeout" in text or "stopped sending heartbeats" in text, text[-2000:]


@pytest.mark.slow
def test_ctrl_c_stops_all(tmp_path):
    """SIGINT to the launcher: SIGTERM to all (JAX's preemption notifier ignores it here), SIGKILL after --grace."""
    proc, err, pids = _launch_peers(tmp_path, "idle", "--grace", "3")
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        _clean_up([proc], pids)
    assert "spmdkit launch: interrupted: process 0 was killed by SIGKILL; process 1 " in err.read_text()
    assert all(_gone(pid) for pid in pids)


# Joins with the documented call, then lays data=2,fsdp=2 over 4 processes of 1 device on 2 emulated hosts.
HOSTS = """
import sys
import spmdkit.distributed
spmdkit.distributed.join()
import jax, numpy as np
from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh import MeshConfig, make_mesh, process_hosts
mesh = make_mesh(MeshConfig.parse("data=2,fsdp=2", "data=2"))
hosts = process_hosts()
rows = [sorted({hosts[d.process_index] for d in row.flatten()}) for row in mesh.devices.reshape(2, 2)]
total = jax.jit(lambda x: x.sum())(jax.device_put(np.arange(8.0), jax.NamedSharding(mesh, jax.P(("data", "fsdp")))))
try:
    make_mesh(MeshConfig.parse("data=4", "data=4"))
except SpmdkitError as error:
    refused = str(error)
sys.stdout.write(f"rows {rows} total {float(total)} refused {refused}\\n")
"""


@pytest.mark.slow
def test_dcn_counts_hosts_not_processes(tmp_path):
    """4 processes x 1 device, 2 per emulated host: `--dcn data=2` is the 2 hosts (each data row one host's two
    processes); data=4 across nodes is refused, naming the 2 hosts."""
    script = tmp_path / "hosts.py"
    script.write_text(HOSTS)
    launch = ["launch", "--processes", "4", "--devices-per-process", "1", "--processes-per-host", "2", "--"]
    done = subprocess.run(
        [f"{BIN}/spmdkit", *launch, sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=job_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    name = socket.gethostname()
    line = re.search(r"^\[0\] .*(rows .*)$", done.stdout, re.M).group(1)
    assert line.startswith(f"rows [['{name}/host0'], ['{name}/host1']] total 28.0 refused --dcn factors multiply to 4")
    assert "the processes run on 2 hosts (nodes): --dcn counts nodes, not processes" in line


def test_an_unjoined_launched_process_is_told_to_join(monkeypatch):
    """A script that `spmdkit launch` started but that did not join: the mesh error names the call (not 'make the
    sizes multiply to 1'); srun's variables alone (a batch step inherits them) only when the mesh does not fit."""
    monkeypatch.setenv("SPMDKIT_NUM_PROCESSES", "4")
    with pytest.raises(SpmdkitError, match=r"1 of 4 \(SPMDKIT_NUM_PROCESSES=4\).*call spmdkit\.distributed\.join\(\)"):
        make_mesh("fsdp=-1")
    monkeypatch.delenv("SPMDKIT_NUM_PROCESSES")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
    assert make_mesh("fsdp=8").shape["fsdp"] == 8
    with pytest.raises(SpmdkitError, match=r"1 of 16 .*spmdkit\.distributed\.join\(\) first thing"):
        make_mesh("data=2,fsdp=16")
    assert make_mesh("fsdp=2", jax.devices()[:2]).shape["fsdp"] == 2  # devices given: a local mesh, as asked


def test_a_lost_peer_is_one_line():
    """The error a collective raises when another process of the job died: one line naming this process (the CLI
    prints it instead of the traceback); any other error, or one process alone, keeps its traceback (None)."""
    from jax.errors import JaxRuntimeError

    from spmdkit.distributed.initialize import lost_peer

    env = {"SPMDKIT_COORDINATOR": "127.0.0.1:1234", "SPMDKIT_NUM_PROCESSES": "2", "SPMDKIT_PROCESS_ID": "0"}
    gone = JaxRuntimeError("UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [127.0.0.1]:1\nmo")
    assert lost_peer(gone, env) == (
        "process 0 of 2 stopped: another process of the job died or stopped (the launcher's last line names it): "
        "UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [127.0.0.1]:1"
    )
    assert lost_peer(gone, {}) is None and lost_peer(RuntimeError(str(gone)), env) is None
    assert lost_peer(JaxRuntimeError("INVALID_ARGUMENT: mismatched shapes"), env) is None


def test_the_launcher_names_the_process_that_died_not_the_survivor_that_said_so():
    """Both ended by the time the launcher looks: process 0 exited saying its peer was lost, process 1 was killed."""
    from spmdkit.distributed.initialize import PEER_LOST_STATUS
    from spmdkit.distributed.launcher import _first_failure

    assert _first_failure([PEER_LOST_STATUS, -9]) == 1 and _first_failure([PEER_LOST_STATUS, None, 1]) == 2
    assert _first_failure([PEER_LOST_STATUS, None]) == 0 and _first_failure([None, 0]) is None


def test_join_is_exported_and_documented():
    import spmdkit
    import spmdkit.distributed
    from spmdkit.distributed import initialize

    assert spmdkit.distributed.join is initialize.join and "spmdkit.distributed.join()" in spmdkit.__doc__
    assert "spmdkit.distributed.join()" in (Path(__file__).parents[1] / "README.md").read_text()
    assert initialize.initialize_distributed({}) is None  # the former name still works


def test_host_of_a_process():
    assert this_host({"SPMDKIT_HOST": "h1", "SLURM_PROCID": "0", "SLURMD_NODENAME": "gpu07"}) == "h1"
    assert this_host({"SLURM_PROCID": "3", "SLURMD_NODENAME": "gpu07"}) == "gpu07"
    assert this_host({}) == socket.gethostname()
    envs = process_environments(4, 1, 1234, "cpu", {}, per_host=2)
    assert [e["SPMDKIT_HOST"] for e in envs] == [f"{socket.gethostname()}/host{i}" for i in (0, 0, 1, 1)]
    assert {e["SPMDKIT_HOST"] for e in process_environments(4, 1, 1234, "cpu", {})} == {socket.gethostname()}


# ----------------------------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-04]", ["node01", "node02", "node03", "node04"]),
        ("a,b", ["a", "b"]),
        ("gpu[001,007-008],login", ["gpu001", "gpu007", "gpu008", "login"]),
        ("r[1-2]-n[8-9]", ["r1-n8", "r1-n9", "r2-n8", "r2-n9"]),
        ("single", ["single"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_detect_nothing_is_one_process():
    assert detect_environment({}) is None
    assert initialize_distributed({}) is None


def test_detect_spmdkit_variables():
    env = {"SPMDKIT_COORDINATOR": "10.0.0.1:1234", "SPMDKIT_NUM_PROCESSES": "4", "SPMDKIT_PROCESS_ID": "3"}
    found = detect_environment(env)
    assert (found.coordinator, found.num_processes, found.process_id, found.source) == (
        "10.0.0.1:1234",
        4,
        3,
        "spmdkit",
    )


def test_detect_slurm_first_node_and_one_gpu_per_task():
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "11",
        "SLURM_NTASKS": "16",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_LOCALID": "3",
        "SLURM_STEP_NODELIST": "h100-[07-08]",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    }
    found = detect_environment(env)
    assert found.coordinator == f"h100-07:{20000 + 4242 % 20000}"
    assert (found.num_processes, found.process_id, found.local_device_ids, found.source) == (16, 11, (3,), "slurm")
    found = detect_environment({**env, "SPMDKIT_COORDINATOR": "head:999", "CUDA_VISIBLE_DEVICES": "5"})
    assert found.coordinator == "head:999" and found.local_device_ids is None  # srun bound one GPU per task


def test_detect_openmpi_needs_a_coordinator():
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    with pytest.raises(SpmdkitError, match="openmpi run of 2 processes without a coordinator.*SPMDKIT_COORDINATOR"):
        detect_environment(env)
    found = detect_environment({**env, "SPMDKIT_COORDINATOR": "n0:5000"})
    assert (found.coordinator, found.num_processes, found.process_id, found.source) == ("n0:5000", 2, 1, "openmpi")


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SPMDKIT_NUM_PROCESSES": "2", "SPMDKIT_PROCESS_ID": "2", "SPMDKIT_COORDINATOR": "a:1"}, "process id 2 of 2"),
        ({"SPMDKIT_NUM_PROCESSES": "2", "SPMDKIT_COORDINATOR": "a:1"}, "SPMDKIT_PROCESS_ID is not set"),
        ({"SPMDKIT_NUM_PROCESSES": "two", "SPMDKIT_PROCESS_ID": "0"}, "SPMDKIT_NUM_PROCESSES='two' is not an integer"),
        ({"SPMDKIT_NUM_PROCESSES": "2", "SPMDKIT_PROCESS_ID": "0"}, "without a coordinator"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[x-y]"}, "cannot read the SLURM node"),
    ],
)
def test_detect_bad_variables(env, message):
    with pytest.raises(SpmdkitError, match=message.replace("(", r"\(").replace(")", r"\)")):
        detect_environment(env)


def test_cpu_device_count_must_agree_with_cpu_devices_flag():
    env = {"SPMDKIT_CPU_DEVICES": "4", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    with pytest.raises(SpmdkitError, match="mismatched device counts: SPMDKIT_CPU_DEVICES=4 .* asks for 8"):
        initialize_distributed(env)


def test_process_environments_cpu_and_gpu():
    base = {"XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8", "PATH": "/bin"}
    cpu = process_environments(2, 4, 1234, "cpu", base)
    assert [e["SPMDKIT_PROCESS_ID"] for e in cpu] == ["0", "1"]
    assert cpu[1]["SPMDKIT_COORDINATOR"] == "127.0.0.1:1234" and cpu[1]["SPMDKIT_NUM_PROCESSES"] == "2"
    assert cpu[1]["SPMDKIT_CPU_DEVICES"] == "4" and cpu[1]["XLA_FLAGS"] == "--foo"
    gpus = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in process_environments(4, None, 1, "gpu", gpus)] == ["0", "1", "2", "3"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in process_environments(1, None, 1, "gpu", gpus)] == ["0,1,2,3"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in process_environments(2, 2, 1, "gpu", gpus)] == ["0,1", "2,3"]
    with pytest.raises(SpmdkitError, match="mismatched device counts: 3 processes .* the 4 GPU"):
        process_environments(3, None, 1, "gpu", gpus)
    with pytest.raises(SpmdkitError, match="mismatched device counts: 2 processes x 4 GPU"):
        process_environments(2, 4, 1, "gpu", gpus)


# ----------------------------------------------------------------------------------------------- SLURM


def test_slurm_dry_run_prints_the_script(capsys, monkeypatch):
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    argv = ["launch", "--slurm", "--nodes", "8", "--gpus-per-node", "8", "--partition", "h100", "--time", "2:00:00"]
    argv += ["--account", "lm", "--dry-run", "--", "spmdkit", "train", "--model", "70b", "--mesh", "fsdp=8,tensor=8"]
    assert main(argv) == 0
    script = capsys.readouterr().out
    for line in (
        "#SBATCH --nodes=8",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --partition=h100",
        "#SBATCH --time=2:00:00",
        "#SBATCH --account=lm",
        f"\n{environment_setup()}\n",  # not commented out: the environment this test runs in
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        'export SPMDKIT_COORDINATOR="$head_node:',
        "# export NCCL_IB_HCA=",
        'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --cpu-bind=none spmdkit train --model 70b',
    ):
        assert line in script, line
    assert environment_setup() == f"source {Path(sys.prefix) / 'bin' / 'activate'}"  # the tests run in a venv
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


FAKE_SLURM = {  # what the script calls, emulated: scontrol lists the nodes, srun prints what it would start
    "scontrol": "echo node01; echo node02\n",
    "srun": 'echo "srun $* coordinator=$SPMDKIT_COORDINATOR python=$(command -v python)"\n',
}


@pytest.mark.parametrize("per, tasks, cpus", [("gpu", 4, 8), ("node", 1, 32)])
def test_slurm_script_runs_under_emulated_slurm(per, tasks, cpus, tmp_path):
    """Both layouts: the script passes `bash -n`, then runs to srun under SLURM's variables (srun and scontrol
    emulated) with the launcher's environment activated; a command not found there stops it before srun."""
    for name, body in FAKE_SLURM.items():
        (tmp_path / name).write_text("#!/bin/bash\n" + body)
        (tmp_path / name).chmod(0o755)
    command = ["spmdkit", "train", "--model", "1b", "--mesh", "data=2,fsdp=4", "--dcn", "data=2"]
    script = sbatch_script(command, 2, 4, per=per)
    assert f"#SBATCH --ntasks-per-node={tasks}\n#SBATCH --gpus-per-node=4\n#SBATCH --cpus-per-task={cpus}\n" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "42"}
    env.update(SLURM_JOB_NODELIST="node[01-02]", SLURM_CPUS_PER_TASK=str(cpus))
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    srun = f"srun --kill-on-bad-exit=1 --cpus-per-task={cpus} --cpu-bind=none {shlex.join(command)} "
    assert done.stdout == f"{srun}coordinator=node01:20042 python={BIN}/python\n"
    missing = sbatch_script(["no-such-command-xyz"], 2, 4, per=per, env_setup="true")
    done = subprocess.run(["bash", "-c", missing], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 127 and done.stdout == "", done.stdout
    assert done.stderr == "no-such-command-xyz: not found after the environment set-up\n"


def test_slurm_without_sbatch_writes_the_script_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{tmp_path}")
    path = tmp_path / "job.sbatch"
    assert main(["launch", "--slurm", "--nodes", "2", "--script", str(path), "--", "spmdkit", "train"]) == 2
    assert "sbatch not found" in capsys.readouterr().err
    assert "#SBATCH --nodes=2" in path.read_text()


def test_example_script_matches_the_generator():
    """scripts/slurm_70b_example.sh is the generator's script (long srun line wrapped) under a comment header."""
    example = (Path(__file__).parents[1] / "scripts" / "slurm_70b_example.sh").read_text()
    assert subprocess.run(["bash", "-n"], input=example, text=True).returncode == 0
    body = re.sub(r" \\\n\s+", " ", example[example.index("#SBATCH --nodes") :])
    command = shlex.split(body.split("--cpu-bind=none ")[1])
    assert command[:5] == ["spmdkit", "train", "--model", "70b", "--mesh"]  # the layout: tests/test_readme.py
    options = dict(job_name="llama70b", partition="h100", time="48:00:00", account="YOUR_ACCOUNT")
    generated = sbatch_script(command, 8, 8, env_setup="source /shared/venvs/spmdkit/bin/activate", **options)
    assert body == generated[generated.index("#SBATCH --nodes") :]


# ----------------------------------------------------------------------------------------------- bad input


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--processes", "0", "--", "spmdkit", "train"], "--processes 0 and --devices-per-process None must be >= 1"),
        (["--processes", "2", "--devices-per-process", "0", "--", "spmdkit"], "--devices-per-process 0 must be >= 1"),
        (["--processes", "2", "--", "no-such-command-xyz"], "command 'no-such-command-xyz' not found"),
        (["--processes", "2"], "no command to run"),
        (["--processes", "2", "--", "spmdkit", "train", "--cpu-devices", "8"], "mismatched device counts"),
        (["--slurm", "--processes", "2", "--", "spmdkit"], "--slurm takes --nodes K"),
        (["--slurm", "--nodes", "0", "--dry-run", "--", "spmdkit"], "--nodes 0 and --gpus-per-node 8 must be"),
        (["--nodes", "2", "--dry-run", "--", "spmdkit"], "--nodes and --dry-run go with --slurm"),
        (["--cpus-per-task", "4", "--", "spmdkit"], "--cpus-per-task goes with --slurm"),
        (["--processes", "2", "--", "spmdkit", "train", "..."], "the command has a literal '...'"),
        (["--processes", "3", "--processes-per-host", "2", "--", "spmdkit"], "--processes-per-host 2 does not divide"),
        (["--slurm", "--nodes", "2", "--dry-run", "--", "spmdkit", "train", "..."], "literal '...': write it whole"),
        (["--slurm", "--nodes", "2", "--dry-run"], "no command to run"),
        (["--slurm", "--nodes", "2", "--dry-run", "--", "no-such-command-xyz"], "'no-such-command-xyz' not found"),
        (["--slurm", "--nodes", "2", "--cpus-per-task", "0", "--dry-run", "--", "spmdkit"], "--cpus-per-task 0 must"),
        (["--slurm", "--nodes", "2", "--processes-per-host", "2", "--", "spmdkit"], "--slurm takes --nodes K"),
        (["--processes", "2", "--port", "99999", "--", "spmdkit", "train"], "--port 99999 is not a TCP port"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spmdkit: error: ") and message in err and "\n" not in err, err


def test_port_in_use_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["launch", "--processes", "2", "--port", str(port), "--", "spmdkit", "train"]) == 2
    assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err
