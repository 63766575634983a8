"""LoRA adapters out in PEFT's format, and merged into the base weights.

A run with `--lora.rank` saves qwix's adapters beside the frozen base (`spmdkit.models.lora`): for a projection W
(`blocks/attention/q` [layers, embed, heads, head_dim]) the stacked A `q_lora_a` [layers, *in, rank] and B
`q_lora_b` [layers, rank, *out], and the layer computes x W + (alpha / rank) x A B. PEFT's LoRA computes
W x + (lora_alpha / r) B(A(x)) on the Hugging Face module (`q_proj.weight` [out, in]) with `lora_A.weight` [r, in]
and `lora_B.weight` [out, r]. So PEFT's A is ours flattened to [in, rank] and transposed, its B ours flattened to
[rank, out] and transposed, where in and out flatten in the order `spmdkit.interop.tensor_names` flattens the base
weight (q's out is heads x head_dim, o's in is heads x head_dim): the names and the layers come from its
`TensorMap`s, the one table of how spmdkit's parameters are named in Hugging Face's files.

A LoRA run's checkpoint holds the adapters, not the frozen base (`spmdkit.checkpoint.tree`); its saved config
names the base (`model.init_from`) and its checksum (`lora.base_checksum`). `lora_run_params` is how every reader of
such a run (`load_model`: evaluation, generation, `--init-from`) gets its model: the base read again from that
path, its checksum checked, and the adapters merged in; `ckpt export` does the same on the host (`base_weights`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.errors import SpmdkitError
from spmdkit.interop.families import FAMILIES
from spmdkit.interop.sources import weights_checksum
from spmdkit.interop.tensor_names import TensorMap, tensor_maps
from spmdkit.models.config import TransformerConfig
from spmdkit.models.lora_config import HF_MODULES, LoraConfig, is_adapter

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel's prefix before the transformers model's own names


def adapter_pairs(params: dict[str, Any]) -> list[tuple[tuple[str, ...], Any, Any]]:
    """(base weight's path, A, B) of every adapter in a pure dict of parameters (nested dicts)."""
    found = []

    def walk(tree: dict[str, Any], path: tuple[str, ...]) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, (*path, str(key)))
            elif str(key).endswith("_lora_a"):
                name = str(key)[: -len("_lora_a")]
                found.append(((*path, name), value, tree[f"{name}_lora_b"]))

    walk(params, ())
    return found


def _delta(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A [layers, *in, r] and B [layers, r, *out] -> A B [layers, *in, *out] in float32."""
    layers, rank = a.shape[0], a.shape[-1]
    product = np.matmul(a.reshape(layers, -1, rank).astype(np.float32), b.reshape(layers, rank, -1).astype(np.float32))
    return product.reshape(a.shape[:-1] + b.shape[2:])


def merged_params(params: dict[str, Any], scale: float) -> dict[str, Any]:
    """The base parameters with every adapter merged in (W + scale x A B, computed in float32, stored in W's
    dtype) and the adapters dropped: what a plain export of a LoRA run writes. A QLoRA run's W is its base as the
    run computed with it (`spmdkit.models.lora.as_trained`: quantized and dequantized), so the export computes
    what the run computed."""
    merged = _without_adapters(params)
    for path, a, b in adapter_pairs(params):
        parent = merged
        for key in path[:-1]:
            parent = parent[key]
        w = np.asarray(parent[path[-1]])
        parent[path[-1]] = (w.astype(np.float32) + np.float32(scale) * _delta(np.asarray(a), np.asarray(b))).astype(
            w.dtype
        )
    return merged


def _without_adapters(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_adapters(v) if isinstance(v, dict) else v for k, v in tree.items() if not is_adapter(str(k))}


def peft_tensors(params: dict[str, Any], model: TransformerConfig, family: str) -> dict[str, np.ndarray]:
    """PEFT's `adapter_model.safetensors` tensors: `base_model.model.<HF module>.lora_A.weight` [r, in] and
    `.lora_B.weight` [out, r] of every layer, from a pure dict of a LoRA run's parameters (float32 as stored)."""
    if FAMILIES[family].fused:
        raise SpmdkitError(f"--adapters: {family} fuses its projections (qkv_proj, gate_up_proj): PEFT adapters of "
                           "fused modules are not written yet; export the merged model instead")  # fmt: skip
    maps: dict[tuple[str, ...], TensorMap] = {m.path: m for m in tensor_maps(model, family)}
    tensors = {}
    for path, a, b in adapter_pairs(params):
        base = maps[path]
        a, b = np.asarray(a), np.asarray(b)
        rank = a.shape[-1]
        for entry in range(len(base.layers)):
            name = PEFT_PREFIX + base.hf_name(entry).removesuffix(".weight")
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[entry].reshape(-1, rank).T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[entry].reshape(rank, -1).T)
    return tensors


