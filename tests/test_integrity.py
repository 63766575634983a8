"""Checkpoint integrity: a checksum per array, verified by `ckpt verify` and by resume, which agree on what a
damaged step is; flipped bytes are named and skipped; NaN/Inf is never saved and never resumed from."""

import json
import re
import shutil
import warnings

import jax
import numpy as np
import pytest
from fixtures import (
    abstract,  # noqa: F401 - a fixture: the tests name it as an argument
    random_state,
    run_cli,
    shardings_for,
    synthetic_stream,
)
from support import flip_byte

from spmdkit.checkpoint.integrity import array_problems, checksum_record, fingerprints
from spmdkit.checkpoint.manager import Checkpointer, CheckpointWarning, NonFiniteState
from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh import make_mesh
from spmdkit.train.config import TrainConfig

# ----------------------------------------------------------------------------------------------- the checksum

GOLDEN, OFFSET = 0x9E3779B1, 0x7F4A7C15
M32 = 2**32 - 1


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _reference(value: np.ndarray) -> str:
    """The checksum as the integrity module's docstring defines it, element by element in Python integers."""
    words = np.ascontiguousarray(value).reshape(-1)
    words = words.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[words.dtype.itemsize]).tolist()
    first = second = 0
    for i, bits in enumerate(words):
        key = (i * GOLDEN + OFFSET) & M32
        mixed = _fmix(bits ^ key)
        first, second = (first + mixed) & M32, (second + mixed * (key | 1)) & M32
    return f"{first:08x}{second:08x}"


def _values():
    rng = np.random.default_rng(0)
    return {
        "matrix": rng.standard_normal((8, 6)).astype(np.float32),
        "bf16": rng.standard_normal((4, 8)).astype(jax.numpy.bfloat16),
        "count": np.int32(7),
        "vector": rng.integers(0, 9, (3,)).astype(np.int32),
    }


def test_checksum_is_the_documented_formula_on_every_layout():
    values = _values()
    want = {path: (_reference(np.asarray(v)), 0) for path, v in values.items()}
    assert fingerprints(values) == want  # host arrays
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    specs = {"matrix": ("fsdp", "tensor"), "bf16": (None, ("fsdp", "tensor")), "count": (), "vector": ()}
    sharded = {
        k: jax.device_put(v, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*specs[k])))
        for k, v in values.items()
    }
    assert fingerprints(sharded) == want  # on the host, shard by shard (replicas counted once)
    assert fingerprints(sharded, on_device=True) == want  # one compiled program over the sharded arrays
    one = {k: jax.device_put(v, jax.devices()[5]) for k, v in values.items()}
    assert fingerprints(one, on_device=True) == want


def test_any_one_changed_element_and_two_sign_flips_are_detected():
    value = _values()["matrix"]
    saved = checksum_record(fingerprints({"w": value}))
    for position in (0, 17, 47):
        for bit in range(32):
            damaged = value.copy()
            damaged.reshape(-1).view(np.uint32)[position] ^= np.uint32(1 << bit)
            assert array_problems(saved, fingerprints({"w": damaged}))[0] == "checksum mismatch in w"  # (+ NaN)
    damaged = value.copy()
    damaged[0, 0], damaged[3, 4] = -damaged[0, 0], -damaged[3, 4]  # a pure sum of sign bits would cancel
    assert array_problems(saved, fingerprints({"w": damaged})) == ["checksum mismatch in w"]
    swapped = value.copy()
    swapped[0, 0], swapped[0, 1] = value[0, 1], value[0, 0]  # same values, other places
    assert array_problems(saved, fingerprints({"w": swapped})) == ["checksum mismatch in w"]
    nan = value.copy()
    nan[2, 2] = np.nan
    assert array_problems(None, fingerprints({"w": nan})) == ["NaN/Inf values in w (1)"]


# ----------------------------------------------------------------------------------------------- on disk

# Three kinds of array: a parameter, an Adam first moment, an Adam second moment (names as stored by OCDBT).
FLIPS = {
    "model.embedding": "model/embedding",
    "optimizer.opt_state.inner_state.1.0.mu.blocks.attention.k": "optimizer/opt_state/inner_state/1/0/mu/blocks/"
    "attention/k",
    "optimizer.opt_state.inner_state.1.0.nu.blocks.mlp.up": "optimizer/opt_state/inner_state/1/0/nu/blocks/mlp/up",
}


@pytest.fixture(scope="module")
def saved_steps(tmp_path_factory, abstract):  # noqa: F811 - the fixture
    """Steps 2, 4, 6 of random states with data and config items, as training writes them; the states too."""
    directory = tmp_path_factory.mktemp("integrity") / "ckpt"
    shardings = shardings_for(abstract, "fsdp=4,tensor=2")
    checkpointer, stream, states = Checkpointer(directory, every=2), synthetic_stream(), {}
    config = json.loads(TrainConfig().to_json())
    for step in range(1, 7):
        next(stream)
        if step % 2 == 0:
            states[step] = random_state(abstract, shardings, seed=step)
            checkpointer.save(step, states[step], stream.iterator, config)
    checkpointer.close()
    return directory, states


