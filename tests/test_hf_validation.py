"""A Hugging Face config.json read as transformers reads it, and nothing damaged let in (transformers is the judge).

- Defaults: for every family, a config.json that leaves every key out but `model_type` (and one that gives only
  other sizes) reads as the config transformers' own config class makes of it (`AutoConfig.for_model`).
- Types and ranges: each malformed key of the audit (Gemma 3 `sliding_window_pattern` 0 or "6", SmolLM3
  `no_rope_layer_interval` 0, `rope_theta` "abc" or null, a local RoPE base "x", `max_position_embeddings` "64k")
  and its kin is one line naming the key, exit 2, and no file of the input changed, on every command that reads
  a config (`ckpt import-hf`, `train --init-from`, `generate`, `eval`).
- A NaN or Inf weight is refused by name (the tensor and its file) on the same four commands; and FP8 under
  float16 compute (its scaling overflows: NaN by step 2) is refused before a run starts.
"""

import json
import shutil

import numpy as np
import pytest
from fixtures import run_cli
from hf_reference import edit_config, save_model, save_tokenizer
from support import error_lines, file_hashes
from transformers import AutoConfig, Gemma3TextConfig, LlamaConfig, SmolLM3Config

from spmdkit.errors import SpmdkitError
from spmdkit.interop.hf_config import FAMILIES, from_hf_config, function_of

VOCAB = 320
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _read(hf: dict) -> dict:
    model = from_hf_config(hf)
    return {**function_of(model), "max_positions": model.max_positions}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_key_left_out_means_what_transformers_config_class_makes_of_it(model_type):
    """The whole function a config fixes, read from transformers' complete config (every key at its class's
    default, derived keys such as head_dim and layer_types spelled out) and from the same config with every key
    left out but those given: the same; with other sizes too, so that a derived default is not a constant."""
    for given in ({}, {"hidden_size": 1024, "num_hidden_layers": 7}):
        theirs = _read(AutoConfig.for_model(model_type, **given).to_dict())
        ours = _read({"model_type": model_type, **given})
        assert ours == theirs, {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs.get(k)}


