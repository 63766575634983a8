"""spmdkit ckpt reshard / export / import-hf: offline resharding, and a checkpoint's Hugging Face Llama round trip
(names, layout, config, an independent numpy forward and transformers'; the interop suite is tests/test_hf_*.py)."""

import json

import jax
import numpy as np
import pytest
from fixtures import (
    MODEL,
    abstract,  # noqa: F401 - a fixture: the tests name it as an argument
    random_state,
    run_cli,
    shardings_for,
    synthetic_stream,
)
from flax import nnx
from safetensors.numpy import load_file

from spmdkit.checkpoint.manager import Checkpointer
from spmdkit.errors import SpmdkitError
from spmdkit.interop import load_model
from spmdkit.tools.convert import read_params
from spmdkit.tools.hf_checkpoint import export_hf, import_hf
from spmdkit.train.config import TrainConfig

MESH_AXES = ("data", "pipeline", "fsdp", "context", "expert", "tensor")


@pytest.fixture(scope="module")
def saved(tmp_path_factory, abstract):  # noqa: F811 - the fixture
    """Step 3 of a tiny float32 model saved on fsdp=4,tensor=2 with data and config items; (dir, state)."""
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    checkpointer, stream = Checkpointer(directory, every=1), synthetic_stream()
    for _ in range(3):
        next(stream)
    config = json.loads(TrainConfig().to_json())
    config["model"]["dtype"] = "float32"
    config["mesh"]["mesh"] = "fsdp=4,tensor=2"
    state = random_state(abstract, shardings_for(abstract, "fsdp=4,tensor=2"), seed=7)
    assert checkpointer.save(3, state, stream.iterator, config)
    checkpointer.close()
    return directory, state


def _flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_reshard_onto_another_mesh_keeps_values_and_data_position(saved, tmp_path, abstract, capsys):  # noqa: F811 - the fixture
    directory, state = saved
    out = tmp_path / "resharded"
    (tmp_path / ".resharded.resharding" / "3").mkdir(parents=True)  # what a killed reshard leaves: never `out`
    code, stdout, err = run_cli(capsys, "ckpt", "reshard", str(directory), "--mesh", "data=8", "--out", str(out))
    assert code == 0, err
    assert "resharded step 3" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resharded"]  # assembled beside it, then renamed

    fresh = Checkpointer(out, read_only=True)
    assert fresh.steps() == [3]
    metadata = fresh.manager.item_metadata(3)["state"]
    for path, leaf in jax.tree_util.tree_leaves_with_path(metadata):  # the saved layout is the new mesh's
        mesh = leaf.sharding.mesh if hasattr(leaf.sharding, "mesh") else None
        shape = dict(zip(leaf.sharding.axis_names, leaf.sharding.shape, strict=True)) if mesh is None else mesh.shape
        assert dict(shape) == {a: 8 if a == "data" else 1 for a in MESH_AXES}, jax.tree_util.keystr(path)
    assert fresh.read_config(3)["mesh"]["mesh"] == "data=8"

    shardings = shardings_for(abstract, "data=8")
    stream = synthetic_stream()
    restored = fresh.restore(3, abstract, shardings, stream.iterator)
    fresh.close()
    want, got = _flat(state), _flat(restored)
    assert want.keys() == got.keys() and len(want) == 42
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    reference = synthetic_stream()
    for _ in range(4):
        expected = next(reference)
    np.testing.assert_array_equal(next(stream)["inputs"], expected["inputs"])  # batch 4 comes next

    code, _, err = run_cli(capsys, "ckpt", "reshard", str(directory), "--mesh", "data=8", "--out", str(out))
    assert code == 2 and "is not empty" in err
    code, _, err = run_cli(capsys, "ckpt", "reshard", str(directory), "--mesh", "data=3", "--out", str(tmp_path / "x"))
    assert code == 2 and "\n" not in err.strip()


def _hf_tensors(directory):
    from safetensors import safe_open

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "np") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    return tensors