def peft_config(lora: LoraConfig, base_model: str | None) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for `lora` (`peft.LoraConfig`'s keys)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "target_modules": sorted(HF_MODULES[t] for t in lora.target_names), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "base_model_name_or_path": base_model,
    }  # fmt: skip


def write_peft_adapter(
    out: Path, params: dict[str, Any], model: TransformerConfig, family: str, lora: LoraConfig, base: str | None
) -> Path:
    """A PEFT adapter directory in `out` (already created, empty): `adapter_config.json` and
    `adapter_model.safetensors`, that `peft.PeftModel.from_pretrained(base_model, out)` loads."""
    from safetensors.numpy import save_file

    tensors = peft_tensors(params, model, family)
    if not tensors:
        raise SpmdkitError("--adapters: this checkpoint holds no LoRA adapters (train with --lora.rank R)")
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora, base), indent=2) + "\n")
    return out


def check_base(run: str | Path, saved: dict[str, Any]) -> str:
    """The base weights' path of the LoRA run `run` (`saved`: its saved config), checked to be the weights its
    adapters were trained on (`lora.base_checksum`); SpmdkitError (one line) when they moved or changed."""
    source, checksum = (saved.get("model") or {}).get("init_from"), (saved.get("lora") or {}).get("base_checksum")
    if not source:
        raise SpmdkitError(f"{run} is a LoRA run without the path of its base weights (no model.init_from saved)")
    if not Path(source).expanduser().exists():
        raise SpmdkitError(
            f"{run} holds LoRA adapters of the base weights {source}, which are gone: put them back there (the "
            "checkpoint holds the adapters only)"
        )
    found = weights_checksum(source)
    if found != checksum:
        raise SpmdkitError(
            f"{run} trained its adapters on other base weights than {source} now holds (checksum {checksum}, found "
            f"{found}): put the run's base weights back there"
        )
    return source


def lora_run_params(
    run: str | Path, saved: dict[str, Any], model: TransformerConfig, shardings: Any, dtype: str, step: int | None
) -> dict[str, Any]:
    """The merged parameters (W + alpha / rank x A B, as `merged_params`) of `step` of the LoRA run `run` (its
    saved config `saved`), in `dtype`, laid out by `shardings` (a pure dict of the base parameters' shardings): the
    base read from its recorded path (checksum checked: `check_base`) on the layout the shardings say, the adapters
    from the checkpoint, each merged weight computed in float32 on the base weight's own layout."""
    from spmdkit.checkpoint.params import read_params
    from spmdkit.interop.loading import load_params
    from spmdkit.models.lora import as_trained

    lora = LoraConfig(**saved["lora"])
    base = as_trained(load_params(check_base(run, saved), model, shardings, dtype), model, lora)
    adapters = jax.tree.map(np.asarray, read_params(run, step=step)[2])  # small; numpy: placed where W is
    scale = float(saved["lora"]["alpha"]) / int(saved["lora"]["rank"])
    for path, a, b in adapter_pairs(adapters):
        parent = base
        for key in path[:-1]:
            parent = parent[key]
        w = parent[path[-1]]
        merge = jax.jit(_merge_one, static_argnums=3, out_shardings=getattr(w, "sharding", None))
        parent[path[-1]] = merge(w, a, b, scale)
    return base


def lora_start(source: str | Path, lora: LoraConfig) -> tuple[str, dict[str, Any] | None]:
    """Where a LoRA run (`lora`) with `--init-from source` reads its frozen base, and the adapters it starts from:
    (source, None) for weights without adapters (the adapters start fresh); for a LoRA checkpoint (a LoRA run's, or
    a PEFT adapter's imported by `ckpt import-hf --adapters`), its recorded base (checksum checked) and its newest
    step's adapters (host arrays), so that training continues them. SpmdkitError (one line) when `lora`'s rank,
    alpha or targets differ from the checkpoint's."""
    from spmdkit.checkpoint.params import read_params
    from spmdkit.interop.sources import saved_run_config, source_kind

    if not lora.enabled or source_kind(source) != "spmdkit":
        return str(source), None
    saved = saved_run_config(source)[2]
    theirs = saved.get("lora") or {}
    if not theirs.get("rank"):
        return str(source), None
    ours = {"rank": lora.rank, "alpha": lora.alpha, "targets": set(lora.target_names)}
    theirs = {**theirs, "targets": set(LoraConfig(targets=theirs.get("targets") or "q").target_names)}
    for key in ("rank", "alpha", "targets"):
        if theirs.get(key) != ours[key]:
            raise SpmdkitError(
                f"--init-from {source} holds LoRA adapters with --lora.{key} {_flag(theirs[key])}, this run has "
                f"{_flag(ours[key])}: pass the same to continue them (or export the merged model and train on it)"
            )
    return check_base(source, saved), read_params(source)[2]


