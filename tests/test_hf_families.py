"""The 2026 families in and out, with transformers as the judge: tiny models of each family written by transformers'
own `save_pretrained` (random non-zero weights, biases and norm scales included; windows shorter than the inputs;
soft-caps small enough to bite) give transformers' logits on one device and on a mesh (fsdp=4,tensor=2; MoE:
expert=4,data=2), the same loss through the chunked training loss, transformers' greedy tokens through
`spmdkit.generate`, and export back bit-identically to a directory `from_pretrained` loads without missing or
unexpected keys."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers as tf
from hf_reference import assert_matches_on_mesh, load, logits, loss, max_relative_error, save_model, save_tokenizer

import spmdkit
from spmdkit.interop import load_model
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules

VOCAB, SEQ = 128, 24
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)  # fmt: skip
SLIDING, FULL = "sliding_attention", "full_attention"
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {  # name: (config, what spmdkit must have read from it)
    "mistral-window": (tf.MistralConfig(**SHAPE, sliding_window=5), dict(sliding_window=5)),
    "mistral": (tf.MistralConfig(**SHAPE, sliding_window=None, head_dim=16), dict(sliding_window=0, head_dim=16)),
    "qwen3-window": (tf.Qwen3Config(**SHAPE, head_dim=8, use_sliding_window=True, sliding_window=6,
                                    max_window_layers=2), dict(sliding_window=6, window_pattern="GGLL")),
    "qwen3_moe": (tf.Qwen3MoeConfig(**SHAPE, **MOE, num_experts=4, mlp_only_layers=[1], norm_topk_prob=True,
                                    head_dim=8), dict(experts=4, dense_layers=(1,), expert_mlp=32)),
    "mixtral": (tf.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=7),
                dict(experts=4, sliding_window=7)),
    "qwen2_moe": (tf.Qwen2MoeConfig(**SHAPE, **MOE, num_experts=4, shared_expert_intermediate_size=48,
                                    decoder_sparse_step=2), dict(shared_expert_gate=True, moe_every=2,
                                                                 router_renormalize=False)),
    "gemma": (tf.GemmaConfig(**SHAPE, head_dim=16), dict(norm_plus_one=True, activation="gelu_pytorch_tanh")),
    "gemma2": (tf.Gemma2Config(**SHAPE, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
                               attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
               dict(post_norm=True, attention_softcap=3.0, logit_softcap=5.0, window_pattern="LG")),
    "gemma3_text": (tf.Gemma3TextConfig(**SHAPE, head_dim=16, sliding_window=5, query_pre_attn_scalar=16,
                                        layer_types=[SLIDING] * 3 + [FULL], rope_parameters={
                                            FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                            SLIDING: {"rope_type": "default", "rope_theta": 1e4}}),
                    dict(qk_norm=True, local_rope_theta=1e4, window_pattern="LLLG", rope_type="linear")),
    "olmo2": (tf.Olmo2Config(**SHAPE), dict(pre_norm=False, post_norm=True, qk_norm_scope="layer")),
    "phi3": (tf.Phi3Config(**SHAPE, sliding_window=9, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                        "partial_rotary_factor": 0.5}),
             dict(sliding_window=9, rope_fraction=0.5)),
    "granite": (tf.GraniteConfig(**SHAPE, embedding_multiplier=3.0, residual_multiplier=0.5,
                                 attention_multiplier=0.2, logits_scaling=4.0, attention_bias=True, mlp_bias=True),
                dict(embed_scale=3.0, residual_scale=0.5, attention_scale=0.2, logit_divisor=4.0, o_bias=True)),
    "smollm3": (tf.SmolLM3Config(**SHAPE, no_rope_layer_interval=2), dict(rope_pattern="RN")),
}  # fmt: skip
TOKENS = np.random.default_rng(5).integers(3, VOCAB, (8, SEQ))  # 8 rows: one per device of expert=4,data=2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: (directory, transformers' logits of TOKENS)}, each saved by transformers once."""
    root, out = tmp_path_factory.mktemp("families"), {}
    for seed, (name, (config, _)) in enumerate(FAMILIES.items()):
        directory = root / name
        save_tokenizer(directory, VOCAB)
        save_model(config, directory, seed=seed + 31)
        out[name] = directory, logits(load(directory), TOKENS)
    return out


