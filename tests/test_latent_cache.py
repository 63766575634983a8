"""DeepSeek-V3's latent KV cache, transformers the judge: generation caches the latent c_kv and the rope key k_pe
(kv_lora_rank + qk_rope_head_dim values per token and layer), decodes with kv_b absorbed into the query and the
output, and gives transformers' greedy tokens and logits, with and without a low-rank query.

Tiny random models written by transformers' `save_pretrained` (two layers: one dense, one MoE with shared experts
and group-limited sigmoid routing; latent attention with interleaved YaRN RoPE and mscale_all_dim; non-zero biases
and norm scales), float32, on `tensor=2` or `tensor=2,data=2`."""

import functools
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from hf_reference import load, logits, max_relative_error, randomize, save_tokenizer
from jax.sharding import PartitionSpec

import spmdkit
from spmdkit.inference.cache import KVCache, cache_bytes, cache_shardings, empty_cache
from spmdkit.inference.forward import decode, prefill
from spmdkit.inference.layerwise import merge_layers, split_layers
from spmdkit.inference.loading import inference_mesh, inference_rules, place_model
from spmdkit.interop import load_model
from spmdkit.plan.inference import decode_memory
from spmdkit.sharding.logical import use_rules

VOCAB, KV_RANK, ROPE = 96, 10, 4
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
        "original_max_position_embeddings": 16, "rope_theta": 10_000.0}  # fmt: skip
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
    n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=KV_RANK, qk_nope_head_dim=6,
    qk_rope_head_dim=ROPE, v_head_dim=5, attention_bias=True, max_position_embeddings=64, rope_interleave=True,
    rope_parameters=YARN, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
PROMPTS = ([3, 17, 5, 90, 42, 8], [11, 64, 29])  # one batch, two lengths
NEW = 8
SEQUENCE = np.random.default_rng(5).integers(3, VOCAB, (2, 16)).astype(np.int32)  # teacher forcing: 9 + 7 steps
PROMPT_LENGTHS, STEPS = np.array([9, 5], np.int32), 7
CACHE_LEN = 37  # a length (prime) no other dim of the programs has


def _save(directory, q_lora_rank):
    """A random model with a low-rank query (q_lora_rank 12) or a plain q_proj (None), saved by transformers."""
    save_tokenizer(directory, VOCAB)
    config = tf.DeepseekV3Config(q_lora_rank=q_lora_rank, **SHAPE)
    randomize(tf.AutoModelForCausalLM.from_config(config), 21).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def q_lora(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("deepseek_v3_q_lora") / "model", 12)


@pytest.fixture(scope="module")
def q_proj(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("deepseek_v3_q_proj") / "model", None)


def test_the_cache_holds_the_latent_and_the_planner_counts_it(q_lora):
    """Each layer caches [batch, len, kv_lora_rank] and [batch, len, qk_rope_head_dim]: layers x (10 + 4) x 4 bytes
    per token; rows split over `data`, the latent whole on every `tensor` rank; the planner counts the same bytes."""
    config = load_model(q_lora).config
    batch, length, layers = 4, 32, SHAPE["num_hidden_layers"]
    cache = jax.eval_shape(lambda: empty_cache(config, batch, length))
    assert [a.shape for a in cache.k] == [(batch, length, KV_RANK)] * layers
    assert [a.shape for a in cache.v] == [(batch, length, ROPE)] * layers
    per_token = layers * (KV_RANK + ROPE) * 4
    assert cache_bytes(config, batch, length) == batch * length * per_token
    mesh = inference_mesh("tensor=2,data=2")
    shardings = cache_shardings(config, batch, length, mesh, inference_rules())
    assert {s.spec for s in shardings.k + shardings.v} == {PartitionSpec("data")}  # no dim over tensor
    planned = decode_memory(config, {"tensor": 2, "data": 2}, None, batch=batch, context=length)
    assert planned["kv_cache"] == batch * length * per_token / 2