def _hf_llama_logits(directory, tokens):
    """Hugging Face LlamaForCausalLM's forward, written out in numpy (float64) from the exported directory alone."""
    config = json.loads((directory / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in _hf_tensors(directory).items()}
    heads, kv, hd, eps = (config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps"))
    seq = tokens.shape[1]

    def norm(x, weight):
        return weight * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))

    def rotate_half(x):
        return np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)

    inv_freq = 1.0 / config["rope_parameters"]["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([np.outer(np.arange(seq), inv_freq)] * 2, -1)  # [seq, head_dim]
    cos, sin = np.cos(emb)[None, :, None], np.sin(emb)[None, :, None]
    x = w["model.embed_tokens.weight"][tokens]
    mask = np.tril(np.ones((seq, seq), bool))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(*h.shape[:2], heads, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(*h.shape[:2], kv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(*h.shape[:2], kv, hd)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, heads // kv, axis=2), np.repeat(v, heads // kv, axis=2)  # repeat_kv
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        scores = np.where(mask, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(*h.shape[:2], heads * hd)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "model"
    export_hf(saved[0], directory)
    return directory


def _tokens():
    return np.random.default_rng(0).integers(0, MODEL.vocab_size, (2, 12))


def test_export_writes_hf_llama_names_layout_and_config(saved, exported):
    tensors = load_file(str(exported / "model.safetensors"))
    c = MODEL
    assert len(tensors) == 3 + 9 * c.layers
    assert tensors["model.embed_tokens.weight"].shape == (c.vocab_size, c.embed)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (c.heads * c.head_dim, c.embed)
    assert tensors["model.layers.3.self_attn.k_proj.weight"].shape == (c.kv_heads * c.head_dim, c.embed)
    assert tensors["model.layers.1.self_attn.o_proj.weight"].shape == (c.embed, c.heads * c.head_dim)
    assert tensors["model.layers.2.mlp.gate_proj.weight"].shape == (c.mlp, c.embed)
    assert tensors["model.layers.2.mlp.down_proj.weight"].shape == (c.embed, c.mlp)
    assert tensors["lm_head.weight"].shape == (c.vocab_size, c.embed)
    _, _, params = read_params(saved[0])
    np.testing.assert_array_equal(
        tensors["model.layers.1.input_layernorm.weight"], params["blocks"]["attention_norm"]["scale"][1]
    )
    np.testing.assert_array_equal(
        tensors["model.layers.2.self_attn.q_proj.weight"][8 * 3 + 5], params["blocks"]["attention"]["q"][2, :, 3, 5]
    )
    np.testing.assert_array_equal(tensors["lm_head.weight"], params["lm_head"].T)
    config = json.loads((exported / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads")} == {
        "hidden_size": c.embed,
        "intermediate_size": c.mlp,
        "num_attention_heads": c.heads,
    }
    assert (config["num_key_value_heads"], config["num_hidden_layers"], config["vocab_size"]) == (
        c.kv_heads,
        c.layers,
        c.vocab_size,
    )
    assert (config["head_dim"], config["rope_parameters"]["rope_theta"], config["rms_norm_eps"]) == (
        c.head_dim,
        c.rope_theta,
        c.norm_eps,
    )
    assert config["tie_word_embeddings"] is False and config["hidden_act"] == "silu"
    # the run's sequence length and the embedded byte data's specials (not Llama's defaults 1 and 2)
    assert (config["max_position_embeddings"], config["bos_token_id"], config["eos_token_id"]) == (128, 256, 257)


def test_export_matches_an_independent_hf_llama_forward(saved, exported):
    tokens = _tokens()
    ours = np.asarray(load_model(saved[0])(tokens))
    reference = _hf_llama_logits(exported, tokens)
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())


def test_export_then_import_round_trips_parameters_and_logits(saved, exported, tmp_path, capsys):
    out = tmp_path / "imported"
    code, _, err = run_cli(capsys, "ckpt", "import-hf", str(exported), "--out", str(out))
    assert code == 0, err
    step, config, params = read_params(out)
    _, _, original = read_params(saved[0])
    assert step == 0 and config.model.build() == MODEL.replace(dtype="bfloat16", max_positions=128)
    want, got = _flat(original), _flat(params)
    assert want.keys() == got.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    tokens = _tokens()
    np.testing.assert_array_equal(np.asarray(load_model(out)(tokens)), np.asarray(load_model(saved[0])(tokens)))
    fresh = Checkpointer(out, read_only=True)
    saved_arrays = fresh.saved_shapes(0)
    fresh.close()
    # the parameters only: `spmdkit train --init-from` starts their optimizer fresh (tests/test_hf_finetune.py)
    assert len(saved_arrays) == len(want) and all(path.startswith("model/") for path in saved_arrays)


def test_bfloat16_export_and_import_errors(saved, tmp_path):
    from safetensors.flax import load_file as load_jax

    file = export_hf(saved[0], tmp_path / "bf16", dtype="bfloat16")[0] / "model.safetensors"
    assert str(load_jax(str(file))["lm_head.weight"].dtype) == "bfloat16"
    import_hf(file.parent, tmp_path / "from_bf16")
    _, _, params = read_params(tmp_path / "from_bf16")
    _, _, original = read_params(saved[0])
    assert str(params["lm_head"].dtype) == "bfloat16"  # the stored dtype is kept
    np.testing.assert_array_equal(params["lm_head"], original["lm_head"].astype(params["lm_head"].dtype))

    config = json.loads((file.parent / "config.json").read_text())
    (file.parent / "config.json").write_text(json.dumps(config | {"hidden_size": 96}))
    with pytest.raises(SpmdkitError, match=r"model.embed_tokens.weight in .* has shape \[264, 64\], but config"):
        import_hf(file.parent, tmp_path / "odd")
    assert not (tmp_path / "odd").exists()


def test_logits_match_transformers_llama(saved, exported):
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    tokens = _tokens()
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(load_model(saved[0])(tokens))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())


# ------------------------------------------------------------------------------------- 2 processes -> 1

_SAVER = """
import sys

import jax
import numpy as np

jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from flax import nnx  # noqa: E402

from spmdkit.checkpoint.manager import Checkpointer  # noqa: E402
from spmdkit.models import Transformer, TransformerConfig  # noqa: E402
from spmdkit.sharding.mesh import make_mesh  # noqa: E402
from spmdkit.sharding.partition import abstract_state  # noqa: E402
from spmdkit.sharding.rules import make_rules  # noqa: E402
from spmdkit.train.config import OptimizerConfig  # noqa: E402
from spmdkit.train.step.optimizer import make_optimizer  # noqa: E402
from spmdkit.train.step.state import train_state_shardings  # noqa: E402

tx = make_optimizer(OptimizerConfig(), 10)


def make():
    model = Transformer(TransformerConfig(dtype="float32"), rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


abstract = abstract_state(make)[1]
mesh = make_mesh("data=2,fsdp=2,tensor=2")
assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
rng = np.random.default_rng(11)  # the same values on both processes; each places its own shards
leaves, treedef = jax.tree.flatten(abstract)
values = []
for leaf, sharding in zip(leaves, jax.tree.leaves(train_state_shardings(abstract, mesh, make_rules(3, False)))):
    full = rng.standard_normal(leaf.shape).astype(leaf.dtype) if leaf.dtype.kind == "f" else rng.integers(
        0, 100, leaf.shape).astype(leaf.dtype)
    values.append(jax.make_array_from_callback(leaf.shape, sharding, lambda index, full=full: full[index]))
assert not all(v.is_fully_addressable for v in values)
checkpointer = Checkpointer(sys.argv[3], every=1)
assert checkpointer.save(5, treedef.unflatten(values), config={"processes": 2})
checkpointer.close()
print("saved", jax.process_index(), flush=True)
"""


@pytest.mark.slow
def test_two_process_checkpoint_restores_in_one_process_on_one_device(tmp_path, abstract):  # noqa: F811 - the fixture
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    directory = tmp_path / "ckpt"
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    command = [sys.executable, str(script), f"127.0.0.1:{port}"]
    procs = [
        subprocess.Popen([*command, str(i), str(directory)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, output) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0 and f"saved {i}" in output, output[-3000:]
    assert sorted(os.listdir(directory / "5" / "state")).count("ocdbt.process_1") == 1  # both processes wrote

    rng = np.random.default_rng(11)
    want = [
        rng.standard_normal(x.shape).astype(x.dtype) if x.dtype.kind == "f" else rng.integers(0, 100, x.shape)
        for x in jax.tree.leaves(abstract)
    ]
    device = jax.devices()[0]
    shardings = shardings_for(abstract, "fsdp=1", [device])
    checkpointer = Checkpointer(directory, read_only=True)
    restored = checkpointer.restore(5, abstract, shardings)  # checks the checksums the two processes summed
    assert checkpointer.read_config(5) == {"processes": 2}
    assert checkpointer.verify(5) == []
    checkpointer.close()
    got = jax.tree.leaves(restored)
    assert len(got) == len(want) == 42
    for array, value in zip(got, want, strict=True):
        assert array.devices() == {device}
        np.testing.assert_array_equal(np.asarray(array), value.astype(array.dtype))
    from spmdkit.checkpoint.params import read_params as read_model_params
    from spmdkit.checkpoint.tree import to_saved_tree

    params = _flat(read_model_params(directory, step=5)[2])  # the model reader, over both processes' files
    expected = _flat(to_saved_tree(restored)["model"])
    assert params.keys() == expected.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(value, expected[name])


def test_the_model_of_any_step_on_any_layout_through_one_reader(saved, tmp_path, abstract):  # noqa: F811 - the fixture
    """`load_model(..., step=)` reads that step's parameters (never the newest by mistake), onto one device or a
    mesh, cast as asked; a name or shape that differs is one line; a damaged byte is a damaged step."""
    from spmdkit.checkpoint.manager import DamagedStep
    from spmdkit.checkpoint.params import read_params as read_model_params
    from spmdkit.checkpoint.tree import to_saved_tree
    from spmdkit.interop.loading import load_params, param_sharding_tree
    from spmdkit.sharding import make_mesh, make_rules

    directory, config = tmp_path / "two-steps", json.loads(TrainConfig().to_json())
    config["model"]["dtype"] = "float32"
    checkpointer = Checkpointer(directory, every=1)
    states = {step: random_state(abstract, shardings_for(abstract, "fsdp=8"), seed=step) for step in (1, 2)}
    for step, state in states.items():
        assert checkpointer.save(step, state, config=config)
    checkpointer.close()
    expected = {step: _flat(to_saved_tree(state)["model"]) for step, state in states.items()}

    mesh = make_mesh("fsdp=2,tensor=4")
    for step in (1, 2):
        for model in (load_model(directory, step=step), load_model(directory, mesh, make_rules(), step=step)):
            got = _flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
            assert got.keys() == expected[step].keys()
            for name, value in got.items():
                np.testing.assert_array_equal(value, expected[step][name])
    newest = _flat(nnx.to_pure_dict(nnx.state(load_model(directory), nnx.Param)))
    np.testing.assert_array_equal(newest["['embedding']"], expected[2]["['embedding']"])
    halved = load_model(directory, param_dtype="bfloat16", step=1)
    assert halved.embedding[...].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(halved.embedding[...], expected[1]["['embedding']"].astype(jax.numpy.bfloat16))

    wider = MODEL.replace(embed=MODEL.embed * 2)
    with pytest.raises(SpmdkitError, match=r"step 2 of .* does not hold this model's parameters: model/\S+ is \["):
        load_params(directory, wider, param_sharding_tree(wider, None, None))
    with pytest.raises(SpmdkitError, match="step 9 is not in"):
        load_model(directory, step=9)

    data = max((directory / "1" / "state" / "d").iterdir(), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(DamagedStep, match="checkpoint step 1 in .* is damaged"):
        read_model_params(directory, step=1)
    assert read_model_params(directory, step=2)[0] == 2  # the other step is untouched


def test_verify_of_a_live_run_skips_steps_rotated_away_while_it_reads(abstract, tmp_path, capsys, monkeypatch):  # noqa: F811 - the fixture
    """A trainer rotates its oldest steps out while `ckpt verify` lists and reads them: a listing that fails is
    tried again; a step deleted before its reading (step 1) or half-way through (step 2: a file of it gone) is
    skipped, never called damaged; step 3 is read."""
    import shutil

    directory = tmp_path / "ckpt"
    checkpointer, stream = Checkpointer(directory, every=1, keep=3), synthetic_stream()
    config = json.loads(TrainConfig().to_json())
    config["model"]["dtype"], config["mesh"]["mesh"] = "float32", "fsdp=4,tensor=2"
    state = random_state(abstract, shardings_for(abstract, "fsdp=4,tensor=2"), seed=7)
    for step in (1, 2, 3):
        next(stream)
        assert checkpointer.save(step, state, stream.iterator, config)
    checkpointer.close()
    verify = Checkpointer.verify

    def rotating(self, step):  # the hook between verify's listing and its reading of each step
        if step == 1:
            shutil.rmtree(directory / "1")
        if step == 2:
            next(p for p in sorted((directory / "2" / "state").rglob("*")) if p.is_file()).unlink()
        return verify(self, step)

    def listing(*args, **kwargs):  # Orbax's listing of the steps failed once by a rotation under it
        opened.append(args)
        if len(opened) == 1:
            raise FileNotFoundError(2, "No such file or directory", str(directory / "1" / "_CHECKPOINT_METADATA"))
        return manager(*args, **kwargs)

    from spmdkit.checkpoint import backend

    manager, opened = backend.ocp.CheckpointManager, []
    monkeypatch.setattr(backend.ocp, "CheckpointManager", listing)
    monkeypatch.setattr(Checkpointer, "verify", rotating)
    code, out, err = run_cli(capsys, "ckpt", "verify", str(directory))
    assert code == 0 and not err and len(opened) == 2, out + err
    lines = out.splitlines()
    assert lines[:3] == ["step 1: rotated away while reading, skipped", "step 2: rotated away while reading, skipped",
                         "step 3: ok"]  # fmt: skip
    assert "DAMAGED" not in out and "delete" not in out and "1 of 3 steps intact" in lines[3]
