"""Mixtures of prepared datasets (`--data A=0.75,B=0.25`): proportions, exact resume, the same global batches on
1 process x 8 devices and 2 processes x 4 (real processes, slow), and the errors."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.data.config import DataConfig
from spmdkit.data.prepare import PrepareOptions, prepare
from spmdkit.data.stream import global_batch_arrays, make_data
from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh import make_mesh

S, BATCH, SEED = 16, 8, 3
BIN = str(Path(sys.executable).parent)


def _prepare(root: Path, name: str, letter: str, tokenizer: str = "bytes") -> Path:
    """A dataset whose text is only `letter`s (documents of varied lengths), so each row says where it came from."""
    (root / f"{name}.jsonl").write_text("".join(f'{{"text": "{letter * (1 + (7 * i) % 40)}"}}\n' for i in range(80)))
    prepare(PrepareOptions((str(root / f"{name}.jsonl"),), tokenizer, str(root / name), progress=False), lambda _: None)
    return root / name


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return f"{_prepare(root, 'a', 'a')}=0.75,{_prepare(root, 'b', 'b')}=0.25", root


def _take(stream, n):
    return [next(stream) for _ in range(n)]


def _stream(source, **kwargs):
    """The train stream of `source`, every document in the train split (whatever the temporary paths' names)."""
    config = DataConfig(source=source, eval_fraction=0.0)
    return make_data(config, seq_len=S, global_batch=BATCH, vocab_size=264, seed=SEED, **kwargs)


def test_rows_come_from_the_components_in_proportion(mixture):
    source, _ = mixture
    rows = np.concatenate([b["inputs"] for b in _take(_stream(source), 50)])  # 400 rows
    from_a = (rows == ord("a")).any(axis=1)
    from_b = (rows == ord("b")).any(axis=1)
    assert not (from_a & from_b).any()  # a row comes from one dataset
    # (a row that holds only the EOS that ends an epoch's last document shows no letter)
    assert from_a.mean() == pytest.approx(0.75, abs=0.015) and from_b.mean() == pytest.approx(0.25, abs=0.015)


def test_mixture_resume_from_a_checkpoint_is_exact(mixture, tmp_path):
    """Stop at step 7, save the data position in an Orbax checkpoint as the trainer does, resume in a fresh stream:
    the next batches are those of the straight run."""
    import grain
    import orbax.checkpoint as ocp

    source, _ = mixture
    stream = _stream(source)
    _take(stream, 7)
    manager = ocp.CheckpointManager(tmp_path.absolute(), item_handlers={"data": grain.checkpoint.CheckpointHandler()})
    manager.save(7, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(stream.iterator)))
    manager.wait_until_finished()
    straight = _take(stream, 4)
    fresh = _stream(source)
    manager.restore(7, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh.iterator)))
    manager.close()
    for want, got in zip(straight, _take(fresh, 4), strict=True):
        for key in want:
            np.testing.assert_array_equal(want[key], got[key])


def test_mixture_eval_is_one_pass(mixture):
    source, _ = mixture
    stream = make_data(
        DataConfig(source=source, eval_fraction=0.5), seq_len=S, global_batch=2, vocab_size=264, seed=0, split="eval"
    )
    batches = list(stream)
    assert len(batches) == stream.steps_per_epoch > 0


def test_mixture_errors(mixture, tmp_path):
    source, root = mixture
    other = _prepare(tmp_path, "c", "c", tokenizer="bpe:300")
    cases = [
        (f"{root / 'a'}=1,{other}=1", "were prepared with different tokenizers (bytes vs bpe:300)"),
        (f"{root / 'a'}=0.5,{root / 'b'}=0", "'" + str(root / "b") + "=0' is not DIR=WEIGHT with a positive weight"),
        (f"{root / 'a'}=x", "is not DIR=WEIGHT with a positive weight"),
        (f"{root / 'a'}=1,{root / 'a'}=2", "names a dataset twice"),
        (f"{root / 'a'}=1,{tmp_path / 'none'}=1", "is not a prepared dataset (no such directory with dataset.json)"),
    ]
    for spec, match in cases:
        with pytest.raises(SpmdkitError) as info:
            _stream(spec)
        assert match in str(info.value) and "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------- real processes

PEER = """
import sys
import numpy as np
from spmdkit.distributed.initialize import initialize_distributed
initialize_distributed()
import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from spmdkit.data.config import DataConfig
from spmdkit.data.stream import global_batch_arrays, make_data
from spmdkit.sharding.mesh import make_mesh

source, out = sys.argv[1], sys.argv[2]
mesh = make_mesh("fsdp=8")

def stream():
    return make_data(DataConfig(source=source, eval_fraction=0.0), seq_len=16, global_batch=8, vocab_size=264, seed=3)

def gathered(s):
    batch = global_batch_arrays(next(s), {k: NamedSharding(mesh, P("fsdp")) for k in s.keys})
    return {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in batch.items()}

s = stream()
batches = [gathered(s) for _ in range(3)]
state = s.get_state()
resumed = stream()
resumed.set_state(state)  # stop at step 3 and resume: the next batches must be those of the straight run
straight = [gathered(s) for _ in range(3)]
again = [gathered(resumed) for _ in range(3)]
for a, b in zip(straight, again):
    for k in a:
        assert np.array_equal(a[k], b[k]), k
if jax.process_index() == 0:
    np.savez(out, **{f"{k}_{i}": v for i, b in enumerate(batches + straight) for k, v in b.items()})
sys.stdout.write(f"done {jax.process_index()}\\n")
"""


@pytest.mark.slow
def test_two_processes_read_the_batches_of_one(mixture, tmp_path):
    source, _ = mixture
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "SPMDKIT_"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", JAX_PLATFORMS="cpu")
    launch = [f"{BIN}/spmdkit", "launch", "--processes", "2", "--devices-per-process", "4", "--"]
    done = subprocess.run(
        [*launch, sys.executable, str(script), source, str(tmp_path / "two.npz")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    two = np.load(tmp_path / "two.npz")
    mesh = make_mesh("fsdp=8")
    stream = _stream(source)
    for i in range(6):
        batch = global_batch_arrays(next(stream), {k: NamedSharding(mesh, P("fsdp")) for k in stream.keys})
        for key, array in batch.items():
            np.testing.assert_array_equal(np.asarray(array), two[f"{key}_{i}"], err_msg=f"step {i} {key}")
    assert jax.process_count() == 1 and len(two.files) == 6 * len(stream.keys)
