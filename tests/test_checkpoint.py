"""spmdkit.checkpoint: exact resume after SIGTERM and SIGKILL, restore onto other meshes, damaged steps."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest
from fixtures import (
    MODEL,
    abstract,  # noqa: F401 - a fixture: the tests name it as an argument
    random_state,
    run_cli,
    shardings_for,
    synthetic_stream,
)
from support import flip_byte

from spmdkit.checkpoint.manager import Checkpointer, CheckpointWarning
from spmdkit.cli.train import parse
from spmdkit.errors import SpmdkitError
from spmdkit.train.config import TrainConfig, apply_overrides, checkpoint_directory
from spmdkit.train.health.preemption import StopRequest
from spmdkit.train.loop import Trainer
from spmdkit.train.reporting.metrics import read_metrics

STEPS, EVERY = 12, 2
TIMEOUT = 240


# ----------------------------------------------------------------------------------------------- CLI runs


def _command(run_dir, steps=STEPS, *extra):
    return [
        sys.executable, "-m", "spmdkit", "train", "--cpu-devices", "2", "--mesh", "fsdp=2", "--steps", str(steps),
        "--log-every", "1", "--checkpoint-every", str(EVERY), "--no-progress", "--seq-len", "32",
        "--batch-size", "4", "--dtype", "float32", "--eval-every", "0", "--run-dir", str(run_dir), *extra,
    ]  # fmt: skip


def _start(run_dir, steps=STEPS, *extra):
    """`spmdkit train` in the background. The runs share the session's compilation cache (tests/conftest.py): the
    first one compiles, the others load the same executables (seconds instead of ~25 s each on two CPU cores)."""
    log = open(f"{run_dir}.log", "w")  # noqa: SIM115 - closed by _finish
    process = subprocess.Popen(_command(run_dir, steps, *extra), stdout=log, stderr=subprocess.STDOUT, text=True)
    process.log = log
    return process


def _finish(process, run_dir):
    """Wait for the process; (return code, its output)."""
    try:
        code = process.wait(timeout=TIMEOUT)
    finally:
        process.log.close()
    with open(f"{run_dir}.log") as f:
        return code, f.read()


def _logged_step(run_dir):
    records = read_metrics(run_dir)
    return records[-1]["step"] if records else 0


def _wait_for(condition, process, what):
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert process.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _losses(run_dir):
    """step -> loss; a resumed run rewrites the steps after its checkpoint, so the last record of a step wins."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def _final_params(run_dir):
    checkpointer = Checkpointer(run_dir / "checkpoints", read_only=True)
    try:
        assert checkpointer.steps()[-1] == STEPS
        return {k: np.asarray(v) for k, v in _flat(checkpointer.read_state(STEPS)).items()}
    finally:
        checkpointer.close()


