"""GPT-OSS (`gpt_oss`) in and out, transformers the judge: a tiny model written by transformers' `save_pretrained`
(random non-zero biases, norm scales and sinks; windows of 5 on every other layer of 24-token inputs; YaRN RoPE; a
SwiGLU clamp of 1, which bites) gives transformers' logits and loss on one device and on two meshes (and under
ring attention), its greedy tokens, and exports back bit-identically. The sinks in the kernels are checked against a
softmax written here, with gradients; kernels that cannot take sinks are refused in one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from fixtures import run_cli
from hf_reference import assert_matches_on_mesh, load, logits, max_relative_error, save_model, save_tokenizer

import spmdkit
from spmdkit.errors import SpmdkitError
from spmdkit.inference.attention import cache_attention
from spmdkit.interop import from_hf_config, load_model
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.models.attention import blockwise_attention, dot_attention
from spmdkit.models.attention_choice import choose_attention
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules

VOCAB, SEQ = 128, 24
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 10_000.0}  # fmt: skip
CONFIG = tf.GptOssConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
    max_position_embeddings=64, swiglu_limit=1.0, rope_parameters=YARN, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip
TOKENS = np.random.default_rng(5).integers(3, VOCAB, (8, SEQ))  # 8 rows: one per device of expert=4,data=2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, transformers' logits of TOKENS) of the model transformers saved."""
    directory = tmp_path_factory.mktemp("gpt_oss") / "model"
    save_tokenizer(directory, VOCAB)
    save_model(CONFIG, directory, seed=39)
    return directory, logits(load(directory), TOKENS)


def test_config_is_read_and_logits_match_transformers_on_one_device(saved):
    directory, theirs = saved
    ours = load_model(directory)
    expected = dict(
        attention_sinks=True, qkv_bias=True, o_bias=True, router_bias=True, expert_bias=True, swiglu_limit=1.0,
        swiglu_alpha=1.702, sliding_window=5, window_pattern="LG", rope_type="yarn", rope_factor=4.0,
        rope_truncate=False, rope_original_max_positions=16, experts=4, top_k=2,
    )  # fmt: skip
    assert {k: getattr(ours.config, k) for k in expected} == expected
    assert max_relative_error(ours(TOKENS), theirs) <= 1e-4


@pytest.mark.parametrize("mesh", ["expert=4,data=2", "fsdp=2,tensor=2,expert=2"])
def test_logits_and_training_loss_match_transformers_on_a_mesh(saved, mesh):
    directory, theirs = saved
    assert_matches_on_mesh(directory, theirs, TOKENS, mesh)


def test_greedy_generation_matches_transformers(saved):
    directory, _ = saved
    prompt, new = [3, 17, 5, 99, 42, 8, 11, 60], 8  # prompt + new tokens pass the window
    ours = spmdkit.generate(directory, prompt, max_new_tokens=new, mesh="tensor=2", stop_tokens=())[0].tokens
    with torch.no_grad():
        theirs = load(directory).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    assert ours == theirs


def _tensors(directory):
    from safetensors.numpy import load_file

    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(file)).items()}


def test_export_is_bit_identical_and_loads_in_transformers(saved, tmp_path):
    directory, theirs = saved
    out = spmdkit.save_hf(load_model(directory), tmp_path / "hf", tokenizer=directory)  # no base: found by function
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt_oss"
    again = load(out)  # no missing or unexpected keys
    want, got = _tensors(directory), _tensors(out)
    assert want.keys() == got.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].tobytes() == tensor.tobytes(), key
    assert max_relative_error(logits(again, TOKENS), theirs) <= 1e-6


