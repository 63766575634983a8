"""Models on an inference mesh: the mesh, its rules, a module placed on it, or parameters restored from a checkpoint.

Inference meshes have two axes that matter: `tensor` (TP: attention heads, KV heads, the MLP and the vocab split;
per token and layer two all-reduces of [batch, 1, embed] and no weight moves, so latency falls as TP grows) and
`data` (replicas, each with its share of the batch: throughput grows, latency does not). An FSDP layout is refused:
every decode step would all-gather every weight, a step's whole parameter bytes over the links per token.
Parameters are replicated over `data` and never sharded over `embed` (the rules of ZeRO stage 0).

Sources of a model (`TransformerConfig` + parameters, from anywhere):
- an `nnx` `Transformer` (from `Transformer(...)`, training, or `spmdkit.load_model`): `place_model` re-lays its
  parameters out on the inference mesh;
- an spmdkit run or checkpoint directory: `open_checkpoint` reads the newest step's saved config (the model
  preset and overrides, the run's sequence length and data source), `restore_model` reads only the parameters
  (`state/model`, never the optimizer state), each device reading only its own blocks, and `run_tokenizer` finds
  the tokenizer that travels with the run (its `tokenizer.json`, else its data source's: bytes for stdlib).

Generation always runs mixture-of-experts layers with the `dropless` dispatch (nothing dropped: a capacity limit
would make a token's output depend on the padding and the other prompts of its batch).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from spmdkit.checkpoint.manager import Checkpointer
from spmdkit.data.config import DataConfig
from spmdkit.data.resolve import source_tokenizer
from spmdkit.data.tokenizer import Tokenizer, load_tokenizer
from spmdkit.data.tokenizer.tokenizer import TOKENIZER_FILE
from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig, model_preset
from spmdkit.models.transformer import Transformer
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.mesh_config import AXES, MeshConfig, format_sizes
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
    kernel), and the compute dtype `dtype` when given."""
    changes: dict[str, Any] = {"attention": "dot"}
    if config.experts:
        changes["dispatch"] = "dropless"
    if dtype is not None:
        changes["dtype"] = dtype
    return config.replace(**changes)


