"""LoRA through qwix (`--lora.rank`) on a random `save_pretrained` Llama: on fsdp=4,tensor=2 only the adapters train
(the trained state's base weights are the source file's bits, the checkpoint holds the adapters and their moments and
nothing of the base, the optimizer holds two moments of the adapters' bytes), the losses are one device's, a resume
is bit-identical and refuses another base (a changed tensor, a changed file end), and `ckpt export --adapters` is a
PEFT adapter that `peft` loads onto the transformers model (logits equal to the merged export's and to
`spmdkit.load_model`'s of the run) while the plain export equals `peft`'s own `merge_and_unload()`; `eval` and
`generate` read the run directly. Bad `--lora` input: test_bad_input."""

import json

import numpy as np
import pytest
from fixtures import run_cli
from hf_reference import load, logits, save_model, save_tokenizer
from transformers import LlamaConfig

from spmdkit.checkpoint.params import read_params
from spmdkit.interop.tensor_names import tensor_maps
from spmdkit.train.reporting.metrics import read_metrics

STEPS = 50  # the acceptance
SAVED = STEPS - 2  # the step saved before the last, that a resume starts from
TAMPERED = "model.layers.1.mlp.up_proj.weight"  # 96 x 192 float32: larger than the checksum reads whole
CONFIG = LlamaConfig(
    vocab_size=1000, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
    max_position_embeddings=256, bos_token_id=997, eos_token_id=998,
)  # fmt: skip


def _args(source, run_dir, mesh, *extra):
    return [
        "train", "--init-from", str(source), "--mesh", mesh, "--dtype", "float32", "--steps", str(STEPS),
        "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--log-every", "1", "--run-dir", str(run_dir),
        "--no-progress", "--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", "q,v,o,up,down", "--lr", "1e-2",
        *extra,
    ]  # fmt: skip


def _scale_tensor(weights) -> None:
    """Multiply the tensor TAMPERED of a safetensors file by 1.001 in place (the header as it was)."""
    raw = bytearray(weights.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    start, stop = (8 + length + at for at in json.loads(raw[8 : 8 + length])[TAMPERED]["data_offsets"])
    raw[start:stop] = (np.frombuffer(raw[start:stop], np.float32) * np.float32(1.001)).tobytes()
    weights.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "model"
    save_tokenizer(directory, 1000)
    save_model(CONFIG, directory, seed=3)
    return directory


@pytest.fixture(scope="module")
def trained(hf_model, tmp_path_factory):
    """(the run directory, the trained state's parameters as host arrays)."""
    import jax
    from flax import nnx

    from spmdkit.cli.train import parse
    from spmdkit.train.loop import train

    run_dir = tmp_path_factory.mktemp("run") / "run"
    result = train(parse(_args(hf_model, run_dir, "fsdp=4,tensor=2", "--checkpoint-every", str(SAVED))[1:])[0])
    return run_dir, jax.tree.map(np.asarray, nnx.to_pure_dict(result.state.state[0]))


@pytest.fixture(scope="module")
def run(trained):
    return trained[0]


def test_only_adapters_train_and_the_base_keeps_its_bits(hf_model, trained):
    from safetensors.numpy import load_file

    from spmdkit.checkpoint.steps import open_step
    from spmdkit.models.lora_config import is_adapter

    run, state = trained
    _, config, params = read_params(run)
    source = load_file(hf_model / "model.safetensors")
    from spmdkit.train.config import config_from_json

    model = config_from_json(json.dumps(config)).model.build()
    for m in tensor_maps(model, "llama"):
        value = m.value_in(state)
        for entry, name in enumerate(m.hf_names()):
            ours = m.to_hf(value[entry] if m.stacked else value)
            assert np.array_equal(ours, source[name]), name  # bit-identical after STEPS optimizer steps
    # the checkpoint holds the adapters and their two moments (and the optimizer's scalars): nothing of the base
    checkpointer, step = open_step(run)
    saved = checkpointer.saved_shapes(step)
    checkpointer.close()
    assert all(is_adapter(name) for name, (shape, _) in saved.items() if name.startswith("model/") or shape), saved
    assert sum(name.startswith("model/") for name in saved) == 2 * 5 and "model/embedding" not in saved
    adapters = params["blocks"]["attention"]
    assert set(adapters) >= {"q_lora_a", "q_lora_b", "v_lora_a", "o_lora_b"} and "k_lora_a" not in adapters
    assert "gate_lora_a" not in params["blocks"]["mlp"] and "down_lora_b" in params["blocks"]["mlp"]
    assert np.abs(adapters["q_lora_b"]).max() > 0  # B starts at zero: it trained
    # [layers, embed, rank] and [layers, rank, heads, head_dim]: A over the input dims, B over the output dims
    assert adapters["q_lora_a"].shape == (2, 96, 4) and adapters["q_lora_b"].shape == (2, 4, 6, 16)


def test_resume_is_bit_identical_and_checks_the_base(hf_model, run, tmp_path, capsys):
    import shutil

    from spmdkit.checkpoint.params import read_params as read_step

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / str(STEPS))  # the copy resumes from step SAVED
    code, out, err = run_cli(capsys, *_args(hf_model, copy, "fsdp=4,tensor=2", "--checkpoint-every", str(SAVED)))
    assert code == 0 and f"resumed from step {SAVED}" in out, err
    assert "initialised the frozen base from" in out  # the checkpoint holds no base: it is read again
    _, saved, _ = read_step(run, step=STEPS)
    assert len(saved["lora"]["base_checksum"]) == 32
    import jax

    from spmdkit.checkpoint.steps import open_step

    states = []
    for directory in (run, copy):  # adapters, moments, step counts: every array the step holds
        checkpointer, _ = open_step(directory, STEPS)
        states.append(checkpointer.read_state(STEPS))
        checkpointer.close()
    assert jax.tree.structure(states[0]) == jax.tree.structure(states[1])
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, *states)))
    # another base under the same run: one line, nothing trained. A file whose last bytes changed, and one tensor
    # of other values in place (the same header: names, dtypes, shapes, offsets)
    other = tmp_path / "other"
    shutil.copytree(hf_model, other)
    weights = other / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-4] + b"\0\0\0\0")
    code, _, err = run_cli(capsys, *_args(other, copy, "fsdp=4,tensor=2"))
    assert code == 2 and "other base weights" in err and len(err.strip().splitlines()) == 1, err
    weights.write_bytes(original)
    _scale_tensor(weights)
    code, _, err = run_cli(capsys, *_args(other, copy, "fsdp=4,tensor=2"))
    assert code == 2 and "other base weights" in err and len(err.strip().splitlines()) == 1, err


