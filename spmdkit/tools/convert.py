"""`spmdkit ckpt reshard`, and reading a checkpoint's parameters (the Hugging Face conversion is in
`spmdkit.tools.hf_checkpoint` and `spmdkit.interop`).

- `reshard_checkpoint`: rebuild the abstract train state from the checkpoint's saved config, with the shardings
  of a new mesh; restore onto it with Orbax; save the same items (state, data, config) into a new directory,
  assembled beside it (`.NAME.resharding`) and renamed at the end: a killed reshard leaves no partial output.
  The data-iterator files are copied as they are; the config records the new mesh.
- `read_params`: a step's model parameters (not its optimizer state) as host arrays, with its saved config.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from spmdkit.checkpoint.manager import Checkpointer
from spmdkit.checkpoint.params import read_params as checkpoint_params
from spmdkit.checkpoint.steps import open_step, saved_config
from spmdkit.errors import SpmdkitError
from spmdkit.rundir.lock import lock_run
from spmdkit.rundir.ownership import check_output, enclosing_run, run_inputs
from spmdkit.sharding.mesh import MeshConfig, make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.train.config import TrainConfig, apply_overrides, config_from_json
from spmdkit.train.step.optimizer import make_optimizer
from spmdkit.train.step.state import abstract_train_state


def fresh_output(out: str | Path) -> Path:
    """`out` as an absolute path, checked to be a new or empty directory that can be created there (its nearest
    existing ancestor a writable directory); SpmdkitError otherwise. Nothing is created."""
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise SpmdkitError(f"{out} is a file: pass a new directory for the converted checkpoint")
    if out.exists() and any(out.iterdir()):
        raise SpmdkitError(f"{out} is not empty: pass a new directory for the converted checkpoint")
    check_creatable(out)
    return out


def check_creatable(out: Path) -> None:
    """SpmdkitError unless the directory `out` can be made: its nearest existing ancestor is a writable directory."""
    existing = next(p for p in out.parents if p.exists())
    if not existing.is_dir():
        raise SpmdkitError(f"{out} lies under {existing}, which is a file: pass a new directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpmdkitError(f"{out} cannot be written ({existing} is not writable): pass a directory you can write")


def staging_for(out: Path, verb: str) -> Path:
    """Where `out` is assembled before it is renamed into place (`.NAME.<verb>` beside it: one file system), emptied
    of what a killed command left there: a killed reshard or import leaves no partial `out`."""
    staging = out.with_name(f".{out.name}.{verb}")
    if jax.process_index() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    return staging


def publish(staging: Path, out: Path) -> None:
    """Rename the complete `staging` to `out` (new, or empty: `fresh_output`), on process 0."""
    if jax.process_index() == 0:
        if out.exists():
            out.rmdir()
        os.replace(staging, out)


@contextlib.contextmanager
def writing_into(out: Path, command: str) -> Iterator[None]:
    """Hold the lock of the run directory `out` lies in (if any) while `command` writes `out`: refused in one line
    while a run (or another command) writes there."""
    run = enclosing_run(out)
    label = f"--out {out} lies in the run directory {run}, which" if run is not None else None
    lock = lock_run(run, command, "--out", label) if run is not None else None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


# ------------------------------------------------------------------------------------------------- reshard


def reshard_checkpoint(directory: str | Path, out: str | Path, mesh: str, step: int | None = None) -> int:
    """Restore `step` (default: the newest) of `directory` onto `mesh` and save it into `out`; returns the step."""
    out = fresh_output(check_output(out, run_inputs(directory)))
    with writing_into(out, "spmdkit ckpt reshard"):
        source, step = open_step(directory, step)
        with contextlib.closing(source):
            config = config_from_json(json.dumps(saved_config(source, step)))
            config = apply_overrides(config, {"mesh": {"mesh": mesh, "dcn": None}})  # this process lays it out
            new_mesh = make_mesh(MeshConfig.parse(mesh, config.mesh.dcn))
            rules = make_rules(config.mesh.zero, config.mesh.sequence_parallel)
            tx = make_optimizer(config.optimizer, config.run.steps, config.model.build())
            model = config.model.build()  # with a LoRA run's adapters: its checkpoint holds them, not the base
            _, abstract, shardings = abstract_train_state(model, tx, new_mesh, rules, config.run.seed, lora=config.lora)
            state = source.restore(step, abstract, shardings)
        staging = staging_for(out, "resharding")
        with contextlib.closing(Checkpointer(staging, every=0, keep=1)) as target:
            target.save(step, state, config=json.loads(config.to_json()), force=True)
            target.wait()
        data = Path(source.directory) / str(step) / "data"
        if data.is_dir() and jax.process_index() == 0:
            shutil.copytree(data, staging / str(step) / "data")
        publish(staging, out)
        return step


# ------------------------------------------------------------------------------------------------- reading


def read_params(directory: str | Path, step: int | None = None) -> tuple[int, TrainConfig, dict[str, Any]]:
    """(step, saved config, model parameters as a pure dict of host arrays in their saved dtypes); the optimizer
    state is not read (`spmdkit.checkpoint.params.read_params`)."""
    step, config, params = checkpoint_params(directory, step=step)
    return step, config_from_json(json.dumps(config)), jax.tree.map(np.asarray, params)
