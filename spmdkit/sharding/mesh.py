"""Named device meshes: `make_mesh` lays the six axes of a `MeshConfig` over the devices.

Axis order, the `AxisType.Auto` axes and the hybrid (in-node ICI x across-node DCN) split of a multi-node mesh:
`spmdkit.sharding.mesh_config`.

The granules of a hybrid mesh are hosts (nodes), not processes: `--dcn data=2` means two nodes whether each runs
one process (of all its GPUs) or one process per GPU. A process's host is `SPMDKIT_HOST` (what `spmdkit launch`
sets: one host, or `--processes-per-host K` to emulate several on one machine), else srun's `SLURMD_NODENAME`,
else the machine's host name; the processes tell each other theirs once, through JAX's coordination service.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh_config import AXES, MeshConfig, format_sizes, split_ici_dcn

__all__ = ["AXES", "MeshConfig", "describe_parallelism", "format_sizes", "make_mesh"]

# How each axis reads in words, for `describe_parallelism`.
_AXIS_WORDS = {"data": "DP", "pipeline": "PP", "fsdp": "FSDP", "context": "CP", "expert": "EP", "tensor": "TP"}
JOIN = "spmdkit.distributed.join()"  # what a launched process calls first (spmdkit.distributed.initialize)
# The process counts a launcher gives each process: spmdkit launch, srun, Open MPI (spmdkit.distributed reads them).
_LAUNCHED = ("SPMDKIT_NUM_PROCESSES", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")
_HOST_TIMEOUT_MS = 300_000
_hosts: list[str] = []  # every process's host, learnt once per process


def this_host(environ: Mapping[str, str] | None = None) -> str:
    """This process's host: `SPMDKIT_HOST`, else srun's `SLURMD_NODENAME`, else the machine's name."""
    env = os.environ if environ is None else environ
    slurm = env.get("SLURMD_NODENAME") if "SLURM_PROCID" in env else None
    return env.get("SPMDKIT_HOST") or slurm or socket.gethostname()


def process_hosts() -> list[str]:
    """The host of every JAX process (index: `jax.process_index()`), exchanged once through the coordination
    service's key-value store; every process must ask (as every process builds the mesh)."""
    count = jax.process_count()
    if count == 1:
        return [this_host()]
    if len(_hosts) == count:
        return list(_hosts)
    from jax._src import distributed  # the client `jax.distributed.initialize` started

    client = distributed.global_state.client
    if client is None:  # joined without a coordination service: a process is a host
        return [f"process {i}" for i in range(count)]
    client.key_value_set(f"spmdkit/host/{jax.process_index()}", this_host())
    hosts = []
    for i in range(count):
        try:
            hosts.append(client.blocking_key_value_get(f"spmdkit/host/{i}", _HOST_TIMEOUT_MS))
        except Exception:  # JaxRuntimeError: DEADLINE_EXCEEDED
            raise SpmdkitError(
                f"process {i} did not tell its host within {_HOST_TIMEOUT_MS // 1000} s: every process of the job "
                "must build the mesh"
            ) from None
    _hosts[:] = hosts
    return hosts


def _not_joined(error: SpmdkitError | None) -> SpmdkitError | None:
    """The error for a launched process that did not join its job: always under `spmdkit launch`; under srun or
    Open MPI (whose variables a single process can inherit) only when the mesh does not fit."""
    launched = [(name, int(v)) for name in _LAUNCHED if (v := os.environ.get(name, "")).isdigit() and int(v) > 1]
    name, count = launched[0] if launched else ("", 1)
    if count == 1 or jax.process_count() > 1 or (error is None and name != "SPMDKIT_NUM_PROCESSES"):
        return error
    return SpmdkitError(
        f"this process is 1 of {count} ({name}={count}) but has not joined their job, so it sees only its own "
        f"{jax.device_count()} device(s): call {JOIN} first thing in your script, before JAX computes anything"
    )


def _granules(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
    """`devices` grouped by host, hosts in the order of their first device; each host's devices in their order.
    In one process, devices of several processes are a compile-only topology's, whose process index is the host."""
    if len({d.process_index for d in devices}) == 1:
        return [list(devices)]
    hosts = process_hosts() if jax.process_count() > 1 else None
    groups: dict[object, list[jax.Device]] = {}
    for device in devices:
        groups.setdefault(hosts[device.process_index] if hosts else device.process_index, []).append(device)
    if len({len(group) for group in groups.values()}) > 1:
        counts = ", ".join(f"{host}: {len(group)}" for host, group in groups.items())
        raise SpmdkitError(f"hosts hold different numbers of devices ({counts}): give every host the same count")
    return list(groups.values())


def _hybrid_grid(ici: list[int], dcn: list[int], granules: list[list[jax.Device]]) -> np.ndarray:
    """The devices as `ici x dcn` (elementwise): granule i's in-host block at position i of the `dcn` grid."""
    blocks = [mesh_utils.create_device_mesh(ici, g, allow_split_physical_axes=True) for g in granules]
    where = np.arange(len(granules)).reshape(dcn)
    return np.block(np.vectorize(lambda i: blocks[i], otypes=[object])(where).tolist())


def make_mesh(config: MeshConfig | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the 6-axis mesh (all `AxisType.Auto`) over `devices` (default: every device of every process)."""
    if isinstance(config, str):
        config = MeshConfig.parse(config)
    every = devices is None  # a launched process that did not join sees only its own devices: say so
    if every and (error := _not_joined(None)):
        raise error
    devices = list(jax.devices() if devices is None else devices)
    try:
        sizes = config.resolve(len(devices))
    except SpmdkitError as error:
        raise (_not_joined(error) if every else error) from None
    granules, dcn = _granules(devices), dict(config.dcn)
    if len(granules) == 1 and any(factor > 1 for factor in dcn.values()):
        processes = len({d.process_index for d in devices})
        where = "one process" if processes == 1 else f"{processes} processes on one host ({this_host()})"
        raise SpmdkitError(
            f"--dcn {format_sizes(dcn)} says axes span nodes, but this run has {where}: drop --dcn, or start "
            "processes on several nodes (srun; on one machine, spmdkit launch --processes-per-host K emulates them)"
        )
    if len(granules) > 1:
        grid = _hybrid_grid(*split_ici_dcn(sizes, len(granules), dcn), granules)
    elif devices == jax.devices():
        grid = mesh_utils.create_device_mesh([sizes[axis] for axis in AXES], devices, allow_split_physical_axes=True)
    else:
        # A subset (e.g. 4 of 8 devices): keep the caller's order.
        grid = np.asarray(devices, dtype=object).reshape([sizes[axis] for axis in AXES])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def describe_parallelism(mesh: Mesh) -> str:
    """'FSDP over 4 devices x TP over 2' for the axes of size > 1."""
    parts = [f"{_AXIS_WORDS[a]} over {mesh.shape[a]}" for a in AXES if mesh.shape.get(a, 1) > 1]
    if not parts:
        return "a single device (no parallelism)"
    parts[0] += " devices"
    return " x ".join(parts)