def test_a_bfloat16_checkpoint_exports_bit_identically(saved, tmp_path):
    """bf16 weights (as GPT-OSS's dequantised checkpoints are) stay bf16 and come back bit for bit."""
    load(saved[0], dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    out = spmdkit.save_hf(load_model(tmp_path / "bf16"), tmp_path / "hf")
    want, got = _tensors(tmp_path / "bf16"), _tensors(out)
    assert want.keys() == got.keys() and {str(t.dtype) for t in got.values()} == {"bfloat16"}
    assert all(got[key].tobytes() == tensor.tobytes() for key, tensor in want.items())


def _reference(q, k, v, sinks, mask):
    """Attention with sinks as written out: K/V repeated to the heads, the sink a last column of the softmax."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(mask[:, None], s, -jnp.inf)
    column = jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))
    p = jax.nn.softmax(jnp.concatenate([s, column], -1), -1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def test_sinks_in_the_dot_blockwise_and_cache_kernels_with_gradients():
    """Packed documents (with padding) and a window of 6 over blocks of 8: values and gradients, sinks' included."""
    keys = jax.random.split(jax.random.key(0), 4)
    b, s, h, kh, d = 2, 16, 4, 2, 8
    q, k, v = (jax.random.normal(key, (b, s, n, d)) for key, n in zip(keys[:3], (h, kh, kh), strict=True))
    sinks = jax.random.normal(keys[3], (h,))
    segments = jnp.asarray(np.repeat([[1, 2, 0], [1, 1, 3]], [7, 6, 3], axis=1), jnp.int32)
    pos = np.arange(s)
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 6)
    mask = visible & (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] != 0)
    spec = AttentionSpec(window=6, block_q=8, block_k=8)
    want = _reference(q, k, v, sinks, mask)
    for kernel in (dot_attention, blockwise_attention):  # jitted: eager op-by-op dispatch is slower than a compile
        got = jax.jit(lambda q, k, v, sk, kernel=kernel: kernel(q, k, v, segments, spec, sk))(q, k, v, sinks)
        assert np.abs(got - want).max() <= 1e-5, kernel.__name__

    def grads(kernel):
        return jax.jit(jax.grad(lambda *args: jnp.sum(jnp.sin(kernel(*args))), argnums=(0, 1, 2, 3)))(q, k, v, sinks)

    want = grads(lambda q, k, v, sk: _reference(q, k, v, sk, mask))
    got = grads(lambda q, k, v, sk: blockwise_attention(q, k, v, segments, spec, sk))
    for name, ours, expected in zip(("q", "k", "v", "sinks"), got, want, strict=True):
        assert np.abs(ours - expected).max() <= 1e-5, name
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))  # the KV-cache kernel (prefill: causal by position)
    cached = cache_attention(q, k, v, positions, AttentionSpec(window=6), sinks)
    assert np.abs(cached - _reference(q, k, v, sinks, np.broadcast_to(visible, (b, s, s)))).max() <= 1e-5


def test_ring_attention_with_sinks_matches_transformers(saved):
    """Context parallelism: the sinks join the ring's final log-sum-exp (zigzag layout, windows across chunks)."""
    from spmdkit.parallel.context.zigzag import from_zigzag, zigzag_batch

    directory, theirs = saved
    mesh, rules = make_mesh("context=2,fsdp=4"), make_rules()
    model = load_model(directory, mesh=mesh, rules=rules)
    batch = zigzag_batch({"inputs": TOKENS, "positions": np.broadcast_to(np.arange(SEQ), TOKENS.shape)}, 2)
    with use_rules(rules, mesh):
        out = jax.jit(lambda m, b: m(b["inputs"], b["positions"]))(model, batch)
    assert max_relative_error(from_zigzag(np.asarray(out), axis=1, n=2), theirs) <= 1e-4


