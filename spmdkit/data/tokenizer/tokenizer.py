"""`Tokenizer`: a Hugging Face `tokenizers.Tokenizer` with spmdkit's document convention, and loading one.

A document becomes `[BOS] + encode(text) + [EOS]`, each special present only when the tokenizer defines it. Where
BOS and EOS come from, first match wins:

1. `tokenizer_config.json` beside `tokenizer.json` (a model or checkpoint directory): its `bos_token` and
   `eos_token` (a string or `{"content": ...}`; null: none).
2. the post-processor in `tokenizer.json` (`TemplateProcessing`, alone or in a `Sequence`): the special token just
   before `$A` is BOS, the one just after it is EOS (Llama's `<s> $A`, spmdkit's `<|bos|> $A <|eos|>`).
3. an added special token with a well-known name (`<|bos|>`, `<s>`, `<|begin_of_text|>`, `<bos>`; `<|eos|>`, `</s>`,
   `<|end_of_text|>`, `<|endoftext|>`, `<eos>`).

When BOS and EOS are the same token (GPT-2's `<|endoftext|>`), only EOS is added: one separator per document.
Text is encoded with `encode_special_tokens = True`, so a literal `<|eos|>` inside a document is plain text, never
the special id. Truncation and padding stored in a `tokenizer.json` are switched off.

`load_tokenizer(spec)`: `"bytes"` (spmdkit's byte vocabulary, `spmdkit.data.tokenizer.builtin`), a `tokenizer.json`
file, or a directory holding one: a model/checkpoint directory, a prepared dataset (`spmdkit data prepare`), or a run
directory (the trainer saves the run's tokenizer there with `Tokenizer.save`). `bpe:N` is trained on the input by
`spmdkit data prepare` (`builtin.train_bpe`), not loaded.

Vocabulary sizes: `Tokenizer.vocab_size` is one more than the largest id. `model_vocab_size` is what a model
trained on it needs as its embedding rows: 264 for `bytes` (256 bytes + specials, a multiple of 8, as the default
`tiny` model has), otherwise `vocab_size` rounded up to a multiple of 128 (fast matmuls, shardable over `tensor`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from spmdkit.errors import SpmdkitError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
VOCAB_MULTIPLE = 128
BOS_NAMES = ("<|bos|>", "<s>", "<|begin_of_text|>", "<bos>")
EOS_NAMES = ("<|eos|>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Tokenizer:
    """Text <-> token ids, with the BOS/EOS convention above.

    Attributes: `hf` (the `tokenizers.Tokenizer`), `name` ("bytes", "bpe:N" or the path it came from),
    `vocab_size`, `bos_id` / `eos_id` (None when the tokenizer has none), `bos` / `eos` ([id], or [] for none),
    `special_ids` ({token: id} of the special added tokens), `sha256` (of the `tokenizer.json` text, as saved),
    `model_vocab_size`.
    """

    def __init__(self, json_text: str, *, name: str, config: dict[str, Any] | None = None):
        self.json_text, self.name, self.config = json_text, name, config
        try:
            self.hf = tokenizers.Tokenizer.from_str(json_text)
        except Exception as error:  # the library raises plain Exceptions for bad files
            raise SpmdkitError(f"{name} is not a tokenizers tokenizer.json ({first_line(error)})") from None
        self.hf.no_truncation()
        self.hf.no_padding()
        self.hf.encode_special_tokens = True
        self.sha256 = hashlib.sha256(json_text.encode()).hexdigest()
        vocab = self.hf.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        added = self.hf.get_added_tokens_decoder()
        self.special_ids = {t.content: i for i, t in sorted(added.items()) if t.special}
        bos, eos = _special_tokens(json.loads(json_text), config, self.special_ids)
        self.bos_id = None if bos is None or bos == eos else self._id_of(bos)
        self.eos_id = None if eos is None else self._id_of(eos)
        self.bos = [] if self.bos_id is None else [self.bos_id]
        self.eos = [] if self.eos_id is None else [self.eos_id]
        from spmdkit.data.tokenizer.builtin import BYTES_NAME, is_byte_tokenizer

        if is_byte_tokenizer(self):  # the byte vocabulary, wherever it was loaded from, is called "bytes"
            self.name = BYTES_NAME

    def _id_of(self, token: str) -> int:
        found = self.hf.token_to_id(token)
        if found is None:
            raise SpmdkitError(f"{self.name}: its special token {token!r} is not in the vocabulary: fix {CONFIG_FILE}")
        return found

    @property
    def model_vocab_size(self) -> int:
        """Embedding rows a model needs for this tokenizer (see the module docstring)."""
        from spmdkit.data.tokenizer.builtin import BYTES_NAME, BYTES_VOCAB

        if self.name == BYTES_NAME:
            return BYTES_VOCAB
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"

    # -- text <-> ids -------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_document(self, text: str) -> list[int]:
        """`[BOS] + encode(text) + [EOS]`, as a prepared dataset stores a document."""
        return self.bos + self.encode(text) + self.eos

    def encode_documents(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64 [sum of lengths], lengths int64 [len(texts)]): the documents `encode_document` gives,
        concatenated; the batch is encoded on all cores (the Rust encoder releases the GIL meanwhile)."""
        encodings = self.hf.encode_batch_fast(list(texts), add_special_tokens=False)
        documents = [self.bos + e.ids + self.eos for e in encodings]
        lengths = np.fromiter(map(len, documents), np.int64, count=len(documents))
        return np.fromiter(itertools.chain.from_iterable(documents), np.int64, count=int(lengths.sum())), lengths

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (BOS/EOS and other specials dropped unless `skip_special_tokens=False`)."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- files ----------------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json` (the exact text this tokenizer was read from, so its hash stays) and
        `tokenizer_config.json` (the original one when there was one, else the resolved BOS/EOS) into `directory`.
        `load_tokenizer(directory)` reads them back; so does `transformers.PreTrainedTokenizerFast.from_pretrained`.
        Each file is written beside and renamed into place: a reader (or a kill) never sees half of one."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.config or {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None if self.bos_id is None else self.hf.id_to_token(self.bos_id),
            "eos_token": None if self.eos_id is None else self.hf.id_to_token(self.eos_id),
        }
        for name, text in ((TOKENIZER_FILE, self.json_text), (CONFIG_FILE, json.dumps(config, indent=2) + "\n")):
            staging = directory / f".{name}.tmp{os.getpid()}"
            try:
                staging.write_text(text)
                os.replace(staging, directory / name)
            finally:
                staging.unlink(missing_ok=True)
        return directory / TOKENIZER_FILE

    def describe(self) -> dict[str, Any]:
        """What `dataset.json` records about the tokenizer."""
        return {
            "name": self.name,
            "file": TOKENIZER_FILE,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "model_vocab_size": self.model_vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "special_ids": self.special_ids,
        }

    def token_bytes(self, size: int | None = None) -> np.ndarray:
        """int32 [size or vocab_size]: UTF-8 bytes of text each token id stands for (0 for special tokens and for
        ids past the vocabulary). Exact for byte-level tokenizers (bytes, bpe:N, GPT-2/Llama-3/Qwen style): a
        document's tokens sum to its UTF-8 byte count. For SentencePiece-style vocabularies ('▁' for a space,
        `<0xNN>` byte fallback) it counts the leading space such tokenizers add to a text; others are approximate."""
        size = self.vocab_size if size is None else size
        out = np.zeros(size, np.int32)
        # byte-level: the decoder maps GPT-2 byte-level characters back to bytes (alone or in a Sequence)
        byte_level = any(
            p.get("type") == "ByteLevel" for p in _parts(json.loads(self.json_text), "decoder", "decoders")
        )
        special = set(self.special_ids.values())
        for token, i in self.hf.get_vocab(with_added_tokens=True).items():
            if i >= size or i in special:
                continue
            if byte_level or _BYTE_FALLBACK.fullmatch(token):
                out[i] = 1 if not byte_level else len(token)  # byte-level: one character per byte
            else:
                out[i] = len(token.replace("\u2581", " ").encode("utf-8"))
        return out


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _parts(spec: dict[str, Any], key: str, sequence_key: str) -> list[dict[str, Any]]:
    """The `key` component of a `tokenizer.json`, or the parts (`sequence_key`) of it when it is a Sequence."""
    component = spec.get(key) or {}
    return component.get(sequence_key, [component]) if component.get("type") == "Sequence" else [component]


