"""`spmdkit data prepare` at any size, and prepared datasets checked as they are read: pieces of long texts encode
as the whole text, bounded memory, the same bytes for any --workers, SIGKILL and re-run, refused inputs and outputs,
shard paths confined to the dataset, chunk checksums, the largest token id against the model's vocabulary."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from support import error_lines, run_spmdkit
from tokenizers import pre_tokenizers

from spmdkit.cli import main
from spmdkit.data.prepare import PrepareOptions, prepare
from spmdkit.data.prepare.text import split_text
from spmdkit.data.store import PreparedDataset, check_vocabulary
from spmdkit.data.store import format as fmt
from spmdkit.data.store.staging import Staging
from spmdkit.data.tokenizer import byte_tokenizer, train_bpe
from spmdkit.errors import SpmdkitError

WORDS = ["def", "x", "  ", "héllo", "漢字", "\n", "\n    ", "\t", "a,b", "12", " ", "return", "\n\n", "\r\n", " \n"]


def _text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) for _ in range(n))


def _hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file()}


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".spmdkit-prepare" in p.name]


def _corpus(src: Path, seed: int = 0) -> Path:
    """A directory: a long text file, one with a huge line without newlines, JSONL with a long record."""
    src.mkdir(parents=True)
    (src / "big.txt").write_text(_text(150_000, seed))
    (src / "line.txt").write_text("y" * 90_000 + " z" * 500)
    rows = [_text(random.Random(seed + i).randint(1, 2000), seed + i) for i in range(120)] + [_text(60_000, 7)]
    (src / "a.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return src


# ----------------------------------------------------------------------------------------------- pieces


def test_pieces_encode_as_the_whole_text_with_the_real_tokenizers():
    text = _text(40_000) + "\n  indented\n\tand tabs \n" + _text(5000, 1)
    bpe = train_bpe(iter([text]), 600)
    llama3 = tokenizers.Tokenizer.from_str(bpe.hf.to_str())  # the Llama-3 split regex, then byte-level
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    )
    llama3.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    for hf in (byte_tokenizer().hf, bpe.hf, llama3):
        whole = hf.encode(text, add_special_tokens=False).ids
        for limit in (1000, 4096):
            pieces = list(split_text(text, limit))
            assert "".join(pieces) == text and max(map(len, pieces)) <= limit
            assert [i for p in pieces for i in hf.encode(p, add_special_tokens=False).ids] == whole
    # a line of 3,000 letters cut at 1,000 (no white space to cut at): the text is kept, BPE tokens may differ there
    pieces = list(split_text("a" * 3000, 1000))
    assert [len(p) for p in pieces] == [1000, 1000, 1000]
    assert bpe.decode([i for p in pieces for i in bpe.encode(p)]) == "a" * 3000


# ----------------------------------------------------------------------------------------------- the same bytes


def test_the_same_bytes_for_any_workers_and_documents_in_pieces(tmp_path):
    src = _corpus(tmp_path / "src")
    before = _hashes(src)
    out = {}
    for workers in (1, 2):
        options = PrepareOptions(
            (str(src),), "bytes", str(tmp_path / f"w{workers}"), progress=False, workers=workers,
            batch_bytes=1 << 15, piece_chars=5000, shard_tokens=50_000,
        )  # fmt: skip
        prepare(options, log=lambda _: None)
        out[workers] = _hashes(tmp_path / f"w{workers}")
    assert out[1] == out[2]
    dataset = PreparedDataset(tmp_path / "w2")
    rows = [json.loads(line)["text"] for line in (src / "a.jsonl").read_text().splitlines()]
    texts = rows + [(src / "big.txt").read_bytes().decode(), (src / "line.txt").read_bytes().decode()]
    assert [dataset.tokenizer.decode(dataset.document(i)) for i in range(dataset.documents)] == texts
    for shard in dataset.meta["shards"]:  # no document spans shards, the long ones have their own
        tokens = np.fromfile(tmp_path / "w2" / shard["file"], np.uint16)
        assert tokens[0] == 256 and tokens[-1] == 257 and (tokens == 256).sum() == shard["documents"]
    assert dataset.meta["max_token_id"] == 257 and dataset.verify()
    assert _hashes(src) == before and not _leftovers(tmp_path)


def tree_rss(pid: int) -> int:
    """Bytes resident in process `pid` and all its descendants now (0 when it is gone)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(status.split("VmRSS:")[1].split()[0]) * 1024
            stack += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, IndexError):
            continue
    return total


