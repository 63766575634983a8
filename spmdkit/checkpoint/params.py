"""The model of a checkpoint step: its parameters read onto any layout, and a parameters-only step written.

Every reader of "the model of step N" (`--init-from`, generation, evaluation, `ckpt export`, `spmdkit.load_model`)
calls `read_params`: the caller passes the parameters it wants as a pure dict of `jax.ShapeDtypeStruct`s (shape,
dtype, sharding: any mesh, any device count). Only the step's `state/model` parameters are read (never the optimizer
state, nor an FP8 run's scales: `spmdkit.models.fp8.is_fp8_state`). A name or shape that differs from the target is
one line naming it; an array that does not read back as saved (checksum, NaN/Inf: `spmdkit.checkpoint.integrity`)
makes the step a `DamagedStep`.

How, and why not Orbax's own restore: Orbax stores each array in TensorStore (zarr over OCDBT) and its restore
stages every array on the host before handing it to the device, which held a 1B model 1.5 times. Here each
device's block (`jax.make_array_from_callback`) is read from the same TensorStore one stored chunk at a time into a
64-byte-aligned buffer that a CPU device adopts without a copy, cast to the target dtype as it is copied in, and
summed for the checksum in the dtype it was saved in while it is at hand: the parameters are held once, plus one
chunk (`scripts/bench_hf_import.py --load` measures it).

`write_params` is the other direction, for `ckpt import-hf`: step 0 with the parameters and the run config, written
by Orbax synchronously, one block's worth of bytes in flight at a time.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from spmdkit.checkpoint.backend import open_manager
from spmdkit.checkpoint.damage import DamagedStep, NonFiniteState
from spmdkit.checkpoint.failures import describe_error
from spmdkit.checkpoint.integrity import (
    block_sums,
    checksum_record,
    fingerprint,
    fingerprints,
    name_list,
    path_text,
    sum_over_processes,
)
from spmdkit.checkpoint.steps import open_step, saved_config
from spmdkit.errors import SpmdkitError
from spmdkit.models.fp8 import is_fp8_state
from spmdkit.models.lora_config import is_adapter

PureTree = dict[str, Any]

ALIGN = 64  # XLA's CPU client takes a buffer aligned to 64 bytes as it is (zero-copy); numpy's are 16-aligned
WRITE_CHUNK_BYTES = 2**24  # import-hf writes 16 MiB chunks: a reader holds one chunk beside the arrays


def _flat(tree: Any) -> dict[str, Any]:
    """'blocks/attention/q' -> leaf, in the tree's leaf order."""
    return {path_text(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _check_names(step: int, directory: Path, saved: dict[str, tuple], target: PureTree) -> None:
    """SpmdkitError naming the first parameter whose name or shape differs between the step and `target`."""
    wanted = {f"model/{name}": tuple(leaf.shape) for name, leaf in _flat(target).items()}
    found = {name: shape for name, (shape, _) in saved.items() if _is_param(name)}
    if any(is_adapter(name) for name in found) and not any(is_adapter(name) for name in wanted):
        raise SpmdkitError(
            f"step {step} of {directory} holds LoRA adapters without their base: read it with spmdkit.load_model "
            f"(the base from the run's --init-from), or merge it with 'spmdkit ckpt export {directory} --out DIR'"
        )
    for name in sorted(wanted.keys() | found.keys()):
        if found.get(name) != wanted.get(name):
            there = "missing" if name not in found else f"{list(found[name])}"
            here = "missing" if name not in wanted else f"{list(wanted[name])}"
            raise SpmdkitError(
                f"step {step} of {directory} does not hold this model's parameters: {name} is {there} there but "
                f"{here} here: use the model settings it was saved with (see 'spmdkit ckpt inspect {directory}')"
            )


def _is_param(name: str) -> bool:
    """A saved array of the model that is a parameter: not the optimizer's, not an FP8 run's scales."""
    return name.startswith("model/") and not is_fp8_state(name)


def host_target(saved: dict[str, tuple]) -> PureTree:
    """The saved parameters as ShapeDtypeStructs whole on the host CPU, in their saved dtypes (`read_params`'
    target for a tool that writes them out as numpy)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target: PureTree = {}
    for name, (shape, dtype) in saved.items():
        if _is_param(name):
            *outer, leaf = name.split("/")[1:]  # below "model"
            node = functools.reduce(lambda tree, key: tree.setdefault(key, {}), outer, target)
            node[leaf] = jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding)
    return target


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary: a CPU device adopts it without a copy, so a
    parameter read on the host is not held twice (on an accelerator it is copied over and then freed)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _open(state_dir: Path, name: str, zarr3: bool) -> ts.TensorStore:
    """The saved array `name` ('model/blocks/mlp/up') of an Orbax OCDBT `state` item, opened for reading with no
    cache (each chunk is read once)."""
    spec = {
        "driver": "zarr3" if zarr3 else "zarr",
        "kvstore": {"driver": "ocdbt", "base": f"file://{state_dir}", "path": name.replace("/", ".")},
        "context": {"cache_pool": {"total_bytes_limit": 0}},
    }
    return ts.open(spec, read=True, open=True).result()


def _cells(key: tuple[tuple[int, int], ...], chunk: tuple[int, ...]) -> Iterator[tuple[slice, ...]]:
    """The pieces of the block `key` ((start, stop) per dimension) that each lie in one stored chunk."""
    cuts = [[start, *range((start // c + 1) * c, stop, c), stop] for (start, stop), c in zip(key, chunk, strict=True)]
    for cell in itertools.product(*(zip(at[:-1], at[1:], strict=True) for at in cuts)):  # [start, stop) cut at chunks
        yield tuple(slice(lo, hi) for lo, hi in cell)


def _read_block(store: ts.TensorStore, key: tuple[tuple[int, int], ...], dtype: np.dtype) -> tuple[np.ndarray, Any]:
    """(the block `key` of `store` in `dtype`, its partial checksum sums in the stored dtype), read one stored chunk
    at a time into a buffer a CPU device adopts."""
    out = aligned_empty(tuple(stop - start for start, stop in key), dtype)
    saved = np.dtype(store.dtype.numpy_dtype)
    sums = np.zeros(3, np.uint64)
    chunk = tuple(store.chunk_layout.read_chunk.shape or store.shape)
    for cell in _cells(key, chunk):
        place = out[tuple(slice(c.start - start, c.stop - start) for c, (start, _) in zip(cell, key, strict=True))]
        if saved == dtype:  # no copy: TensorStore decodes into the block itself
            ts.array(place, copy=False, write=True).write(store[cell]).result()
            piece = place
        else:  # the checksum is of the saved values: one chunk's worth held in the saved dtype
            piece = store[cell].read().result()
            place[...] = piece
        sums += np.array(block_sums(piece, tuple(c.start for c in cell), tuple(store.shape)), np.uint64)
    return out, sums


def _read_array(store: ts.TensorStore, wanted: jax.ShapeDtypeStruct) -> tuple[jax.Array, np.ndarray]:
    """(the array laid out as `wanted` says, this process's partial checksum sums): each device's block read on its
    own, a block shared by several devices read once, each element counted once (replica 0)."""
    blocks: dict[tuple[tuple[int, int], ...], tuple[np.ndarray, Any]] = {}

    def key_of(index: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
        return tuple(s.indices(n)[:2] for s, n in zip(index, wanted.shape, strict=True))

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = key_of(index)
        if key not in blocks:
            blocks[key] = _read_block(store, key, np.dtype(wanted.dtype))
        return blocks[key][0]

    array = jax.make_array_from_callback(wanted.shape, wanted.sharding, block)
    sums = [blocks[key_of(s.index)][1] for s in array.addressable_shards if s.replica_id == 0]
    return array, sum(sums, np.zeros(3, np.uint64))


def _read(step_dir: Path, target: PureTree) -> tuple[PureTree, dict[str, tuple[str, int]]]:
    """(the `state/model` arrays of a step as `target` lays them out, their fingerprints as saved)."""
    state_dir = (step_dir / "state").absolute()
    zarr3 = bool(json.loads((state_dir / "_METADATA").read_text()).get("use_zarr3"))
    names = _flat(target)  # in the tree's leaf order
    read = [_read_array(_open(state_dir, f"model/{name}", zarr3), wanted) for name, wanted in names.items()]
    summed = sum_over_processes([sums for _, sums in read])
    found = {f"model/{name}": fingerprint(*row) for name, row in zip(names, summed, strict=True)}
    return jax.tree.unflatten(jax.tree.structure(target), [array for array, _ in read]), found


def read_params(
    directory: str | Path, target: PureTree | None = None, step: int | None = None
) -> tuple[int, dict[str, Any], PureTree]:
    """(step, the run config saved with it, the model's parameters) of `step` (default: the newest) of a checkpoint
    or run directory.

    `target`: the parameters wanted, a pure dict of ShapeDtypeStructs with shardings (None: each array whole on
    the host CPU in its saved dtype). SpmdkitError when a name or shape differs; DamagedStep when an array does
    not read back as saved."""
    checkpointer, step = open_step(directory, step)
    try:
        config = saved_config(checkpointer, step)
        try:
            saved = checkpointer.saved_shapes(step)
        except Exception as error:  # noqa: BLE001 - unreadable metadata is damage
            raise DamagedStep(step, checkpointer.directory, f"unreadable metadata: {describe_error(error)}") from None
        target = host_target(saved) if target is None else target
        _check_names(step, checkpointer.directory, saved, target)
        try:
            params, found = _read(checkpointer.directory / str(step), target)
        except Exception as error:  # noqa: BLE001 - any failure to read a step means it is damaged
            raise DamagedStep(step, checkpointer.directory, describe_error(error)) from None
        checkpointer.check_read(step, found)  # what is used is what was saved
    finally:
        checkpointer.close()
    return step, config, params


def write_params(directory: Path, params: PureTree, config: dict[str, Any]) -> None:
    """Step 0 of a new checkpoint in `directory`: `{"model": params}` as the state item, with its checksums, and
    `config`; written synchronously in `WRITE_CHUNK_BYTES` pieces, at most the largest block's bytes in flight
    (Orbax's default would allow 96 GB of encoded blocks). NonFiniteState naming the arrays that hold NaN/Inf
    (nothing written)."""
    found = fingerprints({"model": params})
    bad = [f"{path} ({count})" for path, (_, count) in found.items() if count]
    if bad:
        raise NonFiniteState(f"NaN/Inf values in {name_list(bad, 3)}")
    largest = max(shard.data.nbytes for array in jax.tree.leaves(params) for shard in array.addressable_shards)
    in_flight = max(largest, WRITE_CHUNK_BYTES) * 1.01 / 1e9
    with open_manager(Path(directory), asynchronous=False, concurrent_gb=in_flight) as manager:
        chunks = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=WRITE_CHUNK_BYTES), {"model": params})
        items = {
            "state": ocp.args.StandardSave({"model": params}, save_args=chunks),
            "config": ocp.args.JsonSave(config),
        }
        manager.save(
            0,
            args=ocp.args.Composite(**items),
            force=True,
            custom_metadata={"checksums": checksum_record(found, config=config)},
        )
