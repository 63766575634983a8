"""Hugging Face export: models spmdkit trained (dense GQA, tied with every bias and GELU, Qwen2-style) load with
`AutoModelForCausalLM` with no missing or unexpected keys and give spmdkit's logits; HF -> spmdkit -> HF round
trips give bit-identical tensors with the same dtypes and the same config, generation config and tokenizer; the
directory is complete and written atomically (refused over existing files without --force)."""

import json

import numpy as np
import pytest
import transformers
from fixtures import run_cli
from hf_reference import load, logits, max_relative_error, save_model, save_tokenizer
from safetensors import safe_open
from support import error_lines
from transformers import LlamaConfig, Qwen2Config

import spmdkit
from spmdkit.train.config import MeshSettings, ModelSettings, RunSettings, TrainConfig
from spmdkit.train.loop import train

TRAINED = {
    "dense-gqa": {},
    "tied-biased-gelu": dict(qkv_bias=True, o_bias=True, mlp_bias=True, tie_embeddings=True, activation="gelu"),
    "qwen2-style": dict(qkv_bias=True, tie_embeddings=True),
}
TOKENS = np.random.default_rng(1).integers(0, 264, (2, 16))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs of 3 steps on fsdp=4,tensor=2 (the embedded byte data: bos 256, eos 257): {name: run dir}."""
    root, out = tmp_path_factory.mktemp("runs"), {}
    for name, model in TRAINED.items():
        config = TrainConfig(
            model=ModelSettings(dtype="float32", layers=2, **model),
            mesh=MeshSettings(mesh="fsdp=4,tensor=2"),
            run=RunSettings(steps=3, batch_size=8, seq_len=16, eval_every=0, run_dir=str(root / name), progress=False),
        )
        train(config)
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", list(TRAINED))
def test_trained_models_load_in_transformers_with_the_same_logits(name, runs, tmp_path, capsys):
    out = tmp_path / "hf"
    code, _, err = run_cli(capsys, "ckpt", "export", str(runs[name]), "--out", str(out), "--max-shard-size", "60KB")
    assert code == 0, err
    theirs = load(out)  # asserts no missing / unexpected keys
    assert max_relative_error(spmdkit.load_model(runs[name])(TOKENS), logits(theirs, TOKENS)) <= 1e-4

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("qwen2" if name == "qwen2-style" else "llama")
    assert config["tie_word_embeddings"] is ("tie_embeddings" in TRAINED[name])
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (256, 257, 16)
    assert config["rope_parameters"] == {"rope_theta": 10_000.0, "rope_type": "default"}
    assert config["dtype"] == "float32"
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (256, 257)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # --max-shard-size 60KB: several shards
    assert ("lm_head.weight" in index["weight_map"]) is ("tie_embeddings" not in TRAINED[name])
    if name == "tied-biased-gelu":  # the trained biases are there, and not zero
        layer = theirs.model.layers[1]
        for bias in (layer.self_attn.q_proj.bias, layer.self_attn.o_proj.bias, layer.mlp.down_proj.bias):
            assert bias.abs().max() > 0


def _tensors(directory):
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "np") as handle:
            out |= {name: handle.get_tensor(name) for name in handle.keys()}
    return out


@pytest.mark.parametrize(
    "source",
    [
        LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, bos_token_id=297, eos_token_id=298, dtype="bfloat16",
                    rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=297, eos_token_id=298),
    ],
    ids=["llama3-bfloat16-sharded", "qwen2-float32"],
)  # fmt: skip
def test_hf_to_spmdkit_to_hf_is_bit_identical(source, tmp_path, capsys):
    original = tmp_path / "original"
    save_tokenizer(original, 300)
    save_model(source, original, seed=5, max_shard_size="60KB" if source.model_type == "llama" else "5GB")
    code, _, err = run_cli(capsys, "ckpt", "import-hf", str(original), "--out", str(tmp_path / "ckpt"))
    assert code == 0, err
    code, _, err = run_cli(capsys, "ckpt", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "again"),
                            "--max-shard-size", "60KB" if source.model_type == "llama" else "5GB")  # fmt: skip
    assert code == 0, err
    want, got = _tensors(original), _tensors(tmp_path / "again")
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert got[name].tobytes() == tensor.tobytes(), name
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "again" / name).read_text()) == json.loads((original / name).read_text()), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (original / name).read_bytes(), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "again")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (297, 298)


def test_save_hf_takes_the_token_ids_from_the_tokenizer(tmp_path):
    from flax import nnx

    from spmdkit.models import Transformer, TransformerConfig

    ids = save_tokenizer(tmp_path / "tokenizer", 264)
    with nnx.use_eager_sharding(False):  # a plain model on one device
        model = Transformer(TransformerConfig(dtype="float32", layers=2, qkv_bias=True), rngs=nnx.Rngs(4))
    with pytest.raises(spmdkit.errors.SpmdkitError, match="pass max_positions="):
        spmdkit.save_hf(model, tmp_path / "hf", tokenizer=tmp_path / "tokenizer")
    out = spmdkit.save_hf(model, tmp_path / "hf", tokenizer=tmp_path / "tokenizer", max_positions=64)
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids and config["model_type"] == "qwen2"
    assert max_relative_error(model(TOKENS), logits(load(out), TOKENS)) <= 1e-4
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token_id == ids["eos_token_id"]


def test_export_refuses_to_overwrite_and_leaves_nothing_half_written(runs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("mine")
    code, _, err = run_cli(capsys, "ckpt", "export", str(runs["dense-gqa"]), "--out", str(out))
    assert code == 2 and len(error_lines(err)) == 1 and "--force" in err
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "mine"

    code, _, err = run_cli(capsys, "ckpt", "export", str(runs["dense-gqa"]), "--out", str(out), "--force")
    assert code == 2 and "--force replaces only an earlier export" in err  # a user's directory: never replaced
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "mine"
    (out / "config.json").unlink()
    out.rmdir()
    assert run_cli(capsys, "ckpt", "export", str(runs["dense-gqa"]), "--out", str(out))[0] == 0  # an earlier export
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    assert json.loads(earlier[".spmdkit-export"]) == {"written_by": "spmdkit", "source": str(runs["dense-gqa"]),
                                                      "step": 3}  # fmt: skip

    # An export killed between its two renames: the earlier export set aside, a staging directory beside it. The
    # next export puts the earlier one back and removes the staging before it looks at --out.
    out.rename(tmp_path / ".hf.replaced")
    (tmp_path / ".hf.exporting").mkdir()
    (tmp_path / ".hf.exporting" / "model.safetensors").write_bytes(b"half")
    code, _, err = run_cli(capsys, "ckpt", "export", str(runs["dense-gqa"]), "--out", str(out))
    assert code == 2 and "already exists and is not empty" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]

    import safetensors.numpy

    calls = []

    def failing(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(*args, **kwargs)

    save_file = safetensors.numpy.save_file
    monkeypatch.setattr(safetensors.numpy, "save_file", failing)
    from spmdkit.tools.hf_checkpoint import export_hf

    with pytest.raises(OSError, match="disk full"):
        export_hf(runs["dense-gqa"], out, max_shard_size="60KB", force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier  # the old one stays until the new is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # and no temporary directory is left
    monkeypatch.setattr(safetensors.numpy, "save_file", save_file)

    code, _, err = run_cli(capsys, "ckpt", "export", str(runs["dense-gqa"]), "--out", str(out), "--force")
    assert code == 0, err
    assert (out / "model.safetensors").is_file() and json.loads((out / "config.json").read_text())["num_hidden_layers"]
