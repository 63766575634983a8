"""Parameters from a Hugging Face checkpoint or an spmdkit checkpoint, placed straight into their shards.

Every parameter is built with `jax.make_array_from_callback`: each device's block is read on its own (a safetensors
`get_slice` of the rows and columns it holds, or Orbax reading that shard), so no process reads more than it holds
and no device ever holds a full copy. A file is mapped only while a piece of at most 64 MiB is copied out of it,
and a host block starts on a 64-byte boundary, which a CPU device adopts without copying: loading holds the
weights about once (`scripts/bench_hf_import.py` measures it).

Strict: every tensor in the files must be a parameter of the model (the leftovers are named otherwise), every
parameter must be there with the shape the config implies; a tied model may carry `lm_head.weight` only as an
exact copy of the embedding.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from spmdkit.checkpoint.params import aligned_empty
from spmdkit.errors import SpmdkitError, SpmdkitWarning
from spmdkit.interop.families import FAMILIES
from spmdkit.interop.safetensors_files import TensorFiles
from spmdkit.interop.sources import hf_family, source_kind, source_model
from spmdkit.interop.tensor_names import Read, TensorMap, expected_tensors, tensor_maps
from spmdkit.models import Transformer, TransformerConfig
from spmdkit.sharding.partition import abstract_state, state_shardings
from spmdkit.sharding.rules import Rules, make_rules

PureTree = dict[str, Any]
EMBEDDING = "model.embed_tokens.weight"


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 3} more)" if len(names) > 3 else ""


def _without_mtp(spare: list[str], model: TransformerConfig, family: str, where: Any) -> list[str]:
    """`spare` less the multi-token-prediction layers a family stores after its last layer (DeepSeek-V3's
    `num_nextn_predict_layers`) beyond the `mtp_depth` modules the model runs: dropped with one warning."""
    if not FAMILIES[family].mtp_key:
        return spare
    first = model.layers + model.mtp_depth
    mtp = [name for name in spare if re.match(r"model\.layers\.(\d+)\.", name) and int(name.split(".")[2]) >= first]
    if mtp:
        warnings.warn(
            SpmdkitWarning(
                f"{where}: dropping {len(mtp)} tensors of the multi-token-prediction layers (model.layers.{first}.* "
                f"on, {FAMILIES[family].mtp_key}): this model runs {model.mtp_depth} MTP module(s) (mtp_depth)"
            ),
            stacklevel=3,
        )
    return [name for name in spare if name not in mtp]


def _copies(model: TransformerConfig, family: str) -> dict[str, str]:
    """Tensor name -> the tensor it copies (the MTP layers' embedding and head: optional in the files)."""
    return {name: m.copy_of for m in tensor_maps(model, family) if m.copy_of for name in m.hf_names()}


def _same(files: TensorFiles, name: str, original: str) -> bool:
    """Whether tensor `name` holds exactly `original`'s values (compared 4096 rows at a time)."""
    rows = files.shapes[original][0]
    for start in range(0, rows, 4096):
        index = (slice(start, min(start + 4096, rows)), slice(None))
        if not np.array_equal(files.read(name, index), files.read(original, index)):
            return False
    return True


def check_tensors(files: TensorFiles, model: TransformerConfig, family: str) -> None:
    """SpmdkitError (one line) unless the files hold exactly the model's tensors in `family`'s names, with the
    shapes it implies (the MTP layers' copies of the embedding and head may be left out, and must be exact)."""
    where, found, expected = files.directory, files.shapes, expected_tensors(model, family)
    copies = _copies(model, family)
    missing = [name for name in expected if name not in found and name not in copies]
    if missing:
        raise SpmdkitError(
            f"{where} lacks {', '.join(missing[:3])}{_more(missing)}: its config.json does not describe these weights"
        )
    spare = [name for name in found if name not in expected and not (model.tie_embeddings and name == "lm_head.weight")]
    spare = _without_mtp(spare, model, family, where)
    if spare:
        raise SpmdkitError(
            f"{where} holds tensors this model does not use: {', '.join(spare[:3])}{_more(spare)}: refusing to drop "
            "them (is a config key missing or wrong, e.g. attention_bias, mlp_bias, tie_word_embeddings?)"
        )
    for name, shape in expected.items():
        if name in found and found[name] != shape:
            raise SpmdkitError(
                f"{name} in {where} has shape {list(found[name])}, but config.json implies {list(shape)}"
            )
    if model.tie_embeddings and "lm_head.weight" in found and not _same(files, "lm_head.weight", EMBEDDING):
        raise SpmdkitError(
            f"{where}: tie_word_embeddings is true but lm_head.weight differs from {EMBEDDING}: set "
            "tie_word_embeddings to false in config.json"
        )
    for name, original in copies.items():
        if name in found and not _same(files, name, original):
            raise SpmdkitError(
                f"{where}: {name} differs from {original}: spmdkit's multi-token-prediction modules share the "
                "model's embedding and head, so their copies must be exact (or left out of the files)"
            )


def stored_dtype(files: TensorFiles) -> str:
    """The dtype the tensors are stored in (the widest when they differ)."""
    kinds = set(files.dtypes.values())
    return kinds.pop() if len(kinds) == 1 else "float32"


CHUNK_BYTES = 64 * 2**20  # the most of a file read (and mapped) at once


def _fill(out: np.ndarray, m: TensorMap, read: Read, index: tuple[slice, ...], entry: int | None) -> None:
    """Fill `out` with the block `index` of one layer of `m`, in pieces of at most CHUNK_BYTES of the file's rows,
    so that neither the mapped file pages nor the transposed copy of a piece grow with the parameter."""
    dim = m.row_dim
    start, stop = index[dim].start, index[dim].stop
    row_bytes = max(1, out.nbytes // max(1, stop - start))
    step = max(1, CHUNK_BYTES // row_bytes)
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        piece = index[:dim] + (slice(lo, hi),) + index[dim + 1 :]
        out[(slice(None),) * dim + (slice(lo - start, hi - start),)] = m.read(read, piece, entry)


def _reader(files: TensorFiles, m: TensorMap, shape: tuple[int, ...], dtype: str) -> Callable[..., np.ndarray]:
    """index (slices over `shape`) -> that block of the parameter, read from the files (each block once)."""
    blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
    target = jax.numpy.dtype(dtype)

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        if key not in blocks:
            value = aligned_empty(tuple(stop - start for start, stop in key), target)
            within = tuple(slice(*k) for k in (key[1:] if m.stacked else key))
            if m.stacked:  # layer by layer: one layer's piece in flight at a time
                for i, entry in enumerate(range(*key[0])):
                    _fill(value[i], m, files.read, within, entry)
            else:
                _fill(value, m, files.read, within, None)
            blocks[key] = value
        return blocks[key]

    return block


def hf_params(files: TensorFiles, model: TransformerConfig, family: str, shardings: Any, dtype: str) -> PureTree:
    """The model's parameters (a pure dict) from Hugging Face files in `family`'s layout, in `dtype`: global arrays
    laid out as `shardings` (a matching pure dict of shardings) says, each device's block read on its own; or,
    with `shardings=None`, host numpy arrays (what one process writing a checkpoint needs: no device copy)."""
    check_tensors(files, model, family)
    params: PureTree = {}
    for m in tensor_maps(model, family):
        if m.copy_of:  # the MTP layers' copies of the embedding and head: checked equal, read once
            continue
        shape = (len(m.layers), *m.shape) if m.stacked else m.shape
        read = _reader(files, m, shape, dtype)
        if shardings is None:
            value = read(tuple(slice(None) for _ in shape))
        else:
            value = jax.make_array_from_callback(shape, m.value_in(shardings), read)
        tree = params
        for key in m.path[:-1]:
            tree = tree.setdefault(key, {})
        tree[m.path[-1]] = value
    return params


def checkpoint_params(
    path: str | Path, model: TransformerConfig, shardings: Any, dtype: str, step: int | None = None
) -> PureTree:
    """The model's parameters from `step` (default: the newest) of an spmdkit checkpoint, in `dtype`, laid out
    by `shardings` (`spmdkit.checkpoint.params.read_params`: the optimizer state is not read). A LoRA run's step
    holds adapters only: its base is read from the run's recorded path and the adapters merged in
    (`spmdkit.interop.adapters.lora_run_params`)."""
    from spmdkit.checkpoint.params import read_params
    from spmdkit.interop.adapters import lora_run_params
    from spmdkit.interop.sources import saved_run_config

    _, at, saved = saved_run_config(path, step)
    if (saved.get("lora") or {}).get("rank"):
        return lora_run_params(path, saved, model, shardings, dtype, at)

    abstract = nnx.to_pure_dict(_abstract(model)[1])
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, jax.numpy.dtype(dtype), sharding=s), abstract, shardings
    )
    return read_params(path, target, step)[2]


def _abstract(model: TransformerConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, the parameters as ShapeDtypeStructs) of `model`'s Transformer (nothing allocated)."""
    return abstract_state(lambda: Transformer(model, rngs=nnx.Rngs(0)))


def param_sharding_tree(model: TransformerConfig, mesh: jax.sharding.Mesh | None, rules: Rules | None) -> PureTree:
    """A pure dict of each parameter's sharding: by the rules' parameter table on `mesh`, or the first device."""
    abstract = _abstract(model)[1]
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: device, nnx.to_pure_dict(abstract))
    return nnx.to_pure_dict(state_shardings(abstract, mesh, (rules or make_rules()).params))