def initial_params(
    source: str | Path,
    lora: LoraConfig,
    model: TransformerConfig,
    shardings: dict,
    current: dict,
    adapters: bool,
    quantized: Any = None,
) -> dict[str, Any]:
    """What `--init-from source` puts into a run's model (a pure dict of its parameters, for
    `nnx.replace_by_pure_dict`): the base parameters (a LoRA checkpoint's: its recorded base) in the model's
    `param_dtype`, laid out by `shardings` (a pure dict of the model's parameters' shardings, adapters included);
    with `adapters` (a run not resumed) and a LoRA checkpoint to continue (`lora_start`), its adapters too, in the
    dtypes of `current` (the model's state, a pure dict), each device given its block. QLoRA: the weights the
    model `quantized` (the run's `nnx.Module`) holds quantized are quantized as they are placed (`quantize_base`),
    the same way at the start and at every resume."""
    from spmdkit.interop.loading import load_params
    from spmdkit.models.lora import base_params, quantize_base

    base, saved = lora_start(source, lora)
    params = load_params(base, model, base_params(shardings), model.param_dtype)
    if lora.quantize != "none":
        params = quantize_base(params, quantized, shardings)
    if saved is None or not adapters:
        return params

    def place(path: tuple[str, ...], value: Any) -> jax.Array:
        sharding, like = (_at(tree, path) for tree in (shardings, current))
        value = np.asarray(value, like.dtype)
        return jax.make_array_from_callback(like.shape, sharding, lambda index: value[index])

    placed = jax.tree_util.tree_map_with_path(lambda p, v: place(tuple(k.key for k in p), v), saved)
    return with_adapters(params, placed)


