"""A complete Hugging Face model directory from spmdkit parameters: what `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` load.

The directory gets `config.json` (`hf_config`), `generation_config.json`, the tokenizer files, and the weights in
shards of at most `max_shard_size` bytes (`model.safetensors`, or `model-0000X-of-0000N.safetensors` and
`model.safetensors.index.json`), in the parameters' dtype unless `dtype` says otherwise. It is written into a
directory beside the target (`.NAME.exporting`) and renamed at the end: an interrupted export leaves nothing
half-written (the next export to NAME removes what a killed one left), and with `force` only an earlier export
(its `.spmdkit-export` marker) is replaced, after the new one is complete. Parameters are converted one at a time,
so the host holds one parameter and one shard at most (a parameter split over processes is gathered first: every
process calls).
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from spmdkit.errors import SpmdkitError, SpmdkitWarning
from spmdkit.interop.families import FAMILIES
from spmdkit.interop.hf_config_writer import generation_config, hf_config
from spmdkit.interop.hf_files import CONFIG, GENERATION_CONFIG, TOKENIZER_FILES, special_token_ids
from spmdkit.interop.safetensors_files import INDEX, SINGLE
from spmdkit.interop.tensor_names import TensorMap, tensor_maps
from spmdkit.models.config import TransformerConfig

NUMPY_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
MARKER = ".spmdkit-export"  # in every directory `save_hf` writes (JSON: the writer, the run and step exported)
EXPORTED = frozenset({CONFIG, GENERATION_CONFIG, INDEX, SINGLE, MARKER, *TOKENIZER_FILES})
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: str | int) -> int:
    """Bytes of "5GB", "500MB", "2GiB" or an integer (transformers' units: GB = 10^9, GiB = 2^30)."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise SpmdkitError(f"max shard size {size!r} is not a size: write e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _host(value: Any) -> np.ndarray:
    """A parameter on the host, gathered from every process when it is split across them."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def _plan_shards(maps: list[TensorMap], itemsize: int, limit: int) -> list[list[str]]:
    """Tensor names per shard, in parameter order, each shard at most `limit` bytes (a bigger tensor alone); a
    shared tensor (Phi-3, GPT-OSS) is counted once, where its first part comes."""
    shards: list[list[str]] = [[]]
    size, seen = 0, set()
    for m in maps:
        nbytes = int(np.prod(m.file_shape)) * itemsize
        for name in m.hf_names():
            if name in seen:
                continue
            seen.add(name)
            if shards[-1] and size + nbytes > limit:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
    return shards


def _parts(m: TensorMap, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(Hugging Face name, this parameter's part of it) for every layer and expert of `value`."""
    if m.copy_of:  # the same (unstacked) parameter once per layer: the MTP layers' embedding and head
        return [(m.hf_name(i), m.to_hf(value)) for i in range(len(m.layers))]
    layers = [(i, value[i]) for i in range(len(m.layers))] if m.stacked else [(None, value)]
    if not m.experts:
        return [(m.hf_name(i), m.to_hf(v)) for i, v in layers]
    return [(m.hf_name(i, e), m.to_hf(v[e])) for i, v in layers for e in range(m.experts)]


def write_weights(
    directory: Path, model: TransformerConfig, family: str, params: Any, dtype: str, max_shard_size: int
) -> int:
    """The safetensors shards (and index) of `params` (a pure dict) in `family`'s names in `directory`; returns the
    bytes written."""
    from safetensors.numpy import save_file

    maps = tensor_maps(model, family)
    target = NUMPY_DTYPES[dtype]
    shards = _plan_shards(maps, target.itemsize, max_shard_size)
    files = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in
                                               range(len(shards))]  # fmt: skip
    where = {name: file for file, names in zip(files, shards, strict=True) for name in names}
    pending: dict[str, dict[str, np.ndarray]] = {file: {} for file in files}
    remaining = collections.Counter(where[name] for m in maps for name in m.hf_names())  # parts still to come
    total = 0
    for m in maps:
        for name, part in _parts(m, _host(m.value_in(params))):  # every process gathers; process 0 writes
            file, part = where[name], part.astype(target)
            if m.shared:  # rows (Phi-3) or columns (GPT-OSS) of a tensor shared with other parameters
                m.put(pending[file].setdefault(name, np.empty(m.file_shape, target)), part)
            else:
                pending[file][name] = part
            total += part.nbytes
            remaining[file] -= 1
            if not remaining[file]:  # the shard is complete: write it and let its tensors go
                if jax.process_index() == 0:
                    save_file(pending[file], str(directory / file), metadata={"format": "pt"})
                pending[file] = {}
    if len(files) > 1 and jax.process_index() == 0:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(where.items()))}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return total