def check_source(path: str | Path, model: TransformerConfig) -> None:
    """SpmdkitError (one line) unless `load_params(path, model, ...)` can read every parameter: for a Hugging Face
    source, every shard present and every tensor there with its shape (only headers are read). An spmdkit source's
    model is its saved config's, checked when it was read."""
    if source_kind(path) == "hf":
        check_tensors(TensorFiles(path), model, hf_family(path))


def load_params(
    path: str | Path, model: TransformerConfig, shardings: Any, dtype: str | None = None, step: int | None = None
) -> PureTree:
    """The parameters of `model` from `path` (a Hugging Face source, or `step` of an spmdkit checkpoint/run
    directory: default the newest), in `dtype` (None: as stored), laid out by `shardings` (a pure dict matching
    the parameters)."""
    if source_kind(path) == "spmdkit":
        return checkpoint_params(path, model, shardings, dtype or model.param_dtype, step)
    if step is not None:
        raise SpmdkitError(f"{path} is a Hugging Face model: it has no checkpoint steps to choose from")
    files = TensorFiles(path)
    return hf_params(files, model, hf_family(path), shardings, dtype or stored_dtype(files))


def load_model(
    path: str | Path,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules | None = None,
    dtype: str = "float32",
    param_dtype: str | None = None,
    *,
    step: int | None = None,
    config: TransformerConfig | None = None,
) -> Transformer:
    """The `Transformer` stored at `path`: a Hugging Face model directory (or `.safetensors` / index JSON), an
    spmdkit checkpoint directory or a run directory (its newest step, or `step`).

    `dtype` is the compute dtype; `param_dtype` the parameters' (None: as stored). With a `mesh`, every parameter
    is laid out by `rules` (default: `make_rules()`, ZeRO-3) and each device reads only its block; without one, it
    all lands on the first device. `config` builds the module with another config of the same parameters (e.g.
    another attention kernel); its `dtype` and `param_dtype` are still set from the arguments.
    """
    stored = source_model(path, step)
    if param_dtype is None:
        param_dtype = stored_dtype(TensorFiles(path)) if source_kind(path) == "hf" else stored.param_dtype
    model = (config or stored).replace(dtype=dtype, param_dtype=param_dtype)
    params = load_params(path, model, param_sharding_tree(model, mesh, rules), param_dtype, step)
    graphdef, abstract = _abstract(model)
    nnx.replace_by_pure_dict(abstract, params)
    return nnx.merge(graphdef, abstract)