def _flat(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """(losses, final params) of an uninterrupted run of STEPS steps."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    code, output = _finish(_start(run_dir), run_dir)
    assert code == 0, output[-3000:]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses, _final_params(run_dir)


@pytest.mark.slow
def test_sigterm_then_rerun_is_bit_identical_to_a_straight_run(tmp_path, straight):
    run_dir = tmp_path / "run"
    process = _start(run_dir)
    _wait_for(lambda: _logged_step(run_dir) >= 5, process, "step 5")
    process.send_signal(signal.SIGTERM)
    code, output = _finish(process, run_dir)
    assert code == 0, output[-3000:]
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+); checkpoint saved", output).group(1))
    assert 5 <= stopped < STEPS
    checkpointer = Checkpointer(run_dir / "checkpoints", read_only=True)
    assert checkpointer.steps()[-1] == stopped  # saved synchronously on the way out, whatever the interval
    checkpointer.close()

    code, output = _finish(_start(run_dir), run_dir)
    assert code == 0, output[-3000:]
    assert f"resumed from step {stopped}" in output
    losses, params = straight
    assert _losses(run_dir) == losses
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))  # no duplicated records
    resumed = _final_params(run_dir)
    assert resumed.keys() == params.keys() and len(params) == 42
    for key, value in params.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


@pytest.mark.slow
def test_sigkill_during_a_save_resumes_from_an_intact_step(tmp_path, straight):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    process = _start(run_dir)

    def saving_or_late():  # kill right after the async save of step >= 6 starts (its tmp dir exists)
        tmp = [int(os.path.basename(p).split(".")[0]) for p in glob.glob(f"{ckpt}/*.orbax-checkpoint-tmp*")]
        return any(step >= 6 for step in tmp) or _logged_step(run_dir) >= 9

    _wait_for(saving_or_late, process, "a save of step 6 or later")
    process.kill()
    killed_after = _logged_step(run_dir)
    code, _ = _finish(process, run_dir)
    assert code == -signal.SIGKILL

    code, output = _finish(_start(run_dir), run_dir)
    assert code == 0, output[-3000:]
    resumed = int(re.search(r"resumed from step (\d+)", output).group(1))
    assert resumed % EVERY == 0 and killed_after - EVERY <= resumed <= killed_after
    losses, params = straight
    assert _losses(run_dir) == losses
    np.testing.assert_array_equal(_final_params(run_dir)["['model']['embedding']"], params["['model']['embedding']"])


@pytest.mark.slow
def test_a_flipped_byte_in_the_newest_step_resumes_from_the_one_before_bit_identically(tmp_path, straight):
    run_dir = tmp_path / "run"
    code, output = _finish(_start(run_dir, 8), run_dir)
    assert code == 0, output[-3000:]
    flip_byte(run_dir / "checkpoints" / "8" / "state", "optimizer.opt_state.inner_state.1.0.nu.embedding")
    code, output = _finish(_start(run_dir), run_dir)
    assert code == 0, output[-3000:]
    warned = [line for line in output.splitlines() if line.startswith("spmdkit: warning:")]
    assert len(warned) == 1 and "step 8 in" in warned[0] and "checksum mismatch in optimizer/" in warned[0]
    assert "resumed from step 6" in output and "Traceback" not in output
    losses, params = straight
    assert _losses(run_dir) == losses
    resumed = _final_params(run_dir)
    for key, value in params.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


KILLS = 10
LONG = 2 * KILLS + 4  # each killed run adds at most one save (EVERY steps) to the run


@pytest.mark.slow
def test_ten_sigkills_during_asynchronous_saves_each_resume_bit_identical(tmp_path):
    """Kill the run with SIGKILL 10 times, each time a chosen delay after its first asynchronous save began (a
    `<step>.orbax-checkpoint-tmp` directory appears), then resume it: after every resume the losses so far equal a
    straight run's, bit for bit, and the last run ends with its parameters."""
    straight_dir = tmp_path / "straight"
    code, output = _finish(_start(straight_dir, LONG, "--keep", "1"), straight_dir)
    assert code == 0, output[-3000:]
    want = _losses(straight_dir)
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    resumed_from = []
    for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2):  # seconds after the save began
        process = _start(run_dir, LONG)
        before = set(glob.glob(f"{checkpoints}/*"))
        deadline = time.monotonic() + TIMEOUT
        while not [p for p in glob.glob(f"{checkpoints}/*.orbax-checkpoint-tmp*") if p not in before]:
            assert process.poll() is None and time.monotonic() < deadline, "the run ended before saving"
            time.sleep(0.001)
        time.sleep(delay)
        process.kill()
        code, output = _finish(process, run_dir)
        assert code == -signal.SIGKILL, output[-3000:]
        if match := re.search(r"resumed from step (\d+)", output):
            resumed_from.append(int(match.group(1)))
        assert _losses(run_dir) == {s: want[s] for s in _losses(run_dir)}, output[-3000:]
    code, output = _finish(_start(run_dir, LONG), run_dir)
    assert code == 0 and "damaged" not in output, output[-3000:]
    assert _losses(run_dir) == want
    # Killed before its first save committed, a run resumes from the step before (or starts afresh).
    assert len(resumed_from) >= KILLS // 2 and all(step % EVERY == 0 for step in resumed_from), resumed_from
    final = [Checkpointer(d / "checkpoints", read_only=True) for d in (straight_dir, run_dir)]
    try:
        (a, b) = [{k: np.asarray(v) for k, v in _flat(c.read_state(LONG)).items()} for c in final]
    finally:
        for c in final:
            c.close()
    assert a.keys() == b.keys() and len(a) == 42
    for key, value in a.items():
        np.testing.assert_array_equal(b[key], value, err_msg=key)


# ----------------------------------------------------------------------------------------------- in process


def _assert_same_values(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_onto_other_meshes_and_device_counts(tmp_path, abstract):  # noqa: F811 - the fixture
    saved = random_state(abstract, shardings_for(abstract, "fsdp=4,tensor=2"), seed=1)
    checkpointer = Checkpointer(tmp_path / "ckpt", every=1)
    assert checkpointer.save(3, saved, config={"note": "fsdp x tensor"})
    checkpointer.close()

    fresh = Checkpointer(tmp_path / "ckpt")
    devices = jax.devices()
    for mesh, subset in (("data=8", devices), ("fsdp=4", devices[:4]), ("fsdp=1", devices[:1])):
        shardings = shardings_for(abstract, mesh, subset)
        step, restored = fresh.restore_latest(abstract, shardings)
        assert step == 3
        _assert_same_values(restored, saved)
        for array, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings), strict=True):
            assert array.sharding == sharding and {d.id for d in array.devices()} <= {d.id for d in subset}
    assert fresh.read_config(3) == {"note": "fsdp x tensor"}
    fresh.close()