@functools.cache
def _teacher_forced(directory, absorb: bool) -> tuple[np.ndarray, str]:
    """Logits [steps + 1, batch, vocab] of prefill of SEQUENCE's prompts, then STEPS decode steps fed its tokens, on
    tensor=2 (heads split, the latent replicated), and the compiled program's text; the cache holds CACHE_LEN
    positions."""
    mesh, rules = inference_mesh("tensor=2"), inference_rules()
    placed = place_model(load_model(directory), mesh, rules)
    definition, params = split_layers(placed)
    prompts = np.where(np.arange(16) < PROMPT_LENGTHS[:, None], SEQUENCE, 0)
    fed = np.stack([SEQUENCE[[0, 1], PROMPT_LENGTHS + i] for i in range(STEPS)])  # [steps, batch]

    def run(params, prompts, lengths, fed):
        empty = empty_cache(placed.config, 2, CACHE_LEN)
        first, cache = prefill(merge_layers(definition, params), prompts, lengths, empty)

        def step(cache, token):
            logits, cache = decode(merge_layers(definition, params), token, cache, absorb=absorb)
            return KVCache(cache.k, cache.v, cache.lengths + 1), logits

        return jnp.concatenate([first[None], jax.lax.scan(step, cache, fed)[1]])

    with use_rules(rules, mesh):
        compiled = jax.jit(run).lower(params, prompts, PROMPT_LENGTHS, fed).compile()
        return np.asarray(compiled(params, prompts, PROMPT_LENGTHS, fed)), compiled.as_text()


def _largest_over_the_cache(text: str) -> int:
    """Elements of the largest array in a compiled program with a dim of CACHE_LEN (no other dim of them is)."""
    shapes = (m.group(1).split(",") for m in re.finditer(r"\w+\[([0-9,]+)\]", text))
    return max(math.prod(map(int, dims)) for dims in shapes if str(CACHE_LEN) in dims)


def test_absorbed_decode_equals_the_expanded_cache(q_lora):
    """Teacher-forced decode: the absorbed form's logits equal those of expanding the cached latent into per-head
    keys and values within 1e-4 of their scale. The absorbed program never builds an array over the cached
    positions larger than the latent cache's [batch, positions, kv_lora_rank]; expanding builds the per-head keys
    [batch, positions, 2 heads, 10]."""
    (absorbed, absorbed_text), (expanded, expanded_text) = _teacher_forced(q_lora, True), _teacher_forced(q_lora, False)
    for step in range(STEPS + 1):
        assert max_relative_error(absorbed[step], expanded[step]) <= 1e-4, step
    latent = 2 * CACHE_LEN * KV_RANK
    assert _largest_over_the_cache(absorbed_text) == latent < _largest_over_the_cache(expanded_text)


@pytest.mark.parametrize("variant", ["q_lora", "q_proj"])
def test_decode_logits_equal_transformers(variant, request):
    """Teacher-forced absorbed decode: every step's logits are transformers' full forward's there, within 1e-4 of
    their scale."""
    directory = request.getfixturevalue(variant)
    ours, theirs = _teacher_forced(directory, True)[0], logits(load(directory), SEQUENCE)
    for step in range(STEPS + 1):
        assert max_relative_error(ours[step], theirs[[0, 1], PROMPT_LENGTHS - 1 + step]) <= 1e-4, step


@pytest.mark.parametrize("variant", ["q_lora", "q_proj"])
def test_greedy_tokens_equal_transformers_generate(variant, request):
    """Two prompts of different lengths in one batch on tensor=2,data=2: each row's greedy tokens are
    transformers' `generate`'s for that prompt alone."""
    saved = request.getfixturevalue(variant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = spmdkit.generate(saved, list(PROMPTS), max_new_tokens=NEW, mesh="tensor=2,data=2", stop_tokens=())
    reference = load(saved)
    for prompt, completion in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW,
                                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
        assert completion.tokens == theirs
