"""`spmdkit data prepare`: every input kind, the output files and dataset.json, shards and dtypes, every bad input
as one line naming file:line, --skip-bad, and damaged prepared datasets."""

import hashlib
import json
import zlib

import numpy as np
import pytest
import tokenizers
from support import error_lines, run_spmdkit
from tokenizers import models, pre_tokenizers

from spmdkit.cli import main
from spmdkit.data.config import DataConfig
from spmdkit.data.prepare import PrepareOptions, prepare
from spmdkit.data.store import PreparedDataset
from spmdkit.data.stream import make_data
from spmdkit.errors import SpmdkitError

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet, héllo 漢字 " * (1 + i % 5) for i in range(40)]


def _prepare(tmp_path, inputs, out="out", tokenizer="bytes", **kwargs):
    options = PrepareOptions(
        inputs=tuple(map(str, inputs)), tokenizer=tokenizer, out=str(tmp_path / out), progress=False, **kwargs
    )
    lines = []
    meta = prepare(options, log=lines.append)
    return PreparedDataset(tmp_path / out), meta, lines


def _texts(dataset):
    """Every document of a prepared dataset decoded back to its text."""
    tok = dataset.tokenizer
    return [tok.decode(dataset.document(i)) for i in range(dataset.documents)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_directory_with_glob(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / ".hidden").mkdir()
    for i, text in enumerate(DOCS[:6]):
        (src / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(text)
    (src / "notes.md").write_text("not matched by the glob")
    (src / ".hidden" / "x.txt").write_text("hidden files are skipped")
    dataset, meta, lines = _prepare(tmp_path, [src], glob="*.txt")
    names = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.txt") if ".hidden" not in p.parts)
    assert _texts(dataset) == [(src / n).read_text() for n in names]  # sorted path order
    np.testing.assert_array_equal(dataset.keys, [zlib.crc32(n.encode()) for n in names])
    assert meta["documents"] == 6 and meta["bytes"] == sum(len((src / n).read_bytes()) for n in names)
    assert meta["tokens"] == meta["bytes"] + 2 * 6  # bytes: one token per byte plus BOS and EOS
    assert lines[-1].startswith("prepared 6 documents, ") and "tokens/s -> " in lines[-1]


def test_stdlib_input_is_the_stdlib_source_split_by_the_same_rule():
    from spmdkit.data.prepare.inputs import InputOptions, read_inputs
    from spmdkit.data.sources import stdlib_files
    from spmdkit.data.store.format import is_eval

    documents = list(read_inputs(["stdlib"], InputOptions()))
    names = [d.name for d in documents]
    split = stdlib_files(0.05)
    assert names == sorted(split["train"] + split["eval"])
    evals = is_eval(np.array([zlib.crc32(n.encode()) for n in names], np.uint32), 0.05)
    assert [n for n, e in zip(names, evals, strict=True) if e] == list(split["eval"])


def test_dataset_json_and_files(tmp_path):
    path = _write_jsonl(tmp_path / "a.jsonl", [{"text": t, "id": i} for i, t in enumerate(DOCS)])
    dataset, meta, _ = _prepare(tmp_path, [path], shard_tokens=2000)
    out = tmp_path / "out"
    on_disk = json.loads((out / "dataset.json").read_text())
    assert on_disk == meta
    tok = meta["tokenizer"]
    assert tok["sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert (tok["name"], tok["vocab_size"], tok["bos_id"], tok["eos_id"]) == ("bytes", 264, 256, 257)
    assert tok["special_ids"]["<|bos|>"] == 256 and meta["dtype"] == "uint16"
    assert meta["documents"] == len(DOCS) and meta["bytes"] == sum(len(t.encode()) for t in DOCS)
    assert len(meta["shards"]) > 1 and sum(s["tokens"] for s in meta["shards"]) == meta["tokens"]
    for shard in meta["shards"]:
        data = (out / shard["file"]).read_bytes()
        assert len(data) == 2 * shard["tokens"] and hashlib.sha256(data).hexdigest() == shard["sha256"]
    # documents never straddle shards: every shard starts with BOS and ends with EOS
    for shard in meta["shards"]:
        tokens = np.fromfile(out / shard["file"], np.uint16)
        assert tokens[0] == 256 and tokens[-1] == 257 and (tokens == 256).sum() == shard["documents"]
    offsets = np.load(out / "documents.npy")
    assert offsets[0] == 0 and offsets[-1] == meta["tokens"] and len(offsets) == len(DOCS) + 1
    np.testing.assert_array_equal(np.load(out / "document_bytes.npy"), [len(t.encode()) for t in DOCS])
    np.testing.assert_array_equal(dataset.keys, [zlib.crc32(f"{path}:{i + 1}".encode()) for i in range(len(DOCS))])
    assert _texts(dataset) == DOCS
    assert not [p for p in tmp_path.iterdir() if ".spmdkit-prepare" in p.name]  # the temporary directory was renamed
    # the same input gives the same content hash; different input, another
    assert _prepare(tmp_path, [path], out="again", shard_tokens=2000)[1]["content_sha256"] == meta["content_sha256"]
    other = _write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in DOCS[1:]])
    assert _prepare(tmp_path, [other], out="other", shard_tokens=2000)[1]["content_sha256"] != meta["content_sha256"]


def test_json_lines_with_text_key_parquet_and_datasets(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    jsonl = _write_jsonl(tmp_path / "a.json", [{"body": t} for t in DOCS[:3]])
    pq.write_table(pa.table({"body": DOCS[3:6], "n": [1, 2, 3]}), tmp_path / "b.parquet")
    datasets.Dataset.from_dict({"body": DOCS[6:8]}).save_to_disk(str(tmp_path / "saved"))
    splits = {
        "train": datasets.Dataset.from_dict({"body": DOCS[8:9]}),
        "test": datasets.Dataset.from_dict({"body": ["x y"]}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved_dict"))
    inputs = [jsonl, tmp_path / "b.parquet", tmp_path / "saved", tmp_path / "saved_dict"]
    dataset, meta, _ = _prepare(tmp_path, inputs, text_key="body")
    assert _texts(dataset) == DOCS[:9]
    # datasets.load_dataset from local files: json:GLOB, parquet:GLOB, text:GLOB (one document per text file)
    (tmp_path / "t").mkdir()
    for i in range(2):
        (tmp_path / "t" / f"{i}.txt").write_text(DOCS[10 + i])
    loaded = [f"json:{jsonl}", f"parquet:{tmp_path / 'b.parquet'}", f"text:{tmp_path / 't' / '*.txt'}"]
    dataset, _, _ = _prepare(tmp_path, loaded[:2], out="loaded", text_key="body")
    assert _texts(dataset) == DOCS[:6]
    dataset, _, _ = _prepare(tmp_path, loaded[2:], out="loaded_text")
    assert sorted(_texts(dataset)) == sorted(DOCS[10:12])


def _wordlevel(tmp_path, size):
    """A word-level tokenizer of `size` ids, written by the tokenizers library."""
    vocab = {f"w{i}": i for i in range(size - 1)} | {"[UNK]": size - 1}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "words.json"))
    return tmp_path / "words.json"


def test_uint32_when_the_vocab_does_not_fit_uint16(tmp_path):
    words = _wordlevel(tmp_path, 70_000)
    src = tmp_path / "a.txt"
    src.write_text("w1 w65535 w65536 w69998 w7")
    dataset, meta, _ = _prepare(tmp_path, [src], tokenizer=str(words))
    assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] == 70_000
    assert meta["tokenizer"]["model_vocab_size"] == 70_016  # rounded up to a multiple of 128
    np.testing.assert_array_equal(dataset.document(0), [1, 65535, 65536, 69998, 7])  # no BOS/EOS defined
    assert (tmp_path / "out" / "tokens-00000.bin").stat().st_size == 5 * 4
    with pytest.raises(SpmdkitError, match=r"the tokenizer has 70,000 ids, more than uint16 holds \(65,536\)"):
        _prepare(tmp_path, [src], out="small", tokenizer=str(words), dtype="uint16")


def test_bpe_through_the_cli(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in DOCS])
    out = tmp_path / "bpe"
    assert main(["data", "prepare", str(path), "--tokenizer", "bpe:300", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "trained bpe:300 in " in printed and f"tokens/s -> {out}" in printed
    library = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    dataset = PreparedDataset(out)
    for i in (0, 17):
        assert list(dataset.document(i)) == library.encode(DOCS[i]).ids  # <|bos|> text <|eos|>
    assert main(["data", "verify", str(out)]) == 0 and main(["data", "inspect", str(out)]) == 0
    assert "bpe:300" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------- bad inputs

BAD = [  # (file name, content bytes, extra flags, the one line printed after "spmdkit: error: ")
    (
        "a.jsonl",
        b'{"text": "ok"}\n{"text": "fine"}\nnot json\n',
        [],
        r"a.jsonl:3: not JSON \(Expecting value at column 1\)",
    ),
    (
        "a.jsonl",
        b'{"text": "ok"}\n{"body": "x", "id": 2}\n',
        [],
        r"a.jsonl:2: no key 'text' \(keys: body, id\): pass --text-key",
    ),
    ("a.jsonl", b'{"text": "ok"}\n\n{"text": 7}\n', [], r"a.jsonl:3: 'text' holds int, not a string"),
    ("a.jsonl", b'{"text": "ok"}\n[1, 2]\n', [], r"a.jsonl:2: the JSON line is list, not an object with key 'text'"),
    ("a.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', [], r"a.jsonl:2: not UTF-8 \(byte 0xe9 at column 14\)"),
    ("a.jsonl", b'{"text": "ok"}\n{"text": "  "}\n', [], r"a.jsonl:2: empty text under 'text'"),
    ("a.jsonl", b"\n\n", [], r"a.jsonl:1: empty file \(no JSON lines\)"),
    ("a.txt", b"line one\nline two\ncaf\xe9\n", [], r"a.txt:3: not UTF-8 \(byte 0xe9 at offset 21\)"),
    ("a.txt", b"", [], r"a.txt:1: empty file"),
    (
        "a.jsonl",
        b'{"text": "ok"}\n{"text": "a\\ud800b"}\n',
        [],
        r"a.jsonl:2: 'text' holds a lone surrogate \(\\ud800 at character 2\), not UTF-8 text",
    ),
]
SKIP_HINT = ": fix the input or pass --skip-bad to count and skip bad records"


@pytest.mark.parametrize("name, content, flags, message", BAD)
def test_bad_input_is_one_line_naming_file_and_line(tmp_path, capsys, name, content, flags, message):
    (tmp_path / name).write_bytes(content)
    code = main(["data", "prepare", str(tmp_path / name), "--tokenizer", "bytes", "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"spmdkit: error: {tmp_path}/") and err.strip().endswith(SKIP_HINT)
    import re

    assert re.search(message, err), err
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if ".spmdkit-prepare" in p.name]


def test_bad_inputs_of_other_kinds(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"text": ["fine", None]}), tmp_path / "c.parquet")
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(tmp_path / "b.parquet")], r"b.parquet:1: no column 'text' \(columns: body\): pass --text-key"),
        ([str(tmp_path / "c.parquet")], r"c.parquet:2: 'text' holds NoneType, not a string"),
        ([str(tmp_path / "empty")], r"empty: no files match --glob '\*' in this directory"),
        ([str(tmp_path / "missing.txt")], r"input '.*missing.txt' not found: pass existing files or directories"),
    ]
    import re

    for inputs, message in cases:
        code = main(["data", "prepare", *inputs, "--tokenizer", "bytes", "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_skip_bad_counts_and_skips(tmp_path):
    rows = b'{"text": "good one"}\nnot json\n{"body": 1}\n{"text": 5}\n{"text": "caf\xe9"}\n{"text": "good two"}\n'
    (tmp_path / "a.jsonl").write_bytes(rows)
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe")
    (tmp_path / "c.txt").write_bytes(b"")
    inputs = [tmp_path / "a.jsonl", tmp_path / "b.txt", tmp_path / "c.txt"]
    dataset, meta, lines = _prepare(tmp_path, inputs, skip_bad=True)
    assert _texts(dataset) == ["good one", "good two"]
    want = {"empty": 1, "missing key": 1, "not JSON": 1, "not UTF-8": 2, "not text": 1}
    assert meta["skipped"] == want
    assert lines[0] == "skipped 6 bad records (empty: 1, missing key: 1, not JSON: 1, not UTF-8: 2, not text: 1)"
    with pytest.raises(SpmdkitError, match="the inputs hold no documents"):
        _prepare(tmp_path, inputs[1:], out="none", skip_bad=True)


def test_refuses_an_existing_out_and_bad_flags(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "mine").write_text("keep me")
    for flags, message in [
        (["--out", str(tmp_path / "o")], f"--out {tmp_path / 'o'} already exists: choose a new directory"),
        (["--out", str(tmp_path / "p"), "--tokenizer", "bpe:3"], "--tokenizer bpe:3: use bpe:N with N in"),
        (["--out", str(tmp_path / "p"), "--tokenizer", str(tmp_path / "nope")], "tokenizer '"),
    ]:
        argv = ["data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", "bytes", *flags]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
    assert (tmp_path / "o" / "mine").read_text() == "keep me"


def test_the_command_prints_one_line_and_exits_2(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"oops": 1}\n')
    done = run_spmdkit(
        "data", "prepare", str(tmp_path / "a.jsonl"), "--tokenizer", "bytes", "--out", str(tmp_path / "o")
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert error_lines(done.stderr) == [
        f"spmdkit: error: {tmp_path / 'a.jsonl'}:2: no key 'text' (keys: oops): pass --text-key{SKIP_HINT}"
    ]


# ----------------------------------------------------------------------------------------------- damaged datasets


@pytest.fixture
def prepared(tmp_path):
    path = _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in DOCS])
    _prepare(tmp_path, [path], shard_tokens=3000)
    return tmp_path / "out"


def _open_error(path):
    with pytest.raises(SpmdkitError) as info:
        make_data(DataConfig(source=str(path)), seq_len=16, global_batch=2, vocab_size=264, seed=0)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_damaged_datasets_are_clear_errors(prepared):
    shard = prepared / "tokens-00001.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])
    assert _open_error(prepared) == (
        f"{shard} has {len(data) - 2:,} bytes, but dataset.json says {len(data) // 2:,} uint16 tokens ({len(data):,} "
        f"bytes): the prepared dataset {prepared} is damaged or was changed; prepare it again"
    )
    shard.write_bytes(data[:-2] + b"\x01\x00")  # the right size, other content: only verify sees it
    PreparedDataset(prepared)
    with pytest.raises(SpmdkitError, match=f"{shard} is damaged at token offset 0 \\(byte 0\\): chunk 0 does not"):
        PreparedDataset(prepared).verify()
    shard.write_bytes(data)
    assert PreparedDataset(prepared).verify()["documents"] == len(DOCS)
    (prepared / "tokenizer.json").write_text((prepared / "tokenizer.json").read_text() + " ")
    assert "tokenizer.json is not the tokenizer dataset.json names" in _open_error(prepared)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "documents.npy").unlink(), "documents.npy is missing"),
        (lambda d: np.save(d / "documents.npy", np.arange(5)), "document index does not hold 40 documents"),
        (lambda d: (d / "dataset.json").write_text("{"), "dataset.json is not JSON"),
        (lambda d: (d / "dataset.json").unlink(), "is not a prepared dataset (it is a directory without dataset.json)"),
    ],
)
def test_damaged_index_and_description(prepared, damage, match):
    damage(prepared)
    assert match in _open_error(prepared)
