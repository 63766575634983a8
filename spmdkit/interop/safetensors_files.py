"""The tensors of a Hugging Face checkpoint, read lazily with `safetensors` (`safe_open` + `get_slice`).

A checkpoint is a directory (`model.safetensors.index.json` and its `model-0000X-of-0000N.safetensors` shards, or
one `model.safetensors`, or any `*.safetensors` files), one `.safetensors` file, or an index JSON. Opening one
reads the file headers only (names, shapes, dtypes); `read` returns the slice asked for, so a device's share of a
parameter is all that is read, and unmaps the file again (its pages leave the process's memory). Every slice read
is checked for NaN and Inf as it is read (every way into a model from these files reads through it), so damaged
weights are refused by name without a second pass or copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from spmdkit.errors import SpmdkitError
from spmdkit.interop.hf_config import read_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def checkpoint_files(path: str | Path) -> tuple[Path, list[Path], dict[str, str] | None]:
    """(the model directory, its safetensors files, the index's name -> file map or None) of `path`."""
    path = Path(path).expanduser().absolute()
    if path.is_dir():
        if (path / INDEX).is_file():
            path = path / INDEX
        elif (path / SINGLE).is_file():
            return path, [path / SINGLE], None
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise SpmdkitError(
                    f"{path} holds no .safetensors files (nor {INDEX}): pass a Hugging Face model directory saved "
                    "with safetensors (save_pretrained's default)"
                )
            return path, files, None
    if not path.is_file():
        raise SpmdkitError(f"{path} does not exist: pass a model directory, a .safetensors file or an index JSON")
    if path.suffix == ".safetensors":
        return path.parent, [path], None
    if path.suffix != ".json":
        raise SpmdkitError(f"{path} is neither a .safetensors file nor an index JSON nor a model directory")
    index = read_json(path, "a sharded checkpoint's index maps tensor names to shard files")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SpmdkitError(f"{path} has no 'weight_map' of tensor name -> shard file: is it a safetensors index?")
    home = path.parent.resolve()
    outside = sorted({name for name in weight_map.values() if not (home / name).resolve().is_relative_to(home)})
    if outside:
        raise SpmdkitError(
            f"{path} maps tensors to {outside[0]!r}, outside the model directory {path.parent}: refused (an index "
            "names shard files inside its directory)"
        )
    files = sorted({path.parent / name for name in weight_map.values()})
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise SpmdkitError(
            f"missing shard {missing[0]} (listed in {path.name}; {len(missing)} of {len(files)} missing): download "
            "the complete checkpoint"
        )
    return path.parent, files, weight_map


class TensorFiles:
    """Every tensor of a checkpoint: `shapes`, `dtypes` (numpy names), where each lives, and `read` of a slice."""

    def __init__(self, path: str | Path):
        self.directory, self.files, weight_map = checkpoint_files(path)
        self.location: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in self.files:
            for name, shape, dtype in self._header(file):
                if name in self.location:
                    raise SpmdkitError(f"tensor {name} is in both {self.location[name].name} and {file.name}")
                self.location[name], self.shapes[name], self.dtypes[name] = file, shape, dtype
        for name, file in (weight_map or {}).items():
            if self.location.get(name) != self.directory / file:
                raise SpmdkitError(f"the index lists {name} in {file}, but that shard does not hold it")

    @staticmethod
    def _header(file: Path) -> list[tuple[str, tuple[int, ...], str]]:
        try:
            with safe_open(str(file), framework="np") as handle:
                out = []
                for name in handle.keys():
                    view = handle.get_slice(name)
                    dtype = view.get_dtype()
                    if dtype not in DTYPES:
                        raise SpmdkitError(f"tensor {name} in {file} is {dtype}: spmdkit reads F32, BF16 and F16")
                    out.append((name, tuple(view.get_shape()), DTYPES[dtype]))
                return out
        except SafetensorError as error:
            raise SpmdkitError(f"{file} is not a readable safetensors file ({error}): download it again") from None
        except OSError as error:
            raise SpmdkitError(f"cannot read {file}: {error.strerror or error}") from None

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The slice `index` of tensor `name`, in its stored dtype; SpmdkitError (one line naming the tensor and
        its file) when it holds a NaN or an infinity, so that no such weight reaches a model. The file is opened
        for this read alone, so the pages it maps leave the process's memory as soon as the slice is copied out."""
        file = self.location[name]
        try:
            with safe_open(str(file), framework="np") as handle:
                value = np.asarray(handle.get_slice(name)[index])  # a copy: it outlives the mapping
        except SafetensorError as error:
            raise SpmdkitError(f"cannot read {name} from {file} ({error}): download it again") from None
        if not np.isfinite(value).all():
            raise SpmdkitError(
                f"{name} in {file} holds NaN or Inf values: the weights are damaged (download them again, or "
                "re-save them from a model whose weights are finite)"
            )
        return value