def test_shape_mismatch_names_the_array_and_both_shapes(tmp_path, abstract):  # noqa: F811 - the fixture
    shardings = shardings_for(abstract, "data=8")
    checkpointer = Checkpointer(tmp_path / "ckpt")
    checkpointer.save(1, random_state(abstract, shardings, seed=0), force=True)
    checkpointer.wait()
    leaves, treedef = jax.tree.flatten(abstract)
    saved = tuple(leaves[0].shape)  # blocks/attention/k: [layers, embed, kv_heads, head_dim]
    wanted = (saved[0], saved[1] // 2, *saved[2:])
    other = treedef.unflatten([jax.ShapeDtypeStruct(wanted, leaves[0].dtype), *leaves[1:]])
    with pytest.raises(SpmdkitError) as info:
        checkpointer.restore_latest(other, shardings)
    message = str(info.value)
    assert f"model/blocks/attention/k has shape {saved} in the checkpoint but has shape {wanted}" in message
    assert "\n" not in message and checkpointer.steps() == [1]  # a mismatch is not damage: nothing set aside
    checkpointer.close()


def _damage(step_dir, how):
    if how == "arrays deleted":
        shutil.rmtree(step_dir / "state" / "ocdbt.process_0" / "d")
    elif how == "files truncated":
        for path in (step_dir / "state").rglob("*"):
            if path.is_file() and path.stat().st_size > 64:
                with open(path, "r+b") as f:
                    f.truncate(32)
    elif how == "data state deleted":
        (step_dir / "data" / "process_0-of-1.json").unlink()
    elif how.startswith("data state edited"):  # resuming at record 10^12 made grain skip for hours
        (step_dir / "data" / "process_0-of-1.json").write_text('{"next_index": 1000000000000}')
    if how == "data state edited, saved before its checksum":  # only the bounds check can tell
        metadata = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
        del metadata["custom_metadata"]["checksums"]["items"]
        (step_dir / "_CHECKPOINT_METADATA").write_text(json.dumps(metadata))


DAMAGE = ["arrays deleted", "files truncated", "data state deleted", "data state edited"]


@pytest.mark.parametrize("how", [*DAMAGE, "data state edited, saved before its checksum"])
def test_damaged_newest_step_falls_back_with_a_warning(tmp_path, abstract, how):  # noqa: F811 - the fixture
    shardings = shardings_for(abstract, "data=8")
    directory = tmp_path / "ckpt"
    checkpointer = Checkpointer(directory, every=2)
    stream, states = synthetic_stream(), {}
    for step in range(1, 7):
        next(stream)
        states[step] = random_state(abstract, shardings, seed=step)
        checkpointer.save(step, states[step], stream.iterator)  # saved at 2, 4, 6
    checkpointer.close()
    (directory / "8.orbax-checkpoint-tmp").mkdir()  # an unfinished save: never a candidate
    _damage(directory / "6", how)

    fresh, restored_stream = Checkpointer(directory, every=2), synthetic_stream()
    with pytest.warns(CheckpointWarning, match="checkpoint step 6 .* is damaged"):
        step, restored = fresh.restore_latest(abstract, shardings, restored_stream.iterator)
    assert step == 4
    _assert_same_values(restored, states[4])
    reference = synthetic_stream()
    for _ in range(5):
        want = next(reference)
    np.testing.assert_array_equal(next(restored_stream)["inputs"], want["inputs"])  # batch 5 comes next
    assert fresh.steps() == [2, 4] and len(glob.glob(f"{directory}/6.damaged-*")) == 1
    assert fresh.save(6, states[6], force=True)  # the step can be written again
    fresh.close()


def test_every_step_damaged_is_an_error_not_a_fresh_start(tmp_path, abstract):  # noqa: F811 - the fixture
    shardings = shardings_for(abstract, "data=8")
    checkpointer = Checkpointer(tmp_path / "ckpt", every=1)
    for step in (1, 2):
        checkpointer.save(step, random_state(abstract, shardings, seed=step))
    checkpointer.close()
    for step in (1, 2):
        _damage(tmp_path / "ckpt" / str(step), "arrays deleted")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SpmdkitError, match="every checkpoint step"):
        warnings.simplefilter("always")
        Checkpointer(tmp_path / "ckpt").restore_latest(abstract, shardings)
    assert sum(issubclass(w.category, CheckpointWarning) for w in caught) == 2


