"""`--profile-steps A:B` writes a jax.profiler trace of exactly those steps, each annotated, and `--dump-hlo` the
compiled step's HLO; the trace is read back with JAX's own reader of the xplane protobuf (what xprof reads), and
reduced to the roofline's kinds by scripts/profile_kinds.py."""

import gzip
import importlib.util
import json
from pathlib import Path

from jax.profiler import ProfileData
from support import error_lines, run_spmdkit

from spmdkit.inspect.roofline import KINDS

TRAIN = ("train", "--model", "tiny", "--cpu-devices", "8", "--mesh", "fsdp=8", "--steps", "6", "--seq-len", "32")
TRAIN += ("--batch-size", "8", "--eval-every", "0", "--no-progress", "--log-every", "2")


def _script(name: str):
    """A module of scripts/ (not a package), imported from its file."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _events(path) -> list[tuple[str, dict]]:
    return [
        (event.name, dict(event.stats))
        for plane in ProfileData.from_file(str(path)).planes
        for line in plane.lines
        for event in line.events
    ]


def test_profile_steps_trace_holds_those_steps_and_their_phases(tmp_path):
    run_dir = tmp_path / "run"
    done = run_spmdkit(*TRAIN, "--run-dir", str(run_dir), "--profile-steps", "3:5", "--dump-hlo")
    assert done.returncode == 0, done.stderr[-3000:]
    (xplane,) = (run_dir / "profile").rglob("*.xplane.pb")
    events = _events(xplane)
    steps = sorted(stats["step_num"] for name, stats in events if name == "train")
    assert steps == [3, 4, 5]  # the profiled steps, and no other
    names = {name for name, _ in events}
    assert {"data", "step"} <= names
    (trace,) = (run_dir / "profile").rglob("*.trace.json.gz")  # the Chrome/Perfetto trace beside it
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert (run_dir / "train_step.hlo.txt").read_text().startswith("HloModule")
    # scripts/profile_kinds.py (what scripts/gpu_profile.sh runs on an H100) reduces this CPU trace to the kinds
    reducer = _script("profile_kinds")
    assert reducer.main([str(run_dir), "--steps", "3", "--json", str(tmp_path / "kinds.json")]) == 0
    measured = json.loads((tmp_path / "kinds.json").read_text())["measured_seconds"]
    assert measured["gemm"] > 0 and measured["optimizer"] > 0 and set(measured) <= {*KINDS, "unattributed"}


def test_bad_profile_steps_is_one_line(tmp_path):
    done = run_spmdkit(*TRAIN, "--run-dir", str(tmp_path / "run"), "--profile-steps", "5:3")
    assert done.returncode == 2 and len(error_lines(done.stderr)) == 1 and "1 <= A <= B" in done.stderr
    assert not (tmp_path / "run").exists()