def _at(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _flag(value: Any) -> str:
    """A setting as its flag takes it ('q,v' for a set of targets)."""
    return ",".join(t for t in HF_MODULES if t in value) if isinstance(value, set) else str(value)


def _merge_one(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """W [layers, *in, *out] + scale x A [layers, *in, r] B [layers, r, *out], in float32, in W's dtype."""
    layers, rank = a.shape[0], a.shape[-1]
    flat = jnp.matmul(a.reshape(layers, -1, rank).astype(jnp.float32), b.reshape(layers, rank, -1).astype(jnp.float32))
    return (w.astype(jnp.float32) + jnp.float32(scale) * flat.reshape(w.shape)).astype(w.dtype)


def base_weights(run: str | Path, saved: dict[str, Any], model: TransformerConfig, dtype: str | None) -> dict:
    """The frozen base parameters of the LoRA run `run` (its saved config `saved`) as host numpy arrays, read from
    its recorded path (checksum checked: `check_base`), in `dtype` (None: as stored)."""
    from spmdkit.interop.loading import hf_params, load_params, param_sharding_tree, stored_dtype
    from spmdkit.interop.safetensors_files import TensorFiles
    from spmdkit.interop.sources import hf_family, source_kind

    source = check_base(run, saved)
    if source_kind(source) == "hf":
        files = TensorFiles(source)
        return hf_params(files, model, hf_family(source), None, dtype or stored_dtype(files))
    host = param_sharding_tree(model, None, None)
    return jax.tree.map(np.asarray, load_params(source, model, host, dtype or model.param_dtype))


def with_adapters(base: dict[str, Any], adapters: dict[str, Any]) -> dict[str, Any]:
    """One pure dict of parameters: `base`'s with `adapters`' leaves (`q_lora_a`, ...) added beside them."""
    merged = dict(base)
    for key, value in adapters.items():
        merged[key] = with_adapters(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


# PEFT LoraConfig keys an adapter may set only to these values (anything else changes what the adapter computes;
# the initialisations, loftq_config, eva_config, ..., change nothing once trained: not checked)
PLAIN_PEFT = {
    "use_dora": (False, None), "use_rslora": (False, None), "bias": ("none", None), "fan_in_fan_out": (False, None),
    "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "modules_to_save": (None, []), "layers_to_transform":
    (None, []), "layers_pattern": (None, []), "target_parameters": (None, []), "exclude_modules": (None, []),
    "lora_bias": (False, None), "use_qalora": (False, None), "megatron_config": (None,), "trainable_token_indices":
    (None, {}, []), "layer_replication": (None, []), "alora_invocation_tokens": (None, []), "use_bdlora": (None, False),
    "arrow_config": (None,), "kasa_config": (None,), "velora_config": (None,), "monteclora_config": (None,),
}  # fmt: skip


def read_peft_config(directory: Path) -> LoraConfig:
    """The `LoraConfig` of a PEFT adapter directory's `adapter_config.json`; SpmdkitError (one line) for what
    spmdkit's adapters do not compute: another PEFT type, targets other than the q/k/v/o/gate/up/down projections,
    per-module ranks or alphas, DoRA, rsLoRA, biases, extra trained modules, a subset of the layers."""
    from spmdkit.interop.hf_config import read_json

    found = read_json(directory / ADAPTER_CONFIG, "a PEFT adapter directory holds its adapter_config.json")
    where = f"{directory / ADAPTER_CONFIG}"
    if found.get("peft_type") != "LORA":
        raise SpmdkitError(f"{where}: peft_type {found.get('peft_type')!r} is not read: only LORA adapters are")
    for key, plain in PLAIN_PEFT.items():
        if found.get(key) not in plain:
            raise SpmdkitError(f"{where}: {key}={found[key]!r} is not supported by spmdkit's LoRA: use an adapter "
                               f"with {key}={plain[0]!r}")  # fmt: skip
    modules = found.get("target_modules")
    names = {hf: ours for ours, hf in HF_MODULES.items()}
    if not isinstance(modules, list) or not modules or any(m not in names for m in modules):
        raise SpmdkitError(
            f"{where}: target_modules {modules!r} are not among {', '.join(names)}: spmdkit's adapters are on those "
            "projections only (a list of their names; a regex is not read)"
        )
    rank, alpha = found.get("r"), found.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float) or alpha <= 0:
        raise SpmdkitError(f"{where}: r={rank!r}, lora_alpha={alpha!r}: a positive integer rank and alpha are needed")
    targets = ",".join(t for t in HF_MODULES if HF_MODULES[t] in modules)  # in spmdkit's order
    return LoraConfig(rank=rank, alpha=float(alpha), targets=targets)


def read_peft_adapter(directory: Path, shapes: dict[str, Any], model: TransformerConfig, family: str) -> dict:
    """spmdkit's stacked adapters (a pure dict: `blocks/attention/q_lora_a` [layers, *in, r], ...) from a PEFT
    adapter directory, the inverse of `peft_tensors`; `shapes`: the adapters' ShapeDtypeStructs (a pure dict, of the
    model with its adapters added). SpmdkitError (one line) when a tensor is missing, extra or of another shape (an
    adapter of another base)."""
    from safetensors.numpy import load_file

    if FAMILIES[family].fused:
        raise SpmdkitError(f"{family} fuses its projections: PEFT adapters of fused modules are not read yet")
    tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    maps = {m.path: m for m in tensor_maps(model, family)}
    adapters: dict[str, Any] = {}
    for path, a_like, b_like in adapter_pairs(shapes):
        base = maps[path]
        a = np.empty(a_like.shape, a_like.dtype)
        b = np.empty(b_like.shape, b_like.dtype)
        rank = a.shape[-1]
        for entry in range(len(base.layers)):
            name = PEFT_PREFIX + base.hf_name(entry).removesuffix(".weight")
            for part, into, expected in (("A", a, (rank, a[0].size // rank)), ("B", b, (b[0].size // rank, rank))):
                key = f"{name}.lora_{part}.weight"
                value = tensors.pop(key, None)
                if value is None or value.shape != expected:
                    there = "missing" if value is None else f"{list(value.shape)}"
                    raise SpmdkitError(f"{directory / ADAPTER_WEIGHTS}: {key} is {there}, this base with r={rank} "
                                       f"needs {list(expected)}: the adapter was trained on another base")  # fmt: skip
                into[entry] = value.T.reshape(into.shape[1:])  # A [r, in] -> [*in, r]; B [out, r] -> [r, *out]
        node = adapters
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[f"{path[-1]}_lora_a"], node[f"{path[-1]}_lora_b"] = a, b
    if tensors:
        raise SpmdkitError(f"{directory / ADAPTER_WEIGHTS} holds {sorted(tensors)[0]}, which this base lacks (or a "
                           "module spmdkit does not adapt): the adapter was trained on another base")  # fmt: skip
    return adapters
