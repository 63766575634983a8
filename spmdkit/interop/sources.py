"""What a model path is (a Hugging Face model or an spmdkit checkpoint) and the model shape it holds
(`source_model`: what `spmdkit.models.resolve.build_model` reads a path with).

Pure Python on import: reading an spmdkit checkpoint's saved config imports the checkpoint layer (Orbax) only when
such a path is given.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO, Literal

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
        hf, model = read_hf_config(hf_config_path(path))
        return model.replace(mtp_depth=_mtp_layers(path, hf, model))
    return build_model(saved_run_config(path, step)[2].get("model") or {}, source_model)


def _mtp_layers(path: str | Path, hf: dict[str, Any], model: TransformerConfig) -> int:
    """How many of the multi-token-prediction layers the config counts (DeepSeek-V3's `num_nextn_predict_layers`)
    the files hold, `model.layers.{layers + k}` for k = 0, 1, ...: transformers writes the key (default 1) whatever
    the model carries. 0 for a config without weights beside it."""
    from spmdkit.interop.families import FAMILIES
    from spmdkit.interop.safetensors_files import TensorFiles

    key = FAMILIES[family_of(hf, str(path))].mtp_key
    if not key or not hf.get(key):
        return 0
    try:
        names = TensorFiles(path).shapes
    except SpmdkitError:
        return 0
    present = 0
    while present < hf[key] and any(n.startswith(f"model.layers.{model.layers + present}.") for n in names):
        present += 1
    return present


SAMPLE = 1 << 12  # bytes hashed at each sampled place of a tensor (or file)
SAMPLES = 16  # places sampled per tensor (or file): its first and last bytes and evenly strided ones between


def weights_checksum(path: str | Path) -> str:
    """A BLAKE2b digest that identifies the weights of a model path: what a LoRA run records of the frozen base it
    trains on, and checks again on resume, evaluation and export.

    It reads a bounded number of bytes, not the weights (reading all of them took about 1 s per GB: over two
    minutes for a 70B model, on every resume): for each safetensors file of a Hugging Face source, its name, size
    and whole header (every tensor's name, dtype, shape and data offsets), and of each tensor `SAMPLES` pieces of
    `SAMPLE` bytes (its first and last bytes and evenly strided ones between; a tensor of up to SAMPLES x SAMPLE
    bytes, norms and biases, whole); for an spmdkit checkpoint or run directory, each file's name and size and the
    same samples of its bytes. So another checkpoint, another revision, a fine-tuned or re-quantized copy (where
    every tensor differs nearly everywhere), a changed tensor, dtype or shape, or a truncated or edited file end
    change the digest; an edit confined to bytes between the samples of a large tensor does not (the trade-off for
    at most 64 KiB read per tensor: a 70B model's ~720 tensors are ~46 MB in ~12,000 reads, against 140 GB read in
    full). A 0.94 GB file: 1.12 s before, 3 ms now (page cache warm)."""
    path = Path(path).expanduser().absolute()
    root = path if path.is_dir() else path.parent
    if source_kind(path) == "hf":
        files = [path] if path.suffix == ".safetensors" else sorted(root.glob("*.safetensors"))
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root)}\0{size}\0".encode())
        with file.open("rb") as f:
            header, tensors = _safetensors_layout(f, size) if file.suffix == ".safetensors" else (0, [(0, size)])
            f.seek(0)
            digest.update(f.read(header))
            for start, stop in tensors:
                for at in _samples(start, stop):
                    f.seek(at)
                    digest.update(f.read(min(SAMPLE, stop - at)))
    return digest.hexdigest()


def _safetensors_layout(f: BinaryIO, size: int) -> tuple[int, list[tuple[int, int]]]:
    """(the header's length in bytes, [start, stop) of each tensor's bytes in the file, by the header's data
    offsets); (0, the whole file) when it is not a readable safetensors file: it is sampled as bytes then."""
    head = f.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else size
    try:
        if length > size - 8:
            raise ValueError("not a safetensors header")
        header = json.loads(f.read(length))
        offsets = [t["data_offsets"] for name, t in header.items() if name != "__metadata__"]
        return 8 + length, sorted((8 + length + int(a), 8 + length + int(b)) for a, b in offsets)
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0, [(0, size)]


def _samples(start: int, stop: int) -> list[int]:
    """Where the `SAMPLE`-byte pieces of [start, stop) begin: every piece of a short range, else `SAMPLES` pieces
    from its first bytes to its last, evenly strided."""
    if stop - start <= SAMPLES * SAMPLE:
        return list(range(start, stop, SAMPLE))
    last = stop - SAMPLE
    return [start + (last - start) * i // (SAMPLES - 1) for i in range(SAMPLES)]
