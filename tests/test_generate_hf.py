"""`spmdkit generate` and `spmdkit eval` on a Hugging Face model directory, with transformers as the judge.

The model is a tiny Llama written by transformers' `save_pretrained` with random non-zero weights (biases and norm
scales included), every feature generation must carry (q/k/v/o and MLP biases, tied embeddings, llama3 RoPE
scaling, grouped-query attention), and a tokenizer built by `tokenizers` and saved by transformers beside it."""

import json

import numpy as np
import pytest
import torch
from hf_reference import load, loss, save_model, save_tokenizer
from support import run_spmdkit
from transformers import LlamaConfig, PreTrainedTokenizerFast

VOCAB, SEQ, NEW = 128, 16, 12
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
PROMPT = "w5 w17 w3 w99 w42"


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(directory, its special token ids): the model and its tokenizer, as transformers saved them."""
    directory = tmp_path_factory.mktemp("hf-llama")
    ids = save_tokenizer(directory, VOCAB)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_parameters=LLAMA3,
        max_position_embeddings=64, **ids,
    )  # fmt: skip
    save_model(config, directory, seed=5)
    return directory, ids


def test_greedy_generation_matches_transformers(hf_model):
    """The same prompt ids (BOS + the tokenizer's encoding) and the same greedy continuation as transformers'
    `generate(do_sample=False)`, on a tensor=2 mesh; the text is the tokenizer's decoding of those ids."""
    directory, ids = hf_model
    args = ("--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(NEW), "--json")
    result = run_spmdkit("generate", str(directory), *args, "--cpu-devices", "2", "--mesh", "tensor=2")
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[0])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    assert out["prompt_tokens"] == [ids["bos_token_id"], *tokenizer.encode(PROMPT, add_special_tokens=False)]

    model = load(directory)
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([out["prompt_tokens"]]), do_sample=False, max_new_tokens=NEW,
            eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
        )[0, len(out["prompt_tokens"]) :].tolist()  # fmt: skip
    if generated[-1] == ids["eos_token_id"]:  # transformers keeps the EOS; spmdkit stops before it
        generated = generated[:-1]
    assert out["tokens"] == generated
    assert len(set(generated)) > 1  # not a degenerate repetition that any bug could also produce
    assert out["text"] == tokenizer.decode(generated, skip_special_tokens=True)


def test_eval_loss_matches_transformers(hf_model, tmp_path):
    """`spmdkit eval` on the Hugging Face directory with a token file whose every window is one sequence: its loss
    is transformers' loss of that sequence."""
    directory, _ = hf_model
    window = np.random.default_rng(2).integers(0, VOCAB - 3, SEQ + 1).astype(np.uint16)
    tokens = np.tile(window, 40)
    assert int(len(tokens) * 0.05) % len(window) == 0  # the held-out tail (eval_fraction 0.05) starts on a window
    tokens.tofile(tmp_path / "tokens.bin")
    args = ("--data", str(tmp_path / "tokens.bin"), "--seq-len", str(SEQ), "--batch-size", "1", "--json")
    result = run_spmdkit("eval", str(directory), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    want = loss(load(directory), window[None, :-1], window[None, 1:])
    assert out["step"] is None and out["tokens"] == 2 * SEQ
    assert abs(out["loss"] - want) <= 1e-5 * want, (out["loss"], want)
