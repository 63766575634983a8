"""What a model path is (a Hugging Face model or an spmdkit checkpoint) and the model shape it holds
(`source_model`: what `spmdkit.models.resolve.build_model` reads a path with).

Pure Python on import: reading an spmdkit checkpoint's saved config imports the checkpoint layer (Orbax) only when
such a path is given.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from spmdkit.errors import SpmdkitError
from spmdkit.interop.hf_config import family_of, read_hf_config, read_json
from spmdkit.interop.hf_files import CONFIG, is_hf_directory
from spmdkit.models.config import TransformerConfig
from spmdkit.models.resolve import OVERRIDES, build_model

__all__ = [
    "OVERRIDES", "hf_config_path", "hf_family", "saved_run_config", "source_kind", "source_model", "weights_checksum",
]  # fmt: skip


def source_kind(path: str | Path) -> Literal["hf", "spmdkit"]:
    """ "hf" for a model directory, `.safetensors` file, index or config JSON; "spmdkit" for a checkpoint or run
    directory. SpmdkitError when `path` is neither."""
    path = Path(path).expanduser()
    if not path.exists():
        raise SpmdkitError(f"{path} does not exist: pass a Hugging Face model directory or an spmdkit checkpoint")
    if path.is_file():
        if path.suffix in (".safetensors", ".json"):
            return "hf"
        raise SpmdkitError(f"{path} is not a .safetensors file, an index or config JSON, or a model directory")
    if is_hf_directory(path):
        return "hf"
    if (path / "checkpoints").is_dir() or any(p.name.isdigit() for p in path.iterdir() if p.is_dir()):
        return "spmdkit"
    if (path / CONFIG).is_file():
        return "hf"  # reading its config.json says what is wrong with it
    if any(path.glob("*.safetensors")):
        raise SpmdkitError(f"{path} holds safetensors files but no {CONFIG}: a Hugging Face model needs its config")
    raise SpmdkitError(f"{path} is neither a Hugging Face model directory nor an spmdkit checkpoint or run directory")


def hf_config_path(path: str | Path) -> Path:
    """The config.json of a Hugging Face source: in a directory, beside a file, or the JSON file itself."""
    path = Path(path).expanduser().absolute()
    if path.is_dir():
        return path / CONFIG
    if path.suffix == ".json" and "weight_map" not in read_json(path, "a config or index JSON"):
        return path
    return path.parent / CONFIG


def hf_family(path: str | Path) -> str:
    """The family (`model_type`) of a Hugging Face source: it names the tensors (`spmdkit.interop.tensor_names`)."""
    config = hf_config_path(path)
    return family_of(read_json(config, "a Hugging Face model directory holds its config.json"), str(config))


def saved_run_config(path: str | Path, step: int | None = None) -> tuple[Path, int, dict[str, Any]]:
    """(the checkpoint directory, the step: `step` or the newest, the run config saved with it) of an spmdkit
    checkpoint or run directory."""
    from spmdkit.checkpoint.steps import open_step, saved_config

    checkpointer, step = open_step(path, step)
    try:
        return checkpointer.directory, step, saved_config(checkpointer, step)
    finally:
        checkpointer.close()


def source_model(path: str | Path, step: int | None = None) -> TransformerConfig:
    """The model (shape and function) a Hugging Face source or an spmdkit checkpoint (its `step`, default the
    newest) holds."""
    if source_kind(path) == "hf":
        return read_hf_config(hf_config_path(path))[1]
    return build_model(saved_run_config(path, step)[2].get("model") or {}, source_model)


def weights_checksum(path: str | Path) -> str:
    """A BLAKE2b digest of the weight files of a model path, their names and bytes: a Hugging Face source's
    `*.safetensors` (beside its config or index), or every file of an spmdkit checkpoint or run directory. What a
    LoRA run records of the frozen base it trains on (it reads every byte once: about 1 s per GB)."""
    path = Path(path).expanduser().absolute()
    if source_kind(path) == "hf":
        folder = path if path.is_dir() else path.parent
        files = [path] if path.suffix == ".safetensors" else sorted(folder.glob("*.safetensors"))
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        digest.update(str(file.relative_to(path if path.is_dir() else path.parent)).encode() + b"\0")
        with file.open("rb") as f:
            digest.update(hashlib.file_digest(f, "blake2b").digest())
    return digest.hexdigest()
