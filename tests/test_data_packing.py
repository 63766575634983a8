"""Document packing: rows, positions, segment ids, loss mask and targets against an independent pure-Python packer;
whole epochs cover every document once; windows; exact resume; the same global batches on any process count;
bits per byte counts."""

import zlib

import jax
import numpy as np
import pytest

from spmdkit.data.bits import bits_per_byte, target_bytes
from spmdkit.data.config import DataConfig
from spmdkit.data.packing import PackedRows, pack_documents
from spmdkit.data.prepare import PrepareOptions, prepare
from spmdkit.data.store.memory import ArrayDocuments
from spmdkit.data.stream import make_data
from spmdkit.errors import SpmdkitError

S = 16
LENGTHS = [1, S - 1, S + 3, 3 * S, 5, S, 2, S - 1, 1, 7, 2 * S + 1, 4, 9]


def reference_rows(docs: list[list[int]], seq_len: int) -> list[dict[str, list[int]]]:
    """Greedy packing written token by token: a document that fits a row but not the rest of this one starts the
    next row; a longer one fills this row and continues. Each cell: (token, doc, index in doc)."""
    rows, row = [], []
    for d, doc in enumerate(docs):
        if row and len(doc) <= seq_len and len(row) + len(doc) > seq_len:
            rows.append(row + [None] * (seq_len - len(row)))
            row = []
        for j in range(len(doc)):
            row.append((d, j))
            if len(row) == seq_len:
                rows.append(row)
                row = []
    if row:
        rows.append(row + [None] * (seq_len - len(row)))
    out = []
    for cells in rows:
        first_seen: list[int] = []
        fields = {k: [] for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
        for cell in cells:
            if cell is None:
                for k in fields:
                    fields[k].append(0)
                continue
            d, j = cell
            if d not in first_seen:
                first_seen.append(d)
            has_next = j + 1 < len(docs[d])
            fields["inputs"].append(docs[d][j])
            fields["targets"].append(docs[d][j + 1] if has_next else 0)
            fields["positions"].append(j)
            fields["segment_ids"].append(first_seen.index(d) + 1)
            fields["loss_mask"].append(int(has_next))
        out.append(fields)
    return out


def _store(lengths, key=0, start=1000):
    """Documents of `lengths` with distinct tokens (doc i holds start + 100 i, ...); keys `key` (0: every document is
    in the eval split of any eval_fraction > 0)."""
    docs = [list(range(start + 100 * i, start + 100 * i + n)) for i, n in enumerate(lengths)]
    tokens = np.array(sum(docs, []), np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    keys = np.full(len(lengths), key, np.uint32)
    return ArrayDocuments(tokens, offsets, keys, np.array(lengths)), docs


def test_packing_matches_the_reference():
    store, docs = _store(LENGTHS)
    rows = PackedRows(store, seq_len=S, packing="documents", split="eval", eval_fraction=0.5, seed=0)
    want = reference_rows(docs, S)
    assert len(rows) == len(want)
    for r, expected in enumerate(want):
        got = rows[r]
        for key, values in expected.items():
            np.testing.assert_array_equal(got[key], values, err_msg=f"row {r} {key}")
            assert got[key].dtype == np.int32 and got[key].shape == (S,)


def test_pack_documents_for_chosen_documents():
    """The helper the model tests use to pack chosen documents: the reference's rows, and pieces that locate each
    document's tokens."""
    _, docs = _store(LENGTHS)
    fields, pieces = pack_documents(docs, S)
    want = reference_rows(docs, S)
    for key in want[0]:
        np.testing.assert_array_equal(fields[key], [w[key] for w in want], err_msg=key)
    for r, row_pieces in enumerate(pieces):
        for p, doc, offset, count in row_pieces:
            np.testing.assert_array_equal(fields["inputs"][r, p : p + count], docs[doc][offset : offset + count])
    assert sum(count for row in pieces for _, _, _, count in row) == sum(LENGTHS)


def test_packing_invariants_by_hand():
    store, docs = _store([1, S - 1, S + 3])
    rows = PackedRows(store, seq_len=S, packing="documents", split="eval", eval_fraction=0.5, seed=0)
    r0, r1, r2 = rows[0], rows[1], rows[2]
    # row 0: the 1-token document and the S-1 one fill it exactly; the 1-token document has no target
    np.testing.assert_array_equal(r0["segment_ids"], [1] + [2] * (S - 1))
    np.testing.assert_array_equal(r0["positions"], [0, *range(S - 1)])
    np.testing.assert_array_equal(r0["loss_mask"], [0] + [1] * (S - 2) + [0])
    # rows 1-2: the S+3 document starts a row and continues with positions S.. into the next, then padding
    np.testing.assert_array_equal(r1["positions"], range(S))
    assert r1["loss_mask"].all() and r1["targets"][-1] == docs[2][S] == r2["inputs"][0]
    np.testing.assert_array_equal(r2["positions"][:3], [S, S + 1, S + 2])
    np.testing.assert_array_equal(r2["segment_ids"], [1] * 3 + [0] * (S - 3))
    np.testing.assert_array_equal(r2["loss_mask"], [1, 1, 0] + [0] * (S - 3))


def _reassemble(rows_iter, docs_by_first_token):
    """{first token: tokens} rebuilt from rows by segment and position (every piece exactly once)."""
    found: dict[int, dict[int, int]] = {}
    for row in rows_iter:
        for seg in range(1, row["segment_ids"].max() + 1):
            where = row["segment_ids"] == seg
            positions, tokens = row["positions"][where], row["inputs"][where]
            assert (np.diff(positions) == 1).all()
            np.testing.assert_array_equal(row["targets"][where][:-1], tokens[1:])  # next token of the document
            doc = next(k for k, v in docs_by_first_token.items() if tokens[0] in v)
            cells = found.setdefault(doc, {})
            for p, t in zip(positions.tolist(), tokens.tolist(), strict=True):
                assert p not in cells
                cells[p] = t
    return {doc: [cells[p] for p in sorted(cells)] for doc, cells in found.items()}


def test_a_train_epoch_holds_every_train_document_once_and_epochs_differ():
    lengths = [3 + (7 * i) % 40 for i in range(30)]
    store, docs = _store(lengths)
    store.keys = np.array([zlib.crc32(f"doc{i}".encode()) for i in range(30)], np.uint32)
    rows = PackedRows(store, seq_len=S, packing="documents", split="train", eval_fraction=0.2, seed=3)
    train = [i for i in range(30) if zlib.crc32(f"doc{i}".encode()) % 10_000 >= 2000]
    assert 0 < len(train) < 30 and list(rows.doc_ids) == train
    n = rows.rows_per_epoch(0)
    epoch0 = [rows[g] for g in range(n)]
    by_first = {i: set(docs[i]) for i in range(30)}
    rebuilt = _reassemble(epoch0, by_first)
    assert rebuilt == {i: docs[i] for i in train}
    epoch1 = [rows[g] for g in range(n, n + rows.rows_per_epoch(1))]
    assert _reassemble(epoch1, by_first) == rebuilt
    assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(epoch0, epoch1, strict=False))
    assert rows.locate(n) == (1, 0) and rows.locate(n - 1) == (0, n - 1)


def test_windows_are_back_to_back_documents():
    store, docs = _store(LENGTHS)
    rows = PackedRows(store, seq_len=S, packing="windows", split="eval", eval_fraction=0.5, seed=0)
    stream = sum(docs, [])
    assert len(rows) == len(stream) // (S + 1) and set(rows[0]) == {"inputs", "targets", "positions"}
    for r in range(len(rows)):
        window = stream[r * (S + 1) : (r + 1) * (S + 1)]
        np.testing.assert_array_equal(rows[r]["inputs"], window[:-1])
        np.testing.assert_array_equal(rows[r]["targets"], window[1:])
        np.testing.assert_array_equal(rows[r]["positions"], range(S))


# ----------------------------------------------------------------------------------------------- make_data


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A bytes dataset of documents of many lengths (BOS + text + EOS: lengths 3 .. 3 S + 2)."""
    root = tmp_path_factory.mktemp("packed")
    texts = [("abcdefghij" * 10)[: n % (3 * S) + 1] for n in range(0, 400, 7)]
    (root / "a.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    prepare(PrepareOptions((str(root / "a.jsonl"),), "bytes", str(root / "out"), progress=False), log=lambda _: None)
    return root / "out", texts, str(root / "a.jsonl")


def _batches(stream, n):
    return [next(stream) for _ in range(n)]


def test_make_data_packs_a_prepared_dataset(prepared):
    path, texts, jsonl = prepared
    config = DataConfig(source=str(path), eval_fraction=0.5)
    stream = make_data(config, seq_len=S, global_batch=4, vocab_size=264, seed=0, split="eval")
    assert stream.keys == ("inputs", "targets", "positions", "segment_ids", "loss_mask")
    assert stream.tokenizer.name == "bytes" and stream.token_bytes.shape == (264,)
    # the eval documents: crc32 of "file:line" below half of the 10,000 buckets, in file order
    evals = [t for i, t in enumerate(texts) if zlib.crc32(f"{jsonl}:{i + 1}".encode()) % 10_000 < 5000]
    want = reference_rows([[256, *t.encode(), 257] for t in evals], S)
    got = [
        row for batch in stream for row in (dict(zip(batch, v, strict=True)) for v in zip(*batch.values(), strict=True))
    ]
    assert len(got) == len(want) - len(want) % 4 == stream.num_records
    for r, (g, w) in enumerate(zip(got, want, strict=False)):
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=f"row {r} {key}")


def test_resume_is_exact_across_epochs(prepared):
    path, _, _ = prepared
    kwargs = dict(seq_len=S, global_batch=4, vocab_size=300, seed=5)
    config = DataConfig(source=str(path))
    stream = make_data(config, **kwargs)
    epoch = stream.num_records // 4
    _batches(stream, epoch - 2)
    state = stream.get_state()
    straight = _batches(stream, 5)  # crosses into the second epoch
    fresh = make_data(config, **kwargs)
    fresh.set_state(state)
    for want, got in zip(straight, _batches(fresh, 5), strict=True):
        assert want.keys() == got.keys()
        for key in want:
            np.testing.assert_array_equal(want[key], got[key])


def test_processes_read_their_block_of_the_same_global_batch(prepared, monkeypatch):
    path, _, _ = prepared
    for source in (str(path), f"{path}=1"):  # one dataset, and a mixture of one
        config = DataConfig(source=source)
        one = _batches(make_data(config, seq_len=S, global_batch=8, vocab_size=264, seed=1), 3)
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        parts = []
        for pid in range(2):
            monkeypatch.setattr(jax, "process_index", lambda pid=pid: pid)
            parts.append(_batches(make_data(config, seq_len=S, global_batch=8, vocab_size=264, seed=1), 3))
        monkeypatch.undo()
        for step in range(3):
            for key in one[step]:
                joined = np.concatenate([parts[0][step][key], parts[1][step][key]])
                np.testing.assert_array_equal(joined, one[step][key])


def test_stdlib_documents_packing():
    config = DataConfig(packing="documents")
    batch = next(make_data(config, seq_len=64, global_batch=4, vocab_size=264, seed=0))
    assert set(batch) == {"inputs", "targets", "positions", "segment_ids", "loss_mask"}
    assert batch["inputs"].max() < 258 and (batch["segment_ids"] >= 1).any()
    windows = next(make_data(DataConfig(), seq_len=64, global_batch=4, vocab_size=264, seed=0))
    assert set(windows) == {"inputs", "targets", "positions"}  # auto keeps the old stdlib windows


def test_bits_per_byte_counts_the_text_bytes_exactly(prepared):
    path, texts, jsonl = prepared
    config = DataConfig(source=str(path), eval_fraction=0.999)
    stream = make_data(config, seq_len=S, global_batch=1, vocab_size=264, seed=0, split="eval")
    total = sum(float(target_bytes(b["targets"], stream.token_bytes, b["loss_mask"])) for b in stream)
    evals = [t for i, t in enumerate(texts) if zlib.crc32(f"{jsonl}:{i + 1}".encode()) % 10_000 < 9990]
    assert total == sum(len(t.encode()) for t in evals)
    # loss x tokens / bytes / ln 2: 2 nats per token over 3 tokens of 4 bytes
    assert float(bits_per_byte(2.0, 3, 4.0)) == pytest.approx(2.0 * 3 / 4 / np.log(2))


def test_errors(prepared, tmp_path):
    path, _, _ = prepared
    with pytest.raises(
        SpmdkitError, match=r"the model's vocab_size 200 is smaller than the 264 ids .* --model.vocab-size 264"
    ):
        make_data(DataConfig(source=str(path)), seq_len=S, global_batch=4, vocab_size=200, seed=0)
    with pytest.raises(
        SpmdkitError, match="train split packs into .* rows of seq_len 4096, fewer than one global batch"
    ):
        make_data(DataConfig(source=str(path)), seq_len=4096, global_batch=4, vocab_size=264, seed=0)
    with pytest.raises(SpmdkitError, match="--packing documents needs document boundaries"):
        make_data(
            DataConfig(source="synthetic", packing="documents"), seq_len=S, global_batch=4, vocab_size=264, seed=0
        )
    with pytest.raises(SpmdkitError, match="is not a prepared dataset"):
        make_data(DataConfig(source=str(tmp_path)), seq_len=S, global_batch=4, vocab_size=264, seed=0)
