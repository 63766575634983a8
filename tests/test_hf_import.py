"""Hugging Face import: models built and saved by transformers itself load into spmdkit and give transformers'
logits (max |diff| <= 1e-4 x max |logit|, float32) on one device and on fsdp=4,tensor=2, for every family feature:
Llama GQA, llama3 RoPE scaling past original_max_position_embeddings, rope_theta 5e5 in transformers 5's
`rope_parameters`, the older `rope_theta` + `rope_scaling` style (linear), Qwen2 (q/k/v biases, tied), a tied
Llama, attention and MLP biases with GELU, sharded and single-file saves; `ckpt import-hf` takes a directory, a
`.safetensors` file or an index JSON, keeps the stored dtype and carries the Hugging Face files along."""

import json

import jax
import numpy as np
import pytest
from fixtures import run_cli
from hf_reference import edit_config, load, logits, max_relative_error, save_model, save_tokenizer
from transformers import LlamaConfig, Qwen2Config

from spmdkit.interop import find_tokenizer_dir, load_model
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.tools.convert import read_params

VOCAB, SEQ = 320, 48  # SEQ is longer than the llama3 variant's original_max_position_embeddings (16)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
VARIANTS = {
    "llama-gqa": (LlamaConfig(**SHAPE, num_key_value_heads=2), {}),
    "llama3-scaling": (LlamaConfig(**SHAPE, num_key_value_heads=4, rope_parameters=LLAMA3), {}),
    "rope-5e5-sharded": (
        LlamaConfig(**SHAPE, num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        {"max_shard_size": "60KB"},
    ),
    "qwen2-biases-tied": (Qwen2Config(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True), {}),
    "llama-tied-gelu-tanh": (
        LlamaConfig(**SHAPE, num_key_value_heads=8, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh"),
        {},
    ),
    "llama-biases-gelu": (
        LlamaConfig(**SHAPE, num_key_value_heads=2, attention_bias=True, mlp_bias=True, hidden_act="gelu"),
        {},
    ),
    "legacy-rope-linear": (LlamaConfig(**SHAPE, num_key_value_heads=2), {}),  # config rewritten below
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each variant saved by transformers once: {name: (directory, transformers' logits of TOKENS)}."""
    root, out = tmp_path_factory.mktemp("hf"), {}
    for seed, (name, (config, save)) in enumerate(VARIANTS.items()):
        directory = save_model(config, root / name, seed=seed, **save)
        if name == "legacy-rope-linear":  # transformers 4's style: rope_theta at the top, rope_scaling beside it
            edit_config(directory, rope_parameters=None, rope_theta=250_000.0, rope_scaling={"type": "linear",
                        "factor": 4.0})  # fmt: skip
        out[name] = directory, logits(load(directory), TOKENS)
    return out


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (4, SEQ))


@pytest.fixture(scope="module")
def mesh_and_rules():
    return make_mesh("fsdp=4,tensor=2"), make_rules()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_on_one_device_and_on_fsdp_x_tensor(name, models, mesh_and_rules):
    directory, theirs = models[name]
    ours = load_model(directory)
    assert ours.blocks.attention.q[...].dtype == np.float32
    assert max_relative_error(ours(TOKENS), theirs) <= 1e-4

    mesh, rules = mesh_and_rules
    sharded = load_model(directory, mesh=mesh, rules=rules)
    assert sharded.blocks.mlp.up[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert not sharded.embedding[...].sharding.is_fully_replicated  # laid out in shards, not copied whole
    with use_rules(rules, mesh):
        out = jax.jit(lambda model, tokens: model(tokens))(sharded, TOKENS)
    assert max_relative_error(out, theirs) <= 1e-4


def test_what_the_configs_turn_into(models):
    import spmdkit.interop as interop

    def model_of(name):
        return interop.from_hf_config(json.loads((models[name][0] / "config.json").read_text()))

    scaled = model_of("llama3-scaling")
    assert (scaled.rope_type, scaled.rope_factor, scaled.rope_original_max_positions) == ("llama3", 8.0, 16)
    assert scaled.rope_theta == model_of("rope-5e5-sharded").rope_theta == 500_000.0
    legacy = model_of("legacy-rope-linear")
    assert (legacy.rope_type, legacy.rope_factor, legacy.rope_theta) == ("linear", 4.0, 250_000.0)
    qwen = model_of("qwen2-biases-tied")
    assert (qwen.qkv_bias, qwen.o_bias, qwen.mlp_bias, qwen.tie_embeddings) == (True, False, False, True)
    biased = model_of("llama-biases-gelu")
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias, biased.activation) == (True, True, True, "gelu")
    assert (models["rope-5e5-sharded"][0] / "model.safetensors.index.json").is_file()  # really a sharded save


@pytest.mark.parametrize("form", ["directory", "index", "file"])
def test_import_hf_takes_a_directory_an_index_or_a_file(form, models, tmp_path, capsys):
    name = "llama-gqa" if form == "file" else "rope-5e5-sharded"
    directory, theirs = models[name]
    path = {"directory": directory, "index": directory / "model.safetensors.index.json",
            "file": directory / "model.safetensors"}[form]  # fmt: skip
    out = tmp_path / "ckpt"
    code, stdout, err = run_cli(capsys, "ckpt", "import-hf", str(path), "--out", str(out))
    assert code == 0, err
    assert f"--init-from {out}" in stdout
    step, config, params = read_params(out)
    assert step == 0 and config.model.layers == 2 and config.model.kv_heads == 2
    assert params["blocks"]["attention"]["q"].dtype == np.float32  # the stored dtype
    assert sorted(p.name for p in (out / "hf").iterdir()) == ["config.json", "generation_config.json"]
    assert max_relative_error(load_model(out)(TOKENS), theirs) <= 1e-4
    np.testing.assert_array_equal(load_model(out)(TOKENS), load_model(directory)(TOKENS))  # the same weights


def test_import_keeps_bfloat16_unless_told_and_carries_the_tokenizer(tmp_path, capsys):
    import torch

    source = tmp_path / "bf16"
    ids = save_tokenizer(source, VOCAB)
    config = LlamaConfig(**SHAPE, num_key_value_heads=2, bos_token_id=ids["bos_token_id"],
                         eos_token_id=ids["eos_token_id"], dtype=torch.bfloat16)  # fmt: skip
    save_model(config, source, seed=3)
    code, _, err = run_cli(capsys, "ckpt", "import-hf", str(source), "--out", str(tmp_path / "kept"))
    assert code == 0, err
    assert str(read_params(tmp_path / "kept")[2]["blocks"]["mlp"]["down"].dtype) == "bfloat16"
    assert find_tokenizer_dir(tmp_path / "kept") == tmp_path / "kept" / "hf"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (tmp_path / "kept" / "hf" / name).read_bytes() == (source / name).read_bytes(), name

    code, _, err = run_cli(capsys, "ckpt", "import-hf", str(source), "--out", str(tmp_path / "f32"), "--dtype",
                            "float32")  # fmt: skip
    assert code == 0, err
    kept, widened = read_params(tmp_path / "kept")[2], read_params(tmp_path / "f32")[2]
    assert widened["embedding"].dtype == np.float32
    np.testing.assert_array_equal(widened["embedding"], kept["embedding"].astype(np.float32))


def test_import_hf_refuses_nan_weights_and_writes_nothing(models, tmp_path, capsys):
    """A model whose weights hold NaN/Inf (transformers saved them; a training run went bad) is refused in one line
    naming the tensor and its file, with exit 2, and no checkpoint (nor a staging directory) is left behind."""
    import shutil

    from safetensors.numpy import load_file, save_file

    source = tmp_path / "nan-model"
    shutil.copytree(models["llama-gqa"][0], source)
    file = source / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    save_file(tensors, str(file), metadata={"format": "pt"})
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    code, _, err = run_cli(capsys, "ckpt", "import-hf", str(source), "--out", str(tmp_path / "ckpt"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"model.layers.1.mlp.down_proj.weight in {file} holds NaN or Inf values" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan-model"]  # no checkpoint, no staging directory
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before  # the input is untouched
