"""The Hugging Face files that travel with a model: tokenizer, generation config and the imported `config.json`.

An spmdkit checkpoint directory keeps them in `hf/` (`ckpt import-hf` copies them there from the model directory,
`spmdkit train --init-from` from its source), so that export, training and generation find the tokenizer and the
token ids of the model they read. `find_tokenizer_dir` finds them for a checkpoint directory, a run directory or a
Hugging Face model directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

SIDECAR = "hf"  # inside a checkpoint directory
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja",
)  # fmt: skip
GENERATION_CONFIG = "generation_config.json"
CONFIG = "config.json"


def _json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def is_hf_directory(path: Path) -> bool:
    """A directory whose config.json is a Hugging Face model config (it names a `model_type`)."""
    return "model_type" in (_json(path / CONFIG) or {})


def sidecar_candidates(path: str | Path) -> list[Path]:
    """Where the Hugging Face files of `path` may be: a model directory itself, `CKPT/hf`, `RUN/checkpoints/hf`, or
    the `hf/` of the checkpoint directory a run directory's config names."""
    path = Path(path).expanduser().absolute()
    if path.is_file():
        path = path.parent
    candidates = [path, path / SIDECAR, path / "checkpoints" / SIDECAR]
    directory = ((_json(path / CONFIG) or {}).get("checkpoint") or {}).get("directory")
    if isinstance(directory, str):  # a run directory whose checkpoints live elsewhere (--checkpoint-dir)
        candidates.append(Path(directory).expanduser().absolute() / SIDECAR)
    return candidates


def find_hf_files(path: str | Path) -> Path | None:
    """The directory holding the Hugging Face files (config, tokenizer, generation config) of a model directory,
    checkpoint directory or run directory; None when there is none."""
    return next((c for c in sidecar_candidates(path) if is_hf_directory(c) or _has_tokenizer(c)), None)


def find_tokenizer_dir(path: str | Path) -> Path | None:
    """The directory holding the tokenizer files (`tokenizer.json`, ...) of a Hugging Face model directory, an
    spmdkit checkpoint directory or a run directory; None when the model came without a tokenizer."""
    return next((c for c in sidecar_candidates(path) if _has_tokenizer(c)), None)


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def staging_dir(out: Path) -> Path:
    """A fresh directory beside `out` (so the final rename stays on one file system), with the usual permissions."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def copy_hf_files(source: str | Path, destination: str | Path) -> list[str]:
    """Copy the tokenizer files, generation config and config.json of `source` into `destination`
    (created through a temporary directory and a rename; an existing `destination` is left as it is). Returns the
    names copied."""
    source, destination = Path(source), Path(destination)
    present = [name for name in (*TOKENIZER_FILES, GENERATION_CONFIG, CONFIG) if (source / name).is_file()]
    if not present or destination.exists():
        return []
    staging = staging_dir(destination)
    try:
        for name in present:
            shutil.copy2(source / name, staging / name)
        os.replace(staging, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return present


def _token_id(directory: Path, token: Any) -> int | None:
    """The id of a special token (a string or {"content": ...}) in the directory's tokenizer.json."""
    content = token.get("content") if isinstance(token, dict) else token
    tokenizer = _json(directory / "tokenizer.json") if isinstance(content, str) else None
    if tokenizer is None:
        return None
    for added in tokenizer.get("added_tokens") or []:
        if added.get("content") == content:
            return added.get("id")
    vocab = (tokenizer.get("model") or {}).get("vocab")
    return vocab.get(content) if isinstance(vocab, dict) else None


def special_token_ids(directory: str | Path | None) -> dict[str, int | None]:
    """`bos_token_id` / `eos_token_id` / `pad_token_id` the files of `directory` name: the generation config's, else
    the config's (an explicit null counts), else the tokenizer's special tokens looked up in tokenizer.json. Keys
    not found are left out."""
    if directory is None:
        return {}
    directory = Path(directory)
    configs = [_json(directory / GENERATION_CONFIG) or {}, _json(directory / CONFIG) or {}]
    tokenizer_config = {
        **(_json(directory / "special_tokens_map.json") or {}),
        **(_json(directory / "tokenizer_config.json") or {}),
    }
    out: dict[str, int | None] = {}
    for kind in ("bos", "eos", "pad"):
        key = f"{kind}_token_id"
        decided = [config for config in configs if key in config]  # the model's own configs, an explicit null too
        found = decided[0][key] if decided else _token_id(directory, tokenizer_config.get(f"{kind}_token"))
        if decided or found is not None:
            out[key] = found
    return out
