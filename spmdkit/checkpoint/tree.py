"""The tree a checkpoint holds: `{"model": ..., "optimizer": ...}` pure dicts of arrays, built from and back into the
`nnx.State` of (model, optimizer); restore targets with shardings; reading arrays one by one."""

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


def to_saved_tree(state: nnx.State) -> dict[str, Any]:
    """nnx.State of (model, optimizer) -> the pure dict that is saved."""
    pure = nnx.to_pure_dict(state)
    return {"model": pure[0], "optimizer": pure[1]}


def from_saved_tree(saved: dict[str, Any], like: nnx.State) -> nnx.State:
    """Inverse of `to_saved_tree`, with the structure (Variable types, metadata) of `like`."""
    treedef = jax.tree.structure(like)
    leaves = jax.tree.leaves({0: saved["model"], 1: saved["optimizer"]})
    return treedef.unflatten(leaves)


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
