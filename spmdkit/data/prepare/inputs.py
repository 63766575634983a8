"""The inputs of `spmdkit data prepare`, read as documents, and every bad input as one line naming `file:line`.

INPUT kinds, each read as documents in order:

- `stdlib`: each `.py` file of the embedded standard-library corpus (the files the `stdlib` source reads, empty
  ones included), named by its path relative to the stdlib (so the eval split is the stdlib source's); a
  directory called stdlib is `./stdlib`;
- a text file (any extension but those below): the whole file, named by its path as given, read in pieces cut at
  line boundaries (`text.text_pieces`: one document, never held whole);
- a directory: each file matching `--glob` (recursively, hidden entries skipped, sorted), read by its extension,
  named by its path relative to the directory; symbolic links are not followed out of it (a linked file that lies
  outside is skipped, with one warning line from `check_inputs`; linked directories are not entered);
- `.jsonl` / `.json` / `.ndjson`: each JSON line's `--text-key` value (blank lines skipped), named `file:line`;
- `.parquet` (pyarrow): each row's `--text-key` column, named `file:row`;
- a `datasets` `save_to_disk` directory: each row (a `DatasetDict`: of `--split`), named `dir:row`;
- `json:GLOB`, `parquet:GLOB`, `text:GLOB`: each row of `datasets.load_dataset(builder, data_files=GLOB,
  split=--split)` on local files (text: one file per row), named `GLOB:row`.

`check_inputs` runs first: an input given twice (or inside an input directory) and an `--out` inside an input are
refused in one line.

With `chat` (`data prepare --chat`) the JSON / Parquet / datasets values under the key are conversations: lists of
messages (objects with a string `role`; `spmdkit.data.prepare.chat.check_messages`), or JSON text of one; a text
file or `stdlib` is then refused.

A document's name decides the eval split (crc32 of the name, `spmdkit.data.store.format.is_eval`).
A bad input is a `Bad` record: `where` (`file:line`; Parquet and datasets: `file:row`, 1-based), what is wrong, and
its kind ("not JSON", "not UTF-8", "missing key", "not text", "empty"). The preparer raises it as one line, or counts
and skips it with `--skip-bad`. No input is fetched from a network: `datasets` runs with `HF_DATASETS_OFFLINE=1`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from spmdkit.data.prepare.text import PIECE_CHARS, check_text_file, text_pieces
from spmdkit.data.sources import stdlib_texts
from spmdkit.data.tokenizer.tokenizer import first_line
from spmdkit.errors import SpmdkitError

JSON_LINES = (".jsonl", ".json", ".ndjson")
PARQUET = (".parquet",)
LOADERS = ("json", "parquet", "text")  # datasets.load_dataset builders for INPUT "builder:GLOB"
STDLIB = "stdlib"


@dataclasses.dataclass(frozen=True)
class Document:
    """A document, or a piece of one (a long text file's): `first` and `last` say whether it starts / ends it."""

    name: str  # stable name: its crc32 decides the eval split
    text: str
    first: bool = True
    last: bool = True
    messages: list[dict[str, Any]] | None = None  # a conversation (`--chat`); then `text` is ""


@dataclasses.dataclass(frozen=True)
class Bad:
    where: str  # file:line
    reason: str
    kind: str


Record = Document | Bad


@dataclasses.dataclass(frozen=True)
class InputOptions:
    glob: str = "*"
    text_key: str = "text"
    split: str = "train"
    cache_dir: str | None = None  # where `datasets` may write its Arrow cache (a temporary directory)
    piece_chars: int = PIECE_CHARS  # a text file is read in pieces of at most this many characters
    chat: bool = False  # the `text_key` values are conversations (lists of messages), not text

    def __post_init__(self) -> None:
        # A pattern names files *inside* each input directory: an absolute one or one that climbs out is a mistake.
        if not self.glob or Path(self.glob).is_absolute() or ".." in Path(self.glob).parts:
            raise SpmdkitError(
                f"--glob {self.glob!r} must be a pattern inside the input directories (e.g. '*.txt' or 'docs/*.md'): "
                "pass the other directory as an INPUT instead"
            )


def input_bytes(inputs: list[str], options: InputOptions) -> int | None:
    """Bytes on disk of all inputs (a progress bar's total), or None when an input's size is unknown."""
    total = 0
    for spec in inputs:
        if spec == STDLIB:
            total += sum(len(data) for _, data in stdlib_texts())
        elif Path(spec).is_file():
            total += Path(spec).stat().st_size
        elif Path(spec).is_dir() and not _is_saved_dataset(Path(spec)):
            total += sum(p.stat().st_size for p in _directory_files(Path(spec), options.glob)[0])
        else:
            return None
    return total


def _input_path(spec: str) -> Path | None:
    """The file or directory an INPUT names (None for stdlib and builder:GLOB inputs)."""
    builder, _, pattern = spec.partition(":")
    if spec == STDLIB or (builder in LOADERS and pattern and not Path(spec).exists()):
        return None
    return Path(spec)


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def check_inputs(inputs: list[str], out: str, options: InputOptions) -> list[str]:
    """Refuse an INPUT given twice (or lying inside an INPUT directory) and an `--out` inside an INPUT, each in one
    line; returns the warnings to print (one line per INPUT directory with symlinks leading out of it)."""
    out_path = Path(out).expanduser().resolve()
    seen: dict[Path, str] = {}
    warnings = []
    for spec in inputs:
        path = _input_path(spec)
        if path is None or not path.exists():
            continue
        real = path.resolve()
        for other_real, other in seen.items():
            if real == other_real or (other_real.is_dir() and _inside(real, other_real)):
                how = "again" if real == other_real else f"inside INPUT {other}"
                raise SpmdkitError(f"INPUT {spec} is given {how} ({other}): pass each input once")
            if real.is_dir() and _inside(other_real, real):
                raise SpmdkitError(f"INPUT {other} lies inside INPUT {spec}: pass each input once")
        seen[real] = spec
        if real.is_dir() and _inside(out_path, real):
            raise SpmdkitError(f"--out {out} lies inside INPUT {spec}: choose a place outside the inputs")
        if real.is_dir() and not _is_saved_dataset(real):
            outside = _directory_files(path, options.glob)[1]
            if outside:
                warnings.append(
                    f"warning: {len(outside)} file(s) in {spec} are symbolic links leading outside it, not followed "
                    f"(e.g. {outside[0]})"
                )
    return warnings


def read_inputs(inputs: list[str], options: InputOptions) -> Iterator[Record]:
    """Every document (or bad record) of `inputs`, in order."""
    if not inputs:
        raise SpmdkitError("no INPUT given: pass text/JSONL/Parquet files, directories, datasets or 'stdlib'")
    for spec in inputs:
        path = _input_path(spec)
        if spec == STDLIB and options.chat:
            raise SpmdkitError("--chat reads conversations (JSONL, Parquet, datasets), not the stdlib corpus")
        if path is None:  # stdlib (as --data stdlib; a directory of that name is ./stdlib) or builder:GLOB
            yield from _read_stdlib() if spec == STDLIB else _read_loaded(spec, options)
        elif path.is_dir() and _is_saved_dataset(path):
            yield from _read_saved(path, options)
        elif path.is_dir():
            files = _directory_files(path, options.glob)[0]
            if not files:
                yield Bad(spec, f"no files match --glob {options.glob!r} in this directory", "empty")
            for file in files:
                yield from _read_file(file, file.relative_to(path).as_posix(), options)
        elif path.is_file():
            yield from _read_file(path, spec, options)
        else:
            raise SpmdkitError(
                f"input {spec!r} not found: pass existing files or directories, 'stdlib', or json:|parquet:|text:GLOB"
            )


def _directory_files(directory: Path, glob: str) -> tuple[list[Path], list[str]]:
    """(the files under `directory` matching `glob`, recursively, with no hidden part in their path, sorted; the
    symbolic links among them that lead outside `directory`, as `link -> target`, left out of the first list).
    Linked directories are not entered."""
    real = directory.resolve()
    files, outside = [], []
    for p in sorted(directory.rglob(glob)):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts):
            if p.is_symlink() and not _inside(p.resolve(), real):
                outside.append(f"{p} -> {p.resolve()}")
            else:
                files.append(p)
    return files, sorted(outside)


