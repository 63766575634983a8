"""The tree a checkpoint holds: `{"model": ..., "optimizer": ...}` pure dicts of arrays, built from and back into the
`nnx.State` of (model, optimizer); restore targets with shardings; reading arrays one by one.

A model with LoRA adapters (`nnx.LoRAParam`s: `spmdkit.models.lora`) trains only them: its other `nnx.Param`s are
the frozen base, which the run reads from its `--init-from` weights (their identity, path and checksum, is in the
saved config's `lora` section) and which a checkpoint therefore does not hold. Its `model` item holds the adapters
(and any state that is not a parameter), its `optimizer` item their moments: for a 1B base at rank 16, megabytes,
not gigabytes. A restore fills the base's leaves from the state it is given (the caller reads the base again).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from spmdkit.checkpoint.failures import drop_orphaned_reads
from spmdkit.checkpoint.integrity import path_text


def abstract_target(state: nnx.State, shardings: Any) -> dict[str, Any]:
    """The restore target: `{"model", "optimizer"}` trees of ShapeDtypeStructs carrying `shardings`."""
    leaves, treedef = jax.tree.flatten(state)
    sharding_leaves = jax.tree.leaves(shardings)
    if len(leaves) != len(sharding_leaves):
        raise ValueError(f"state has {len(leaves)} arrays but shardings has {len(sharding_leaves)}")
    abstract = treedef.unflatten(
        [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, sharding_leaves, strict=True)]
    )
    return to_saved_tree(abstract)


def first_mismatch(saved: dict[str, tuple[tuple[int, ...], str]], target: dict[str, Any]) -> str | None:
    """The first array whose shape differs between a step (`saved`: 'model/...' -> (shape, dtype)) and `target`
    (arrays or ShapeDtypeStructs), in words; None when every array matches."""
    wanted = {path_text(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(target)}
    for path, shape in wanted.items():
        found = saved.get(path, (None, None))[0]
        if found != shape:
            what = "is missing" if found is None else f"has shape {found}"
            return f"{path} {what} in the checkpoint but has shape {shape} here"
    extra = sorted(set(saved) - set(wanted))
    return f"it holds {extra[0]} {saved[extra[0]][0]}, which this model lacks" if extra else None


def frozen_paths(model: nnx.State) -> set[tuple[Any, ...]]:
    """The paths (pure-dict keys) of the frozen base's parameters in a model's state: every `nnx.Param` that is not
    an `nnx.LoRAParam` when the model has adapters; none otherwise (every parameter trains)."""
    variables = jax.tree_util.tree_leaves_with_path(model, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if not any(isinstance(v, nnx.LoRAParam) for _, v in variables):
        return set()
    keys = lambda path: tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)  # noqa: E731
    return {keys(p) for p, v in variables if isinstance(v, nnx.Param) and not isinstance(v, nnx.LoRAParam)}


def _without(tree: dict[Any, Any], paths: set[tuple[Any, ...]], at: tuple[Any, ...] = ()) -> dict[Any, Any]:
    """`tree` (a pure dict) without the leaves at `paths`, nor the dicts left empty."""
    kept = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            value = _without(value, paths, (*at, key))
            if value:
                kept[key] = value
        elif (*at, key) not in paths:
            kept[key] = value
    return kept


def to_saved_tree(state: nnx.State) -> dict[str, Any]:
    """nnx.State of (model, optimizer) -> the pure dict that is saved (without a LoRA run's frozen base)."""
    pure = nnx.to_pure_dict(state)
    return {"model": _without(pure[0], frozen_paths(state[0])), "optimizer": pure[1]}


def from_saved_tree(saved: dict[str, Any], like: nnx.State) -> nnx.State:
    """Inverse of `to_saved_tree`, with the structure (Variable types, metadata) of `like`, whose frozen base's
    leaves (a LoRA run's) are kept as they are."""
    model = nnx.to_pure_dict(like[0])
    _overlay(model, saved["model"])
    leaves = jax.tree.leaves({0: model, 1: saved["optimizer"]})
    return jax.tree.structure(like).unflatten(leaves)


def _overlay(tree: dict[Any, Any], saved: dict[Any, Any]) -> None:
    """Replace `tree`'s leaves by `saved`'s, in place, where `saved` has them."""
    for key, value in saved.items():
        if isinstance(value, dict):
            _overlay(tree[key], value)
        else:
            tree[key] = value


def unreadable_arrays(metadata: Any, step_dir: Path, device: jax.Device) -> list[str]:
    """The arrays ('model/embedding') of a saved `state/` item that do not read back: each array is read on its own
    (partial restore), so that the damaged ones can be named."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    unreadable = []
    with ocp.PyTreeCheckpointer() as reader:
        for path, leaf in jax.tree_util.tree_leaves_with_path(metadata):
            target = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
            for key in reversed(path):  # the tree of this one array
                target = {getattr(key, "key", getattr(key, "idx", key)): target}
            args = ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
            )
            try:
                reader.restore(step_dir / "state", args=args)
            except Exception:  # noqa: BLE001 - what is being looked for
                drop_orphaned_reads()
                unreadable.append(path_text(path))
    return unreadable
