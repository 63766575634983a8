"""Qwen3 (dense) in and out, with transformers as the judge: tiny models written by transformers' `save_pretrained`
with random non-zero weights (the per-head q_norm/k_norm scales and the attention biases included) and a head_dim
(16) other than hidden / heads (8), give transformers' logits on one device and on fsdp=4,tensor=2, its greedy
tokens through `spmdkit.generate`, and round-trip bit-identically; a model spmdkit builds with `qk_norm` exports as a
Qwen3 that `Qwen3ForCausalLM` loads; a sliding window that would apply (Qwen2 or Qwen3) is refused in one line."""

import json

import jax
import numpy as np
import pytest
import torch
from fixtures import run_cli
from hf_reference import edit_config, load, logits, max_relative_error, save_model, save_tokenizer
from transformers import Qwen3Config

import spmdkit
from spmdkit.errors import SpmdkitError
from spmdkit.interop import from_hf_config, load_model
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules

VOCAB, SEQ = 128, 24
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
VARIANTS = {
    # tied, rope_theta 1e6 in transformers 5's rope_parameters, a sliding window configured but never applied
    "tied-window-unused": Qwen3Config(
        **SHAPE,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=64,
        max_window_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    # q/k/v/o biases, an untied head, and the older rope_theta + rope_scaling style (rewritten below)
    "biased-legacy-rope": Qwen3Config(**SHAPE, attention_bias=True, tie_word_embeddings=False),
}
TOKENS = np.random.default_rng(2).integers(0, VOCAB, (4, SEQ))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (directory, transformers' logits of TOKENS)}, each saved by transformers once."""
    root, out = tmp_path_factory.mktemp("qwen3"), {}
    for seed, (name, config) in enumerate(VARIANTS.items()):
        directory = root / name
        save_tokenizer(directory, VOCAB)
        save_model(config, directory, seed=seed + 7)
        if name == "biased-legacy-rope":
            edit_config(directory, rope_parameters=None, rope_theta=50_000.0, rope_scaling={"type": "linear",
                        "factor": 2.0})  # fmt: skip
        out[name] = directory, logits(load(directory), TOKENS)
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_on_one_device_and_on_fsdp_x_tensor(name, models):
    directory, theirs = models[name]
    ours = load_model(directory)
    config = ours.config
    assert (config.qk_norm, config.head_dim, config.embed // config.heads) == (True, 16, 8)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == ((name == "biased-legacy-rope"),) * 2 + (False,)
    assert np.abs(np.asarray(ours.blocks.attention.q_norm.scale[...]) - 1).max() > 0.1  # really the random scales
    assert max_relative_error(ours(TOKENS), theirs) <= 1e-4

    mesh, rules = make_mesh("fsdp=4,tensor=2"), make_rules()
    sharded = load_model(directory, mesh=mesh, rules=rules)
    with use_rules(rules, mesh):
        out = jax.jit(lambda model, tokens: model(tokens))(sharded, TOKENS)
    assert max_relative_error(out, theirs) <= 1e-4


def test_greedy_generation_matches_transformers(models):
    directory, _ = models["tied-window-unused"]
    prompt, new = [3, 17, 5, 99, 42, 8], 10
    ours = spmdkit.generate(directory, prompt, max_new_tokens=new, mesh="tensor=2", stop_tokens=())[0].tokens
    with torch.no_grad():
        theirs = load(directory).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    eos = json.loads((directory / "config.json").read_text()).get("eos_token_id")
    assert ours == theirs[: len(ours)] and (len(ours) == new or theirs[len(ours)] == eos)
    assert len(set(ours)) > 1


def _tensors(directory):
    from safetensors.numpy import load_file

    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(file)).items()}


def test_hf_to_spmdkit_to_hf_is_bit_identical(models, tmp_path, capsys):
    original = models["biased-legacy-rope"][0]
    code, _, err = run_cli(capsys, "ckpt", "import-hf", str(original), "--out", str(tmp_path / "ckpt"))
    assert code == 0, err
    code, _, err = run_cli(capsys, "ckpt", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "again"))
    assert code == 0, err
    load(tmp_path / "again")  # no missing or unexpected keys
    want, got = _tensors(original), _tensors(tmp_path / "again")
    assert want.keys() == got.keys() and "model.layers.1.self_attn.k_norm.weight" in got
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].tobytes() == tensor.tobytes(), name
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "again" / name).read_text()) == json.loads((original / name).read_text()), name