def config_token(value: Any) -> str | None:
    """A special token of `tokenizer_config.json`: a string or `{"content": ...}`."""
    return value.get("content") if isinstance(value, dict) else value


def _template_tokens(spec: dict[str, Any]) -> tuple[str | None, str | None]:
    """(BOS, EOS) of a TemplateProcessing post-processor's single-sequence template, else (None, None)."""
    for part in _parts(spec, "post_processor", "processors"):
        if part.get("type") != "TemplateProcessing":
            continue
        items = part.get("single", [])
        where = next((k for k, item in enumerate(items) if "Sequence" in item), None)
        if where is None:
            continue
        before = [item["SpecialToken"]["id"] for item in items[:where] if "SpecialToken" in item]
        after = [item["SpecialToken"]["id"] for item in items[where + 1 :] if "SpecialToken" in item]
        return (before[-1] if before else None), (after[0] if after else None)
    return None, None


def _special_tokens(
    spec: dict[str, Any], config: dict[str, Any] | None, special_ids: dict[str, int]
) -> tuple[str | None, str | None]:
    """(BOS token, EOS token) by the rules of the module docstring."""
    if config is not None and ("bos_token" in config or "eos_token" in config):
        return config_token(config.get("bos_token")), config_token(config.get("eos_token"))
    bos, eos = _template_tokens(spec)
    if bos is not None or eos is not None:
        return bos, eos
    bos = next((t for t in BOS_NAMES if t in special_ids), None)
    eos = next((t for t in EOS_NAMES if t in special_ids), None)
    return bos, eos


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """The tokenizer named by `spec`: "bytes", a `tokenizer.json`, or a directory holding one (see the module
    docstring); a `tokenizer_config.json` beside the file supplies BOS/EOS."""
    spec = str(spec)
    if spec == "bytes":
        from spmdkit.data.tokenizer.builtin import byte_tokenizer

        return byte_tokenizer()
    if spec.startswith("bpe:"):
        raise SpmdkitError(
            f"{spec} is trained on the input by `spmdkit data prepare --tokenizer {spec}`: to use a trained one, pass "
            f"its {TOKENIZER_FILE} or the prepared dataset's directory"
        )
    path = Path(spec)
    if path.is_dir():
        path = path / TOKENIZER_FILE
        if not path.is_file():
            raise SpmdkitError(
                f"{spec} has no {TOKENIZER_FILE}: pass a Hugging Face tokenizer.json, a directory holding one, "
                "'bytes' or 'bpe:N'"
            )
    elif not path.is_file():
        raise SpmdkitError(
            f"tokenizer {spec!r} not found: pass a tokenizer.json, a directory holding one, 'bytes' or 'bpe:N'"
        )
    config_path = path.parent / CONFIG_FILE
    config = None
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise SpmdkitError(f"{config_path} is not JSON ({first_line(error)}): fix or remove it") from None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpmdkitError(f"{path} is not UTF-8 text: pass a Hugging Face tokenizer.json") from None
    return Tokenizer(text, name=str(spec), config=config)
