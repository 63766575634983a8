"""Hugging Face reference models for the interop tests: built and saved by transformers itself, with random
non-zero weights (biases and norm scales included: transformers initialises biases to 0 and norms to 1, which
would hide a dropped bias or scale), a tokenizer written by `tokenizers` and saved by transformers, and the logits
and losses transformers computes from the saved files (the judge)."""

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter re-drawn with torch: matrices ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.2), biases ~
    N(0, 0.1) (a tied head is the embedding, drawn once)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if p.ndim > 1:
                p.copy_(noise / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)
    return model


def save_model(config: transformers.PretrainedConfig, directory: Path, seed: int = 0, **save) -> Path:
    """A random model of `config` saved by `save_pretrained(directory, **save)` (e.g. max_shard_size)."""
    model = randomize(transformers.AutoModelForCausalLM.from_config(config), seed)
    model.save_pretrained(directory, **save)
    return directory


def edit_config(directory: Path, **changes) -> None:
    """Change config.json keys (None removes one), as a hand-edited or older checkpoint has them."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))


def load(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained`, checking that it found exactly the tensors it expects."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not problems and not info.get("error_msgs"), problems
    return model.eval()


def logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def loss(model: torch.nn.Module, inputs: np.ndarray, targets: np.ndarray) -> float:
    """Mean next-token cross-entropy of `targets` given `inputs` [batch, seq], in float32."""
    out = torch.tensor(logits(model, inputs))
    return float(
        torch.nn.functional.cross_entropy(out.flatten(0, 1), torch.tensor(np.asarray(targets)).flatten().long())
    )


def save_tokenizer(directory: Path, vocab_size: int) -> dict[str, int]:
    """A word-level tokenizer of `vocab_size` tokens with <s>, </s>, <pad> specials (the last three ids, so that
    they differ from Llama's config defaults), built by `tokenizers` and saved by transformers; returns their ids."""
    vocab = {f"w{i}": i for i in range(vocab_size - 3)}
    vocab |= {"<s>": vocab_size - 3, "</s>": vocab_size - 2, "<pad>": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(directory)
    return {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id, "pad_token_id": fast.pad_token_id}


def max_relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max |ours - theirs| / max |theirs|: the parity measure (<= 1e-4 in float32)."""
    return float(np.abs(np.asarray(ours, np.float64) - theirs).max() / np.abs(theirs).max())


def assert_matches_on_mesh(directory: Path, theirs: np.ndarray, tokens: np.ndarray, mesh: str) -> None:
    """spmdkit's model of `directory` loaded onto `mesh`: its logits of `tokens` are transformers' (`theirs`) within
    1e-4 of their scale, and its training loss (chunked over the sequence) of tokens[:, :-1] -> tokens[:, 1:] is
    transformers' within 1e-5."""
    import jax

    from spmdkit.interop import load_model
    from spmdkit.sharding.logical import use_rules
    from spmdkit.sharding.mesh import make_mesh
    from spmdkit.sharding.rules import make_rules

    mesh, rules = make_mesh(mesh), make_rules()
    model = load_model(directory, mesh=mesh, rules=rules)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def forward(model, tokens, inputs, targets):  # the training loss: chunked over the sequence
        return model(tokens), model.loss(model.hidden(inputs)[0], targets)[0]

    with use_rules(rules, mesh):
        out, ce = jax.jit(forward)(model, tokens, inputs, targets)
    assert max_relative_error(out, theirs) <= 1e-4
    reference = loss(load(directory), inputs, targets)
    assert abs(float(ce) - reference) <= 1e-5 * reference
