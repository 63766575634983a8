"""The checksums and bounds of a step's non-array files: the data-iterator states (`data/process_<i>-of-<n>.json`)
and the run config (`config/metadata`).

Saved with the step (in its `_CHECKPOINT_METADATA`, beside the arrays' checksums): the SHA-256 of each file's JSON
value written canonically (sorted keys, no spaces), so a file re-indented by hand still matches and a changed value
never does. Checked on restore and by `ckpt verify`, with bounds that hold for any state however it was written: an
iterator's `next_index` (batches read) is at most the step, and no position is negative or beyond the tokens the run
has read (an edited `next_index: 10**12` made grain skip records for hours).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from spmdkit.distributed.gather import gather_over_processes

CONFIG_FILE = "config/metadata"  # what Orbax's JsonSave writes for the `config` item


def digest(value: Any) -> str:
    """SHA-256 (hex) of a JSON value written canonically."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def item_digests(data: Any = None, config: dict[str, Any] | None = None) -> dict[str, str]:
    """'data/process_<i>-of-<n>.json' (every process's, gathered: a collective with several processes) and 'config'
    -> the digest of what the step saves for them (`data`: the grain iterator saved, `config`: the config dict)."""
    digests = {}
    if data is not None:
        every = gather_over_processes(digest(data.get_state()))
        for index, own in enumerate(every):
            digests[f"data/process_{index}-of-{len(every)}.json"] = own
    if config is not None:
        digests["config"] = digest(config)
    return digests


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def items_problem(step_dir: Path, saved: dict[str, str] | None) -> str | None:
    """None if the step's data and config files match their saved digests (`saved`; None: a step saved before
    them) and the iterator states are within bounds; else what is wrong, naming the file."""
    config = None
    for name, expected in sorted((saved or {}).items()):
        path = step_dir / (CONFIG_FILE if name == "config" else name)
        if name.startswith("data/") and not path.exists() and any((step_dir / "data").glob("process_*-of-*.json")):
            continue  # the positions of another process count: restore refuses them as such, naming both counts
        try:
            value = _read_json(path)
        except (OSError, ValueError):
            return f"{path.relative_to(step_dir)} is missing or not JSON"
        if digest(value) != expected:
            return f"checksum mismatch in {path.relative_to(step_dir)}"
        config = value if name == "config" else config
    if config is None and (step_dir / CONFIG_FILE).is_file():
        try:
            config = _read_json(step_dir / CONFIG_FILE)
        except (OSError, ValueError):
            config = None
    return _bounds_problem(step_dir, config if isinstance(config, dict) else None)


def _bounds_problem(step_dir: Path, config: dict[str, Any] | None) -> str | None:
    """What is out of bounds in the step's iterator states (see the module docstring); None when all are within."""
    step = int(step_dir.name) if step_dir.name.isdigit() else None
    run = (config or {}).get("run") or {}
    sizes = [run.get(k) for k in ("batch_size", "seq_len")]
    tokens = None
    if step is not None and all(isinstance(n, int) and n > 0 for n in sizes):
        tokens = max(step, 1) * sizes[0] * sizes[1]  # positions of any kind (rows, records, tokens) stay below
    data = step_dir / "data"
    for path in sorted(data.glob("process_*-of-*.json")) if data.is_dir() else ():
        try:
            state = _read_json(path)
        except (OSError, ValueError):
            continue  # reported by the item check
        where = f"data/{path.name}"
        index = state.get("next_index") if isinstance(state, dict) else None
        if index is not None and (not isinstance(index, int) or step is not None and not 0 <= index <= step):
            return f"{where} says next_index {index!r}, but step {step} has read {step} batches"
        for value in _integers(state):
            if value < 0:
                return f"{where} holds the negative position {value}"
            if tokens is not None and value > tokens:
                return f"{where} holds the position {value}, beyond the {tokens} tokens step {step} has read"
    return None


def _integers(value: Any, key: str = "") -> list[int]:
    """The integers of a state held under keys naming positions (`next_index`, `*_offset`, ...): seeds are not."""
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in _integers(v, str(k))]
    if isinstance(value, list):
        return [n for v in value for n in _integers(v, key)]
    positional = any(word in key for word in ("index", "position", "offset"))
    return [value] if positional and isinstance(value, int) and not isinstance(value, bool) else []
