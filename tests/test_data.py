"""spmdkit.data.stream: stdlib / token-file / synthetic sources, sharding by process, exact resume, errors."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.data.config import DataConfig
from spmdkit.data.sources import stdlib_files, stdlib_root
from spmdkit.data.stream import global_batch_arrays, make_data
from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh import make_mesh

SEQ = 32


def _take(stream, n):
    return [next(stream) for _ in range(n)]


def _windows(batch):
    """[b, seq+1] token windows rebuilt from a batch: inputs plus the last target."""
    return np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)


def _reference_stdlib(paths, seq):
    """Set of window bytes built straight from disk: each file = 256 + bytes + 257, concatenated, cut by seq+1."""
    parts = []
    for rel in paths:
        with open(os.path.join(stdlib_root(), rel), "rb") as f:
            parts += [[256], np.frombuffer(f.read(), np.uint8), [257]]
    tokens = np.concatenate(parts).astype(np.int32)
    n = len(tokens) // (seq + 1)
    return tokens[: n * (seq + 1)].reshape(n, seq + 1)


@pytest.fixture(scope="module")
def split_files():
    return stdlib_files(0.05)


def test_stdlib_batches_are_shifted_windows_of_the_train_files(split_files):
    stream = make_data(DataConfig(), seq_len=SEQ, global_batch=8, vocab_size=264, seed=0)
    batch = next(stream)
    for name in ("inputs", "targets", "positions"):
        assert batch[name].shape == (8, SEQ) and batch[name].dtype == np.int32
    np.testing.assert_array_equal(batch["positions"], np.broadcast_to(np.arange(SEQ), (8, SEQ)))
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    assert batch["inputs"].min() >= 0 and batch["inputs"].max() < 264
    train_windows = {w.tobytes() for w in _reference_stdlib(split_files["train"], SEQ)}
    assert all(w.tobytes() in train_windows for w in _windows(batch))


def test_stdlib_text_is_python_source():
    stream = make_data(DataConfig(), seq_len=512, global_batch=4, vocab_size=264, seed=3)
    tokens = next(stream)["inputs"].ravel()
    text = bytes(tokens[tokens < 256].astype(np.uint8)).decode("utf-8", errors="ignore")
    assert any(word in text for word in ("def ", "import ", "class ", "return", "self"))


def test_stdlib_eval_files_are_disjoint_and_eval_is_one_ordered_pass(split_files):
    train, evals = set(split_files["train"]), set(split_files["eval"])
    assert train and evals and not train & evals
    assert not any("site-packages" in p for p in train | evals)
    assert 0.01 < len(evals) / len(train | evals) < 0.15
    stream = make_data(DataConfig(), seq_len=256, global_batch=8, vocab_size=264, seed=0, split="eval")
    reference = _reference_stdlib(split_files["eval"], 256)
    batches = list(stream)
    assert len(batches) == len(reference) // 8 == stream.steps_per_epoch
    np.testing.assert_array_equal(_windows(batches[0]), reference[:8])
    np.testing.assert_array_equal(_windows(batches[-1]), reference[(len(batches) - 1) * 8 : len(batches) * 8])


def test_stdlib_determinism_and_seed():
    def first(seed):
        return _take(make_data(DataConfig(), seq_len=SEQ, global_batch=4, vocab_size=264, seed=seed), 2)

    a, b, c = first(0), first(0), first(1)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert not np.array_equal(a[0]["inputs"], c[0]["inputs"])


def test_exact_resume():
    kwargs = dict(seq_len=SEQ, global_batch=4, vocab_size=264, seed=7)
    stream = make_data(DataConfig(), **kwargs)
    _take(stream, 3)
    state = stream.get_state()
    expected = _take(stream, 2)
    fresh = make_data(DataConfig(), **kwargs)
    fresh.set_state(state)
    for want, got in zip(expected, _take(fresh, 2), strict=True):
        for name in want:
            np.testing.assert_array_equal(want[name], got[name])
    assert fresh.iterator is not None and fresh.get_state() == stream.get_state()


def test_bin_uint16_windows_epochs_and_eval_tail(tmp_path):
    seq = 15
    tokens = ((np.arange(20 * (seq + 1)) * 7) % 1000).astype(np.uint16)  # 20 windows
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    config = DataConfig(source=str(path), token_dtype="uint16", eval_fraction=0.2)  # eval = last 4 windows
    windows = tokens.astype(np.int32).reshape(20, seq + 1)
    stream = make_data(config, seq_len=seq, global_batch=4, vocab_size=1000, seed=0)
    epochs = [np.concatenate([_windows(b) for b in _take(stream, 4)]) for _ in range(2)]  # 16 train windows each
    for epoch in epochs:  # each epoch is a permutation of exactly the 16 head windows
        assert sorted(map(bytes, epoch)) == sorted(map(bytes, windows[:16]))
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled per epoch
    ev = list(make_data(config, seq_len=seq, global_batch=4, vocab_size=1000, seed=0, split="eval"))
    assert len(ev) == 1
    np.testing.assert_array_equal(_windows(ev[0]), windows[16:])


def test_npy_uint32(tmp_path):
    seq = 8
    tokens = (70_000 + np.arange(10 * (seq + 1))).astype(np.uint32)
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    config = DataConfig(source=str(path), eval_fraction=0.0)
    batch = next(make_data(config, seq_len=seq, global_batch=5, vocab_size=80_000, seed=1))
    windows = _windows(batch)
    for w in windows:  # each row is an aligned window of the file
        start = int(w[0]) - 70_000
        assert start % (seq + 1) == 0
        np.testing.assert_array_equal(w, tokens[start : start + seq + 1])
    assert len({int(w[0]) for w in windows}) == 5


def test_processes_read_disjoint_records_covering_the_data(tmp_path, monkeypatch):
    seq = 7
    tokens = np.arange(8 * (seq + 1), dtype=np.uint16)
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    config = DataConfig(source=str(path), eval_fraction=0.0)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    seen = []
    for pid in range(2):
        monkeypatch.setattr(jax, "process_index", lambda pid=pid: pid)
        stream = make_data(config, seq_len=seq, global_batch=4, vocab_size=64, seed=0)
        assert stream.local_batch == 2
        seen += [int(w[0]) for b in _take(stream, 2) for w in _windows(b)]  # one epoch per process
    assert sorted(seen) == list(range(0, 8 * (seq + 1), seq + 1))


def test_synthetic_in_range_and_deterministic():
    def first(seed):
        config = DataConfig(source="synthetic")
        return next(make_data(config, seq_len=SEQ, global_batch=4, vocab_size=100, seed=seed))

    a, b, c = first(0), first(0), first(1)
    assert a["inputs"].shape == (4, SEQ) and a["inputs"].dtype == np.int32
    assert a["inputs"].min() >= 0 and a["inputs"].max() < 100 and len(np.unique(a["inputs"])) > 50
    np.testing.assert_array_equal(a["targets"][:, :-1], a["inputs"][:, 1:])
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], c["inputs"])


def _write(tmp_path, name, array):
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, array)
    else:
        path.write_bytes(np.asarray(array).tobytes())
    return str(path)


@pytest.mark.parametrize(
    "name, array, kwargs, match",
    [
        ("missing.bin", None, {}, "not found"),
        ("tokens.txt", np.zeros(100, np.uint16), {}, "unknown extension '.txt'"),
        ("odd.bin", np.zeros(3, np.uint8), {}, "not a multiple of 2"),
        ("float.npy", np.zeros(100, np.float32), {}, "float32.*integer"),
        ("big.bin", np.array([1, 2, 500] * 40, np.uint16), {}, "token id 500 but vocab_size is 264"),
        ("short.bin", np.zeros(10, np.uint16), {}, "shorter than one sequence"),
        ("few.bin", np.zeros(3 * 17, np.uint16), {}, "fewer than one global batch of 4"),
    ],
)
def test_token_file_errors(tmp_path, name, array, kwargs, match):
    path = str(tmp_path / name) if array is None else _write(tmp_path, name, array)
    config = DataConfig(source=path, eval_fraction=0.0, **kwargs)
    with pytest.raises(SpmdkitError, match=match) as info:
        make_data(config, seq_len=16, global_batch=4, vocab_size=264, seed=0)
    assert "\n" not in str(info.value)


def test_a_token_dtype_without_a_bin_reader_is_refused_by_the_config():
    with pytest.raises(SpmdkitError, match="token_dtype='int8' must be of type") as info:
        DataConfig(source="tokens.bin", token_dtype="int8")
    assert "\n" not in str(info.value)


def test_config_errors(monkeypatch):
    with pytest.raises(SpmdkitError, match="vocab_size >= 264"):
        make_data(DataConfig(), seq_len=SEQ, global_batch=4, vocab_size=200, seed=0)
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    with pytest.raises(SpmdkitError, match="global_batch=4 does not divide by the 3"):
        make_data(DataConfig(), seq_len=SEQ, global_batch=4, vocab_size=264, seed=0)


def test_global_batch_arrays_single_process():
    mesh = make_mesh("data=2,fsdp=4")
    sharding = NamedSharding(mesh, P(("data", "fsdp")))
    local = next(make_data(DataConfig(), seq_len=SEQ, global_batch=8, vocab_size=264, seed=0))
    arrays = global_batch_arrays(local, {name: sharding for name in local})
    for name, array in arrays.items():
        assert array.shape == (8, SEQ) and array.sharding == sharding
        assert len(array.addressable_shards) == 8 and array.addressable_shards[0].data.shape == (1, SEQ)
        np.testing.assert_array_equal(np.asarray(array), local[name])
    with pytest.raises(SpmdkitError, match="no sharding given for batch field 'targets'"):
        global_batch_arrays(local, {"inputs": sharding, "positions": sharding})