def test_flags_and_default_directory(tmp_path):
    config, _ = parse(["--checkpoint-dir", "ck", "--checkpoint-every", "5", "--keep", "2", "--no-resume"])
    settings = config.checkpoint
    assert (settings.directory, settings.every, settings.keep, settings.resume) == ("ck", 5, 2, False)
    assert checkpoint_directory(config) == (tmp_path.cwd() / "ck").absolute()
    default = apply_overrides(TrainConfig(), {"run": {"run_dir": str(tmp_path / "r")}})
    assert checkpoint_directory(default) == tmp_path / "r" / "checkpoints"
    assert json.loads(default.to_json())["checkpoint"]["every"] == 100
    with pytest.raises(SpmdkitError, match="--keep must be at least 1"):
        apply_overrides(TrainConfig(), {"checkpoint": {"keep": 0}})


def test_no_resume_refuses_to_mix_runs_in_one_directory(saved_run, tmp_path):
    config = apply_overrides(
        TrainConfig(),
        {"checkpoint": {"directory": str(saved_run), "resume": False}, "run": {"run_dir": str(tmp_path / "run")}},
    )
    with pytest.raises(SpmdkitError, match="--no-resume, but .* already holds steps 2-6 .* pass a fresh"):
        Trainer(config)
    fresh = apply_overrides(config, {"checkpoint": {"directory": str(tmp_path / "new")}})
    Trainer(fresh).checkpointer.close()
    assert (tmp_path / "new").is_dir()


def test_stop_request_catches_sigterm_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() and stop.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


# ----------------------------------------------------------------------------------------------- spmdkit ckpt


@pytest.fixture
def saved_run(tmp_path, abstract):  # noqa: F811 - the fixture
    """Steps 2, 4, 6 with data and config items, as training writes them."""
    shardings = shardings_for(abstract, "fsdp=4,tensor=2")
    checkpointer, stream = Checkpointer(tmp_path / "ckpt", every=2), synthetic_stream()
    config = json.loads(TrainConfig().to_json())
    for step in (2, 4, 6):
        next(stream)
        checkpointer.save(step, random_state(abstract, shardings, seed=step), stream.iterator, config)
    checkpointer.close()
    return tmp_path / "ckpt"


def test_ckpt_inspect_text_and_json(saved_run, capsys):
    code, out, _ = run_cli(capsys, "ckpt", "inspect", str(saved_run))
    assert code == 0
    assert "steps       2, 4, 6 (showing 6)" in out
    assert f"parameters  {MODEL.num_params():,}" in out and "saved by    model tiny" in out
    assert re.search(r"model/embedding\s+\(264, 64\)\s+float32\s+66\.0 KiB", out)
    assert "data        process_0-of-1.json" in out

    code, out, _ = run_cli(capsys, "ckpt", "inspect", str(saved_run), "--step", "4", "--json")
    info = json.loads(out)
    assert code == 0 and info["step"] == 4 and info["steps"] == [2, 4, 6]
    assert info["parameters"] == MODEL.num_params() and info["config"]["model"]["name"] == "tiny"
    arrays = {a["path"]: a for a in info["arrays"]}
    assert arrays["optimizer/step"]["shape"] == [] and arrays["model/lm_head"]["bytes"] == 64 * 264 * 4

    code, _, err = run_cli(capsys, "ckpt", "inspect", str(saved_run), "--step", "5")
    assert code == 2 and "step 5 is not in" in err and "holds steps 2, 4, 6" in err
    code, _, err = run_cli(capsys, "ckpt", "inspect", str(saved_run / "nope"))
    assert code == 2 and "does not exist" in err


def test_ckpt_verify_reports_damaged_steps_and_exits_1(saved_run, capsys):
    code, out, _ = run_cli(capsys, "ckpt", "verify", str(saved_run))
    assert code == 0 and "step 2: ok" in out and "3 of 3 steps intact" in out

    _damage(saved_run / "6", "arrays deleted")
    _damage(saved_run / "4", "data state deleted")
    code, out, _ = run_cli(capsys, "ckpt", "verify", str(saved_run))
    assert code == 1
    assert "step 2: ok" in out
    assert "step 4: DAMAGED (data/ holds no process_*-of-*.json file)" in out
    assert "step 6: DAMAGED (" in out and "1 of 3 steps intact" in out
