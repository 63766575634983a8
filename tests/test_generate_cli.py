"""`spmdkit generate`, `spmdkit eval` and `spmdkit.generate` on a trained run, and every bad input of generation.

The run is the session's `trained_tiny` (tests/conftest.py): `tiny` trained 300 steps on the stdlib bytes."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import error_lines, run_spmdkit

import spmdkit
from spmdkit.data.tokenizer import byte_tokenizer

MESH = ("--cpu-devices", "8", "--mesh", "tensor=2,data=2")
GREEDY = ("--prompt", "def ", "--temperature", "0", "--max-new-tokens", "48", *MESH)


@functools.cache
def greedy_json(run_dir) -> dict:
    result = run_spmdkit("generate", str(run_dir), *GREEDY, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def continuation_loss(run_dir, prompt: list[int], continuation: list[int]) -> float:
    """Mean cross-entropy (nats per token) of `continuation` after `prompt` under the run's model (float32)."""
    model = spmdkit.load_model(run_dir, dtype="float32")
    tokens = jnp.asarray([prompt + continuation], jnp.int32)
    logits = model(tokens)[0, len(prompt) - 1 : -1]
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(continuation)).mean())


def test_greedy_def_continues_with_likely_text(trained_tiny):
    """Asked greedily for `def `, the model continues with text it finds far likelier than random bytes."""
    out = greedy_json(trained_tiny)
    tokenizer = byte_tokenizer()
    assert out["prompt_tokens"] == [tokenizer.bos_id, *b"def "]
    assert len(out["tokens"]) == 48 and out["text"] == tokenizer.decode(out["tokens"])
    assert out["time_to_first_token_s"] >= out["prefill_s"] > 0 and out["decode_tokens_per_s"] > 0
    greedy = continuation_loss(trained_tiny, out["prompt_tokens"], out["tokens"])
    rng = np.random.default_rng(0)
    random_bytes = [continuation_loss(trained_tiny, out["prompt_tokens"], list(rng.integers(0, 256, 48))) for _ in "ab"]
    assert greedy < min(random_bytes) / 2, (greedy, random_bytes, out["text"])


def test_generate_streams_the_same_text(trained_tiny):
    """Without --json, one prompt is printed and its continuation streamed after it: the same greedy text."""
    result = run_spmdkit("generate", str(trained_tiny), *GREEDY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "def " + greedy_json(trained_tiny)["text"] + "\n"


def test_python_api_gives_the_cli_tokens(trained_tiny):
    """`spmdkit.generate` on the run directory, same mesh and settings: the tokens the CLI printed."""
    streamed = []
    (completion,) = spmdkit.generate(
        trained_tiny, "def ", max_new_tokens=48, mesh="tensor=2,data=2", on_text=lambda row, text: streamed.append(text)
    )
    assert completion.tokens == greedy_json(trained_tiny)["tokens"]
    assert "".join(streamed) == completion.text


def test_sampled_batch_of_prompts(trained_tiny):
    """Several prompts (one from a file) in one batch, sampled with top-k and top-p: one JSON line each."""
    result = run_spmdkit(
        "generate", str(trained_tiny), "--prompt", "import ", "--prompt", "class A:\n    ", "--temperature", "0.8",
        "--top-k", "40", "--top-p", "0.9", "--seed", "5", "--max-new-tokens", "20", "--json", *MESH,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["import ", "class A:\n    "]
    assert all(0 < len(r["tokens"]) <= 20 and all(0 <= t < 264 for t in r["tokens"]) for r in rows)


def test_eval_reports_loss_perplexity_and_bits_per_byte(trained_tiny):
    result = run_spmdkit(
        "eval", str(trained_tiny), "--batches", "3", "--json", "--cpu-devices", "8", "--mesh", "data=2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["batches"] == 3 and out["tokens"] == 3 * 8 * 128 and out["step"] == 300
    assert 0 < out["loss"] < math.log(256) / 2  # far better than a uniform guess over bytes
    assert out["perplexity"] == pytest.approx(math.exp(out["loss"]))
    # bytes: one per byte token, none for the BOS/EOS targets, so bits per byte is at least loss / ln 2
    assert out["bytes"] <= out["tokens"] and out["bits_per_byte"] >= out["loss"] / math.log(2) - 1e-6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--prompt", "x" * 200), "context is max_len=128"),
        (("--prompt", ""), "empty"),
        (("--prompt", "def ", "--temperature", "-1"), "--temperature"),
        (("--prompt", "def ", "--top-p", "0"), "--top-p"),
        (("--prompt", "def ", "--top-p", "1.5"), "--top-p"),
        (("--prompt", "def ", "--mesh", "fsdp=2,tensor=2"), "all-gather every weight"),
    ],
    ids=["too-long", "empty", "temperature", "top-p-0", "top-p-above-1", "fsdp"],
)
def test_bad_input_is_one_line(trained_tiny, args, message):
    result = run_spmdkit("generate", str(trained_tiny), *args, "--cpu-devices", "8")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr


def test_missing_checkpoint_is_one_line(tmp_path):
    for command in ("generate", "eval"):
        result = run_spmdkit(
            command, str(tmp_path / "nowhere"), *(("--prompt", "def ") if command == "generate" else ())
        )
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert len(lines := error_lines(result.stderr)) == 1 and "does not exist" in lines[0]


def test_generate_is_lazy():
    """`import spmdkit` stays light: `spmdkit.generate` loads its module (and JAX) on first use."""
    assert callable(spmdkit.generate) and jax is not None


def test_the_tokenizer_saved_in_the_checkpoint_directory_is_used(tmp_path):
    """The trainer saves a run's tokenizer with `Tokenizer.save(checkpoint_dir)`: generation finds it there, before
    the data source's (a tokenizers BPE here, trained in the test, so it differs from the stdlib's bytes)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, trainers

    from spmdkit.data.tokenizer import Tokenizer
    from spmdkit.inference.sources import ModelSource, model_tokenizer

    bpe = HFTokenizer(models.BPE())
    bpe.train_from_iterator(["def f(x): return x"] * 8, trainers.BpeTrainer(vocab_size=40, special_tokens=["<|eos|>"]))
    saved = Tokenizer(bpe.to_str(), name="bpe")
    saved.save(tmp_path / "checkpoints")
    source = ModelSource(tmp_path / "checkpoints", "spmdkit", step=1, config={"data": {"source": "stdlib"}})
    found = model_tokenizer(source)
    assert found.sha256 == saved.sha256 and found.eos_id == saved.eos_id
