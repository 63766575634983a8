"""Generation: the KV cache against the full forward, sampling, the same tokens on any mesh, buckets that do not
recompile, and what one decode step under tensor parallelism communicates and holds.

Models are tiny (embed 32, 8 query heads over 4 KV heads, float32); the mixture-of-experts one alternates dense and
MoE blocks (4 experts, top 2, dropless). Each (model, mesh) compiles its programs once (`functools.cache`)."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdkit.errors import SpmdkitError
from spmdkit.inference.cache import KVCache, cache_bytes, empty_cache
from spmdkit.inference.engine import Generator
from spmdkit.inference.forward import decode, prefill
from spmdkit.inference.layerwise import merge_layers, split_layers
from spmdkit.inference.loading import generation_config, inference_mesh, inference_rules, place_model
from spmdkit.inference.sampling import Sampling, sample, sampling_arrays
from spmdkit.inspect.hlo import collective_report
from spmdkit.models import TransformerConfig
from spmdkit.models.transformer import Transformer
from spmdkit.plan.devices import DEVICES
from spmdkit.plan.inference import decode_memory
from spmdkit.sharding.logical import use_rules

DENSE = TransformerConfig(vocab_size=128, embed=32, layers=2, heads=8, kv_heads=4, head_dim=8, mlp=64, dtype="float32")
MOE = DENSE.replace(layers=4, experts=4, top_k=2, moe_every=2, dispatch="dropless")
# What Hugging Face models bring: every bias, one tied embedding/head parameter, llama3 RoPE scaling (the sequences
# here pass its original_max_positions, and its three wavelength bands are all present at head_dim 8).
FEATURED = DENSE.replace(
    qkv_bias=True, o_bias=True, mlp_bias=True, tie_embeddings=True, rope_type="llama3", rope_factor=8.0,
    rope_original_max_positions=16,
)  # fmt: skip
MODELS = {"dense": DENSE, "moe": MOE, "featured": FEATURED}
PROMPT_LENGTHS = (3, 8, 5, 11)  # one batch, four lengths
DECODE_STEPS = 6
ONE = "one device"


@functools.cache
def model(name: str) -> Transformer:
    with nnx.use_eager_sharding(False):
        built = Transformer(MODELS[name], rngs=nnx.Rngs(7))
    if name == "featured":  # biases start at 0 and norm scales at 1: move every parameter, so a dropped one shows
        graphdef, state = nnx.split(built)
        leaves, treedef = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.key(3), len(leaves))
        moved = [a + 0.1 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys, strict=True)]
        built = nnx.merge(graphdef, jax.tree.unflatten(treedef, moved))
    return built


@functools.cache
def sequences(name: str) -> np.ndarray:
    """[batch, longest prompt + decode steps] token ids; row b's prompt is its first PROMPT_LENGTHS[b] tokens."""
    width = max(PROMPT_LENGTHS) + DECODE_STEPS
    return np.random.default_rng(1).integers(0, MODELS[name].vocab_size, (len(PROMPT_LENGTHS), width), np.int32)


@functools.cache
def full_logits(name: str) -> np.ndarray:
    """The reference: the plain model's forward over the whole sequences, on one device."""
    return np.asarray(jax.jit(lambda m, t: m(t))(model(name), jnp.asarray(sequences(name))))


def mesh_of(text: str):
    return inference_mesh(None if text == ONE else text)


