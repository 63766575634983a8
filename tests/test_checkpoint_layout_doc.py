"""docs/checkpoints.md's reader, plain Orbax and numpy without spmdkit, run as the document says on ONE device,
restores the model parameters of a checkpoint saved on 8 devices: the names, shapes, dtypes and values (bit for
bit) that spmdkit's own loader (`spmdkit.load_model`) reads."""

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from support import run_spmdkit

import spmdkit
from spmdkit.distributed.platform import filter_noise

DOC = Path(__file__).resolve().parent.parent / "docs" / "checkpoints.md"

# Appended to the document's code: hands its `params` to the test, with the device count and any spmdkit module.
DUMP = """
import os as _os, pickle as _pickle, sys as _sys, jax as _jax
with open(_os.environ["READER_DUMP"], "wb") as _file:
    _pickle.dump({
        "devices": _jax.device_count(),
        "spmdkit_modules": sorted(m for m in _sys.modules if m.split(".")[0] == "spmdkit"),
        "params": {_jax.tree_util.keystr(p, simple=True, separator="/"): x
                   for p, x in _jax.tree_util.tree_leaves_with_path(params)},
    }, _file)
"""


def reader_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, f"docs/checkpoints.md should hold one python block, found {len(blocks)}"
    assert not re.search(r"^\s*(import|from)\s+spmdkit\b", blocks[0], re.M), "the reader must not import spmdkit"
    return blocks[0]


def test_documented_reader_restores_the_parameters_on_one_device(tmp_path):
    run_dir = tmp_path / "run"
    trained = run_spmdkit(
        "train", "--model", "tiny", "--cpu-devices", "8", "--mesh", "fsdp=4,tensor=2", "--steps", "2",
        "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--no-progress", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    sharding = json.loads(next(iter(json.loads((run_dir / "checkpoints/2/state/_sharding").read_text()).values())))
    assert sharding["shape"][sharding["axis_names"].index("fsdp")] == 4, sharding  # saved on the 8-device mesh
    assert len(re.findall(r'"id"', json.dumps(sharding["device_mesh"]))) == 8

    script, dump = tmp_path / "read_params.py", tmp_path / "params.pkl"
    script.write_text(reader_code() + DUMP)
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}  # no device count: one CPU device
    env.update(JAX_PLATFORMS="cpu", READER_DUMP=str(dump))
    read = subprocess.run(
        [sys.executable, str(script), str(run_dir)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert read.returncode == 0, read.stderr[-3000:]
    assert filter_noise(read.stderr) == "", f"the reader printed warnings:\n{filter_noise(read.stderr)}"
    found = pickle.loads(dump.read_bytes())
    assert found["devices"] == 1 and found["spmdkit_modules"] == []

    model = spmdkit.load_model(run_dir)  # spmdkit's own reading of the newest step
    expected = {
        jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(x)
        for path, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    }
    params = found["params"]
    assert sorted(params) == sorted(expected) and "embedding" in params and "blocks/attention/q" in params
    for name, want in expected.items():
        got = params[name]
        assert type(got) is np.ndarray, (name, type(got))
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        assert got.tobytes() == want.tobytes(), f"{name} differs from what spmdkit restores"
    printed = [f"{name} {x.shape} {x.dtype}" for name, x in params.items()]
    assert read.stdout.splitlines() == printed