def test_optimizer_state_is_two_moments_of_the_adapters(run, hf_model):
    import jax
    from flax import nnx

    from spmdkit.train.config import TrainConfig, apply_overrides
    from spmdkit.train.step.program import build_program

    config = apply_overrides(TrainConfig(), {
        "model": {"init_from": str(hf_model), "dtype": "float32"}, "mesh": {"mesh": "fsdp=4,tensor=2"},
        "run": {"batch_size": 8, "seq_len": 32}, "lora": {"rank": 4, "targets": "q,v,o,up,down"},
    })  # fmt: skip
    state = build_program(config).abstract_state()
    model = nnx.merge(state.graphdef, state.state)[0]
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim)  # noqa: E731
    adapters = nnx.state(model, nnx.LoRAParam)
    assert nbytes(state.state[1]) == 2 * nbytes(adapters) > 0
    # the base stays sharded as the mesh says; A's embed dim over fsdp like q's, B's heads over tensor like q's
    q_a = tuple(state.state[0]["blocks"]["attention"]["q_lora_a"].get_value().sharding.spec) + (None,) * 3
    q_b = tuple(state.state[0]["blocks"]["attention"]["q_lora_b"].get_value().sharding.spec) + (None,) * 4
    assert q_a[1] == "fsdp" and q_a[2] is None and q_b[1] is None and q_b[2] == "tensor"


def test_losses_equal_one_devices(hf_model, run, tmp_path):
    from support import run_spmdkit

    done = run_spmdkit(*_args(hf_model, tmp_path / "one", "fsdp=1", "--cpu-devices", "1"))
    assert done.returncode == 0, done.stderr
    ours = {r["step"]: r["loss"] for r in read_metrics(run)}
    one = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "one")}
    assert len(ours) == STEPS and ours[STEPS] < ours[1]
    for step, loss in one.items():
        assert abs(ours[step] - loss) <= 1e-5 * loss, step


def test_peft_loads_the_adapters_and_merges_them_as_the_plain_export(hf_model, run, tmp_path, capsys):
    import torch
    from peft import PeftModel

    for extra in ((), ("--adapters",)):
        code, _, err = run_cli(capsys, "ckpt", "export", str(run), "--out", str(tmp_path / f"out{len(extra)}"), *extra)
        assert code == 0, err
    written = json.loads((tmp_path / "out1" / "adapter_config.json").read_text())
    assert written["peft_type"] == "LORA" and (written["r"], written["lora_alpha"]) == (4, 8.0)
    assert sorted(written["target_modules"]) == ["down_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    peft = PeftModel.from_pretrained(load(hf_model), tmp_path / "out1")  # raises on unexpected adapter keys
    tokens = np.arange(24).reshape(2, 12) * 37 % 1000
    theirs = peft(torch.tensor(tokens)).logits.detach().numpy()
    merged = load(tmp_path / "out0")
    ours = logits(merged, tokens)
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= 1e-4 * scale
    assert np.abs(logits(load(hf_model), tokens) - ours).max() > 1e-3 * scale  # the adapters change the model
    # the run itself, read by the loader of eval and generate (base from --init-from, adapters merged on the device)
    import spmdkit
    from spmdkit.inference.loading import inference_mesh, inference_rules

    for mesh in (None, inference_mesh("tensor=2")):  # the adapters go where each base weight lies
        direct = np.asarray(spmdkit.load_model(run, mesh, inference_rules())(tokens))
        assert np.abs(direct - theirs).max() <= 1e-4 * scale
    unloaded, exported = peft.merge_and_unload().state_dict(), merged.state_dict()
    assert unloaded.keys() == exported.keys()
    for name, value in exported.items():
        np.testing.assert_allclose(value.numpy(), unloaded[name].numpy(), rtol=1e-5, atol=1e-5 * scale, err_msg=name)


PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def peft_adapter(hf_model, tmp_path_factory):
    """(a PEFT adapter directory written by peft on the base, with random non-zero A and B; that PeftModel)."""
    import peft
    import torch

    torch.manual_seed(5)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, init_lora_weights=False)
    model = peft.get_peft_model(load(hf_model), config)
    directory = tmp_path_factory.mktemp("peft") / "adapter"
    model.save_pretrained(directory)
    return directory, model


