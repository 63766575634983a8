"""`spmdkit ckpt reshard`, `export` and `import-hf`: move a checkpoint onto another mesh, or to and from Hugging Face.

- `reshard_checkpoint`: rebuild the abstract train state from the checkpoint's saved config, with the shardings
  of a new mesh; restore onto it with Orbax; save the same items (state, data, config) into a new directory.
  The data-iterator files are copied as they are; the config records the new mesh.
- `export_hf`: the parameters (only) as one `.safetensors` file with Hugging Face Llama names and layout, and a
  `config.json` (LlamaConfig keys) beside it. Both use rotate-half RoPE, so q/k need no permutation.
- `import_hf`: the inverse; a fresh optimizer state (step 0) and a `TrainConfig` naming the matching preset.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from spmdkit.checkpoint.manager import Checkpointer, to_saved_tree
from spmdkit.data.stream import make_data
from spmdkit.errors import SpmdkitError
from spmdkit.models import Transformer, TransformerConfig
from spmdkit.models.config import PRESETS
from spmdkit.sharding.mesh import MeshConfig, make_mesh
from spmdkit.sharding.partition import abstract_state
from spmdkit.sharding.rules import make_rules
from spmdkit.train.config import TrainConfig, apply_overrides, config_from_json
from spmdkit.train.optimizer import make_optimizer
from spmdkit.train.state import abstract_train_state

EXPORT_DTYPES = ("float32", "bfloat16")
# Fields of TransformerConfig that fix a model's parameters and its function (compute dtype aside).
_SHAPE_FIELDS = ("vocab_size", "embed", "layers", "heads", "kv_heads", "head_dim", "mlp", "rope_theta", "norm_eps")


def _open_step(directory: str | Path, step: int | None) -> tuple[Checkpointer, int]:
    checkpointer = Checkpointer(directory, read_only=True)
    steps = checkpointer.steps()
    if not steps:
        checkpointer.close()
        raise SpmdkitError(f"no checkpoint steps in {checkpointer.directory}: pass a directory written by training")
    if step is None:
        return checkpointer, steps[-1]
    if step not in steps:
        checkpointer.close()
        raise SpmdkitError(
            f"step {step} is not in {checkpointer.directory}: it holds steps {', '.join(map(str, steps))}"
        )
    return checkpointer, step


def _saved_config(checkpointer: Checkpointer, step: int) -> TrainConfig:
    try:
        saved = checkpointer.read_config(step)
    except Exception:  # noqa: BLE001 - a missing or unreadable config item: say what is needed
        raise SpmdkitError(
            f"step {step} of {checkpointer.directory} holds no config item: only checkpoints written by "
            "'spmdkit train' or 'spmdkit ckpt import-hf' know their model"
        ) from None
    return config_from_json(json.dumps(saved))


def _fresh_output(out: str | Path) -> Path:
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise SpmdkitError(f"{out} is a file: pass a new directory for the converted checkpoint")
    if out.exists() and any(out.iterdir()):
        raise SpmdkitError(f"{out} is not empty: pass a new directory for the converted checkpoint")
    return out


def train_state_layout(config: TrainConfig, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef, nnx.State, Any]:
    """(graphdef, abstract train state, shardings) of `config`'s model and optimizer on `mesh`; no allocation."""
    model = config.model.build(mesh.shape["context"])
    tx = make_optimizer(config.optimizer, config.run.steps)
    rules = make_rules(config.mesh.zero, config.mesh.sequence_parallel)
    return abstract_train_state(model, tx, mesh, rules, config.run.seed)


# ------------------------------------------------------------------------------------------------- reshard


def reshard_checkpoint(directory: str | Path, out: str | Path, mesh: str, step: int | None = None) -> int:
    """Restore `step` (default: the newest) of `directory` onto `mesh` and save it into `out`; returns the step."""
    out = _fresh_output(out)
    source, step = _open_step(directory, step)
    try:
        config = _saved_config(source, step)
        config = apply_overrides(config, {"mesh": {"mesh": mesh, "dcn": None}})  # this process lays it out
        new_mesh = make_mesh(MeshConfig.parse(mesh, config.mesh.dcn))
        _, abstract, shardings = train_state_layout(config, new_mesh)
        state = source.restore(step, abstract, shardings)
    finally:
        source.close()
    target = Checkpointer(out, every=0, keep=1)
    try:
        target.save(step, state, config=json.loads(config.to_json()), force=True)
        target.wait()
    finally:
        target.close()
    data = Path(source.directory) / str(step) / "data"
    if data.is_dir() and jax.process_index() == 0:
        shutil.copytree(data, out / str(step) / "data")
    return step


# ------------------------------------------------------------------------------------------------- HF export


