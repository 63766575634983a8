"""Where a model to generate with or to evaluate comes from, read straight onto the inference mesh.

`open_source(path)` takes either
- an spmdkit run or checkpoint directory: the newest step (or `step`) and the run config saved with it (the model
  settings, resolved by `spmdkit.models.resolve.build_model` as the trainer resolves them; the run's sequence
  length and data source), or
- a Hugging Face model directory (`save_pretrained`'s: `config.json` and safetensors; or one `.safetensors` file
  or an index JSON): its `config.json` read strictly by `spmdkit.interop`, computed in the dtype it is stored in.

The parameters are read by `spmdkit.load_model(source.directory, step=source.step)`, the one loader of every entry
point. `model_tokenizer` finds the tokenizer that travels with the model: `tokenizer.json` (+ `tokenizer_config.json`,
as `Tokenizer.save` writes them) in the checkpoint directory or the run directory, the Hugging Face files of an
imported checkpoint (its `hf/`) or of a model directory (`spmdkit.interop.find_tokenizer_dir`), else the run's data
source's (bytes for stdlib).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from spmdkit.checkpoint.steps import check_not_a_step
from spmdkit.data.config import DataConfig
from spmdkit.data.resolve import source_tokenizer
from spmdkit.data.tokenizer import Tokenizer, load_tokenizer
from spmdkit.data.tokenizer.tokenizer import TOKENIZER_FILE
from spmdkit.errors import SpmdkitError
from spmdkit.interop.hf_files import find_tokenizer_dir
from spmdkit.interop.loading import stored_dtype
from spmdkit.interop.safetensors_files import TensorFiles
from spmdkit.interop.sources import saved_run_config, source_kind, source_model
from spmdkit.models.config import TransformerConfig
from spmdkit.models.resolve import build_model
from spmdkit.rundir.ownership import is_checkpoint_directory, is_run_directory


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model on disk: an spmdkit checkpoint step with its saved run config, or a Hugging Face model."""

    directory: Path  # the checkpoint directory (RUN_DIR/checkpoints), or the Hugging Face path as given
    kind: Literal["spmdkit", "hf"]
    step: int | None = None  # the checkpoint step (None for a Hugging Face model)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the saved run config ({} for Hugging Face)
    hf_model: TransformerConfig | None = None  # a Hugging Face model's config, in its stored dtype

    @property
    def model(self) -> TransformerConfig:
        """The model's config, as training (or the Hugging Face config) defines it."""
        if self.hf_model is not None:
            return self.hf_model
        return build_model(self.config.get("model") or {}, source_model)

    @property
    def seq_len(self) -> int | None:
        """The longest context the model is meant for: the run's training sequence length, or a Hugging Face
        model's `max_position_embeddings` (None when unknown)."""
        if self.kind == "hf":
            return self.model.max_positions or None
        return self.config.get("run", {}).get("seq_len")

    @property
    def data(self) -> DataConfig | None:
        """The run's data source (None for a Hugging Face model: it names none)."""
        if self.kind == "hf":
            return None
        fields = {f.name for f in dataclasses.fields(DataConfig)}
        return DataConfig(**{k: v for k, v in self.config.get("data", {}).items() if k in fields})

    def describe(self) -> str:
        return str(self.directory) if self.step is None else f"{self.directory} step {self.step}"


def open_source(path: str | Path, step: int | None = None) -> ModelSource:
    """The model at `path`: the newest step (or `step`) of a run or checkpoint directory, or a Hugging Face model."""
    path = Path(path).expanduser()
    if not path.exists():
        raise SpmdkitError(
            f"{path} does not exist: pass a run directory, its checkpoints/ directory or a Hugging Face model directory"
        )
    check_not_a_step(path, "" if step is not None else " (the newest step is used; the API takes step=)")
    if is_run_directory(path) and not (path / "checkpoints").is_dir() and not is_checkpoint_directory(path):
        raise SpmdkitError(
            f"{path} is an spmdkit run directory without checkpoints (its run saved none: a run saves every "
            "--checkpoint-every steps and at its end): train it to a checkpoint, or pass a run that has one"
        )
    if source_kind(path) == "hf":
        if step is not None:
            raise SpmdkitError(f"{path} is a Hugging Face model: it has no checkpoint steps to choose from")
        dtype = stored_dtype(TensorFiles(path))
        return ModelSource(path, "hf", hf_model=source_model(path).replace(dtype=dtype, param_dtype=dtype))
    directory, step, config = saved_run_config(path, step)
    return ModelSource(directory, "spmdkit", step, config)


def model_tokenizer(source: ModelSource) -> Tokenizer | None:
    """The tokenizer that travels with the model (see the module docstring); None for a run trained on token ids
    (token files, synthetic data) or a Hugging Face model saved without one."""
    directories = [source.directory, source.directory.parent] if source.kind == "spmdkit" else []
    for directory in directories:  # the trainer's `Tokenizer.save(checkpoint_dir)`; older runs: the run directory
        if (directory / TOKENIZER_FILE).is_file():
            return load_tokenizer(directory)
    found = find_tokenizer_dir(source.directory)
    if found is not None and (found / TOKENIZER_FILE).is_file():
        return load_tokenizer(found)
    if found is not None and any((found / name).is_file() for name in ("tokenizer.model", "vocab.json")):
        raise SpmdkitError(
            f"{found} holds a tokenizer without a {TOKENIZER_FILE} (a slow tokenizer): save it with a fast tokenizer "
            "(transformers' AutoTokenizer(...).save_pretrained writes tokenizer.json)"
        )
    if found is not None:
        raise SpmdkitError(
            f"{found / TOKENIZER_FILE} is missing ({found} holds the rest of the tokenizer): put it back (a run writes "
            "it there; transformers' save_pretrained of a fast tokenizer writes it)"
        )
    if source.kind == "hf":
        return None
    try:
        return source_tokenizer(source.data)
    except SpmdkitError as error:
        raise SpmdkitError(f"the tokenizer of {source.directory} cannot be found ({error})") from None


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers map text to the same ids (the same tokenizer.json, or both spmdkit's bytes)."""
    return a.sha256 == b.sha256 or a.name == b.name == "bytes"
