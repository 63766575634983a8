"""What "intact" means for a checkpoint step, decided in one place for `ckpt verify` and for resume.

A step is intact when every item it lists is complete (`state`; `data`: one iterator file per process, valid
JSON; `config`: readable), every array reads back, every array's checksum equals the one saved with the step, and
every floating-point array is finite.

The checksum of an array is layout-independent: with `b_i` the bits of element `i` (row-major index over the
*global* shape) as uint32 and `k_i = i * 0x9E3779B1 + 0x7F4A7C15`, it is the pair
`(sum_i f(b_i ^ k_i), sum_i f(b_i ^ k_i) * (k_i | 1))` mod 2^32, where `f` is MurmurHash3's 32-bit finaliser (a
bijection). Sums add over any partition of the elements, so each shard is summed where it lives: on the device
(`jax.jit`, any mesh, any process count) or on the host, shard by shard with its global offsets, and the partial
sums of several processes add up. Changing any one element always changes the first sum (f is a bijection);
other damage goes unnoticed with probability about 2^-64. Orbax 0.12.8 checksums only its shard index
(`crc32c` on the zarr3 index), not the data, hence this.

The non-array files, the data-iterator states (`data/process_<i>-of-<n>.json`) and the run config
(`config/metadata`), are saved with the SHA-256 of each file's JSON value written canonically (sorted keys, no
spaces: `digest`), so a file re-indented by hand still matches and a changed value never does. They are checked
with bounds that hold for any state however it was written: an iterator's `next_index` (batches read) is at most
the step, and no position is negative or beyond the tokens the run has read (an edited `next_index: 10**12` made
grain skip records for hours).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.distributed.gather import gather_over_processes

FORMAT = "spmdkit-checksum-1"
CONFIG_FILE = "config/metadata"  # what Orbax's JsonSave writes for the `config` item
_DATA_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")  # a data item's file: process i of n
_GOLDEN, _OFFSET = 0x9E3779B1, 0x7F4A7C15


def _sums(bits: Any, index: Any, xp: Any) -> tuple[Any, Any]:
    """The two checksum sums of uint32 `bits` at uint32 global flat positions `index` (same shape; `xp` is numpy or
    jax.numpy)."""
    key = index * xp.uint32(_GOLDEN) + xp.uint32(_OFFSET)
    mixed = bits ^ key
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):  # MurmurHash3's fmix32
        mixed = (mixed ^ (mixed >> shift)) * xp.uint32(factor)
    mixed = mixed ^ (mixed >> 16)
    return xp.sum(mixed, dtype=xp.uint32), xp.sum(mixed * (key | xp.uint32(1)), dtype=xp.uint32)


def _strides(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[dim + 1 :]) for dim in range(len(shape))]


def _device_bits(x: jax.Array) -> jax.Array:
    """[*shape] uint32 of an array's bits (8-byte elements folded: low ^ high * golden)."""
    if x.dtype == jnp.bool_:  # a bool's bits are its value (JAX 0.11 refuses to bitcast bool)
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size == 8:
        pair = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return pair[..., 0] ^ (pair[..., 1] * jnp.uint32(_GOLDEN))
    narrow = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)


def _host_bits(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    size = x.dtype.itemsize
    if size == 8:
        pair = x.view(np.uint32).reshape(*x.shape, 2)
        return pair[..., 0] ^ (pair[..., 1] * np.uint32(_GOLDEN))
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).astype(np.uint32)


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)


def _device_leaf(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    index = jnp.zeros(x.shape, jnp.uint32)
    for dim, stride in enumerate(_strides(x.shape)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim) * jnp.uint32(stride % 2**32)
    first, second = _sums(_device_bits(x), index, jnp)
    bad = jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) if _is_float(x.dtype) else jnp.int32(0)
    return first, second, bad


_device_fingerprint = jax.jit(lambda leaves: [_device_leaf(x) for x in leaves])


_HOST_BLOCK = 1 << 20  # elements summed at a time on the host: ~30 MB of temporaries for any shard size


