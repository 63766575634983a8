"""The tokenizers spmdkit builds itself, both byte-level `tokenizers` objects saved as ordinary `tokenizer.json`.

- `bytes`: the byte vocabulary the embedded stdlib corpus has always used: id b (0-255) is the byte b of the UTF-8
  text, `<|bos|>` = 256, `<|eos|>` = 257, six reserved specials up to 264 ids (the default `tiny` vocab). A BPE
  model with no merges over the GPT-2 byte alphabet, with no pre-tokenizer splitting, so `encode(text)` is exactly
  `list(text.encode("utf-8"))`.
- `bpe:N`: a byte-level BPE of at most N ids trained on the input with `tokenizers.trainers.BpeTrainer`: `<|bos|>` =
  0, `<|eos|>` = 1, the 256 byte symbols, then merges (fewer when the text offers fewer pairs seen twice). GPT-2's
  pre-tokenization regex; training is deterministic for the same texts in the same order.

Both carry the post-processor `<|bos|> $A <|eos|>`, so a bare `tokenizer.json` says where BOS and EOS go.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from spmdkit.data.tokenizer.tokenizer import Tokenizer
from spmdkit.errors import SpmdkitError

BYTES_NAME = "bytes"
BYTES_VOCAB = 264
BOS_TOKEN, EOS_TOKEN = "<|bos|>", "<|eos|>"
MIN_BPE_VOCAB = 258  # two specials + 256 bytes: no merges at all
MAX_BPE_VOCAB = 1 << 20


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map byte -> printable character, the alphabet of `pre_tokenizers.ByteLevel`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    return dict(sorted(chars.items()))


@functools.cache
def _byte_tokenizer_json() -> str:
    vocab = {char: byte for byte, char in byte_alphabet().items()}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([BOS_TOKEN, EOS_TOKEN, *(f"<|reserved_{k}|>" for k in range(BYTES_VOCAB - 258))])
    hf.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A {EOS_TOKEN}", special_tokens=[(BOS_TOKEN, 256), (EOS_TOKEN, 257)]
    )
    return hf.to_str()


def byte_tokenizer() -> Tokenizer:
    """The `bytes` tokenizer (see the module docstring)."""
    return Tokenizer(_byte_tokenizer_json(), name=BYTES_NAME)


def is_byte_tokenizer(tokenizer: Tokenizer) -> bool:
    """Whether `tokenizer` is spmdkit's byte vocabulary (its `tokenizer.json` text, wherever it was loaded from)."""
    return tokenizer.json_text == _byte_tokenizer_json()


def parse_bpe_spec(spec: str) -> int:
    """N of "bpe:N", checked."""
    size = spec.removeprefix("bpe:")
    if not size.isdigit() or not MIN_BPE_VOCAB < int(size) <= MAX_BPE_VOCAB:
        raise SpmdkitError(
            f"--tokenizer {spec}: use bpe:N with N in ({MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}] "
            f"(2 specials + 256 bytes + merges), e.g. bpe:4096"
        )
    return int(size)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` ids trained on `texts` (an iterator is read once)."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    hf.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A {EOS_TOKEN}",
        special_tokens=[(BOS_TOKEN, hf.token_to_id(BOS_TOKEN)), (EOS_TOKEN, hf.token_to_id(EOS_TOKEN))],
    )
    return Tokenizer(hf.to_str(), name=f"bpe:{vocab_size}")