def test_a_peft_adapter_imports_onto_its_base_and_exports_back(hf_model, peft_adapter, tmp_path, capsys):
    import torch
    from safetensors.numpy import load_file

    import spmdkit

    adapter, peft_model = peft_adapter
    ckpt = tmp_path / "ckpt"
    code, out, err = run_cli(capsys, "ckpt", "import-hf", str(hf_model), "--adapters", str(adapter), "--out", str(ckpt))
    assert code == 0 and "LoRA rank 4" in out, err
    tokens = np.arange(24).reshape(2, 12) * 41 % 1000
    theirs = peft_model(torch.tensor(tokens)).logits.detach().numpy()
    ours = np.asarray(spmdkit.load_model(ckpt)(tokens))
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= 1e-4 * scale
    assert np.abs(logits(load(hf_model), tokens) - theirs).max() > 1e-2 * scale  # A and B are not zero
    code, _, err = run_cli(capsys, "ckpt", "export", str(ckpt), "--adapters", "--out", str(tmp_path / "back"))
    assert code == 0, err
    original, back = (load_file(d / "adapter_model.safetensors") for d in (adapter, tmp_path / "back"))
    assert original.keys() == back.keys() and len(original) == 2 * 7 * CONFIG.num_hidden_layers
    assert all(np.array_equal(original[k], back[k]) and original[k].dtype == back[k].dtype for k in original)
    # training continues these adapters (on the recorded base): one step at a negligible rate leaves them in place
    targets = ("--lora.targets", "q,k,v,o,gate,up,down")  # the flags given last win
    args = [*_args(ckpt, tmp_path / "more", "fsdp=8")[:-2], *targets, "--steps", "1", "--lr", "1e-9"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    _, _, imported = read_params(ckpt)
    _, _, continued = read_params(tmp_path / "more")
    import jax

    assert jax.tree.structure(continued) == jax.tree.structure(imported)  # the adapters, nothing of the base
    for (path, ours), theirs in zip(
        jax.tree_util.tree_leaves_with_path(continued), jax.tree.leaves(imported), strict=True
    ):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"peft_type": "LOHA"}, "peft_type 'LOHA' is not read: only LORA adapters are"),
        ({"use_dora": True}, "use_dora=True is not supported by spmdkit's LoRA"),
        ({"use_rslora": True}, "use_rslora=True is not supported"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern={'q_proj': 8} is not supported"),
        ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern={'q_proj': 8} is not supported"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules ['q_proj', 'lm_head'] are not among q_proj"),
        ({"target_modules": ".*proj"}, "target_modules '.*proj' are not among"),
        ({"r": 8}, "lora_A.weight is [4, 96], this base with r=8 needs [8, 96]: the adapter was trained on another"),
    ],
)  # fmt: skip
def test_what_a_peft_adapter_import_refuses(hf_model, peft_adapter, tmp_path, capsys, change, message):
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(peft_adapter[0], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text()) | change
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    code, _, err = run_cli(
        capsys, "ckpt", "import-hf", str(hf_model), "--adapters", str(adapter), "--out", str(tmp_path / "o")
    )
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_a_lora_checkpoint_whose_base_changed_or_went_is_refused(hf_model, peft_adapter, tmp_path, capsys):
    import shutil

    base, ckpt = tmp_path / "base", tmp_path / "ckpt"
    shutil.copytree(hf_model, base)
    code, _, err = run_cli(
        capsys, "ckpt", "import-hf", str(base), "--adapters", str(peft_adapter[0]), "--out", str(ckpt)
    )
    assert code == 0, err
    _scale_tensor(base / "model.safetensors")
    for gone in (False, True):
        if gone:
            shutil.rmtree(base)
        code, _, err = run_cli(capsys, "ckpt", "export", str(ckpt), "--out", str(tmp_path / f"out{gone}"))
        expected = "which are gone: put them back there" if gone else "trained its adapters on other base weights"
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