def _is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets` `save_to_disk` (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _read_stdlib() -> Iterator[Record]:
    for relpath, data in stdlib_texts():
        yield Document(relpath, data.decode("utf-8"))


def _read_file(path: Path, name: str, options: InputOptions) -> Iterator[Record]:
    suffix = path.suffix.lower()
    if suffix in JSON_LINES:
        yield from _read_json_lines(path, name, options.text_key, options.chat)
    elif suffix in PARQUET:
        yield from _read_parquet(path, name, options.text_key, options.chat)
    elif options.chat:
        yield Bad(f"{path}:1", "a text file holds no conversations: --chat reads JSONL, Parquet, datasets", "not JSON")
    else:
        yield from _read_text(path, name, options.piece_chars)


def _read_text(path: Path, name: str, piece_chars: int) -> Iterator[Record]:
    """The file as one document, in pieces (read twice: checked first, so that a bad byte at its end is found
    before any piece of it is written)."""
    problem = check_text_file(path)
    if problem is not None:
        line, reason, kind = problem
        yield Bad(f"{path}:{line}", reason, kind)
        return
    try:
        for text, first, last in text_pieces(path, piece_chars):
            yield Document(name, text, first, last)
    except UnicodeDecodeError:
        raise SpmdkitError(f"{path} changed while it was read (it is no longer UTF-8): run again") from None


def _checked_value(value: Any, key: str, where: str, chat: bool) -> Bad | str | list:
    if not chat:
        return _checked_text(value, key, where)
    from spmdkit.data.prepare.chat import check_messages

    messages = check_messages(value, key)
    return Bad(where, messages, "not messages") if isinstance(messages, str) else messages


def _document(name: str, value: str | list) -> Document:
    return Document(name, "", messages=value) if isinstance(value, list) else Document(name, value)


def _checked_text(value: Any, key: str, where: str) -> Bad | str:
    """A record's value under `key` as text (str, or UTF-8 bytes), or a `Bad` saying why not."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as error:
            return Bad(where, f"{key!r} is not UTF-8 (byte 0x{value[error.start]:02x})", "not UTF-8")
    if not isinstance(value, str):
        return Bad(where, f"{key!r} holds {type(value).__name__}, not a string", "not text")
    if not value.strip():
        return Bad(where, f"empty text under {key!r}", "empty")
    if not value.isascii():  # JSON may escape a lone surrogate (\ud800), which no UTF-8 text holds
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            at = f"\\u{ord(value[error.start]):04x} at character {error.start + 1}"
            return Bad(where, f"{key!r} holds a lone surrogate ({at}), not UTF-8 text", "not UTF-8")
    return value


def _read_json_lines(path: Path, name: str, key: str, chat: bool = False) -> Iterator[Record]:
    found = False
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield Bad(where, f"not UTF-8 (byte 0x{raw[error.start]:02x} at column {error.start + 1})", "not UTF-8")
                continue
            if not line.strip():
                continue
            found = True
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                yield Bad(where, f"not JSON ({error.msg} at column {error.colno})", "not JSON")
                continue
            if not isinstance(record, dict):
                what = type(record).__name__
                yield Bad(where, f"the JSON line is {what}, not an object with key {key!r}", "not JSON")
            elif key not in record:
                keys = ", ".join(list(record)[:8]) or "none"
                yield Bad(where, f"no key {key!r} (keys: {keys}): pass --text-key", "missing key")
            else:
                value = _checked_value(record[key], key, where, chat)
                yield value if isinstance(value, Bad) else _document(f"{name}:{number}", value)
    if not found:
        yield Bad(f"{path}:1", "empty file (no JSON lines)", "empty")


def _import_optional(module: str, feature: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise SpmdkitError(f"{feature} needs the {module} package: pip install {module}") from None


def _read_parquet(path: Path, name: str, key: str, chat: bool = False) -> Iterator[Record]:
    pq = _import_optional("pyarrow.parquet", "reading Parquet")
    try:
        file = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid and OSError subclasses for damaged files
        raise SpmdkitError(f"{path}: not a readable Parquet file ({first_line(error)})") from None
    batches = lambda: (b.column(0).to_pylist() for b in file.iter_batches(columns=[key], batch_size=4096))
    yield from _table_rows(file.schema_arrow.names, batches, key, str(path), name, "empty file (no rows)", chat)


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, whatever the library would fetch
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return _import_optional("datasets", "reading Hugging Face datasets")


def _table_rows(
    columns: list[str], batches: Callable[[], Iterator[list[Any]]], key: str, where: str, name: str, empty: str,
    chat: bool = False,
) -> Iterator[Record]:  # fmt: skip
    """Each value of a table's column `key` (`batches()`: lists of them, read only when the column exists) as a
    document `name:row`, else a `Bad`."""
    if key not in columns:
        yield Bad(
            f"{where}:1", f"no column {key!r} (columns: {', '.join(columns[:8])}): pass --text-key", "missing key"
        )
        return
    row = 0
    for values in batches():
        for value in values:
            row += 1
            text = _checked_value(value, key, f"{where}:{row}", chat)
            yield text if isinstance(text, Bad) else _document(f"{name}:{row}", text)
    if row == 0:
        yield Bad(f"{where}:1", empty, "empty")


def _rows(dataset: Any, key: str, where: str, name: str, chat: bool = False) -> Iterator[Record]:
    batches = lambda: (b[key] for b in dataset.select_columns([key]).iter(batch_size=4096))
    yield from _table_rows(dataset.column_names, batches, key, where, name, "empty dataset (no rows)", chat)


def _read_saved(path: Path, options: InputOptions) -> Iterator[Record]:
    datasets = _datasets()
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # the library's own exception types vary by version
        raise SpmdkitError(f"{path}: datasets.load_from_disk failed ({first_line(error)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if options.split not in loaded:
            raise SpmdkitError(f"{path} has splits {', '.join(loaded)}, not {options.split!r}: pass --split")
        loaded = loaded[options.split]
    yield from _rows(loaded, options.text_key, str(path), path.name, options.chat)


def _read_loaded(spec: str, options: InputOptions) -> Iterator[Record]:
    builder, _, pattern = spec.partition(":")
    datasets = _datasets()
    kwargs: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
    try:
        loaded = datasets.load_dataset(
            builder, data_files=pattern, split=options.split, cache_dir=options.cache_dir, **kwargs
        )
    except Exception as error:  # FileNotFoundError, DatasetGenerationError, ... : one line either way
        raise SpmdkitError(f"{spec}: datasets.load_dataset({builder!r}) failed ({first_line(error)})") from None
    yield from _rows(loaded, options.text_key, spec, spec, options.chat)