@functools.cache
def teacher_forced(name: str, mesh_text: str) -> np.ndarray:
    """Logits [steps + 1, batch, vocab] of prefill then DECODE_STEPS decode steps, each fed the true next token:
    step 0 is each prompt's last position, step i its position length - 1 + i."""
    mesh, rules = mesh_of(mesh_text), inference_rules()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tensor=8 replicates the 4 KV heads, with a warning
        placed = place_model(model(name), mesh, rules)
        definition, params = split_layers(placed)
        tokens, lengths = sequences(name), np.array(PROMPT_LENGTHS, np.int32)
        bucket, cache_len = 16, 32
        prompts = np.where(np.arange(bucket) < lengths[:, None], tokens[:, :bucket], 0)
        rows = np.arange(len(lengths))
        fed = np.stack([tokens[rows, lengths + i] for i in range(DECODE_STEPS)])  # [steps, batch]

        def run(params, prompts, lengths, fed):
            layers = merge_layers(definition, params)
            first, cache = prefill(layers, prompts, lengths, empty_cache(placed.config, len(rows), cache_len))

            def step(cache, token):
                logits, cache = decode(merge_layers(definition, params), token, cache)
                return KVCache(cache.k, cache.v, cache.lengths + 1), logits

            _, rest = jax.lax.scan(step, cache, fed)
            return jnp.concatenate([first[None], rest])

        with use_rules(rules, mesh):
            return np.asarray(jax.jit(run)(params, prompts, lengths, fed))


@pytest.mark.parametrize("mesh_text", [ONE, "tensor=4,data=2", "tensor=8"])
@pytest.mark.parametrize("name", ["dense", "moe", "featured"])
def test_cache_matches_the_full_forward(name, mesh_text):
    """Every decoded position's logits equal the full-sequence forward's there (teacher forcing, float32, 1e-5
    relative), for prompts of four lengths in one batch: dense GQA, MoE, and biases + tied head + llama3 RoPE."""
    cached, full = teacher_forced(name, mesh_text), full_logits(name)
    for step in range(DECODE_STEPS + 1):
        for row, length in enumerate(PROMPT_LENGTHS):
            got, want = cached[step, row], full[row, length - 1 + step]
            error = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert error < 1e-5, f"{name} on {mesh_text}: row {row} step {step}: relative error {error:.2e}"


@functools.cache
def generator(name: str, mesh_text: str) -> Generator:
    mesh, rules = mesh_of(mesh_text), inference_rules()
    return Generator(place_model(model(name), mesh, rules), mesh, rules, max_len=64, chunk=4)


PROMPTS = [[5, 9, 2], list(range(1, 12)), [7] * 6]


@pytest.mark.parametrize(
    "sampling", [Sampling(12), Sampling(12, temperature=1.0, top_k=20, top_p=0.9, seed=3)], ids=["greedy", "sampled"]
)
def test_same_seed_same_tokens_on_any_mesh(sampling):
    one = [c.tokens for c in generator("dense", ONE).generate(PROMPTS, sampling)]
    sharded = [c.tokens for c in generator("dense", "tensor=4,data=2").generate(PROMPTS, sampling)]
    assert one == sharded
    assert all(len(tokens) == 12 for tokens in one)  # no stop token: max_new_tokens each


def test_the_seed_decides_the_sample():
    runs = [[c.tokens for c in generator("dense", ONE).generate(PROMPTS, Sampling(12, 1.0, seed=s))] for s in (0, 1)]
    assert runs[0] != runs[1]


def test_a_bucket_compiles_once():
    """Other prompt lengths, budgets, sampling settings and batch sizes inside one bucket reuse its programs."""
    gen = generator("dense", ONE)
    gen.generate(PROMPTS, Sampling(12))
    compiled = dict(gen.programs)
    gen.generate([[1, 2], [3] * 9, [4] * 4, [5]], Sampling(14, temperature=0.7, top_p=0.5, seed=9, stop_tokens=(3,)))
    assert gen.programs == compiled  # no new program: same shapes, settings are arrays


def test_stop_tokens_end_a_row():
    gen = generator("dense", ONE)
    free = gen.generate(PROMPTS, Sampling(12))
    stop = free[0].tokens[4]
    stopped = gen.generate(PROMPTS, Sampling(12, stop_tokens=(stop,)))
    first = free[0].tokens.index(stop)
    assert stopped[0].tokens == free[0].tokens[:first] and stopped[0].finish_reason == "stop"
    assert free[0].finish_reason == "length"