def test_ulysses_with_sinks_gives_the_blockwise_kernels_values_and_gradients():
    """Each device takes its heads' sinks after the exchange (heads over tensor x context, kv heads repeated)."""
    from spmdkit.models.attention import KERNEL_TABLE

    keys = jax.random.split(jax.random.key(1), 4)
    b, s, h, kh, d = 4, 16, 8, 4, 8
    q, k, v = (jax.random.normal(key, (b, s, n, d)) for key, n in zip(keys[:3], (h, kh, kh), strict=True))
    sinks, spec = jax.random.normal(keys[3], (h,)), AttentionSpec(window=6)
    mesh, rules = make_mesh("context=4,tensor=2"), make_rules()

    def grads(kernel):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(kernel(*a))), argnums=(0, 1, 2, 3)))

    def ulysses(q, k, v, sk):
        with use_rules(rules, mesh):
            return KERNEL_TABLE["ulysses_blockwise"](q, k, v, None, spec, sk)

    want = grads(lambda q, k, v, sk: blockwise_attention(q, k, v, None, spec, sk))(q, k, v, sinks)
    got = grads(ulysses)(q, k, v, sinks)
    assert abs(float(got[0] - want[0])) <= 1e-4
    for name, ours, expected in zip(("q", "k", "v", "sinks"), got[1], want[1], strict=True):
        assert np.abs(ours - expected).max() <= 1e-5, name


def test_kernels_that_cannot_take_sinks_are_refused_and_auto_avoids_them(tmp_path, capsys):
    args = dict(platform="cuda", dtype="bfloat16", head_dim=64, sinks=True)
    assert choose_attention("auto", context=1, **args) == "blockwise"  # cuDNN takes the shape, not the sinks
    assert choose_attention("auto", context=2, head_split=4, **args) == "ring"  # not Ulysses around cuDNN
    with pytest.raises(SpmdkitError, match="cudnn has no attention sinks"):
        choose_attention("cudnn", context=1, **args)
    assert choose_attention("auto", context=2, context_parallel="ulysses", head_split=4, **args) == "ulysses_blockwise"
    with pytest.raises(SpmdkitError, match="cudnn has no attention sinks"):
        choose_attention("ulysses_cudnn", context=2, head_split=4, **args)
    code, _, err = run_cli(capsys, "train", "--model", "tiny-moe", "--model.attention-sinks", "True",
                           "--model.attention", "cudnn", "--mesh", "fsdp=8", "--steps", "1", "--run-dir",
                           str(tmp_path / "run"), "--no-progress", "--data", "synthetic")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no attention sinks" in err, err
    assert not (tmp_path / "run").exists()


def test_mxfp4_checkpoints_are_refused_in_one_line_naming_the_fix(saved):
    hf = json.loads((saved[0] / "config.json").read_text())
    with pytest.raises(SpmdkitError, match="Mxfp4Config\\(dequantize=True\\)") as error:
        from_hf_config(hf | {"quantization_config": {"quant_method": "mxfp4"}})
    assert "\n" not in str(error.value)


PUBLISHED_20B = {  # openai/gpt-oss-20b's config.json, less its quantization_config (bf16 weights)
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999, "rms_norm_eps": 1e-05, "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
        "rope_type": "yarn", "truncate": False}, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}  # fmt: skip


def test_the_gpt_oss_20b_preset_is_its_published_config_and_counts_its_parameters():
    from spmdkit.models.presets import PRESETS

    preset = PRESETS["gpt-oss-20b"]
    imported = from_hf_config(PUBLISHED_20B)  # dispatch is the run's: an import drops nothing, as transformers
    assert imported.replace(dispatch=preset.dispatch) == preset
    assert imported.dispatch == ("dropless" if preset.experts else "capacity")
    with torch.device("meta"):
        reference = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**PUBLISHED_20B))
    assert preset.num_params() == sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize(
    "rope",
    [
        {"truncate": True},  # transformers' default: the correction range rounded out to whole dims
        {"truncate": False, "attention_factor": 1.3},
        {"beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},  # DeepSeek's correction
    ],
)
def test_yarn_frequencies_and_attention_factor_are_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from spmdkit.models.layers import rope_frequencies, rope_scaling

    block = {"rope_type": "yarn", "rope_theta": 50_000.0, "factor": 8.0, "original_max_position_embeddings": 64}
    config = tf.LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=512,
                            rope_parameters=block | rope)  # fmt: skip
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = from_hf_config(config.to_dict())
    np.testing.assert_allclose(rope_frequencies(ours), inv.numpy(), rtol=1e-6)  # float32 powers: within an ulp
    assert rope_scaling(ours) == pytest.approx(factor, rel=1e-12)
