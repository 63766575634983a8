"""spmdkit.data.tokenizer: the bytes vocabulary, bpe:N training, Hugging Face tokenizer files and their BOS/EOS,
token byte counts, checked against the `tokenizers` library itself."""

import json
import random

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from spmdkit.data.sources import BOS, EOS, stdlib_documents, stdlib_texts
from spmdkit.data.tokenizer import byte_tokenizer, load_tokenizer, parse_bpe_spec, train_bpe
from spmdkit.errors import SpmdkitError

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "héllo wörld, ünïcödé ✓ 🎉 and CJK 漢字",
    "literal specials stay text: <|bos|> <|eos|> </s> <s>",
    "tabs\tand\r\nwindows newlines\x00 and a NUL",
] + [f"line {i}: the quick brown fox jumps over the lazy dog {i * i}" for i in range(60)]


def _random_text(rng: random.Random, n: int) -> str:
    alphabet = "abc xyz\n\t é漢🎉<|>" + "".join(chr(c) for c in range(0x20, 0x7F))
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    tokenizer = train_bpe(iter(TEXTS * 3), 320)
    directory = tmp_path_factory.mktemp("bpe")
    tokenizer.save(directory)
    return tokenizer, directory


def test_bytes_are_utf8_bytes_with_bos_257_eos():
    tok = byte_tokenizer()
    assert (tok.vocab_size, tok.model_vocab_size, tok.bos_id, tok.eos_id) == (264, 264, BOS, EOS)
    rng = random.Random(0)
    for text in TEXTS + [_random_text(rng, 200) for _ in range(20)]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.encode_document(text) == [256, *ids, 257]
        assert tok.decode(tok.encode_document(text)) == text
        assert int(tok.token_bytes()[ids].sum()) == len(text.encode("utf-8"))
    np.testing.assert_array_equal(tok.token_bytes()[:256], 1)
    assert tok.token_bytes()[256:].sum() == 0