def read_params(directory: str | Path, step: int | None = None) -> tuple[int, TrainConfig, dict[str, Any]]:
    """(step, saved config, model parameters as a pure dict of host arrays); the optimizer state is not read."""
    checkpointer, step = _open_step(directory, step)
    try:
        config = _saved_config(checkpointer, step)
        metadata = checkpointer.manager.item_metadata(step)["state"]
        sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        target = {
            "model": jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), metadata["model"]
            )
        }
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
        with ocp.PyTreeCheckpointer() as reader:  # only the model's arrays are read
            restored = reader.restore(checkpointer.directory / str(step) / "state", args=args)["model"]
    finally:
        checkpointer.close()
    return step, config, jax.tree.map(np.asarray, restored)


def hf_config(model: TransformerConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.embed,
        "intermediate_size": model.mlp,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "num_hidden_layers": model.layers,
        "vocab_size": model.vocab_size,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def to_hf_tensors(params: dict[str, Any], model: TransformerConfig) -> dict[str, np.ndarray]:
    """spmdkit parameters (pure dict) -> {Hugging Face Llama name: [out, in] array}."""
    blocks, attention, mlp = params["blocks"], params["blocks"]["attention"], params["blocks"]["mlp"]
    inner = model.heads * model.head_dim
    tensors = {"model.embed_tokens.weight": params["embedding"]}
    for i in range(model.layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = attention["q"][i].reshape(model.embed, -1).T
        tensors[p + "self_attn.k_proj.weight"] = attention["k"][i].reshape(model.embed, -1).T
        tensors[p + "self_attn.v_proj.weight"] = attention["v"][i].reshape(model.embed, -1).T
        tensors[p + "self_attn.o_proj.weight"] = attention["o"][i].reshape(inner, model.embed).T
        tensors[p + "mlp.gate_proj.weight"] = mlp["gate"][i].T
        tensors[p + "mlp.up_proj.weight"] = mlp["up"][i].T
        tensors[p + "mlp.down_proj.weight"] = mlp["down"][i].T
        tensors[p + "input_layernorm.weight"] = blocks["attention_norm"]["scale"][i]
        tensors[p + "post_attention_layernorm.weight"] = blocks["mlp_norm"]["scale"][i]
    tensors["model.norm.weight"] = params["final_norm"]["scale"]
    tensors["lm_head.weight"] = params["lm_head"].T
    return {name: np.ascontiguousarray(value) for name, value in tensors.items()}


def export_hf(directory: str | Path, out: str | Path, dtype: str = "float32", step: int | None = None) -> Path:
    """Write `out` (.safetensors) and `config.json` beside it from `step` (default: the newest); returns `out`."""
    from safetensors.flax import save_file

    if dtype not in EXPORT_DTYPES:
        raise SpmdkitError(f"unknown export dtype {dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
    out = Path(out).expanduser().absolute()
    if out.suffix != ".safetensors":
        raise SpmdkitError(f"--out {out} must name a .safetensors file")
    step, config, params = read_params(directory, step)
    model = config.model.build()
    if model.experts:
        raise SpmdkitError(
            f"{config.model.name} is a mixture-of-experts model; export writes the dense Llama format: export a "
            f"dense model, or read the experts with `spmdkit ckpt inspect`"
        )
    tensors = to_hf_tensors(params, model)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: jax.numpy.asarray(v, dtype) for k, v in tensors.items()}, str(out), metadata={"format": "pt"})
    meta = hf_config(model) | {"torch_dtype": dtype}
    (out.parent / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


# ------------------------------------------------------------------------------------------------- HF import


def model_from_hf_config(hf: dict[str, Any]) -> TransformerConfig:
    heads = hf["num_attention_heads"]
    return TransformerConfig(
        vocab_size=hf["vocab_size"],
        embed=hf["hidden_size"],
        layers=hf["num_hidden_layers"],
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp=hf["intermediate_size"],
        rope_theta=float(hf.get("rope_theta", 10_000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def matching_preset(model: TransformerConfig) -> str:
    """The preset whose shape (and RoPE base, norm epsilon) equals `model`'s; SpmdkitError if none does."""
    wanted = tuple(getattr(model, f) for f in _SHAPE_FIELDS)
    for name, preset in PRESETS.items():
        if tuple(getattr(preset, f) for f in _SHAPE_FIELDS) == wanted:
            return name
    shape = ", ".join(f"{f}={v}" for f, v in zip(_SHAPE_FIELDS, wanted, strict=True))
    raise SpmdkitError(f"no spmdkit model preset has this shape ({shape}): add a preset to models/config.py first")


def from_hf_tensors(tensors: dict[str, np.ndarray], model: TransformerConfig, tied: bool) -> dict[str, Any]:
    """Inverse of `to_hf_tensors`: {HF name: array} -> spmdkit's pure parameter dict (float32)."""

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise SpmdkitError(f"the safetensors file lacks {name}: is it a Llama model?")
        return np.asarray(tensors[name], np.float32)

    def stack(suffix: str, convert: Any) -> np.ndarray:
        return np.stack([convert(get(f"model.layers.{i}.{suffix}")) for i in range(model.layers)])

    e, hd = model.embed, model.head_dim
    lm_head = get("model.embed_tokens.weight") if tied or "lm_head.weight" not in tensors else get("lm_head.weight")
    return {
        "embedding": get("model.embed_tokens.weight"),
        "blocks": {
            "attention": {
                "q": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(e, model.heads, hd)),
                "k": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(e, model.kv_heads, hd)),
                "v": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(e, model.kv_heads, hd)),
                "o": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(model.heads, hd, e)),
            },
            "attention_norm": {"scale": stack("input_layernorm.weight", lambda w: w)},
            "mlp": {
                "gate": stack("mlp.gate_proj.weight", lambda w: w.T),
                "up": stack("mlp.up_proj.weight", lambda w: w.T),
                "down": stack("mlp.down_proj.weight", lambda w: w.T),
            },
            "mlp_norm": {"scale": stack("post_attention_layernorm.weight", lambda w: w)},
        },
        "final_norm": {"scale": get("model.norm.weight")},
        "lm_head": lm_head.T,
    }


def import_hf(file: str | Path, out: str | Path, mesh: str = "", step: int = 0) -> Path:
    """An spmdkit checkpoint (state with a fresh optimizer, config) in `out` from a Llama `.safetensors` file
    and the `config.json` beside it; the parameters are laid out on `mesh` (default: every device on fsdp)."""
    from safetensors.numpy import load_file

    file = Path(file).expanduser().absolute()
    hf_path = file.parent / "config.json"
    if not file.is_file() or not hf_path.is_file():
        raise SpmdkitError(f"need {file} and a config.json beside it (the Hugging Face model directory)")
    out = _fresh_output(out)
    hf = json.loads(hf_path.read_text())
    model = model_from_hf_config(hf)
    config = apply_overrides(TrainConfig(), {"model": {"name": matching_preset(model)}, "mesh": {"mesh": mesh}})
    try:
        tensors = load_file(str(file))
    except Exception:  # noqa: BLE001 - numpy has no bfloat16: read through JAX
        from safetensors.flax import load_file as load_jax

        tensors = {k: np.asarray(v.astype(np.float32)) for k, v in load_jax(str(file)).items()}
    params = from_hf_tensors(tensors, model, bool(hf.get("tie_word_embeddings", False)))

    new_mesh = make_mesh(MeshConfig.parse(mesh, config.mesh.dcn))
    _, abstract, shardings = train_state_layout(config, new_mesh)
    model_config = config.model.build(new_mesh.shape["context"])
    like = to_saved_tree(abstract)["model"]
    paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(like)}
    if paths != {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}:
        raise SpmdkitError("the imported parameters do not form this model's parameter tree")
    for path, value in jax.tree_util.tree_leaves_with_path(params):
        wanted = like
        for key in path:
            wanted = wanted[key.key]
        if value.shape != wanted.shape:
            raise SpmdkitError(f"imported {jax.tree_util.keystr(path)} has shape {value.shape}, not {wanted.shape}")
    tx = make_optimizer(config.optimizer, config.run.steps)

    def create(pure: dict[str, Any]) -> nnx.State:
        """The train state with these parameters and a fresh optimizer (the random init is dead code)."""
        with nnx.use_eager_sharding(False):
            model = Transformer(model_config, rngs=nnx.Rngs(0))
            params_state = nnx.state(model)
            nnx.replace_by_pure_dict(params_state, pure)
            nnx.update(model, params_state)
            return nnx.state((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

    with jax.set_mesh(new_mesh):
        state = jax.jit(create, out_shardings=shardings)(params)
    # The data position of a run that starts here: a fresh train iterator, so that `spmdkit train` resumes from
    # this step like from any other.
    run = config.run
    data = make_data(config.data, seq_len=run.seq_len, global_batch=run.batch_size,
                     vocab_size=model_config.vocab_size, seed=run.seed, split="train")  # fmt: skip
    checkpointer = Checkpointer(out, every=0, keep=1)
    try:
        checkpointer.save(step, state, data.iterator, config=json.loads(config.to_json()), force=True)
    finally:
        checkpointer.close()
    return out


def model_from_checkpoint(directory: str | Path, step: int | None = None, dtype: str = "float32") -> Transformer:
    """The `Transformer` of a checkpoint's step (default: the newest), on one device, computing in `dtype`."""
    _, config, params = read_params(directory, step)
    model_config = config.model.build().replace(dtype=dtype)
    graphdef, abstract = abstract_state(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
    nnx.replace_by_pure_dict(abstract, jax.tree.map(jax.numpy.asarray, params))
    return nnx.merge(graphdef, abstract)