def block_sums(data: np.ndarray, offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Partial (sum1, sum2, non-finite count) of the block `data` that starts at `offsets` of an array `shape`;
    blocks of rows at a time, positions in uint32 (they only matter mod 2^32)."""
    if data.ndim and data.size > _HOST_BLOCK and data.shape[0] > 1:
        rows = max(1, _HOST_BLOCK // (data.size // data.shape[0]))
        parts = [
            block_sums(data[r : r + rows], (offsets[0] + r, *offsets[1:]), shape) for r in range(0, data.shape[0], rows)
        ]
        return sum(p[0] for p in parts) % 2**32, sum(p[1] for p in parts) % 2**32, sum(p[2] for p in parts)
    index = np.zeros(data.shape, np.uint32)
    with np.errstate(over="ignore"):
        for dim, (start, stride) in enumerate(zip(offsets, _strides(shape), strict=True)):
            positions = ((start + np.arange(data.shape[dim], dtype=np.uint64)) * np.uint64(stride % 2**32)) % 2**32
            index = index + positions.astype(np.uint32).reshape([-1 if d == dim else 1 for d in range(data.ndim)])
        first, second = _sums(_host_bits(data).reshape(-1), index.reshape(-1), np)
    bad = int(np.sum(~np.isfinite(data))) if _is_float(data.dtype) else 0
    return int(first), int(second), bad


def _host_leaf(x: Any, own: bool = False) -> np.ndarray:
    """[3] uint32: this process's partial (sum1, sum2, non-finite count) of `x`, a jax.Array (summed shard by
    shard) or a host array (counted by process 0 only, so that the sums over processes count it once). `own`: of
    every block this process holds, each once (its own checksum: copies other processes hold count there too)."""
    total = np.zeros(3, np.uint64)
    if not isinstance(x, jax.Array):
        if jax.process_index() == 0:
            total += np.array(block_sums(np.asarray(x), (0,) * np.ndim(x), tuple(np.shape(x))), np.uint64)
        return (total % 2**32).astype(np.uint32)
    seen = set()
    for shard in x.addressable_shards:
        offsets = tuple(s.indices(n)[0] for s, n in zip(shard.index, x.shape, strict=True))
        if (offsets not in seen) if own else shard.replica_id == 0:  # each element once, whoever holds copies
            seen.add(offsets)
            total += np.array(block_sums(np.asarray(shard.data), offsets, x.shape), np.uint64)
    return (total % 2**32).astype(np.uint32)


def fingerprints(tree: Any, on_device: bool | None = None, own: bool = False) -> dict[str, tuple[str, int]]:
    """'model/embedding' -> (checksum as 16 hex digits, count of NaN/Inf values) of every array of `tree`.

    Accelerator arrays are summed on their devices (one compiled program, any mesh; `on_device=True` does that
    for CPU arrays too); CPU and host arrays (numpy, or jax.Arrays in host memory) on the host, shard by shard.
    With several JAX processes the partial sums are added across them (a collective: every process must call this).
    `own`: of the elements this process's shards hold, each once, on the host (the checksums of a step each process
    saves alone): local, no other process is asked.
    """
    flat = jax.tree_util.tree_leaves_with_path(tree)
    if own:
        return {path_text(path): fingerprint(*_host_leaf(x, own=True)) for path, x in flat}
    leaves = [x for _, x in flat]

    def summed_on_device(x: Any) -> bool:  # arrays in host memory (`--optimizer.offload`'s pinned_host): on the host
        if not isinstance(x, jax.Array) or on_device is not None:
            return bool(on_device) and isinstance(x, jax.Array)
        return next(iter(x.devices())).platform != "cpu" and x.sharding.memory_kind in (None, "device")

    device = [i for i, x in enumerate(leaves) if summed_on_device(x)]
    host = sorted(set(range(len(leaves))) - set(device))
    results = {}
    if device:
        results.update(zip(device, jax.device_get(_device_fingerprint([leaves[i] for i in device])), strict=True))
    if host:
        results.update(zip(host, sum_over_processes([_host_leaf(leaves[i]) for i in host]), strict=True))
    return {path_text(path): fingerprint(*results[i]) for i, (path, _) in enumerate(flat)}


def sum_over_processes(parts: list[np.ndarray]) -> list[tuple[int, int, int]]:
    """Each array's (sum1, sum2, non-finite count) from every process's partial sums ([3] numbers each, as
    `block_sums` gives them): a collective when there are several processes (every process must call it)."""
    stacked = (np.stack(parts).astype(np.uint64) % 2**32).astype(np.uint32)
    if jax.process_count() > 1:
        gathered = np.stack(gather_over_processes(stacked)).astype(np.uint32)
        stacked = gathered.sum(axis=0, dtype=np.uint32)  # mod 2^32, as the sums themselves
    return [(row[0], row[1], row[2]) for row in stacked.tolist()]


def fingerprint(first: Any, second: Any, bad: Any) -> tuple[str, int]:
    """(the checksum as saved: 16 hex digits, the count of NaN/Inf values) of an array's sums."""
    return f"{int(first):08x}{int(second):08x}", int(bad)