def peak_rss(argv: list[str]) -> int:
    """Run `argv`; the largest resident size of it with its workers together, sampled every 10 ms."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss(process.pid))
        time.sleep(0.01)
    assert process.returncode == 0
    return peak


def test_memory_does_not_grow_with_the_file(tmp_path):
    peaks = {}
    for lines in (2, 15):  # 4 and 32 MB of text: lines of every length, some of 2 MB without a newline
        path = tmp_path / f"{lines}.txt"
        with open(path, "w") as f:
            for k in range(lines):
                f.write(_text(20_000, k) + "\n" + "w" * (2 << 20) + "\n")
        argv = [str(path), "--tokenizer", "bytes", "--out", str(tmp_path / f"o{lines}"), "--no-progress"]
        code = "import sys; from spmdkit.cli.data import main; sys.exit(main(sys.argv[1:]))"
        peaks[lines] = peak_rss([sys.executable, "-c", code, "prepare", *argv, "--workers", "2"])
        assert PreparedDataset(tmp_path / f"o{lines}").meta["bytes"] == path.stat().st_size
    # 150 bytes per byte of input would be 4.8 GB; a file 8 times larger takes (about) no more memory
    assert peaks[15] < 300e6 and peaks[15] < 1.25 * peaks[2], peaks


# ----------------------------------------------------------------------------------------------- SIGKILL


def _prepare_argv(src: Path, tokenizer: Path, out: Path) -> list[str]:
    argv = [str(src), "--tokenizer", str(tokenizer), "--out", str(out), "--no-progress", "--workers", "2"]
    return [sys.executable, "-c", "import sys; from spmdkit.cli.data import main; sys.exit(main(sys.argv[1:]))"] + [
        "prepare",
        *argv,
        "--shard-tokens",
        "200000",
    ]


@pytest.mark.slow
def test_sigkill_at_five_moments_then_the_same_bytes_and_nothing_left(tmp_path):
    src = _corpus(tmp_path / "src")
    for k in range(3):
        (src / f"more{k}.txt").write_text(_text(250_000, 10 + k))
    before = _hashes(src)
    bpe = train_bpe(iter([_text(60_000)]), 2000)
    bpe.save(tmp_path / "tok")
    reference = tmp_path / "reference"
    started = time.perf_counter()
    assert subprocess.run(_prepare_argv(src, tmp_path / "tok" / "tokenizer.json", reference)).returncode == 0
    seconds = time.perf_counter() - started
    out = tmp_path / "out"
    kills = 0
    for fraction in (0.3, 0.45, 0.6, 0.75, 0.9):
        delay = fraction * seconds
        while True:
            process = subprocess.Popen(_prepare_argv(src, tmp_path / "tok" / "tokenizer.json", out))
            time.sleep(delay)
            process.send_signal(signal.SIGKILL)
            if process.wait() == -signal.SIGKILL and not out.exists():
                break
            subprocess.run(["rm", "-rf", str(out)], check=True)  # it finished first: kill earlier
            delay /= 2
        kills += 1
        assert len([n for n in _leftovers(tmp_path) if not n.endswith(".lock")]) <= 1  # earlier kills' removed
    assert subprocess.run(_prepare_argv(src, tmp_path / "tok" / "tokenizer.json", out)).returncode == 0
    assert kills == 5 and _hashes(out) == _hashes(reference)
    assert not _leftovers(tmp_path) and _hashes(src) == before


# ----------------------------------------------------------------------------------------------- refusals


def _refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spmdkit: error: "), err
    return lines[0]


def test_inputs_twice_out_inside_an_input_and_symlinks_out(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.txt").write_text("beta")
    (tmp_path / "secret.txt").write_text("outside")
    (src / "link.txt").symlink_to(tmp_path / "secret.txt")
    (src / "inner.txt").symlink_to(src / "a.txt")  # inside: read
    before = _hashes(src)
    prep = ["data", "prepare", "--tokenizer", "bytes", "--no-progress"]
    line = _refused([*prep, str(src / "a.txt"), f"{src}/./a.txt", "--out", str(tmp_path / "o")], capsys)
    assert f"INPUT {src}/./a.txt is given again ({src / 'a.txt'}): pass each input once" in line
    line = _refused([*prep, str(src), str(src / "sub" / "b.txt"), "--out", str(tmp_path / "o")], capsys)
    assert f"is given inside INPUT {src}" in line
    line = _refused([*prep, str(src), "--out", str(src / "sub" / "o")], capsys)
    assert (
        line == f"spmdkit: error: --out {src / 'sub' / 'o'} lies inside INPUT {src}: choose a place outside the inputs"
    )
    assert main([*prep, str(src), "--out", str(tmp_path / "o")]) == 0
    warnings = [w for w in capsys.readouterr().err.splitlines() if w]
    assert warnings == [
        f"spmdkit: warning: 1 file(s) in {src} are symbolic links leading outside it, not followed "
        f"(e.g. {src / 'link.txt'} -> {tmp_path / 'secret.txt'})"
    ]
    dataset = PreparedDataset(tmp_path / "o")
    assert sorted(dataset.tokenizer.decode(dataset.document(i)) for i in range(dataset.documents)) == [
        "alpha",
        "alpha",
        "beta",
    ]
    assert _hashes(src) == before and not (src / "sub" / "o").exists() and not _leftovers(tmp_path)


def test_a_second_prepare_of_the_same_out_is_refused_and_stale_staging_removed(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("alpha")
    stale = tmp_path / ".o.spmdkit-prepare-dead1234"
    (stale / "cache").mkdir(parents=True)
    (stale / "tokens-00000.bin").write_bytes(b"\0" * 10)
    argv = ["data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", "bytes", "--out", str(tmp_path / "o")]
    with Staging(tmp_path / "o"):
        line = _refused(argv, capsys)
        assert f"another `spmdkit data prepare` (pid {os.getpid()} on " in line and "is writing --out" in line
    assert main(argv) == 0 and not _leftovers(tmp_path) and (tmp_path / "o" / "dataset.json").is_file()
    (tmp_path / ".o.spmdkit-prepare.lock").write_text("pid 1 on a host")  # killed after its rename
    assert "--out" in _refused(argv, capsys) and not _leftovers(tmp_path)


# ----------------------------------------------------------------------------------------------- checked when read


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A prepared dataset of 2 shards with chunks of 1,000 tokens."""
    monkeypatch.setattr(fmt, "CHUNK_TOKENS", 1000)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": _text(300, k)}) + "\n" for k in range(40)))
    options = PrepareOptions(
        (str(tmp_path / "a.jsonl"),), "bytes", str(tmp_path / "d"), progress=False, shard_tokens=12_000
    )
    prepare(options, log=lambda _: None)
    return tmp_path / "d"


