"""Fine-tuning from Hugging Face in one command: `spmdkit train --init-from HF_DIR` on fsdp=4,tensor=2 takes a
random `save_pretrained` model of a shape no preset has (hidden 96, 6 layers, vocab 1000); its step-1 loss is
transformers' loss on the same batch (rel 1e-5, float32); the run exports again and transformers reproduces its eval
loss; the tokenizer travels along; a resumed run ignores --init-from; an imported checkpoint starts the same way."""

import json

import numpy as np
import pytest
from fixtures import run_cli
from hf_reference import load, loss, save_model, save_tokenizer
from transformers import LlamaConfig

from spmdkit.data.config import DataConfig
from spmdkit.data.stream import make_data
from spmdkit.interop import find_tokenizer_dir
from spmdkit.train.reporting.metrics import read_metrics

SEQ, BATCH, STEPS = 32, 8, 3
CONFIG = LlamaConfig(
    vocab_size=1000, hidden_size=96, intermediate_size=192, num_hidden_layers=6, num_attention_heads=6,
    num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
    max_position_embeddings=256, bos_token_id=997, eos_token_id=998,
)  # fmt: skip


def _train_args(source, run_dir, steps=STEPS):
    return [
        "train", "--init-from", str(source), "--mesh", "fsdp=4,tensor=2", "--dtype", "float32", "--steps", str(steps),
        "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--eval-every", str(STEPS), "--eval-batches", "2",
        "--log-every", "1", "--run-dir", str(run_dir), "--no-progress",
    ]  # fmt: skip


def _train(capsys, source, run_dir, steps=STEPS):
    code, out, err = run_cli(capsys, *_train_args(source, run_dir, steps))
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "model"
    save_tokenizer(directory, 1000)
    save_model(CONFIG, directory, seed=11)
    return directory


@pytest.fixture(scope="module")
def run(hf_model, tmp_path_factory):
    """`spmdkit train --init-from HF_DIR` for 3 steps, evaluating at the end: the run directory."""
    from spmdkit.cli import main

    run_dir = tmp_path_factory.mktemp("run") / "run"
    assert main(_train_args(hf_model, run_dir)) == 0
    return run_dir


def _batches(split, count):
    stream = make_data(DataConfig(), seq_len=SEQ, global_batch=BATCH, vocab_size=1000, seed=0, split=split)
    return [next(stream) for _ in range(count)]


def test_step_1_loss_is_transformers_loss_on_the_same_batch(hf_model, run):
    first = _batches("train", 1)[0]
    theirs = loss(load(hf_model), first["inputs"], first["targets"])
    records = read_metrics(run)
    assert records[0]["step"] == 1 and abs(records[0]["loss"] - theirs) <= 1e-5 * theirs
    # the fine-tuning defaults: a small peak lr from step 1 (no warmup from 0)
    assert records[0]["lr"] == pytest.approx(1e-5)
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["init_from"] == str(hf_model) and saved["model"]["embed"] == 96
    assert (saved["optimizer"]["lr"], saved["optimizer"]["warmup_steps"]) == (1e-5, 0)


def test_the_run_exports_and_transformers_reproduces_its_eval_loss(run, tmp_path, capsys):
    assert find_tokenizer_dir(run) == run / "checkpoints" / "hf"  # training carried the tokenizer along
    code, _, err = run_cli(capsys, "ckpt", "export", str(run), "--out", str(tmp_path / "out"))
    assert code == 0, err
    model = load(tmp_path / "out")
    theirs = np.mean([loss(model, b["inputs"], b["targets"]) for b in _batches("eval", 2)])
    ours = read_metrics(run)[-1]
    assert ours["step"] == STEPS and abs(ours["eval_loss"] - theirs) <= 1e-5 * theirs
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (997, 998, 256)
    assert config["rope_parameters"]["rope_theta"] == 500_000.0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        run / "checkpoints" / "hf" / "tokenizer.json"
    ).read_bytes()


def test_a_resumed_run_ignores_init_from(hf_model, run, tmp_path, capsys):
    import shutil

    resumed = tmp_path / "run"
    shutil.copytree(run, resumed)
    out = _train(capsys, hf_model, resumed, steps=STEPS + 1)
    assert f"resumed from step {STEPS}" in out and "initialised the parameters" not in out
    records = read_metrics(resumed)
    assert [r["step"] for r in records] == list(range(1, STEPS + 2))


def test_an_imported_checkpoint_starts_the_same_run(hf_model, run, tmp_path, capsys):
    code, _, err = run_cli(capsys, "ckpt", "import-hf", str(hf_model), "--out", str(tmp_path / "ckpt"))
    assert code == 0, err
    _train(capsys, tmp_path / "ckpt", tmp_path / "run", steps=2)
    # the same weights and a fresh optimizer: the same first two steps
    for ours, theirs in zip(read_metrics(tmp_path / "run"), read_metrics(run)[:2], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    assert find_tokenizer_dir(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "hf"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["optimizer"]["lr"] == 1e-5
