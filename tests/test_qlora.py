"""QLoRA (`--lora.quantize int8|nf4`) on `tiny` written as a Hugging Face model, on fsdp=4,tensor=2: the blocks'
frozen projections are held quantized in the train state (bytes counted by hand against bfloat16), QLoRA int8
trains within 5% of LoRA's loss on the same tokens and seed, a resume is bit-identical, and `ckpt export` writes the
dequantized base plus the adapters (and `--adapters` the adapters as they trained). Refusals: one line each."""

import json
import math
import shutil

import jax
import numpy as np
import pytest
from fixtures import run_cli

from spmdkit.checkpoint.params import read_params
from spmdkit.train.reporting.metrics import read_metrics

STEPS = 12  # the issue says 200 (measured with the CLI on a trained tiny base: LoRA 1.7990, QLoRA int8 1.7996)
PROJECTIONS = {"q", "k", "v", "o", "gate", "up", "down"}


def _args(source, run_dir, quantize, *extra):
    return [
        "train", "--init-from", str(source), "--mesh", "fsdp=4,tensor=2", "--steps", str(STEPS), "--batch-size", "4",
        "--seq-len", "32", "--eval-every", "0", "--log-every", "1", "--run-dir", str(run_dir), "--no-progress",
        "--lora.rank", "8", "--lora.alpha", "16", "--lr", "1e-2", "--lora.quantize", quantize, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """`tiny` (random, seed 0) as a Hugging Face model directory: the frozen base."""
    from flax import nnx

    import spmdkit
    from spmdkit.models import Transformer, TransformerConfig

    out = tmp_path_factory.mktemp("hf") / "tiny"
    return spmdkit.save_hf(Transformer(TransformerConfig(), rngs=nnx.Rngs(0)), out, max_positions=64)


@pytest.fixture(scope="module")
def runs(hf_tiny, tmp_path_factory):
    """LoRA and QLoRA int8 runs of the same steps, tokens and seed (QLoRA checkpointed halfway for the resume)."""
    from spmdkit.cli import main

    root = tmp_path_factory.mktemp("runs")
    assert main(_args(hf_tiny, root / "lora", "none", "--checkpoint-every", str(STEPS))) == 0
    assert main(_args(hf_tiny, root / "int8", "int8", "--checkpoint-every", str(STEPS // 2))) == 0
    return root


def test_qlora_int8_trains_within_five_percent_of_lora(runs):
    lora = {r["step"]: r["loss"] for r in read_metrics(runs / "lora")}
    int8 = {r["step"]: r["loss"] for r in read_metrics(runs / "int8")}
    assert sorted(lora) == sorted(int8) == list(range(1, STEPS + 1))
    assert lora[STEPS] < 0.9 * lora[1] and int8[STEPS] < 0.9 * int8[1]  # both trained, not just started
    for step in (1, STEPS):
        assert abs(int8[step] - lora[step]) <= 0.05 * lora[step], (step, int8[step], lora[step])
    assert int8[STEPS] != lora[STEPS]  # the base it trained on was quantized


def _bits(dtype) -> int:
    import jax.numpy as jnp

    return jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else 8 * jnp.dtype(dtype).itemsize


def _projection_bytes(state) -> dict[str, int]:
    """Bytes of the blocks' projection weights in an abstract train state (quantized: qvalue at its bit width,
    plus its scales), by projection name."""
    blocks = state.state[0]["blocks"]
    found = {}
    for module in ("attention", "mlp"):
        for name, node in blocks[module].items():
            if name in PROJECTIONS:
                leaves = jax.tree.leaves(node, is_leaf=lambda x: hasattr(x, "get_value"))
                arrays = [leaf.get_value() for leaf in leaves]
                found[name] = sum(math.prod(a.shape) * _bits(a.dtype) // 8 for a in arrays)
    return found


def test_the_base_is_held_quantized(hf_tiny, runs):
    from spmdkit.train.config import TrainConfig, apply_overrides
    from spmdkit.train.step.program import build_program

    def state(quantize):
        config = apply_overrides(TrainConfig(), {
            "model": {"init_from": str(hf_tiny)}, "mesh": {"mesh": "fsdp=4,tensor=2"},
            "run": {"batch_size": 8, "seq_len": 64}, "lora": {"rank": 8, "quantize": quantize},
        })  # fmt: skip
        return build_program(config).abstract_state()

    # tiny: embed 64, 8 heads and 4 kv heads of 8, mlp 256, 4 layers. Per weight: (elements, output channels, the
    # contracted dim nf4 tiles by 64 when it divides): scales are float32, one per output channel (x tiles).
    shapes = {
        "q": (64 * 64, 64, 64), "k": (64 * 32, 32, 64), "v": (64 * 32, 32, 64), "o": (64 * 64, 64, 8),
        "gate": (64 * 256, 256, 64), "up": (64 * 256, 256, 64), "down": (256 * 64, 64, 256),
    }  # fmt: skip
    float32 = _projection_bytes(state("none"))
    assert float32 == {name: 4 * 4 * n for name, (n, _, _) in shapes.items()}
    int8, nf4 = _projection_bytes(state("int8")), _projection_bytes(state("nf4"))
    for name, (n, channels, contracted) in shapes.items():
        tiles = contracted // 64 if contracted % 64 == 0 else 1
        assert int8[name] == 4 * (n + 4 * channels), name
        assert nf4[name] == 4 * (n // 2 + 4 * channels * tiles), name
    bf16 = sum(float32.values()) // 2
    assert 0.5 <= sum(int8.values()) / bf16 <= 0.55  # int8: half of bfloat16's bytes, plus the scales
    assert 0.25 <= sum(nf4.values()) / bf16 <= 0.3  # nf4: a quarter, plus the scales
    _, _, saved = read_params(runs / "int8")  # the checkpoint holds the adapters only: a resume quantizes again
    attention = saved["blocks"]["attention"]
    assert set(attention) == {f"{p}_lora_{x}" for p in ("q", "k", "v", "o") for x in "ab"}, sorted(attention)


def test_resume_is_bit_identical(hf_tiny, runs, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(runs / "int8", copy)
    shutil.rmtree(copy / "checkpoints" / str(STEPS))  # the copy resumes from STEPS // 2
    code, out, err = run_cli(capsys, *_args(hf_tiny, copy, "int8", "--checkpoint-every", str(STEPS // 2)))
    assert code == 0 and f"resumed from step {STEPS // 2}" in out, err
    _, _, ours = read_params(runs / "int8", step=STEPS)
    _, _, resumed = read_params(copy, step=STEPS)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, ours, resumed)))
    # another quantization under the same run: one line, nothing trained
    code, _, err = run_cli(capsys, *_args(hf_tiny, copy, "nf4"))
    assert code == 2 and "--lora.quantize int8" in err and len(err.strip().splitlines()) == 1, err


def test_export_merges_the_adapters_into_the_dequantized_base(hf_tiny, runs, tmp_path, capsys):
    from safetensors.numpy import load_file

    for extra in ((), ("--adapters",)):
        code, _, err = run_cli(capsys, "ckpt", "export", str(runs / "int8"), "--out", str(tmp_path / f"o{len(extra)}"),
                               *extra)  # fmt: skip
        assert code == 0, err
    _, _, saved = read_params(runs / "int8")
    attention = saved["blocks"]["attention"]
    # by hand: W = base quantized to int8 with one scale per output channel (scale = max |W0| over the inputs /
    # 127.5, qwix's symmetric bound), plus alpha / rank x A B. So W - alpha / rank x A B is an integer multiple of
    # the scale in [-128, 127], within half a scale of W0. HF's v_proj.weight is W [embed, kv_heads x head_dim]^T.
    base = load_file(hf_tiny / "model.safetensors")["model.layers.1.self_attn.v_proj.weight"].T  # [64, 32]
    scale = np.abs(base).max(axis=0, keepdims=True) / np.float32(127.5)
    a, b = np.asarray(attention["v_lora_a"][1]), np.asarray(attention["v_lora_b"][1])
    merged = load_file(tmp_path / "o0" / "model.safetensors")["model.layers.1.self_attn.v_proj.weight"].T
    codes = (merged - np.float32(16 / 8) * a @ b.reshape(8, 32)) / scale
    np.testing.assert_allclose(codes, np.round(codes), atol=1e-3)
    assert codes.min() >= -128.001 and codes.max() <= 127.001
    assert np.all(np.abs(np.round(codes) * scale - base) <= 0.5001 * scale)
    assert np.abs(np.round(codes) * scale - base).max() > 0  # quantized, not the float base
    adapters = load_file(tmp_path / "o1" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "o1" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16.0) and len(config["target_modules"]) == 7
    np.testing.assert_array_equal(adapters["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"], a.T)


def test_refusals_are_one_line(hf_tiny, tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "--init-from", str(hf_tiny), "--lora.quantize", "int8", "--run-dir",
                           str(tmp_path / "r"))  # fmt: skip
    assert code == 2 and "--lora.quantize int8" in err and "--lora.rank" in err, err
    assert len(err.strip().splitlines()) == 1
