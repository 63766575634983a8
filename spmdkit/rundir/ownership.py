"""Which directories a command may write: no command writes into a directory it does not own.

- A run directory (`train --run-dir`) is new, empty, or an spmdkit run's (its lock file, `metrics.jsonl`,
  checkpoint steps in `checkpoints/`, or a `config.json` that is a run config); anything else (a Hugging Face
  model, a user's own files) is refused before a byte is written.
- An output (`--out`) is refused when it is, contains or lies inside one of the command's inputs (`--force`
  included: replacing it would delete what is being read), and when it lies inside a checkpoint directory (Orbax
  owns every entry there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spmdkit.errors import SpmdkitError
from spmdkit.rundir.identity import RUN_ID_FILE
from spmdkit.rundir.lock import LOCK_FILE, RunLock, lock_run

CONFIG = "config.json"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def is_run_directory(path: Path) -> bool:
    """Whether `path` is a directory an spmdkit run wrote (or holds the lock of); one holding a `config.json` is when
    that is the one spmdkit train writes (an object of sections, among them `run` and `model`)."""
    if not path.is_dir():
        return False
    if (path / CONFIG).exists():
        value = _json(path / CONFIG)
        return isinstance(value, dict) and all(isinstance(value.get(k), dict) for k in ("run", "model"))
    return (
        (path / LOCK_FILE).exists()
        or (path / RUN_ID_FILE).is_file()
        or (path / "metrics.jsonl").is_file()
        or is_checkpoint_directory(path / "checkpoints")
    )


def is_checkpoint_directory(path: Path) -> bool:
    """Whether `path` holds checkpoint steps (`<step>/_CHECKPOINT_METADATA`): Orbax's directory."""
    try:
        return path.is_dir() and any(
            p.name.isdigit() and (p / "_CHECKPOINT_METADATA").is_file() for p in path.iterdir() if p.is_dir()
        )
    except OSError:
        return False


def check_run_directory(directory: str | Path, flag: str = "--run-dir") -> None:
    """SpmdkitError unless `directory` is new, empty or an spmdkit run directory (see the module docstring)."""
    path = Path(directory).expanduser().absolute()
    if not path.is_dir():
        return
    names = sorted(p.name for p in path.iterdir())
    if not names or is_run_directory(path):
        return
    if (path / CONFIG).exists():
        config = _json(path / CONFIG)
        what = (
            "a Hugging Face model's config.json"
            if isinstance(config, dict) and "model_type" in config
            else "a config.json that is not an spmdkit run's"
        )
    else:
        what = f"files that are not an spmdkit run's ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
    raise SpmdkitError(
        f"{flag} {path} holds {what}: training would overwrite them; pass a new or empty directory, or the "
        "directory of an earlier spmdkit run"
    )


def check_output(out: str | Path, inputs: list[str | Path], flag: str = "--out") -> Path:
    """`out` (absolute), refused when it is, contains or lies inside one of `inputs`, or lies inside a checkpoint
    directory; nothing is created."""
    path = Path(out).expanduser().absolute()
    real = path.resolve()
    for source in inputs:
        given = Path(source).expanduser().absolute()
        src = given.resolve()
        if real == src:
            problem = f"is {given}, which this command reads"
        elif real.is_relative_to(src):
            problem = f"lies inside {given}, which this command reads"
        elif src.is_relative_to(real):
            problem = f"contains {given}, which this command reads"
        else:
            continue
        raise SpmdkitError(f"{flag} {path} {problem}: pass a new directory outside it (--force never replaces input)")
    for ancestor in real.parents:
        if is_checkpoint_directory(ancestor):
            raise SpmdkitError(
                f"{flag} {path} lies inside the checkpoint directory {ancestor}, whose entries are a run's "
                "checkpoint steps: pass a directory outside it"
            )
    return path


def run_inputs(directory: str | Path) -> list[Path]:
    """What reading a checkpoint or run directory reads: the directory itself, its `checkpoints/`, the checkpoint
    directory its run config names (`--checkpoint-dir`), and the weights it was initialised from (`--init-from`:
    an output there would replace the run's own source)."""
    path = Path(directory).expanduser().absolute()
    inputs = [path]
    if (path / "checkpoints").is_dir():
        inputs.append(path / "checkpoints")
    config = _json(path / CONFIG) if (path / CONFIG).is_file() else None
    for section, key in (("checkpoint", "directory"), ("model", "init_from")):
        named = ((config or {}).get(section) or {}).get(key) if isinstance(config, dict) else None
        if isinstance(named, str) and named:
            inputs.append(Path(named).expanduser().absolute())
    return inputs


def enclosing_run(path: str | Path) -> Path | None:
    """The nearest run directory that is `path` or holds it (an output written there takes that run's lock)."""
    real = Path(path).expanduser().absolute()
    for candidate in (real, *real.parents):
        if is_run_directory(candidate):
            return candidate
    return None


def lock_run_directories(
    run_dir: Path, written: dict[str, Path | None], command: str, each: dict[str, Path] | None = None
) -> list[RunLock | None]:
    """The locks a trainer holds (`lock.lock_run` of each, in order; all or none: a refusal releases the locks
    taken): its run directory's and, for every other directory it writes (`written`: flag -> directory or None,
    e.g. its checkpoint directory) that lies elsewhere, the lock of the run directory holding it (else of the
    directory itself); `each`: flag -> a directory within that one which every process locks, each its own
    (`<local-dir>/process-<i>/`: each host's disk is its own)."""
    wanted: list[tuple[str, Path, str | None, bool]] = [("--run-dir", run_dir, None, False)]
    for flag, path in written.items():
        if path is None or path.is_relative_to(run_dir):
            continue  # the run directory's lock covers it
        owner = enclosing_run(path) or path
        label = f"{flag} {path}" + (f" lies in the run directory {owner}, which" if owner != path else "")
        wanted.append((flag, owner, label, False))
        if flag in (each or {}):
            wanted.append((flag, each[flag], f"{flag} {each[flag]}", True))
    locks: list[RunLock | None] = []
    try:
        for flag, directory, label, one_each in wanted:
            locks.append(lock_run(directory, command, flag, label, each=one_each))
    except BaseException:
        for lock in reversed(locks):
            if lock is not None:
                lock.release(failed=True)
        raise
    return locks