def param_shardings(config: TransformerConfig, mesh: Mesh, rules: Rules) -> tuple[nnx.GraphDef, nnx.State, Any]:
    """(graphdef, abstract state, shardings) of `config`'s Transformer on `mesh` under `rules`; no allocation."""
    graphdef, abstract = abstract_state(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return graphdef, abstract, state_shardings(abstract, mesh, rules.params)


def place_model(
    model: Transformer, mesh: Mesh, rules: Rules, *, dtype: str | None = None, param_dtype: str | None = None
) -> Transformer:
    """`model`'s parameters laid out on the inference mesh (cast to `param_dtype` when given), as a module with
    the generation config (`generation_config`)."""
    config = generation_config(model.config, dtype)
    graphdef, _, shardings = param_shardings(config, mesh, rules)
    state = nnx.state(model)
    if param_dtype is not None:
        state = jax.tree.map(lambda a: a.astype(param_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
    return nnx.merge(graphdef, jax.device_put(state, shardings))


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """A step of an spmdkit checkpoint and what its saved run config says."""

    directory: Path  # the checkpoint directory (RUN_DIR/checkpoints)
    step: int
    config: dict[str, Any]  # the run config saved with the step (sections model, data, run, ...)

    @property
    def model(self) -> TransformerConfig:
        """The model: the preset named by `model.name` with every field the run overrode."""
        settings = self.config.get("model", {})
        fields = {f.name for f in dataclasses.fields(TransformerConfig)}
        changes = {k: v for k, v in settings.items() if k in fields and k != "attention" and v is not None}
        return model_preset(settings.get("name", "tiny")).replace(**changes)

    @property
    def seq_len(self) -> int | None:
        """The sequence length the run trained on: the context generation allows by default."""
        return self.config.get("run", {}).get("seq_len")

    @property
    def data(self) -> DataConfig:
        fields = {f.name for f in dataclasses.fields(DataConfig)}
        return DataConfig(**{k: v for k, v in self.config.get("data", {}).items() if k in fields})


def open_checkpoint(path: str | Path, step: int | None = None) -> CheckpointSource:
    """The newest step (or `step`) of a run directory or checkpoint directory, with its saved config."""
    path = Path(path).expanduser()
    if not path.exists():
        raise SpmdkitError(f"{path} does not exist: pass a run directory or its checkpoints/ directory")
    checkpointer = Checkpointer(path, read_only=True)
    try:
        steps = checkpointer.steps()
        if not steps:
            raise SpmdkitError(f"no checkpoint steps in {checkpointer.directory}: pass a directory written by training")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise SpmdkitError(f"step {step} is not in {checkpointer.directory}: it holds {', '.join(map(str, steps))}")
        try:
            config = checkpointer.read_config(step)
        except Exception:  # noqa: BLE001 - a missing or unreadable config item: say what is needed
            raise SpmdkitError(
                f"step {step} of {checkpointer.directory} holds no config item: only checkpoints written by "
                "'spmdkit train' or 'spmdkit ckpt import-hf' know their model"
            ) from None
        return CheckpointSource(checkpointer.directory, step, config)
    finally:
        checkpointer.close()


def restore_model(
    source: CheckpointSource,
    mesh: Mesh,
    rules: Rules,
    *,
    dtype: str | None = None,
    param_dtype: str | None = None,
    config: TransformerConfig | None = None,
) -> Transformer:
    """The checkpoint's parameters (only: the optimizer state is never read) on `mesh`, each device reading its
    own blocks, cast to `param_dtype` (default: the compute dtype, halving the bytes every token reads), as a
    module of `config` (default: the saved model's `generation_config`; evaluation passes the saved one)."""
    config = config or generation_config(source.model, dtype)
    param_dtype = param_dtype or config.dtype
    graphdef, abstract, shardings = param_shardings(config.replace(param_dtype=param_dtype), mesh, rules)
    leaves, treedef = jax.tree.flatten(abstract)
    wanted = treedef.unflatten(
        [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(leaves, jax.tree.leaves(shardings), strict=True)
        ]
    )
    target = {"model": nnx.to_pure_dict(wanted)}
    _check_shapes(source, target["model"])
    args = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    with ocp.PyTreeCheckpointer() as reader:  # only the model's arrays are read
        restored = reader.restore(source.directory / str(source.step) / "state", args=args)["model"]
    nnx.replace_by_pure_dict(abstract, restored)
    return nnx.merge(graphdef, abstract)


def _check_shapes(source: CheckpointSource, wanted: dict[str, Any]) -> None:
    checkpointer = Checkpointer(source.directory, read_only=True)
    try:
        saved = checkpointer.saved_shapes(source.step)
    finally:
        checkpointer.close()
    for path, leaf in jax.tree_util.tree_leaves_with_path(wanted):
        name = "model/" + "/".join(str(getattr(p, "key", p)) for p in path)
        found = saved.get(name, (None, None))[0]
        if found != tuple(leaf.shape):
            raise SpmdkitError(
                f"step {source.step} of {source.directory} does not match its saved model config: {name} is "
                f"{'missing' if found is None else found} there but {tuple(leaf.shape)} here"
            )


def run_tokenizer(source: CheckpointSource) -> Tokenizer | None:
    """The tokenizer of the run: `tokenizer.json` in the run or checkpoint directory, else the data source's
    (bytes for stdlib, a prepared dataset's own); None for token files and synthetic data."""
    for directory in (source.directory, source.directory.parent):
        if (directory / TOKENIZER_FILE).is_file():
            return load_tokenizer(directory)
    try:
        return source_tokenizer(source.data)
    except SpmdkitError as error:
        raise SpmdkitError(f"the tokenizer of {source.directory} cannot be found ({error})") from None


def describe_mesh(mesh: Mesh) -> str:
    """'tensor=4,data=2' (axes of size 1 left out), or 'single device'."""
    return format_sizes(dict(mesh.shape))