def test_bytes_tokenizer_gives_the_stdlib_source_tokens():
    tok, docs = byte_tokenizer(), stdlib_documents()
    texts = stdlib_texts()
    for i in (0, len(texts) // 2, len(texts) - 1):
        want = tok.encode_document(texts[i][1].decode("utf-8"))
        np.testing.assert_array_equal(docs.read(i, 0, int(docs.lengths[i])), want)


def test_encode_documents_matches_one_by_one():
    tok = byte_tokenizer()
    tokens, lengths = tok.encode_documents(TEXTS[:5])
    assert list(lengths) == [len(t.encode()) + 2 for t in TEXTS[:5]]
    np.testing.assert_array_equal(tokens, sum((tok.encode_document(t) for t in TEXTS[:5]), []))


def test_bpe_trains_byte_level_and_round_trips_through_the_library(bpe):
    tok, directory = bpe
    library = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert library.token_to_id("<|bos|>") == tok.bos_id == 0 and library.token_to_id("<|eos|>") == tok.eos_id == 1
    assert 258 < tok.vocab_size <= 320 and tok.vocab_size == library.get_vocab_size()
    assert tok.model_vocab_size == 384  # rounded up to a multiple of 128
    rng = random.Random(1)
    for text in TEXTS[:4] + [_random_text(rng, 100) for _ in range(10)]:
        ids = tok.encode(text)
        if "<|" not in text:  # the library's default matches special strings inside text; spmdkit never does
            assert ids == library.encode(text, add_special_tokens=False).ids
            # the file's own post-processor puts BOS/EOS where spmdkit does
            assert tok.encode_document(text) == library.encode(text).ids
        assert library.decode(ids) == text == tok.decode(tok.encode_document(text))
        assert int(tok.token_bytes()[ids].sum()) == len(text.encode("utf-8"))
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges were learned


def test_special_strings_in_text_are_text(bpe):
    tok, _ = bpe
    ids = tok.encode("a <|eos|> b")
    assert tok.eos_id not in ids and tok.decode(ids) == "a <|eos|> b"


def test_bpe_training_is_deterministic(bpe):
    tok, _ = bpe
    assert train_bpe(iter(TEXTS * 3), 320).sha256 == tok.sha256


def test_saved_tokenizer_loads_back(bpe, tmp_path):
    tok, directory = bpe
    for spec in (directory, directory / "tokenizer.json"):
        loaded = load_tokenizer(spec)
        assert (loaded.sha256, loaded.bos_id, loaded.eos_id, loaded.vocab_size) == (
            tok.sha256,
            tok.bos_id,
            tok.eos_id,
            tok.vocab_size,
        )
    byte_tokenizer().save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.name == "bytes" and loaded.model_vocab_size == 264


def _library_bpe(specials: list[str], template: str | None = None) -> tokenizers.Tokenizer:
    """A tokenizer written by the `tokenizers` library itself (not by spmdkit)."""
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(TEXTS, trainer)
    if template:
        ids = [(t, hf.token_to_id(t)) for t in specials if t in template]
        hf.post_processor = processors.TemplateProcessing(single=template, special_tokens=ids)
    return hf


def test_bos_eos_from_the_template_the_config_and_known_names(tmp_path):
    llama = _library_bpe(["<unk>", "<s>", "</s>"], "<s> $A")  # Llama: BOS only, in the post-processor
    llama.save(str(tmp_path / "llama.json"))
    tok = load_tokenizer(tmp_path / "llama.json")
    assert (tok.bos_id, tok.eos_id) == (llama.token_to_id("<s>"), None)
    assert tok.encode_document("hi") == llama.encode("hi").ids

    model_dir = tmp_path / "model"  # a model directory: tokenizer_config.json decides
    model_dir.mkdir()
    llama.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    tok = load_tokenizer(model_dir)
    assert (tok.bos_id, tok.eos_id) == (llama.token_to_id("<s>"), llama.token_to_id("</s>"))

    gpt2 = _library_bpe(["<|endoftext|>"])  # no template: a known name; BOS == EOS gives one separator
    gpt2.save(str(tmp_path / "gpt2.json"))
    tok = load_tokenizer(tmp_path / "gpt2.json")
    assert (tok.bos_id, tok.eos_id) == (None, gpt2.token_to_id("<|endoftext|>"))
    assert tok.encode_document("hi") == [*gpt2.encode("hi").ids, gpt2.token_to_id("<|endoftext|>")]

    bare = _library_bpe([])
    bare.save(str(tmp_path / "bare.json"))
    tok = load_tokenizer(tmp_path / "bare.json")
    assert (tok.bos_id, tok.eos_id) == (None, None) and tok.encode_document("hi") == bare.encode("hi").ids


def test_truncation_stored_in_a_file_is_ignored(tmp_path):
    hf = _library_bpe(["<s>"])
    hf.enable_truncation(max_length=3)
    hf.save(str(tmp_path / "t.json"))
    text = "the quick brown fox jumps over the lazy dog"
    assert len(hf.encode(text).ids) == 3
    assert len(load_tokenizer(tmp_path / "t.json").encode(text)) > 3


@pytest.mark.parametrize(
    "spec, match",
    [
        ("missing.json", "tokenizer 'missing.json' not found: pass a tokenizer.json"),
        ("bpe:4096", "bpe:4096 is trained on the input by `spmdkit data prepare"),
    ],
)
def test_load_errors(spec, match):
    with pytest.raises(SpmdkitError, match=match) as info:
        load_tokenizer(spec)
    assert "\n" not in str(info.value)


def test_load_errors_of_files(tmp_path):
    with pytest.raises(SpmdkitError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(SpmdkitError, match="is not a tokenizers tokenizer.json"):
        load_tokenizer(tmp_path)
    for bad in ("bpe:10", "bpe:x", "bpe:"):
        with pytest.raises(SpmdkitError, match=f"--tokenizer {bad}: use bpe:N with N in"):
            parse_bpe_spec(bad)
    assert parse_bpe_spec("bpe:4096") == 4096