def test_three_flipped_arrays_are_each_named_by_verify_and_the_step_skipped(saved_steps, tmp_path, abstract, capsys):  # noqa: F811 - the fixture
    """One byte flipped in each of three arrays of step 6 (a parameter, an Adam first and second moment)."""
    source, states = saved_steps
    directory = tmp_path / "ckpt"
    shutil.copytree(source, directory)
    for stored in FLIPS:
        flip_byte(directory / "6" / "state", stored)

    code, out, _ = run_cli(capsys, "ckpt", "verify", str(directory))
    assert code == 1
    assert "step 2: ok" in out and "step 4: ok" in out
    (line,) = [line for line in out.splitlines() if "step 6:" in line]
    mismatched = re.search(r"DAMAGED \(checksum mismatch in ([^;)]*)", line)
    assert mismatched and sorted(mismatched.group(1).split(", ")) == sorted(FLIPS.values()), line

    shardings = shardings_for(abstract, "data=8")  # another mesh than the one saved on
    restored_stream = synthetic_stream()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, restored = Checkpointer(directory).restore_latest(abstract, shardings, restored_stream.iterator)
    messages = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert len(messages) == 1 and f"step 6 in {directory} is damaged (checksum mismatch in " in messages[0]
    assert all(name in messages[0] for name in FLIPS.values()), messages[0]
    assert step == 4
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(states[4]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    reference = synthetic_stream()
    for _ in range(5):
        want = next(reference)
    np.testing.assert_array_equal(next(restored_stream)["inputs"], want["inputs"])  # batch 5 comes next
    assert sorted(p.name.split(".")[0] for p in directory.iterdir() if ".damaged-" in p.name) == ["6"]


def test_non_finite_state_is_never_saved_and_never_resumed_from(tmp_path, abstract, capsys):  # noqa: F811 - the fixture
    shardings = shardings_for(abstract, "data=8")
    directory = tmp_path / "ckpt"
    checkpointer = Checkpointer(directory, every=1, keep=2)
    good = {step: random_state(abstract, shardings, seed=step) for step in (1, 2)}
    for step, state in good.items():
        assert checkpointer.save(step, state)
    leaves, treedef = jax.tree.flatten(good[2])
    mu = next(i for i, (p, _) in enumerate(jax.tree_util.tree_leaves_with_path(good[2])) if "mu" in str(p))
    bad_leaves = list(leaves)
    bad_leaves[mu] = leaves[mu].at[(0,) * leaves[mu].ndim].set(np.inf)
    bad = treedef.unflatten(bad_leaves)
    with pytest.raises(NonFiniteState, match=r"step 3 not saved: NaN/Inf values in optimizer/.*mu.* \(1\)"):
        checkpointer.save(3, bad)
    checkpointer.wait()
    assert checkpointer.steps() == [1, 2]  # keep=2: a NaN step 3 would have rotated step 1 out

    # A step holding Inf written around the check (an older spmdkit, another tool): verify and resume reject it.
    import orbax.checkpoint as ocp

    from spmdkit.checkpoint.manager import to_saved_tree

    checkpointer.manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(to_saved_tree(bad))), force=True)
    checkpointer.close()
    code, out, _ = run_cli(capsys, "ckpt", "verify", str(directory))
    assert code == 1 and "step 3: DAMAGED (NaN/Inf values in optimizer/" in out and "step 2: ok" in out
    with pytest.warns(CheckpointWarning, match="step 3 .* is damaged \\(NaN/Inf values in optimizer/"):
        step, restored = Checkpointer(directory, keep=2).restore_latest(abstract, shardings)
    assert step == 2
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(good[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_verify_and_resume_agree_on_a_missing_data_item(saved_steps, tmp_path, abstract, capsys):  # noqa: F811 - the fixture
    directory = tmp_path / "ckpt"
    shutil.copytree(saved_steps[0], directory)
    shutil.rmtree(directory / "6" / "data")  # the step lists a data item it no longer holds
    code, out, _ = run_cli(capsys, "ckpt", "verify", str(directory))
    assert code == 1 and "step 6: DAMAGED (data/ is missing)" in out
    with pytest.warns(CheckpointWarning, match="step 6 .* is damaged \\(data/ is missing\\)"):
        step, _ = Checkpointer(directory).restore_latest(
            abstract, shardings_for(abstract, "data=8"), synthetic_stream().iterator
        )
    assert step == 4


def test_data_positions_of_another_process_count_are_refused_not_set_aside(saved_steps, tmp_path, abstract):  # noqa: F811 - the fixture
    directory = tmp_path / "ckpt"
    shutil.copytree(saved_steps[0], directory)
    for step in (2, 4, 6):  # as if two processes had saved them
        data = directory / str(step) / "data"
        for i in range(2):
            shutil.copy(data / "process_0-of-1.json", data / f"process_{i}-of-2.json")
        (data / "process_0-of-1.json").unlink()
    with pytest.raises(SpmdkitError, match="step 6 .* holds the data positions of 2 process\\(es\\), this run has 1"):
        Checkpointer(directory).restore_latest(abstract, shardings_for(abstract, "data=8"), synthetic_stream().iterator)
    assert sorted(p.name for p in directory.iterdir()) == ["2", "4", "6"]  # nothing set aside as damaged
