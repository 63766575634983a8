"""Who writes a checkpoint directory, as a small policy object the store (`manager.Checkpointer`) is given.

- `SHARED`: every process writes one directory together (Orbax's default). A step's checksums are of the whole
  arrays (the processes add their partial sums), its data item holds every process's iterator position.
- `PER_PROCESS`: the local tier of a job spanning several hosts. A node-local directory holds only what its own host
  wrote, so each process keeps its own steps in `<local-dir>/process-<i>/` (`process_directory`), saving alone the
  shards it can address, its iterator position and the config (`backend.open_manager(per_process=True)`). Emulated
  hosts sharing one machine's disk and real nodes both work: the directories differ by process index. A step's
  checksums are of the elements this process's shards hold, its digests of its own iterator file and the config; it
  records the process layout (which blocks of which array this process held, out of how many processes), which a
  restore must match: the shards are read back by the process that wrote them, onto the same mesh. A state holding
  NaN/Inf anywhere is saved by no process, and every verdict of a restore is agreed by all (`gather`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from spmdkit.checkpoint.integrity import (
    FORMAT,
    checksum_record,
    data_process_count,
    fingerprints,
    item_problem,
    path_text,
    process_fingerprints,
)
from spmdkit.checkpoint.item_checks import digest
from spmdkit.distributed.gather import gather_over_processes
from spmdkit.errors import SpmdkitError

__all__ = ["PER_PROCESS", "PREFIX", "SHARED", "process_directory"]

PREFIX = "process-"  # `<local-dir>/process-<i>/`: process i's steps


def process_directory(local_dir: Path) -> Path:
    """This process's directory of the local tier."""
    return Path(local_dir) / f"{PREFIX}{jax.process_index()}"


class _Shared:
    """One directory all processes write together (see the module docstring)."""

    per_process = False
    advice = ": see 'spmdkit ckpt verify', then delete the damaged steps or use a fresh --checkpoint-dir"
    state_save, state_restore = staticmethod(ocp.args.StandardSave), staticmethod(ocp.args.StandardRestore)
    fingerprints = staticmethod(fingerprints)  # whole arrays: already summed over the processes

    def any_non_finite(self, found: dict[str, tuple[str, int]]) -> bool:
        return any(count for _, count in found.values())

    def record(self, tree: Any, found: dict[str, tuple[str, int]], data: Any, config: Any) -> dict[str, Any]:
        """The step's checksums and item digests (`integrity.checksum_record`)."""
        return checksum_record(found, data, config)

    def items_problem(self, step_dir: Path, listed: set[str], record: dict[str, Any] | None) -> str | None:
        return item_problem(step_dir, listed, record)

    def check_data(self, directory: Path, step: int) -> None:
        """SpmdkitError (not damage) when the step's data positions were saved by another number of processes."""
        saved = data_process_count(directory / str(step) / "data")
        if saved is not None and saved != jax.process_count():
            raise SpmdkitError(
                f"checkpoint step {step} in {directory} holds the data positions of {saved} process(es), this "
                f"run has {jax.process_count()}: resume it with {saved} process(es) (spmdkit launch --processes "
                f"{saved}, or as many SLURM tasks); the mesh and the devices per process may change"
            )

    def wanted(self, state: Any) -> str | None:
        """The layout a step must record to be read onto `state` (None: any)."""
        return None

    def gather(self, value: Any) -> list[Any]:
        """What every process found (one directory: all find the same, nothing is asked)."""
        return [value]

    def set_aside(self, directory: Path, steps: list[int], why: str) -> None:
        """Rename `steps` out of Orbax's view: process 0 renames, the others wait for it."""
        if jax.process_index() == 0:
            _rename(directory, steps, why)
        if jax.process_count() > 1:
            gather_over_processes(np.int32(0))  # a barrier: every process sees the renamed steps


class _PerProcess(_Shared):
    """This process's own directory of the local tier (see the module docstring)."""

    per_process = True
    advice = " on some process: see the warnings, then delete the damaged steps or use a fresh --checkpoint.local-dir"
    state_save = staticmethod(ocp.args.PyTreeSave)

    @staticmethod
    def state_restore(target: Any) -> ocp.args.PyTreeRestore:
        return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))

    fingerprints = staticmethod(process_fingerprints)  # this process's elements: no other process asked

    def any_non_finite(self, found: dict[str, tuple[str, int]]) -> bool:
        """Whether any process holds NaN/Inf (a collective: every process refuses alike)."""
        return any(gather_over_processes(np.int32(sum(count for _, count in found.values()))))

    def record(self, tree: Any, found: dict[str, tuple[str, int]], data: Any, config: Any) -> dict[str, Any]:
        """This process's checksums, the digests of its items and its layout."""
        arrays = {path: checksum for path, (checksum, _) in found.items()}
        return {"format": FORMAT, "arrays": arrays, "layout": layout_digest(tree), "items": _digests(data, config)}

    def items_problem(self, step_dir: Path, listed: set[str], record: dict[str, Any] | None) -> str | None:
        """What is wrong with this process's items: one missing, or not matching its digest."""
        return item_problem(step_dir, listed, record, every_process=False)

    def check_data(self, directory: Path, step: int) -> None:
        """Nothing: the step's layout, checked before, names the process count."""

    def wanted(self, state: Any) -> str | None:
        return layout_digest(state)

    def gather(self, value: Any) -> list[Any]:
        """What every process found (a collective)."""
        return gather_over_processes(value)

    def set_aside(self, directory: Path, steps: list[int], why: str) -> None:
        """Rename this process's copies of `steps` (no other process waited for)."""
        _rename(directory, steps, why)


SHARED, PER_PROCESS = _Shared(), _PerProcess()
Layout = _Shared


def _rename(directory: Path, steps: list[int], why: str) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for step in steps:
        path = directory / str(step)
        if path.exists():
            path.rename(directory / f"{step}.{why}-{stamp}")


def _blocks(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """The distinct blocks ((start, stop) per dimension) of an array `shape` this process's devices hold."""
    found = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        found.add(tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True)))
    return sorted(found)


def layout_digest(tree: Any) -> str:
    """Digest of which blocks of which array this process holds, out of how many processes: a step is read back
    only by a process of the same layout (arrays or ShapeDtypeStructs with shardings)."""
    blocks = {path_text(p): _blocks(x.sharding, tuple(x.shape)) for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    return digest({"process": [jax.process_index(), jax.process_count()], "blocks": blocks})


def _digests(data: grain.DatasetIterator | None, config: dict[str, Any] | None) -> dict[str, str]:
    """`item_checks.item_digests` of this process's part: its own iterator file and the config."""
    digests = {}
    if data is not None:
        digests[f"data/process_{jax.process_index()}-of-{jax.process_count()}.json"] = digest(data.get_state())
    if config is not None:
        digests["config"] = digest(config)
    return digests
