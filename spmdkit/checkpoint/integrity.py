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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.checkpoint.item_checks import item_digests, items_problem
from spmdkit.distributed.gather import gather_over_processes

FORMAT = "spmdkit-checksum-1"
_GOLDEN, _OFFSET = 0x9E3779B1, 0x7F4A7C15


def _mix(h: Any, xp: Any) -> Any:
    """MurmurHash3's fmix32 on a uint32 array (`xp` is numpy or jax.numpy)."""
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _sums(bits: Any, index: Any, xp: Any) -> tuple[Any, Any]:
    """The two checksum sums of uint32 `bits` at uint32 global flat positions `index` (same shape)."""
    key = index * xp.uint32(_GOLDEN) + xp.uint32(_OFFSET)
    mixed = _mix(bits ^ key, xp)
    return xp.sum(mixed, dtype=xp.uint32), xp.sum(mixed * (key | xp.uint32(1)), dtype=xp.uint32)


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, size = [], 1
    for n in reversed(shape):
        strides.append(size)
        size *= n
    return strides[::-1]


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


def process_fingerprints(tree: Any) -> dict[str, tuple[str, int]]:
    """`fingerprints` of the elements this process's shards hold (each once): the checksums of a step each process
    saves alone. Local: no other process is asked."""
    found = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        first, second, bad = (int(v) for v in _host_leaf(x, own=True))
        found[path_text(path)] = (fingerprint_text(first, second), bad)
    return found


def fingerprints(tree: Any, on_device: bool | None = None) -> dict[str, tuple[str, int]]:
    """'model/embedding' -> (checksum as 16 hex digits, count of NaN/Inf values) of every array of `tree`.

    Accelerator arrays are summed on their devices (one compiled program, any mesh; `on_device=True` does that
    for CPU arrays too); CPU and host arrays (numpy, or jax.Arrays in host memory) on the host, shard by shard.
    With several JAX processes the partial sums are added across them (a collective: every process must call this).
    """
    flat = jax.tree_util.tree_leaves_with_path(tree)
    leaves = [x for _, x in flat]
    if on_device is None:  # arrays in host memory (`--optimizer.offload`'s pinned_host) are summed on the host
        on_device_each = [
            isinstance(x, jax.Array)
            and next(iter(x.devices())).platform != "cpu"
            and x.sharding.memory_kind in (None, "device")
            for x in leaves
        ]
    else:
        on_device_each = [on_device and isinstance(x, jax.Array) for x in leaves]
    results: list[tuple[int, int, int]] = [(0, 0, 0)] * len(leaves)
    chosen = [i for i, device in enumerate(on_device_each) if device]
    if chosen:
        computed = jax.device_get(_device_fingerprint([leaves[i] for i in chosen]))
        for i, (first, second, bad) in zip(chosen, computed, strict=True):
            results[i] = (int(first), int(second), int(bad))
    host = [i for i, device in enumerate(on_device_each) if not device]
    if host:
        for i, row in zip(host, sum_over_processes([_host_leaf(leaves[i]) for i in host]), strict=True):
            results[i] = row
    return {
        path_text(path): (fingerprint_text(first, second), bad)
        for (path, _), (first, second, bad) in zip(flat, results, strict=True)
    }


def sum_over_processes(parts: list[np.ndarray]) -> list[tuple[int, int, int]]:
    """Each array's (sum1, sum2, non-finite count) from every process's partial sums ([3] numbers each, as
    `block_sums` gives them): a collective when there are several processes (every process must call it)."""
    stacked = (np.stack(parts).astype(np.uint64) % 2**32).astype(np.uint32)
    if jax.process_count() > 1:
        gathered = np.stack(gather_over_processes(stacked)).astype(np.uint32)
        stacked = gathered.sum(axis=0, dtype=np.uint32)  # mod 2^32, as the sums themselves
    return [(row[0], row[1], row[2]) for row in stacked.tolist()]


def fingerprint_text(first: int, second: int) -> str:
    """The checksum as saved: 16 hex digits."""
    return f"{first:08x}{second:08x}"


def path_text(path: tuple[Any, ...]) -> str:
    """A key path as 'model/blocks/attention/q'."""
    return "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def checksum_record(found: Mapping[str, tuple[str, int]], data: Any = None, config: Any = None) -> dict[str, Any]:
    """What is saved with a step (in its `_CHECKPOINT_METADATA`, under `custom_metadata`): the arrays' checksums and
    the digests of the data-iterator states (`data`: the iterator saved) and the config (`item_checks`)."""
    arrays = {path: checksum for path, (checksum, _) in found.items()}
    return {"format": FORMAT, "arrays": arrays, "items": item_digests(data, config)}


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
    """None if every item the step lists (or holds) is complete, and its data and config files match the digests
    of the step's checksum record `saved` and are within bounds (`item_checks`); else what is missing or broken.
    `every_process`: the data item holds every process's iterator file (else only this process's, checked by its
    digest)."""
    missing = [item for item in ["state", *sorted(set(listed or ()) - {"state"})] if not (step_dir / item).is_dir()]
    if missing:
        return f"{missing[0]}/ is missing"
    if every_process and (step_dir / "data").exists() and (problem := data_problem(step_dir / "data")):
        return problem
    return items_problem(step_dir, (saved or {}).get("items") if isinstance(saved, Mapping) else None)


def data_files(data_dir: Path) -> list[str]:
    """The data iterator's `process_<i>-of-<n>.json` files in a step's `data/`."""
    return sorted(p.name for p in data_dir.iterdir() if _data_file(p.name)) if data_dir.is_dir() else []


def _data_file(name: str) -> tuple[int, int] | None:
    stem = name.removeprefix("process_").removesuffix(".json")
    index, _, count = stem.partition("-of-")
    if name.startswith("process_") and name.endswith(".json") and index.isdigit() and count.isdigit():
        return int(index), int(count)
    return None


def data_process_count(data_dir: Path) -> int | None:
    """How many processes wrote a (complete) `data/` item; None without one."""
    counts = {_data_file(f)[1] for f in data_files(data_dir)}  # type: ignore[index]
    return counts.pop() if len(counts) == 1 else None


def data_problem(data_dir: Path) -> str | None:
    """None if `data/` holds a valid iterator file for each of its processes; else what is wrong."""
    files = data_files(data_dir)
    if not files:
        return "data/ holds no process_*-of-*.json file"
    counts = {_data_file(f)[1] for f in files}  # type: ignore[index]
    if len(counts) != 1:
        return f"data/ mixes process counts {sorted(counts)}"
    (count,) = counts
    missing = [i for i in range(count) if f"process_{i}-of-{count}.json" not in files]
    if missing:
        return f"data/ lacks the iterator state of process(es) {missing} of {count}"
    for name in files:
        try:
            json.loads((data_dir / name).read_text())
        except (ValueError, OSError):
            return f"data/{name} is not valid JSON"
    return None