def save_hf(
    model: Any,
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    *,
    params: Any = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    max_positions: int | None = None,
    tokens: dict[str, int | None] | None = None,
    base_config: dict[str, Any] | None = None,
    base_generation: dict[str, Any] | None = None,
    force: bool = False,
    origin: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (a `Transformer`, or a `TransformerConfig` with `params`, a pure dict of its parameters) as a
    Hugging Face model directory `out_dir`; returns it.

    `tokenizer`: a directory whose tokenizer files are copied (and whose special tokens give bos/eos/pad ids
    unless `tokens` names them). `max_positions`: `max_position_embeddings` (default: the model's; required when
    the model has none). `base_config` / `base_generation`: the configs the model was imported with (kept when the
    model still computes what they say). `dtype`: stored dtype (default: the parameters'). `force`: replace an
    earlier `save_hf` directory (`check_target`); `origin`: what its `MARKER` records besides the writer."""
    from flax import nnx

    if params is None:
        config, params = model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param))
    else:
        config = model
    out = Path(out_dir).expanduser().absolute()
    _settle(out)
    check_target(out, force)
    dtype, positions = _stored_as(config, params, dtype, max_positions)
    limit = parse_size(max_shard_size)
    tokenizer = Path(tokenizer).expanduser() if tokenizer is not None else None
    ids = {**special_token_ids(tokenizer), **(tokens or {})}
    hf = hf_config(
        config.replace(param_dtype=dtype), dtype=dtype, max_positions=positions, tokens=ids, base=base_config
    )
    _warn_unexported_mtp(config, hf["model_type"])
    staging = _staging(out)
    try:
        write_weights(staging, config, hf["model_type"], params, dtype, limit)
        if jax.process_index() != 0:
            return out
        files = {CONFIG: hf, GENERATION_CONFIG: generation_config(ids, base_generation)}
        for name, value in {**files, MARKER: {"written_by": "spmdkit", **(origin or {})}}.items():
            (staging / name).write_text(json.dumps(value, indent=2) + "\n")
        for name in TOKENIZER_FILES if tokenizer is not None else ():
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, staging / name)
        _replace(staging, out)
    finally:
        if jax.process_index() == 0:
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _stored_as(config: TransformerConfig, params: Any, dtype: str | None, max_positions: int | None) -> tuple[str, int]:
    """(the export's dtype: `dtype` or the parameters', its max_position_embeddings: `max_positions` or the
    model's), each refused in one line where it cannot be written."""
    dtype = dtype or str(np.dtype(jax.tree.leaves(params)[0].dtype))
    if dtype not in NUMPY_DTYPES:
        raise SpmdkitError(f"unknown export dtype {dtype!r}: choose one of {', '.join(NUMPY_DTYPES)}")
    positions = max_positions or config.max_positions
    if not positions:
        raise SpmdkitError("the model records no max_positions: pass max_positions= (the context it was trained for)")
    return dtype, positions


def _warn_unexported_mtp(config: TransformerConfig, model_type: str) -> None:
    """One warning where the family stores no multi-token-prediction layers and the model has some."""
    if config.mtp_depth and not FAMILIES[model_type].mtp_key:
        message = (
            f"{model_type} stores no multi-token-prediction layers: the model's {config.mtp_depth} MTP module(s) are "
            "not exported (they trained the main model, which is)"
        )
        warnings.warn(SpmdkitWarning(message), stacklevel=3)


def _beside(out: Path, what: str) -> Path:
    """`.NAME.exporting`: where an export of `out` is written (renamed to `out` when complete); `.NAME.replaced`:
    where an earlier export waits while the new one is renamed into place."""
    return out.with_name(f".{out.name}.{what}")


def _staging(out: Path) -> Path:
    """A new `.NAME.exporting` beside `out` on process 0; `out` itself on the others (they write no file)."""
    if jax.process_index() != 0:
        return out
    staging = _beside(out, "exporting")
    staging.mkdir(parents=True)
    return staging


def _settle(out: Path) -> None:
    """What an export of `out` killed before it finished left: its staging directory removed, an earlier export
    set aside put back (process 0)."""
    if jax.process_index() == 0:
        shutil.rmtree(_beside(out, "exporting"), ignore_errors=True)
        earlier = _beside(out, "replaced")
        if earlier.is_dir():
            if out.exists():
                shutil.rmtree(earlier)
            else:
                os.replace(earlier, out)


def check_target(out: Path, force: bool) -> None:
    """SpmdkitError unless `out` is new, empty, or (with `force`) an earlier export: a directory holding the
    `MARKER` this module writes and only the files of an export. A Hugging Face `save_pretrained` directory, a
    downloaded model or a user's files are never replaced."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not force:
        raise SpmdkitError(f"{out} already exists and is not empty: pass another --out, or --force to replace it")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    other = [n for n in names if n not in EXPORTED and not (n.startswith("model-") and n.endswith(".safetensors"))]
    if not out.is_dir() or other or MARKER not in names or CONFIG not in names:
        what = (
            "is a file" if not out.is_dir() else f"holds {other[0]}" if other
            else f"has no {MARKER} (a directory spmdkit did not write, e.g. a save_pretrained model)"
        )  # fmt: skip
        raise SpmdkitError(
            f"--force replaces only an earlier export, but {out} {what}: it is not one; pass a new --out"
        )


def _replace(staging: Path, out: Path) -> None:
    """Move the finished `staging` directory to `out`; an existing `out` (with --force) is removed only after."""
    if not out.exists():
        os.replace(staging, out)
        return
    old = _beside(out, "replaced")
    os.replace(out, old)
    os.replace(staging, out)
    shutil.rmtree(old)
