"""What a `DataConfig.source` names, its tokenizer, and the vocab a model needs for it.

`resolve_source(config)` -> `Resolved`: the kind (stdlib | synthetic | file | prepared | mixture), the document
stores with their weights (prepared datasets, or the stdlib corpus under `--packing documents`) and the packing
`auto` stands for. `source_tokenizer(config)` -> the `Tokenizer` of the source: `bytes` for stdlib, the prepared
dataset's (all of a mixture's must be the same file), None for token files and synthetic data. The trainer reads
the model vocab from `source_tokenizer(config).model_vocab_size` and saves the tokenizer into the run directory
(`Tokenizer.save`); `check_vocab` is the error a too small model vocab gets.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from spmdkit.data.config import DataConfig
from spmdkit.data.store import PreparedDataset, is_prepared_dataset
from spmdkit.data.tokenizer import Tokenizer, byte_tokenizer
from spmdkit.errors import SpmdkitError

VOCAB_FLAG = "--model.vocab-size"


@dataclasses.dataclass(frozen=True)
class Resolved:
    kind: str  # "stdlib" | "synthetic" | "file" | "prepared" | "mixture"
    packing: str  # "documents" | "windows"
    paths: tuple[str, ...] = ()  # prepared datasets
    weights: tuple[float, ...] = ()  # normalised, one per path


def parse_mixture(source: str) -> list[tuple[str, float]]:
    """`"DIR_A=0.7,DIR_B=0.3"` -> [(DIR_A, 0.7), (DIR_B, 0.3)], checked (weights positive and finite)."""
    parts = []
    for item in source.split(","):
        path, equals, weight = item.strip().rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not equals or not path or not math.isfinite(value) or value <= 0:
            raise SpmdkitError(
                f"--data {source!r}: {item.strip()!r} is not DIR=WEIGHT with a positive weight: write a mixture "
                "as DIR_A=0.7,DIR_B=0.3"
            )
        parts.append((path, value))
    if len({p for p, _ in parts}) < len(parts):
        raise SpmdkitError(f"--data {source!r} names a dataset twice: give each dataset once, with its total weight")
    return parts


def resolve_source(config: DataConfig) -> Resolved:
    source = config.source
    prepared = "documents" if config.packing == "auto" else config.packing  # auto, for prepared data
    if "=" in source:
        parts = parse_mixture(source)
        for path, _ in parts:
            if not is_prepared_dataset(path):
                PreparedDataset(path)  # raises the one-line error of a missing or unprepared directory
        total = sum(w for _, w in parts)
        return Resolved("mixture", prepared, tuple(p for p, _ in parts), tuple(w / total for _, w in parts))
    if source in ("stdlib", "synthetic"):
        kind = source
    elif Path(source).is_dir():
        PreparedDataset(source)  # a directory must be a prepared dataset: its one-line error otherwise
        return Resolved("prepared", prepared, (source,), (1.0,))
    else:
        kind = "file"
    resolved = "windows" if config.packing == "auto" else config.packing
    if resolved == "documents" and kind != "stdlib":
        raise SpmdkitError(
            f"--packing documents needs document boundaries, which {kind} data has not: prepare the text with "
            "`spmdkit data prepare` and pass --data DIR, or use --packing windows"
        )
    return Resolved(kind, resolved)


def source_tokenizer(config: DataConfig) -> Tokenizer | None:
    """The tokenizer of `config.source` (see the module docstring); None when the source has none."""
    resolved = resolve_source(config)
    if resolved.kind == "stdlib":
        return byte_tokenizer()
    if resolved.kind in ("synthetic", "file"):
        return None
    return shared_tokenizer([PreparedDataset(p) for p in resolved.paths])


def shared_tokenizer(datasets: list[PreparedDataset]) -> Tokenizer:
    """The one tokenizer of `datasets`; a mixture of datasets with different tokenizers is refused."""
    first = datasets[0]
    for other in datasets[1:]:
        if other.meta["tokenizer"]["sha256"] != first.meta["tokenizer"]["sha256"]:
            raise SpmdkitError(
                f"the mixture's datasets {first.path} and {other.path} were prepared with different tokenizers "
                f"({first.meta['tokenizer']['name']} vs {other.meta['tokenizer']['name']}): prepare them with the "
                "same --tokenizer"
            )
    return first.tokenizer


def check_vocab(tokenizer: Tokenizer, vocab_size: int, source: str) -> None:
    """A model vocab smaller than the tokenizer's is an error naming the flag that sets it."""
    if vocab_size < tokenizer.vocab_size:
        raise SpmdkitError(
            f"the model's vocab_size {vocab_size:,} is smaller than the {tokenizer.vocab_size:,} ids of the "
            f"tokenizer of {source} ({tokenizer.name}): set {VOCAB_FLAG} {tokenizer.model_vocab_size}"
        )
