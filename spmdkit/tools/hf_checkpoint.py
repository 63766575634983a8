"""`spmdkit ckpt import-hf` and `ckpt export`: a Hugging Face model into an spmdkit checkpoint, and a checkpoint out
as a complete Hugging Face model directory.

- `import_hf`: the weights (strictly checked against the config, read shard by shard into their shards on the
  mesh, in the stored dtype unless `dtype`), the resolved run config (the model's full shape) and, in `hf/`, the
  source's config.json, generation config and tokenizer files. Step 0 holds the parameters only: train from it
  with `spmdkit train --init-from DIR` (a fresh optimizer). Everything is checked before anything is written; the
  checkpoint is assembled in a temporary directory and renamed into place.
- `import_peft`: a PEFT LoRA adapter directory (`adapter_config.json`, `adapter_model.safetensors`) on its Hugging
  Face base: step 0 holds the adapters only, its config the base's path and checksum and the adapters' settings, as
  a LoRA run's checkpoint does; evaluation, generation and export read it as they read such a run.
- `export_hf`: the newest (or a given) step's parameters as `save_hf` writes them, with the imported config kept
  where it still holds, the token ids of the tokenizer the model came with (or the embedded byte data's), and
  `max_position_embeddings` from the imported config or the run's sequence length. A LoRA run's step holds the
  adapters only: merged into its base (read from the run's `--init-from`, its checksum checked), or, with
  `--adapters`, a PEFT adapter directory.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
from flax import nnx

from spmdkit.checkpoint.manager import NonFiniteState
from spmdkit.checkpoint.params import write_params
from spmdkit.data.sources import BOS, EOS
from spmdkit.errors import SpmdkitError
from spmdkit.interop.adapters import (
    ADAPTER_CONFIG,
    base_weights,
    merged_params,
    read_peft_adapter,
    read_peft_config,
    with_adapters,
    write_peft_adapter,
)
from spmdkit.interop.hf_config import read_hf_config
from spmdkit.interop.hf_files import (
    CONFIG,
    GENERATION_CONFIG,
    SIDECAR,
    copy_hf_files,
    find_hf_files,
    special_token_ids,
)
from spmdkit.interop.loading import check_tensors, hf_params, param_sharding_tree, stored_dtype
from spmdkit.interop.safetensors_files import TensorFiles
from spmdkit.interop.sources import (
    OVERRIDES,
    hf_config_path,
    hf_family,
    source_kind,
    source_model,
    weights_checksum,
)
from spmdkit.interop.writing import NUMPY_DTYPES, check_target, save_hf
from spmdkit.models import Transformer
from spmdkit.models.config import TransformerConfig
from spmdkit.models.lora import add_adapters, as_trained
from spmdkit.models.lora_config import LoraConfig
from spmdkit.rundir.ownership import check_output, run_inputs
from spmdkit.sharding.mesh import MeshConfig, make_mesh
from spmdkit.sharding.partition import abstract_state
from spmdkit.sharding.rules import make_rules
from spmdkit.tools.convert import check_creatable, fresh_output, publish, read_params, staging_for, writing_into
from spmdkit.train.config import TrainConfig, apply_overrides


def import_hf(path: str | Path, out: str | Path, dtype: str | None = None, mesh: str = "") -> TransformerConfig:
    """An spmdkit checkpoint in `out` (step 0: the parameters, the run config, `hf/`) from the Hugging Face model
    at `path` (a directory, a `.safetensors` file or an index JSON); returns the model's config.

    The parameters are laid out on `mesh` (default: every device on fsdp), each device's block read on its own,
    and written by Orbax synchronously, one block's worth of bytes in flight at a time: the host never holds a
    second copy of the weights. The checkpoint restores onto any mesh (`--init-from`, `load_model`)."""
    if source_kind(path) != "hf":
        raise SpmdkitError(f"{path} is an spmdkit checkpoint, not a Hugging Face model: train from it with --init-from")
    source = Path(path).expanduser().absolute()
    out = fresh_output(check_output(out, [source if source.is_dir() else source.parent]))
    with writing_into(out, "spmdkit ckpt import-hf"):
        config_path = hf_config_path(path)
        model = source_model(path)  # with the multi-token-prediction layers the files hold
        files, family = TensorFiles(path), hf_family(path)
        check_tensors(files, model, family)  # every refusal comes before anything is written
        if dtype is not None and dtype not in NUMPY_DTYPES:
            raise SpmdkitError(f"unknown dtype {dtype!r}: choose one of {', '.join(NUMPY_DTYPES)}")
        model = model.replace(param_dtype=dtype or stored_dtype(files))
        # The run config records the full shape (every override set), so it needs neither a preset nor the source.
        settings = {"name": str(source), **{k: getattr(model, k) for k in OVERRIDES}}
        config = apply_overrides(TrainConfig(), {"model": settings, "mesh": {"mesh": mesh}})
        layout = make_mesh(MeshConfig.parse(mesh, config.mesh.dcn))
        rules = make_rules(config.mesh.zero, config.mesh.sequence_parallel)
        params = hf_params(files, model, family, param_sharding_tree(model, layout, rules), model.param_dtype)
        staging = staging_for(out, "importing")
        try:
            write_params(staging, params, json.loads(config.to_json()))
        except NonFiniteState as error:
            shutil.rmtree(staging, ignore_errors=True)  # what the refused write left
            raise SpmdkitError(f"{path} holds {error}: nothing was written") from None
        del params
        if jax.process_index() == 0:
            copy_hf_files(config_path.parent, staging / SIDECAR)
        publish(staging, out)
        return model


def import_peft(path: str | Path, adapter: str | Path, out: str | Path) -> tuple[TransformerConfig, LoraConfig]:
    """An spmdkit checkpoint in `out` of the PEFT LoRA adapter directory `adapter` on the Hugging Face base model at
    `path`: step 0 with the adapters (`spmdkit.interop.adapters.read_peft_adapter`), the run config naming the base
    (path, checksum) and the adapters' rank, alpha and targets, and the base's `hf/` files; returns (the base's
    model, the adapters' settings). What PEFT computes that spmdkit does not is refused before anything is
    written, and so is an adapter whose tensors do not fit the base."""
    if source_kind(path) != "hf":
        raise SpmdkitError(f"{path} is not a Hugging Face model: --adapters goes onto the base model's directory")
    source, adapter = Path(path).expanduser().absolute(), Path(adapter).expanduser().absolute()
    if not (adapter / ADAPTER_CONFIG).is_file():
        raise SpmdkitError(f"--adapters {adapter} holds no {ADAPTER_CONFIG}: pass a PEFT adapter directory")
    out = fresh_output(check_output(out, [source if source.is_dir() else source.parent, adapter]))
    with writing_into(out, "spmdkit ckpt import-hf"):
        config_path = hf_config_path(source)
        _, model = read_hf_config(config_path)
        files, family = TensorFiles(source), hf_family(source)
        check_tensors(files, model, family)
        model = model.replace(param_dtype=stored_dtype(files))
        lora = dataclasses.replace(read_peft_config(adapter), base_checksum=weights_checksum(source))
        shapes = abstract_state(lambda: add_adapters(Transformer(model, rngs=nnx.Rngs(0)), lora, nnx.Rngs(1)))[1]
        adapters = read_peft_adapter(adapter, nnx.to_pure_dict(shapes), model, family)
        settings = {"name": str(source), "init_from": str(source), **{k: getattr(model, k) for k in OVERRIDES}}
        config = apply_overrides(TrainConfig(), {"model": settings, "lora": dataclasses.asdict(lora)})
        staging = staging_for(out, "importing")
        host = jax.devices("cpu")[0]
        try:
            write_params(staging, jax.device_put(adapters, host), json.loads(config.to_json()))
        except NonFiniteState as error:
            shutil.rmtree(staging, ignore_errors=True)
            raise SpmdkitError(f"{adapter} holds {error}: nothing was written") from None
        if jax.process_index() == 0:
            copy_hf_files(config_path.parent, staging / SIDECAR)
        publish(staging, out)
        return model, lora


def default_token_ids(config: TrainConfig) -> dict[str, int | None]:
    """bos/eos ids of a run without a tokenizer: the embedded byte data's specials, else none (an explicit null,
    so that transformers does not fall back to Llama's 1 and 2)."""
    stdlib = config.data.source == "stdlib"
    return {"bos_token_id": BOS if stdlib else None, "eos_token_id": EOS if stdlib else None, "pad_token_id": None}


def export_hf(
    directory: str | Path,
    out: str | Path,
    dtype: str | None = None,
    step: int | None = None,
    max_shard_size: str | int = "5GB",
    force: bool = False,
    adapters: bool = False,
) -> tuple[Path, int]:
    """The Hugging Face model directory `out` from `step` (default: the newest) of a checkpoint or run directory;
    returns (out, the step). A LoRA run's adapters are merged into the weights (W + alpha / rank x A B); with
    `adapters`, `out` is a PEFT adapter directory of them instead (`spmdkit.interop.adapters`)."""
    out_path = check_output(out, run_inputs(directory))
    check_target(out_path, force)  # before the checkpoint is read: --force replaces an earlier export only
    check_creatable(out_path)
    with writing_into(out_path, "spmdkit ckpt export"):
        step, config, params = read_params(directory, step)
        model = config.model.build()
        hf_dir = find_hf_files(directory)
        base, generation = (
            json.loads((hf_dir / name).read_text()) if hf_dir is not None and (hf_dir / name).is_file() else None
            for name in (CONFIG, GENERATION_CONFIG)
        )
        if adapters:
            return _export_adapters(out_path, params, config, base, force), step
        if config.lora.enabled:  # its step holds the adapters: the base is read from the run's --init-from
            frozen = base_weights(directory, json.loads(config.to_json()), model, model.param_dtype)
            frozen = as_trained(frozen, model, config.lora)  # QLoRA: the base quantized as the run held it
            params = merged_params(with_adapters(frozen, params), config.lora.scale)
        tokens = special_token_ids(hf_dir) if hf_dir is not None else default_token_ids(config)
        written = save_hf(
            model, out_path, hf_dir, params=params, dtype=dtype, max_shard_size=max_shard_size, force=force,
            max_positions=model.max_positions or config.run.seq_len, tokens=tokens, base_config=base,
            base_generation=generation, origin={"source": str(Path(directory).expanduser().absolute()), "step": step},
        )  # fmt: skip
        return written, step


def _export_adapters(out: Path, params: dict, config: TrainConfig, base: dict | None, force: bool) -> Path:
    """A LoRA run's adapters as a PEFT adapter directory `out`, for the family of the weights it was trained on
    (their imported config's `model_type`; Llama's names without one)."""
    if not config.lora.enabled:
        raise SpmdkitError("--adapters: this run trained every parameter (no --lora.rank): export without --adapters")
    family = (base or {}).get("model_type", "llama")
    if out.exists() and force:
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return write_peft_adapter(out, params, config.model.build(), family, config.lora, config.model.init_from)