MALFORMED = {  # (family, keys to set, the start of the line that names it)
    "gemma3 pattern 0": ("gemma3_text", {"sliding_window_pattern": 0}, "sliding_window_pattern=0 must be a positive"),
    "gemma3 pattern '6'": ("gemma3_text", {"sliding_window_pattern": "6"}, "sliding_window_pattern='6' must be"),
    "smollm3 interval 0": ("smollm3", {"no_rope_layer_interval": 0}, "no_rope_layer_interval=0 must be a positive"),
    "rope_theta 'abc'": ("llama", {"rope_theta": "abc"}, "rope_theta='abc' must be a positive number"),
    "rope_theta null": ("llama", {"rope_theta": None}, "rope_theta=None must be a positive number"),
    "local rope base 'x'": ("gemma3_text", {"rope_local_base_freq": "x"}, "rope_local_base_freq='x' must be"),
    "max_position_embeddings '64k'": ("llama", {"max_position_embeddings": "64k"}, "max_position_embeddings='64k'"),
    "attention_bias 'false'": ("llama", {"attention_bias": "false"}, "attention_bias='false' must be true or false"),
    "rms_norm_eps null": ("llama", {"rms_norm_eps": None}, "rms_norm_eps=None must be a positive number"),
    "num_key_value_heads 0": ("llama", {"num_key_value_heads": 0}, "num_key_value_heads=0 must be a positive"),
    "rope_scaling a string": ("llama", {"rope_scaling": "linear"}, "rope_scaling='linear' must be a JSON object"),
    "architectures a string": ("llama", {"architectures": "LlamaForCausalLM"}, "architectures='LlamaForCausalLM'"),
    "partial_rotary_factor 1.5": ("phi3", {"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5 must be"),
    "softcap '30'": ("gemma2", {"final_logit_softcapping": "30"}, "final_logit_softcapping='30' must be a number"),
    "experts 2.5": ("mixtral", {"num_local_experts": 2.5}, "num_local_experts=2.5 must be a positive integer"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_key_is_one_line_naming_it(case):
    model_type, keys, message = MALFORMED[case]
    hf = AutoConfig.for_model(model_type, **SHAPE).to_dict() | keys
    if "sliding_window_pattern" in keys:
        hf.pop("layer_types")  # the pattern is what transformers reads without them
    with pytest.raises(SpmdkitError, match="correct it in config.json") as error:
        from_hf_config(hf)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_malformed_key_inside_a_rope_block_is_named_by_its_path():
    hf = AutoConfig.for_model("gemma3_text", **SHAPE).to_dict()
    hf["rope_parameters"]["sliding_attention"]["rope_theta"] = "x"
    with pytest.raises(SpmdkitError, match=r"rope_parameters\['sliding_attention'\]\['rope_theta'\]='x' must be"):
        from_hf_config(hf)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny models transformers saved (a Llama with its tokenizer, a Gemma 3, a SmolLM3), and a token file."""
    root = tmp_path_factory.mktemp("validation")
    ids = save_tokenizer(root / "llama", VOCAB)
    save_model(LlamaConfig(**SHAPE, num_key_value_heads=2, max_position_embeddings=64, **ids), root / "llama")
    save_model(Gemma3TextConfig(**SHAPE, num_key_value_heads=2, head_dim=8), root / "gemma3_text")
    save_model(SmolLM3Config(**SHAPE, num_key_value_heads=2, pad_token_id=None), root / "smollm3")
    np.random.default_rng(0).integers(0, VOCAB - 3, 4096).astype(np.uint16).tofile(root / "tokens.bin")
    return root


TRAIN = ("--steps", "1", "--batch-size", "8", "--seq-len", "16", "--dtype", "float32", "--no-progress")


def _commands(model, tmp_path, tokens):
    return {
        "import-hf": ["ckpt", "import-hf", str(model), "--out", str(tmp_path / "out")],
        "train": ["train", "--init-from", str(model), *TRAIN, "--run-dir", str(tmp_path / "run")],
        "generate": ["generate", str(model), "--prompt", "w1 w2", "--max-new-tokens", "2", "--temperature", "0"],
        "eval": ["eval", str(model), "--data", str(tokens), "--seq-len", "16", "--batch-size", "1"],
    }


def _refused_everywhere(capsys, model, tmp_path, tokens, message):
    """Each command on `model`: exit 2, one line holding `message`, no traceback, its input unchanged, no output."""
    before = file_hashes(model)
    for name, args in _commands(model, tmp_path, tokens).items():
        code, out, err = run_cli(capsys, *args)
        assert code == 2 and len(error_lines(err)) == 1 and "Traceback" not in err, (name, err)
        assert message in err, (name, err)
        assert file_hashes(model) == before, name
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["gemma3 pattern 0", "smollm3 interval 0", "max_position_embeddings '64k'"])
def test_every_command_refuses_a_malformed_config(case, saved, tmp_path, capsys):
    model_type, keys, message = MALFORMED[case]
    model = tmp_path / "model"
    shutil.copytree(saved / ("llama" if model_type == "llama" else model_type), model)
    edit_config(model, **keys, **({"layer_types": None} if "sliding_window_pattern" in keys else {}))
    _refused_everywhere(capsys, model, tmp_path, saved / "tokens.bin", message)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_every_command_refuses_a_weight_that_is_not_finite(bad, saved, tmp_path, capsys):
    """One NaN (or Inf) in one tensor is named with its file by every way into a model from the directory."""
    from safetensors.numpy import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(saved / "llama", model)
    file = model / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
    save_file(tensors, str(file), {"format": "pt"})
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"
    message = f"model.layers.1.mlp.up_proj.weight in {file} holds NaN or Inf values"
    _refused_everywhere(capsys, model, tmp_path, saved / "tokens.bin", message)


def test_fp8_under_float16_compute_is_refused_before_the_run_starts(tmp_path, capsys):
    """FP8's delayed scaling overflows float16 (the loss was NaN at step 2, blamed on the data or the lr)."""
    args = ["train", "--model", "tiny", "--model.fp8", "True", "--steps", "2", "--run-dir", str(tmp_path / "run")]
    code, _, err = run_cli(capsys, *args, "--dtype", "float16")
    assert code == 2 and len(error_lines(err)) == 1 and "Traceback" not in err, err
    assert "fp8 needs a bfloat16 or float32 compute dtype" in err and "--dtype bfloat16" in err
    assert not (tmp_path / "run").exists()
