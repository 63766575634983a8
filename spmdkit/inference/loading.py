"""Models on an inference mesh: the mesh, its rules, a module placed on it, or parameters restored from a checkpoint.

Inference meshes have two axes that matter: `tensor` (TP: attention heads, KV heads, the MLP and the vocab split;
per token and layer two all-reduces of [batch, 1, embed] and no weight moves, so latency falls as TP grows) and
`data` (replicas, each with its share of the batch: throughput grows, latency does not). An FSDP layout is refused:
every decode step would all-gather every weight, a step's whole parameter bytes over the links per token.
Parameters are replicated over `data` and never sharded over `embed` (the rules of ZeRO stage 0).

An `nnx` `Transformer` (from `Transformer(...)`, training, or `spmdkit.load_model`) is re-laid out on the inference
mesh by `place_model`; a checkpoint or a Hugging Face directory is read straight onto it by
`spmdkit.inference.sources`.

Generation always runs mixture-of-experts layers with the `dropless` dispatch (nothing dropped: a capacity limit
would make a token's output depend on the padding and the other prompts of its batch).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig
from spmdkit.models.transformer import Transformer
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.mesh_config import AXES, MeshConfig
from spmdkit.sharding.partition import abstract_state, state_shardings
from spmdkit.sharding.rules import Rules, make_rules

INFERENCE_AXES = ("data", "tensor")


def inference_rules() -> Rules:
    """Logical names -> mesh axes for generation: batch over data, heads / kv_heads / mlp / vocab over tensor,
    parameters never split over `embed` (no per-token all-gather of weights)."""
    return make_rules(zero_stage=0)


def check_mesh_spec(spec: str) -> dict[str, int]:
    """The axis sizes of an inference mesh spec, refusing fsdp and every axis but `data` and `tensor`."""
    sizes = MeshConfig.parse(spec).sizes()
    if sizes["fsdp"] != 1:
        raise SpmdkitError(
            f"--mesh {spec}: generation does not use fsdp (it would all-gather every weight for every token): "
            "use tensor=N for latency and data=N for throughput"
        )
    other = [axis for axis in AXES if axis not in INFERENCE_AXES and sizes[axis] != 1]
    if other:
        raise SpmdkitError(f"--mesh {spec}: generation runs on the tensor and data axes only, not {', '.join(other)}")
    return sizes


def inference_mesh(spec: str | None = None, devices: list[jax.Device] | None = None) -> Mesh:
    """The mesh of `spec` ('tensor=4,data=2'; None or '': one device). Only `data` and `tensor` may exceed 1;
    the mesh takes the first devices it needs (or all, with an axis of -1)."""
    devices = list(jax.devices() if devices is None else devices)
    if not spec:
        return make_mesh(MeshConfig(fsdp=1), devices[:1])
    sizes = check_mesh_spec(spec)
    count = len(devices) if -1 in sizes.values() else math.prod(sizes.values())
    if count > len(devices):
        raise SpmdkitError(f"--mesh {spec} needs {count} devices but {len(devices)} are present")
    return make_mesh(MeshConfig.parse(spec), devices[:count])


def generation_config(config: TransformerConfig, dtype: str | None = None) -> TransformerConfig:
    """The config generation runs: MoE dispatch `dropless`, the `dot` attention setting (generation brings its own
    kernel) with its output whole (no Ulysses parts), no FP8 (its scales are training state: generation runs the
    compute dtype), and the compute dtype `dtype` when given."""
    changes: dict[str, Any] = {"attention": "dot", "ulysses_parts": 1, "fp8": False}
    if config.experts:
        changes["dispatch"] = "dropless"
    if dtype is not None:
        changes["dtype"] = dtype
    return config.replace(**changes)


def abstract_model(config: TransformerConfig, mesh: Mesh, rules: Rules) -> tuple[nnx.GraphDef, nnx.State, Any]:
    """(graphdef, abstract state, shardings) of `config`'s Transformer on `mesh` under `rules`; no allocation."""
    graphdef, abstract = abstract_state(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return graphdef, abstract, state_shardings(abstract, mesh, rules.params)


def place_model(
    model: Transformer, mesh: Mesh, rules: Rules, *, dtype: str | None = None, param_dtype: str | None = None
) -> Transformer:
    """`model`'s parameters laid out on the inference mesh (cast to `param_dtype` when given), as a module with
    the generation config (`generation_config`)."""
    config = generation_config(model.config, dtype)
    graphdef, _, shardings = abstract_model(config, mesh, rules)
    state = nnx.state(model)
    if param_dtype is not None:
        state = jax.tree.map(lambda a: a.astype(param_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
    return nnx.merge(graphdef, jax.device_put(state, shardings))