def _mesh(name: str) -> str:
    return "expert=4,data=2" if "moe" in name or name == "mixtral" else "fsdp=4,tensor=2"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_and_loss_match_transformers_on_one_device_and_on_a_mesh(name, saved):
    directory, theirs = saved[name]
    ours = load_model(directory)
    for field, value in FAMILIES[name][1].items():
        assert getattr(ours.config, field) == value, field
    assert max_relative_error(ours(TOKENS), theirs) <= 1e-4

    assert_matches_on_mesh(directory, theirs, TOKENS, _mesh(name))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_matches_transformers(name, saved):
    directory, _ = saved[name]
    prompt, new = [3, 17, 5, 99, 42, 8, 11, 60], 8  # prompt + new tokens pass every window
    ours = spmdkit.generate(directory, prompt, max_new_tokens=new, mesh="tensor=2", stop_tokens=())[0].tokens
    with torch.no_grad():
        theirs = load(directory).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    assert ours == theirs


@pytest.mark.parametrize("name", ["mistral-window", "gemma3_text"])
def test_ring_attention_with_a_window_matches_transformers(name, saved):
    """Context parallelism (ring attention, zigzag layout) with windows that cross the ring's chunks (6 positions
    per chunk on context=2, windows of 5)."""
    from spmdkit.parallel.context.zigzag import from_zigzag, zigzag_batch

    directory, theirs = saved[name]
    mesh, rules = make_mesh("context=2,fsdp=4"), make_rules()
    model = load_model(directory, mesh=mesh, rules=rules)
    assert model.config.attention == "auto"  # ring on a context axis
    batch = zigzag_batch({"inputs": TOKENS, "positions": np.broadcast_to(np.arange(SEQ), TOKENS.shape)}, 2)
    with use_rules(rules, mesh):
        out = jax.jit(lambda m, b: m(b["inputs"], b["positions"]))(model, batch)
    assert max_relative_error(from_zigzag(np.asarray(out), axis=1, n=2), theirs) <= 1e-4


def _tensors(directory):
    from safetensors.numpy import load_file

    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(file)).items()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_is_bit_identical_and_loads_in_transformers(name, saved, tmp_path):
    directory, theirs = saved[name]
    model = load_model(directory)
    out = spmdkit.save_hf(model, tmp_path / "hf", tokenizer=directory, base_config=json.loads(
        (directory / "config.json").read_text()))  # fmt: skip
    again = load(out)  # no missing or unexpected keys
    want, got = _tensors(directory), _tensors(out)
    assert want.keys() == got.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].tobytes() == tensor.tobytes(), key
    assert max_relative_error(logits(again, TOKENS), theirs) <= 1e-6


@pytest.mark.parametrize("name", ["gemma2", "olmo2", "qwen2_moe", "phi3"])
def test_a_model_built_in_spmdkit_exports_as_its_family(name, saved, tmp_path):
    """No base config: the family is found by the model's function alone, and transformers computes it."""
    directory, theirs = saved[name]
    out = spmdkit.save_hf(load_model(directory), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == json.loads((directory / "config.json").read_text())["model_type"]
    assert max_relative_error(logits(load(out), TOKENS), theirs) <= 1e-5


PUBLISHED = {  # the published config.json (text part) of each family preset
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "gemma3-12b": {
        "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360, "num_attention_heads": 16,
        "num_hidden_layers": 48, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_family_presets_are_their_published_configs_and_count_their_parameters(name):
    from spmdkit.interop import from_hf_config
    from spmdkit.models.presets import PRESETS

    preset = PRESETS[name]
    imported = from_hf_config(PUBLISHED[name])  # dispatch is the run's: an import drops nothing, as transformers
    assert imported.replace(dispatch=preset.dispatch) == preset
    assert imported.dispatch == ("dropless" if preset.experts else "capacity")
    config = tf.AutoConfig.for_model(**PUBLISHED[name])
    with torch.device("meta"):
        reference = tf.AutoModelForCausalLM.from_config(config)
    assert preset.num_params() == sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("name", ["gemma2", "qwen2_moe"])
def test_the_first_fine_tuning_step_loss_is_transformers_loss(name, saved, tmp_path, capsys):
    """`spmdkit train --init-from DIR` on a mesh: step 1's loss is transformers' on the same batch (float32)."""
    from fixtures import run_cli

    from spmdkit.data.config import DataConfig
    from spmdkit.data.stream import make_data
    from spmdkit.train.reporting.metrics import read_metrics

    directory, _ = saved[name]
    args = ["train", "--init-from", str(directory), "--mesh", _mesh(name), "--dtype", "float32", "--steps", "1",
            "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--log-every", "1", "--run-dir",
            str(tmp_path / "run"), "--no-progress", "--data", "synthetic"]  # fmt: skip
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    batch = next(
        make_data(DataConfig(source="synthetic"), seq_len=32, global_batch=8, vocab_size=VOCAB, seed=0, split="train")
    )
    theirs = loss(load(directory), batch["inputs"], batch["targets"])
    assert abs(read_metrics(tmp_path / "run")[0]["loss"] - theirs) <= 1e-5 * theirs
