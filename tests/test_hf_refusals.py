"""What Hugging Face import refuses: each refusal is one line naming what is wrong, exit 2, and nothing written.

The artifacts are transformers' own saves (a GPT-2, a ReLU Llama, a Mixtral with router noise, a bidirectional
Gemma 3, a dynamic RoPE), or a save then damaged the way real downloads and hand edits are (a config that no longer
matches its weights, a missing or truncated shard, a broken config.json)."""

import json
from pathlib import Path

import pytest
from fixtures import run_cli
from hf_reference import edit_config, save_model
from support import error_lines
from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, MixtralConfig, Qwen2Config

SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _gpt2(d: Path) -> None:
    save_model(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64), d)


def _relu(d: Path) -> None:
    save_model(LlamaConfig(**SHAPE, hidden_act="relu"), d)


def _unconsumed(d: Path) -> None:
    save_model(LlamaConfig(**SHAPE, attention_bias=True), d)
    edit_config(d, attention_bias=False)  # the config no longer says what the biases are for


def _jitter(d: Path) -> None:
    save_model(MixtralConfig(**SHAPE, num_key_value_heads=2, num_local_experts=4, router_jitter_noise=0.1), d)


def _bidirectional(d: Path) -> None:
    save_model(Gemma3TextConfig(**SHAPE, head_dim=8, use_bidirectional_attention=True), d)


def _missing_shard(d: Path) -> None:
    save_model(LlamaConfig(**SHAPE), d, max_shard_size="20KB")
    sorted(d.glob("model-*-of-*.safetensors"))[1].unlink()


def _dynamic(d: Path) -> None:
    rope = {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 4.0}
    save_model(LlamaConfig(**SHAPE, rope_parameters=rope), d)


def _truncated(d: Path) -> None:
    save_model(LlamaConfig(**SHAPE), d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:200])


def _broken_config(d: Path) -> None:
    save_model(LlamaConfig(**SHAPE), d)
    (d / "config.json").write_text('{"model_type": "llama",')


def _wrong_shape(d: Path) -> None:
    save_model(LlamaConfig(**SHAPE), d)
    edit_config(d, intermediate_size=96)


CASES = {
    "unsupported model_type": (_gpt2, "model_type='gpt2' is not a family spmdkit runs"),
    "hidden_act": (_relu, "hidden_act='relu' is not implemented"),
    "unconsumed tensor": (_unconsumed, "holds tensors this model does not use: model.layers.0.self_attn.k_proj.bias"),
    "router noise": (_jitter, "router_jitter_noise=0.1 is not implemented"),
    "bidirectional": (_bidirectional, "use_bidirectional_attention is not implemented"),
    "missing shard": (_missing_shard, "missing shard"),
    "rope_type": (_dynamic, "rope_type='dynamic' is not implemented"),
    "truncated file": (_truncated, "is not a readable safetensors file"),
    "broken config": (_broken_config, "is not valid JSON"),
    "shape": (_wrong_shape, "has shape [64, 32], but config.json implies [96, 32]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_import_refuses_in_one_line_and_writes_nothing(case, tmp_path, capsys):
    make, message = CASES[case]
    make(tmp_path / "model")
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "ckpt", "import-hf", str(tmp_path / "model"), "--out", str(out))
    assert code == 2 and len(error_lines(err)) == 1 and "Traceback" not in err, err
    assert message in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_missing_shard_is_named_when_the_index_is_given(tmp_path, capsys):
    _missing_shard(tmp_path / "model")
    index = tmp_path / "model" / "model.safetensors.index.json"
    code, _, err = run_cli(capsys, "ckpt", "import-hf", str(index), "--out", str(tmp_path / "out"))
    assert code == 2 and "missing shard" in err and "model-00002-of-" in err
    assert not (tmp_path / "out").exists()


def test_init_from_refuses_a_conflicting_model(tmp_path, capsys):
    save_model(LlamaConfig(**SHAPE), tmp_path / "model")
    base = ["train", "--init-from", str(tmp_path / "model"), "--run-dir", str(tmp_path / "run")]
    for extra, message in [
        (["--model", "1b"], "--model 1b conflicts with --init-from"),
        (["--model.layers", "3"], "--model.layers 3 conflicts with --init-from"),
    ]:
        code, _, err = run_cli(capsys, *base, *extra)
        assert code == 2 and len(error_lines(err)) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_the_refusals_leave_a_good_config_alone(tmp_path):
    """The checks refuse what transformers would compute differently, not keys its modeling code ignores."""
    from spmdkit.interop import from_hf_config

    save_model(LlamaConfig(**SHAPE, pretraining_tp=2, use_cache=False), tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    model = from_hf_config(config | {"rope_interleaved": False, "initializer_range": 0.5})
    assert (model.embed, model.layers, model.heads, model.kv_heads, model.head_dim) == (32, 2, 4, 4, 8)


def test_a_tied_model_may_carry_the_head_only_as_a_copy_of_the_embedding(tmp_path, capsys):
    """Some tied checkpoints store lm_head.weight anyway: an exact copy is consumed, a different one refused."""
    from safetensors.numpy import load_file, save_file

    from spmdkit.interop import load_model

    save_model(Qwen2Config(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True), tmp_path / "model")
    file = tmp_path / "model" / "model.safetensors"
    tensors = load_file(str(file))
    save_file(tensors | {"lm_head.weight": tensors["model.embed_tokens.weight"]}, str(file), {"format": "pt"})
    assert load_model(tmp_path / "model").config.tie_embeddings

    save_file(tensors | {"lm_head.weight": tensors["model.embed_tokens.weight"] + 1}, str(file), {"format": "pt"})
    code, _, err = run_cli(capsys, "ckpt", "import-hf", str(tmp_path / "model"), "--out", str(tmp_path / "out"))
    assert code == 2 and len(error_lines(err)) == 1 and "lm_head.weight differs from model.embed_tokens" in err
    assert not (tmp_path / "out").exists()
