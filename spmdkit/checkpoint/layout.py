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

import jax
import numpy as np
import orbax.checkpoint as ocp

from spmdkit.checkpoint.integrity import (
    checksum_record,
    data_process_count,
    digest,
    fingerprints,
    item_problem,
    path_text,
)
from spmdkit.distributed.gather import gather_over_processes
from spmdkit.errors import SpmdkitError

PREFIX = "process-"  # `<local-dir>/process-<i>/`: process i's steps


def process_directory(local_dir: Path) -> Path:
    """This process's directory of the local tier."""
    return Path(local_dir) / f"{PREFIX}{jax.process_index()}"


class Layout:
    """Who writes a directory (see the module docstring): all processes together (`SHARED`), or each process its own
    (`PER_PROCESS`); with the latter, `any_non_finite`, `record` and `gather` are collectives."""

    def __init__(self, per_process: bool, advice: str):
        self.per_process = per_process
        self.advice = advice  # what to do when every step is damaged

    def state_save(self, tree: Any) -> ocp.args.CheckpointArgs:
        return ocp.args.PyTreeSave(tree) if self.per_process else ocp.args.StandardSave(tree)

    def state_restore(self, target: Any) -> ocp.args.CheckpointArgs:
        if not self.per_process:
            return ocp.args.StandardRestore(target)
        return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))

    def fingerprints(self, tree: Any) -> dict[str, tuple[str, int]]:
        """Shared: of the whole arrays (summed over the processes); per process: of this process's elements."""
        return fingerprints(tree, own=self.per_process)

    def any_non_finite(self, found: dict[str, tuple[str, int]]) -> bool:
        """Whether any process holds NaN/Inf (every process refuses alike)."""
        return any(self.gather(np.int32(any(count for _, count in found.values()))))

    def record(self, tree: Any, found: dict[str, tuple[str, int]], data: Any, config: Any) -> dict[str, Any]:
        """The step's checksums and item digests (`integrity.checksum_record`); per process, also its layout."""
        return checksum_record(found, data, config, self.wanted(tree))

    def items_problem(self, step_dir: Path, listed: set[str], record: dict[str, Any] | None) -> str | None:
        """What is wrong with the step's items (per process: this process's), as `integrity.item_problem` says."""
        return item_problem(step_dir, listed, record, every_process=not self.per_process)

    def check_data(self, directory: Path, step: int) -> None:
        """SpmdkitError (not damage) when the step's data positions were saved by another number of processes (per
        process, nothing: the step's layout, checked before, names the process count)."""
        saved = None if self.per_process else data_process_count(directory / str(step) / "data")
        if saved is not None and saved != jax.process_count():
            raise SpmdkitError(
                f"checkpoint step {step} in {directory} holds the data positions of {saved} process(es), this "
                f"run has {jax.process_count()}: resume it with {saved} process(es) (spmdkit launch --processes "
                f"{saved}, or as many SLURM tasks); the mesh and the devices per process may change"
            )

    def wanted(self, state: Any) -> str | None:
        """The layout a step must record to be read onto `state` (None: any)."""
        return layout_digest(state) if self.per_process else None

    def gather(self, value: Any) -> list[Any]:
        """What every process found (one shared directory: all find the same, nothing is asked)."""
        return gather_over_processes(value) if self.per_process else [value]

    def set_aside(self, directory: Path, steps: list[int], why: str) -> None:
        """Rename `steps` out of Orbax's view: shared, process 0 renames and the others wait for it; per process,
        each renames its own copies (no other process waited for)."""
        if self.per_process or jax.process_index() == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for step in (s for s in steps if (directory / str(s)).exists()):
                (directory / str(step)).rename(directory / f"{step}.{why}-{stamp}")
        if not self.per_process and jax.process_count() > 1:
            gather_over_processes(np.int32(0))  # a barrier: every process sees the renamed steps


SHARED = Layout(False, ": see 'spmdkit ckpt verify', then delete the damaged steps or use a fresh --checkpoint-dir")
PER_PROCESS = Layout(
    True, " on some process: see the warnings, then delete the damaged steps or use a fresh --checkpoint.local-dir"
)


def layout_digest(tree: Any) -> str:
    """Digest of which blocks ((start, stop) per dimension) of which array this process's devices hold, out of how
    many processes: a step is read back only by a process of the same layout (arrays or ShapeDtypeStructs with
    shardings)."""
    blocks = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        held = x.sharding.addressable_devices_indices_map(tuple(x.shape)).values()
        found = {tuple(s.indices(n)[:2] for s, n in zip(index, x.shape, strict=True)) for index in held}
        blocks[path_text(path)] = sorted(found)
    return digest({"process": [jax.process_index(), jax.process_count()], "blocks": blocks})