def test_sampling_rules():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 256))
    keys = jax.random.split(jax.random.key(0), 256)

    def drawn(**settings):
        return np.asarray(sample(logits, keys, sampling_arrays(Sampling(**settings), vocab_limit=4)))

    assert (drawn() == 0).all()  # temperature 0: greedy
    assert (drawn(temperature=1.0, top_k=1) == 0).all()
    assert set(drawn(temperature=1.0, top_k=2)) == {0, 1}
    assert set(drawn(temperature=1.0, top_p=0.75)) == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert set(drawn(temperature=1.0, top_p=0.85)) == {0, 1, 2}
    assert set(np.asarray(sample(logits, keys, sampling_arrays(Sampling(temperature=5.0), vocab_limit=2)))) == {0, 1}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"temperature": -0.5}, "--temperature"),
        ({"top_p": 0.0}, "--top-p"),
        ({"top_p": 1.5}, "--top-p"),
        ({"max_new_tokens": 0}, "--max-new-tokens"),
    ],
)
def test_bad_sampling_settings(settings, message):
    with pytest.raises(SpmdkitError, match=message):
        Sampling(**settings)


def test_bad_prompts():
    gen = generator("dense", ONE)
    with pytest.raises(SpmdkitError, match="empty"):
        gen.generate([[1], []], Sampling(4))
    with pytest.raises(SpmdkitError, match="max_len=64"):
        gen.generate([[1] * 64], Sampling(4))


def test_fsdp_is_refused():
    with pytest.raises(SpmdkitError, match="all-gather every weight"):
        inference_mesh("fsdp=2,tensor=4")


@functools.cache
def decode_step_tensor4():
    """One decode step of the dense model (batch 8, 64 cache slots) compiled under tensor=4."""
    gen = generator("dense", "tensor=4")
    return gen.step_program(8, 64)


def test_decode_step_collectives_under_tensor_parallelism():
    """Per layer two all-reduces of [batch, 1, embed] (attention out, MLP down) and no weight moves; outside the
    layers one more for the vocab-parallel embedding lookup, and the logits gathered for sampling."""
    report = collective_report(decode_step_tensor4())
    activation = 8 * 1 * DENSE.embed * 4  # [batch, 1, embed] float32
    reduces = [c for c in report.collectives if c.opcode in ("all-reduce", "reduce-scatter")]
    assert sum(c.executions for c in reduces) == 2 * DENSE.layers + 1  # the layers are unrolled: one instruction each
    assert all(c.operand_bytes == activation for c in reduces)
    gathers = [c for c in report.collectives if c.opcode == "all-gather"]
    assert [c.result_bytes for c in gathers] == [8 * DENSE.vocab_size * 4]  # the logits, never a weight
    assert not [c for c in report.collectives if c.opcode not in ("all-reduce", "all-gather", "reduce-scatter")]


def test_decode_step_memory_under_tensor_parallelism():
    """The step's arguments are the weights / 4 (norm scales replicated) and the KV cache / 4, as the planner
    predicts; the cache is updated in place (its output aliases its input) and never copied whole."""
    stats = decode_step_tensor4().memory_analysis()
    c = DENSE
    kv = 2 * c.layers * 8 * 64 * c.kv_heads * c.head_dim * 4 / 4  # 2 x layers x batch x max_len x kv x d x bytes / T
    assert cache_bytes(c, 8, 64) / 4 == kv
    predicted = decode_memory(c, {"tensor": 4}, DEVICES["cpu"], batch=8, context=64)
    assert predicted["kv_cache"] == kv
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model("dense"))))
    norms = (2 * c.layers + 1) * c.embed
    assert predicted["weights"] == ((params - norms) / 4 + norms) * 4
    small = stats.argument_size_in_bytes - predicted["weights"] - kv
    assert 0 <= small < 1024  # tokens, lengths, counters, sampling settings
    assert stats.alias_size_in_bytes >= kv
    assert stats.temp_size_in_bytes < kv


def test_generation_config_runs_moe_dropless():
    assert generation_config(MOE.replace(dispatch="capacity")).dispatch == "dropless"
