"""Tokenizers through the Hugging Face `tokenizers` library: `Tokenizer`, `load_tokenizer`, and the built-in `bytes`
vocabulary and `bpe:N` training (see `tokenizer.py` for the BOS/EOS rules and the vocab-size rule)."""

from spmdkit.data.tokenizer.builtin import byte_tokenizer, parse_bpe_spec, train_bpe
from spmdkit.data.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "byte_tokenizer", "load_tokenizer", "parse_bpe_spec", "train_bpe"]