def test_a_model_with_qk_norm_exports_as_qwen3(tmp_path):
    from flax import nnx

    from spmdkit.models import Transformer, TransformerConfig

    config = TransformerConfig(dtype="float32", layers=2, head_dim=16, qk_norm=True, tie_embeddings=True)
    model = Transformer(config, rngs=nnx.Rngs(3))
    for seed, norm in enumerate((model.blocks.attention.q_norm, model.blocks.attention.k_norm)):  # not their init 1
        norm.scale[...] = 1 + 0.3 * jax.random.normal(jax.random.key(seed), norm.scale[...].shape)
    out = spmdkit.save_hf(model, tmp_path / "hf", max_positions=64)
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"], hf["head_dim"]) == ("qwen3", ["Qwen3ForCausalLM"], 16)
    assert from_hf_config(hf) == config.replace(max_positions=64, dtype="bfloat16")
    tokens = TOKENS % config.vocab_size
    assert max_relative_error(model(tokens), logits(load(out), tokens)) <= 1e-4
    with pytest.raises(
        SpmdkitError, match="no Hugging Face family computes this model: the closest, [a-z0-9]+, cannot have"
    ):
        spmdkit.save_hf(Transformer(config.replace(mlp_bias=True), rngs=nnx.Rngs(0)), tmp_path / "x", max_positions=8)


QWEN = dict(SHAPE, model_type="qwen3", architectures=["Qwen3ForCausalLM"])


@pytest.mark.parametrize(
    "family, changes, window",
    [
        ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), (16, "GL")),
        ("qwen3", dict(use_sliding_window=True, layer_types=["sliding_attention", "full_attention"],
                       sliding_window=63), (63, "LG")),
        # left out, the window is transformers' default 4096 (on every layer from max_window_layers=0)
        ("qwen2", dict(use_sliding_window=True, sliding_window=None, max_position_embeddings=None, max_window_layers=0),
         (4096, "")),
        # as long as the positions: still honoured (longer inputs see only the window, as in transformers)
        ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), (64, "")),
        ("qwen3", dict(use_sliding_window=False, sliding_window=4), (0, "")),  # off
        ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2), (0, "")),  # no layer slides
    ],
)  # fmt: skip
def test_a_qwen_sliding_window_applies_to_the_layers_it_names(family, changes, window):
    hf = QWEN | {"model_type": family, "architectures": [f"{family.title()}ForCausalLM"]}
    hf = {k: v for k, v in (hf | changes).items() if v is not None}
    config = from_hf_config(hf)
    assert (config.sliding_window, config.window_pattern) == window
    assert [config.window_of(i) for i in range(2)] == [window[0] * (c == "L") for c in (window[1] or "LL") * 2][:2]


def test_a_malformed_sliding_window_is_one_line():
    with pytest.raises(SpmdkitError, match="sliding_window='4k' must be a positive integer") as error:
        from_hf_config(QWEN | dict(use_sliding_window=True, sliding_window="4k", max_window_layers=0))
    assert "\n" not in str(error.value)


QWEN3_8B = {  # the published Qwen/Qwen3-8B config.json (transformers 4 style)
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip


def test_the_qwen3_8b_preset_is_the_published_config_and_counts_its_parameters():
    import transformers

    from spmdkit.models.presets import PRESETS

    preset = PRESETS["qwen3-8b"]
    assert from_hf_config(QWEN3_8B) == preset
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_8B))
    assert preset.num_params() == sum(p.numel() for p in reference.parameters())  # 8,190,735,360


def test_the_planner_inventory_has_the_qk_norms():
    from flax import nnx

    from spmdkit.models import Transformer, TransformerConfig
    from spmdkit.plan.layout import parameters
    from spmdkit.sharding.partition import abstract_state

    config = TransformerConfig(head_dim=16, qk_norm=True, qkv_bias=True, o_bias=True)
    _, state = abstract_state(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    real = {".".join(map(str, path[:-1] if path[-1] == "scale" else path)): (v.get_value().shape, v.out_sharding)
            for path, v in nnx.to_flat_state(state)}  # fmt: skip
    assert {name: (shape, names) for name, shape, names in parameters(config)} == real
    assert real["blocks.attention.q_norm"] == ((config.layers, 16), ("layers", "norm"))
    assert config.num_params() == sum(int(np.prod(shape)) for shape, _ in real.values())