def path_text(path: tuple[Any, ...]) -> str:
    """A key path as 'model/blocks/attention/q'."""
    return "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def digest(value: Any) -> str:
    """SHA-256 (hex) of a JSON value written canonically (see the module docstring)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checksum_record(
    found: Mapping[str, tuple[str, int]], data: Any = None, config: Any = None, layout: str | None = None
) -> dict[str, Any]:
    """What is saved with a step (in its `_CHECKPOINT_METADATA`, under `custom_metadata`): the arrays' checksums,
    the digests of the data-iterator states (`data`: the iterator saved; every process's, gathered: a collective
    with several processes) and of the config under `items`. With a `layout` (a step each process saves alone, as
    `layout.layout_digest` describes it), the layout too, and only this process's iterator state."""
    items = {}
    if data is not None:
        own = digest(data.get_state())
        states = dict(enumerate(gather_over_processes(own))) if layout is None else {jax.process_index(): own}
        items.update({f"data/process_{i}-of-{jax.process_count()}.json": d for i, d in states.items()})
    if config is not None:
        items["config"] = digest(config)
    record = {"format": FORMAT, "arrays": {path: checksum for path, (checksum, _) in found.items()}}
    return {**record, "layout": layout, "items": items} if layout is not None else {**record, "items": items}


