"""Host-memory arrays in a train step lowered for compile-only GPU devices (`--optimizer.offload`).

JAX drops the memory kind of a sharding whose devices report no memories, and the compile-only devices of a GPU
topology (`spmdkit.targets.target_devices`) report none: the offloaded step's state would be lowered as device
arrays. The step's own transfers survive (the optimizer's `jax.device_put` to `jax.memory.Space.Device` and back to
`Space.Host`, `spmdkit.train.step.optimizer.host_offloaded`); `annotate_host_arrays` adds what is missing, the
`mhlo.memory_kind = "pinned_host"` JAX writes on a real GPU for each offloaded argument and result, so that
XLA:GPU compiles the program a GPU run gets: those buffers in host memory (its host_* sizes), copied in and out.
"""

from __future__ import annotations

from typing import Any

import jax
from jax._src.lib.mlir import ir

from spmdkit.train.step.state import HOST, offloaded


def _with_memory_kind(attrs: ir.Attribute) -> ir.DictAttr:
    """An argument's or result's attribute dictionary with `mhlo.memory_kind` set to the host."""
    old = ir.DictAttr(attrs)
    values = {old[i].name: old[i].attr for i in range(len(old))}
    return ir.DictAttr.get({**values, "mhlo.memory_kind": ir.StringAttr.get(HOST)})


def _main(module: ir.Module) -> ir.Operation:
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op.operation
    raise ValueError("the lowered module has no main function")


def annotate_host_arrays(lowered: Any, host_args: list[int], host_results: list[int]) -> None:
    """Mark the `main` arguments `host_args` and results `host_results` (positions in the module) of `lowered`
    (a `jax.stages.Lowered`, changed in place before it is compiled) as pinned host memory."""
    module = lowered._lowering._hlo  # the module `Lowered.compile` compiles
    with module.context, ir.Location.unknown():
        main = _main(module)
        for key, positions in (("arg_attrs", host_args), ("res_attrs", host_results)):
            attrs = list(ir.ArrayAttr(main.attributes[key]))
            for i in positions:
                attrs[i] = _with_memory_kind(attrs[i])
            main.attributes[key] = ir.ArrayAttr.get(attrs)


def host_positions(abstract: Any, batch_keys: int, kept: set[int] | None = None) -> tuple[list[int], list[int]]:
    """(argument positions, result positions) of the offloaded optimizer arrays in the lowered train step
    `step(state, batch) -> (state, metrics)`: `abstract` is the train state (`nnx.State`), `batch_keys` the
    batch's array count; `kept` the argument indices jit kept (None: all)."""
    flags = jax.tree.leaves(offloaded(abstract))
    arguments = flags + [False] * batch_keys
    kept_order = sorted(kept) if kept is not None else range(len(arguments))
    args = [position for position, index in enumerate(kept_order) if arguments[index]]
    return args, [i for i, flag in enumerate(flags) if flag]