def _edit_meta(path: Path, edit) -> None:
    meta = json.loads((path / "dataset.json").read_text())
    edit(meta)
    (path / "dataset.json").write_text(json.dumps(meta))


def test_a_damaged_chunk_stops_the_first_read_of_it(chunked, capsys):
    meta = json.loads((chunked / "dataset.json").read_text())
    assert meta["chunk_tokens"] == 1000 and len(meta["shards"][1]["chunks"]) == -(-meta["shards"][1]["tokens"] // 1000)
    dataset = PreparedDataset(chunked)
    assert not any(any(c) for c in dataset._checked)  # opening reads no chunk
    shard = chunked / meta["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[2 * 2500] ^= 1  # token 2,500 of shard 1: its chunk 2
    shard.write_bytes(bytes(data))
    dataset = PreparedDataset(chunked)
    first = meta["shards"][0]["documents"]
    dataset.read(first, 0, 10)  # chunk 0 of shard 1: fine
    doc = int(np.searchsorted(dataset.offsets, dataset._shard_starts[1] + 2500, side="right")) - 1
    with pytest.raises(SpmdkitError) as info:
        dataset.document(doc)
    assert str(info.value) == (
        f"{shard} is damaged at token offset 2,000 (byte 4,000): chunk 2 does not match its crc32 in dataset.json: "
        f"the prepared dataset {chunked} is damaged or was changed; prepare it again"
    )
    line = _refused(["data", "verify", str(chunked)], capsys)
    assert f"{shard} is damaged at token offset 2,000" in line


def test_shard_paths_stay_in_the_dataset(chunked, tmp_path, capsys):
    outside = tmp_path / "outside.bin"
    first = json.loads((chunked / "dataset.json").read_text())["shards"][0]["file"]
    outside.write_bytes((chunked / first).read_bytes())
    cases = [
        (lambda m: m["shards"][0].update(file=str(outside)), f"names the file '{outside}', which is not a plain name"),
        (lambda m: m["shards"][0].update(file="../outside.bin"), "names the file '../outside.bin', which is not a"),
        (lambda m: m["index"]["keys"].update(file="/etc/passwd"), "names the file '/etc/passwd', which is not a plain"),
        (lambda m: m["shards"][0].pop("sha256"), "dataset.json shard 0 lacks or mangles sha256"),
        (lambda m: m["shards"][0].update(tokens="12"), "dataset.json shard 0 lacks or mangles tokens"),
        (lambda m: m.update(dtype="float32"), "dataset.json says dtype 'float32', not uint16 or uint32"),
        (lambda m: m["shards"][0]["chunks"].pop(), f"has no chunk checksum list of {chunked / first}'s size"),
    ]
    original = (chunked / "dataset.json").read_text()
    for edit, message in cases:
        _edit_meta(chunked, edit)
        line = _refused(["data", "verify", str(chunked)], capsys)
        assert message in line and line.endswith("is damaged or was changed; prepare it again"), line
        (chunked / "dataset.json").write_text(original)
    (chunked / first).unlink()
    (chunked / first).symlink_to(outside)
    line = _refused(["data", "verify", str(chunked)], capsys)
    assert f"{chunked / first} leads outside the dataset (to {outside})" in line
    # an older dataset without chunk checksums: the other checks only
    (chunked / first).unlink()
    (chunked / first).write_bytes(outside.read_bytes())
    _edit_meta(
        chunked, lambda m: [m.pop("chunk_tokens"), m.pop("max_token_id"), [s.pop("chunks") for s in m["shards"]]]
    )
    assert main(["data", "verify", str(chunked)]) == 0
    assert "(no chunk checksums: an older dataset)" in capsys.readouterr().out


def test_the_largest_token_id_against_the_model_vocabulary(chunked):
    dataset = PreparedDataset(chunked)
    assert dataset.meta["max_token_id"] == 257
    check_vocabulary(dataset, 258)
    with pytest.raises(SpmdkitError) as info:
        check_vocabulary(dataset, 257)
    assert str(info.value) == (
        f"the prepared dataset {chunked} holds token id 257, but the model's vocabulary has 257 ids: use a model "
        "vocab_size of at least 264 (its tokenizer is bytes) or prepare the data with the model's tokenizer"
    )
    _edit_meta(chunked, lambda m: m.pop("max_token_id"))  # older: the tokenizer's largest id stands for it
    with pytest.raises(SpmdkitError, match="holds token id 263, but the model's vocabulary has 260 ids"):
        check_vocabulary(PreparedDataset(chunked), 260)


def test_the_command_refuses_an_input_twice_in_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    done = run_spmdkit(
        "data", "prepare", str(tmp_path / "a.txt"), str(tmp_path / "a.txt"), "--tokenizer", "bytes", "--out",
        str(tmp_path / "o"),
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert error_lines(done.stderr) == [
        f"spmdkit: error: INPUT {tmp_path / 'a.txt'} is given again ({tmp_path / 'a.txt'}): pass each input once"
    ]
    assert not (tmp_path / "o").exists() and not _leftovers(tmp_path)