def name_list(names: list[str], most: int = 6) -> str:
    """'a, b, c' (at most `most` names, then 'and N more'): one line, even when a whole step is damaged."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def array_problems(saved: Mapping[str, Any] | None, found: Mapping[str, tuple[str, int]]) -> list[str]:
    """What is wrong with the arrays read back (`found`) against the record saved with the step (`saved`, None for
    a step written before checksums): one line per kind of damage, naming every array."""
    problems = []
    if saved is not None and saved.get("format") == FORMAT:
        expected = saved.get("arrays", {})
        wrong = [path for path, (checksum, _) in found.items() if expected.get(path, checksum) != checksum]
        if wrong:
            problems.append(f"checksum mismatch in {name_list(wrong)}")
    not_finite = [f"{path} ({bad})" for path, (_, bad) in found.items() if bad]
    if not_finite:
        problems.append(f"NaN/Inf values in {name_list(not_finite)}")
    return problems


def item_problem(
    step_dir: Path, listed: set[str] | None = None, saved: Mapping[str, Any] | None = None, every_process: bool = True
) -> str | None:
    """None if every item the step lists (or holds) is complete, its data and config files match the digests of the
    step's checksum record `saved` (None, or a record without them: a step saved before them) and its iterator
    states are within bounds; else what is missing or broken, naming the file. `every_process`: the data item holds
    every process's iterator file (else only this process's, checked by its digest)."""
    missing = [item for item in ["state", *sorted(set(listed or ()) - {"state"})] if not (step_dir / item).is_dir()]
    if missing:
        return f"{missing[0]}/ is missing"
    if every_process and (step_dir / "data").exists() and (problem := data_problem(step_dir / "data")):
        return problem
    config, digests = None, saved.get("items") if isinstance(saved, Mapping) else None
    for name, expected in sorted((digests or {}).items()):
        path = step_dir / (CONFIG_FILE if name == "config" else name)
        if name.startswith("data/") and not path.exists() and data_files(step_dir / "data"):
            continue  # the positions of another process count: restore refuses them as such, naming both counts
        try:
            value = _read_json(path)
        except (OSError, ValueError):
            return f"{path.relative_to(step_dir)} is missing or not JSON"
        if digest(value) != expected:
            return f"checksum mismatch in {path.relative_to(step_dir)}"
        config = value if name == "config" else config
    if config is None and (step_dir / CONFIG_FILE).is_file():
        with contextlib.suppress(OSError, ValueError):
            config = _read_json(step_dir / CONFIG_FILE)
    return _bounds_problem(step_dir, config if isinstance(config, dict) else None)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _bounds_problem(step_dir: Path, config: dict[str, Any] | None) -> str | None:
    """What is out of bounds in the step's iterator states (see the module docstring); None when all are within."""
    step = int(step_dir.name) if step_dir.name.isdigit() else None
    run = (config or {}).get("run") or {}
    sizes = [run.get(k) for k in ("batch_size", "seq_len")]
    tokens = None
    if step is not None and all(isinstance(n, int) and n > 0 for n in sizes):
        tokens = max(step, 1) * sizes[0] * sizes[1]  # positions of any kind (rows, records, tokens) stay below
    for name in data_files(step_dir / "data"):
        try:
            state = _read_json(step_dir / "data" / name)
        except (OSError, ValueError):
            continue  # reported by the item check
        index = state.get("next_index") if isinstance(state, dict) else None
        if index is not None and (not isinstance(index, int) or step is not None and not 0 <= index <= step):
            return f"data/{name} says next_index {index!r}, but step {step} has read {step} batches"
        for value in _integers(state):
            if value < 0:
                return f"data/{name} holds the negative position {value}"
            if tokens is not None and value > tokens:
                return f"data/{name} holds the position {value}, beyond the {tokens} tokens step {step} has read"
    return None


def _integers(value: Any, key: str = "") -> list[int]:
    """The integers of a state held under keys naming positions (`next_index`, `*_offset`, ...): seeds are not."""
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in _integers(v, str(k))]
    if isinstance(value, list):
        return [n for v in value for n in _integers(v, key)]
    positional = any(word in key for word in ("index", "position", "offset"))
    return [value] if positional and isinstance(value, int) and not isinstance(value, bool) else []


def data_files(data_dir: Path) -> list[str]:
    """The data iterator's `process_<i>-of-<n>.json` files in a step's `data/`."""
    return sorted(p.name for p in data_dir.iterdir() if _DATA_FILE.fullmatch(p.name)) if data_dir.is_dir() else []


def data_process_count(data_dir: Path) -> int | None:
    """How many processes wrote a (complete) `data/` item; None without one."""
    counts = {int(_DATA_FILE.fullmatch(name)[2]) for name in data_files(data_dir)}  # type: ignore[index]
    return counts.pop() if len(counts) == 1 else None


def data_problem(data_dir: Path) -> str | None:
    """None if `data/` holds a valid iterator file for each of its processes; else what is wrong."""
    files = data_files(data_dir)
    counts = sorted({int(_DATA_FILE.fullmatch(name)[2]) for name in files})  # type: ignore[index]
    if not files:
        return "data/ holds no process_*-of-*.json file"
    if len(counts) != 1:
        return f"data/ mixes process counts {counts}"
    missing = [i for i in range(counts[0]) if f"process_{i}-of-{counts[0]}.json" not in files]
    if missing:
        return f"data/ lacks the iterator state of process(es) {missing} of {counts[0]}"
    for name in files:
        try:
            json.loads((data_dir / name).read_text())
        except (ValueError, OSError):
            return f"data/{name} is not valid JSON"
    return None
