"""Long texts in pieces: where `spmdkit data prepare` cuts a document it never holds whole (a plain text file) or
that is too long to encode at once, and reading a text file that way.

A document is still one document (`[BOS] + tokens of its text + [EOS]`); only its encoding is done piece by piece,
and the pieces' tokens are written one after the other. `cut_point` prefers, within the second half of the
window, the end of a line whose last character is not white space and whose next line starts with a character that
is not white space (`...x\\n|y...`); failing that, a single space between two such characters (`x| y`); failing
that (one huge line without spaces), the window's end. Pre-tokenizers that split text at white space, as the
GPT-2 regex of `bpe:N` and GPT-2/Llama-3/Qwen-style byte-level BPEs do, cut such text at the same two places, so
encoding the pieces one by one gives exactly the tokens of the whole text; `bytes` gives them at any cut. Only a
cut at the window's end, or a tokenizer whose encoding depends on where a text starts (SentencePiece-style
`Metaspace` with a prepended "▁", a normalizer prepending one) can give other tokens at a cut (a few tokens in a
piece of `limit` characters; the decoded text keeps every character).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

PIECE_CHARS = 1 << 16  # the longest piece of text encoded at once (the encoder needs ~250 bytes per character)


def _cut_around(text: str, char: str, lo: int, hi: int) -> int:
    """The last `char` in text[lo:hi] with a non-space character on both sides, or -1."""
    pos = text.rfind(char, lo, hi)
    while pos > 0:
        if pos + 1 < len(text) and not text[pos - 1].isspace() and not text[pos + 1].isspace():
            return pos
        pos = text.rfind(char, lo, pos)
    return -1


def cut_point(text: str, limit: int) -> int:
    """Where to cut `text` (longer than `limit`) so that its first piece has at most `limit` characters (and at
    least half of them); see the module docstring."""
    for char, after in (("\n", 1), (" ", 0)):  # after a newline, or at a space
        pos = _cut_around(text, char, limit // 2, limit)
        if pos > 0:
            return pos + after
    return limit


def split_text(text: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of at most `limit` characters, cut by `cut_point`; their concatenation is `text`."""
    start = 0
    while len(text) - start > limit:
        cut = start + cut_point(text[start : start + limit + 1], limit)
        yield text[start:cut]
        start = cut
    yield text[start:]


def check_text_file(path: Path, block: int = 1 << 22) -> tuple[int, str, str] | None:
    """Read `path` once in blocks: None when it is UTF-8 with some text that is not white space, else (line, what is
    wrong, kind): "empty" when it is only white space, "not UTF-8" (with its first bad byte and offset)."""
    carry, offset, lines, content = b"", 0, 0, False
    with open(path, "rb") as f:
        while True:
            data = f.read(block)
            final = not data
            data = carry + data
            try:
                text, used = codecs.utf_8_decode(data, "strict", final)
            except UnicodeDecodeError as error:
                line = lines + data.count(b"\n", 0, error.start) + 1
                at = f"byte 0x{data[error.start]:02x} at offset {offset + error.start}"
                return line, f"not UTF-8 ({at})", "not UTF-8"
            content = content or bool(text.strip())
            lines += data.count(b"\n", 0, used)
            offset += used
            carry = data[used:]
            if final:
                return None if content else (1, "empty file", "empty")


def text_pieces(path: Path, limit: int = PIECE_CHARS) -> Iterator[tuple[str, bool, bool]]:
    """(piece, first, last) of a UTF-8 text file (checked by `check_text_file`) read in blocks: the whole file in
    pieces of at most `limit` characters cut by `cut_point`."""
    pending, first = "", True
    with open(path, encoding="utf-8", newline="") as f:  # newline="": every character as it is in the file
        for block in iter(lambda: f.read(limit), ""):
            *done, pending = split_text(pending + block, limit)
            for piece in done:
                yield piece, first, False
                first = False
    if pending:
        yield pending, first, True
