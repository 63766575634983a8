"""Attention kernels: the blockwise kernel and the cuDNN wrapper give jax.nn.dot_product_attention's numbers (documents
packed with segment ids too), the kernel choice and its refusals, and a whole training step with the blockwise kernel
equals the dot-attention step on fsdp=4,tensor=2.

Memory and FLOPs of the kernels are in tests/test_attention_memory.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import error_lines, run_spmdkit

from spmdkit.errors import SpmdkitError
from spmdkit.inspect.hlo import collective_report
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.models import TransformerConfig
from spmdkit.models.attention import blockwise_attention, cudnn_attention, dot_attention
from spmdkit.models.attention_choice import choose_attention
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.train.step.optimizer import OptimizerConfig, make_optimizer
from spmdkit.train.step.state import create_train_state
from spmdkit.train.step.train_step import make_train_step

RTOL = 1e-5


def _inputs(batch, seq, heads, kv_heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seq, heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((batch, seq, kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((batch, seq, kv_heads, head_dim), dtype=np.float32)
    dout = rng.standard_normal((batch, seq, heads, head_dim), dtype=np.float32)
    return q, k, v, dout


def _out_and_grads(attention):
    """jit(f(q, k, v, dout) -> (out, dq, dk, dv)), dout the output cotangent."""

    def f(q, k, v, dout):
        out, vjp = jax.vjp(attention, q, k, v)
        return (out, *vjp(dout))

    return jax.jit(f)


def _rel_err(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))) / np.max(np.abs(np.asarray(want))))


def _assert_close(got, want, names=("out", "dq", "dk", "dv")):
    for name, g, w in zip(names, got, want, strict=True):
        assert g.shape == w.shape and g.dtype == np.float32, name
        assert _rel_err(g, w) < RTOL, (name, _rel_err(g, w))


# Every (causal, GQA group, head_dim) at seq 1000: two query and key blocks of 512, the last one padded.
GRID = [(causal, group, head_dim) for causal in (True, False) for group in (1, 3, 8) for head_dim in (64, 128)]


@pytest.mark.parametrize("causal,group,head_dim", GRID)
def test_blockwise_equals_dot_product_attention(causal, group, head_dim):
    q, k, v, dout = _inputs(1, 1000, group, 1, head_dim)
    got = _out_and_grads(lambda q, k, v: blockwise_attention(q, k, v, None, AttentionSpec(causal)))(q, k, v, dout)
    want = _out_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal))(q, k, v, dout)
    _assert_close(got, want)


@pytest.mark.parametrize("block_q,block_k", [(64, 128), (128, 48)], ids=["bq<bk", "bq>bk"])
def test_unequal_blocks(block_q, block_k):
    """Query and key blocks of different sizes, neither dividing the sequence (a gathered schedule, not slices)."""
    q, k, v, dout = _inputs(2, 300, 4, 2, 64, seed=1)
    spec = AttentionSpec(block_q=block_q, block_k=block_k)
    got = _out_and_grads(lambda q, k, v: blockwise_attention(q, k, v, None, spec))(q, k, v, dout)
    want = _out_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))(q, k, v, dout)
    _assert_close(got, want)


def _documents(seq: int) -> np.ndarray:
    """Two rows of packed documents: [1 x 300, 2 x 500, 3 x 150, padding x 50] and [1 x 700, 2 x 300]."""
    first = np.repeat([1, 2, 3, 0], [300, 500, 150, seq - 950])
    second = np.repeat([1, 2], [700, seq - 700])
    return np.stack([first, second]).astype(np.int32)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_segment_ids(causal):
    """A query sees only its own document: equal to dot_product_attention with that mask on every real row;
    padding rows give 0, pass no gradient, and nothing is NaN. The reference `dot_attention` agrees everywhere."""
    seq = 1000
    q, k, v, dout = _inputs(2, seq, 6, 2, 64, seed=2)
    seg = _documents(seq)
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    if causal:
        mask &= np.tril(np.ones((seq, seq), bool))

    def reference(q, k, v):  # padding rows see nothing: dot_product_attention averages them, so they are zeroed
        out = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask)[:, None])
        return jnp.where(jnp.asarray(seg != 0)[..., None, None], out, 0.0)

    got = _out_and_grads(lambda q, k, v: blockwise_attention(q, k, v, seg, AttentionSpec(causal)))(q, k, v, dout)
    want = _out_and_grads(reference)(q, k, v, dout)
    _assert_close(got, want)
    pad = seg == 0
    assert all(np.isfinite(np.asarray(x)).all() for x in got)
    assert np.all(np.asarray(got[0])[pad] == 0) and np.all(np.asarray(got[1])[pad] == 0)  # out, dq of padding
    assert np.all(np.asarray(got[2])[pad] == 0) and np.all(np.asarray(got[3])[pad] == 0)  # dk, dv of padding keys
    dot = _out_and_grads(lambda q, k, v: dot_attention(q, k, v, seg, AttentionSpec(causal)))(q, k, v, dout)
    _assert_close(dot, want)


@pytest.mark.parametrize(
    "mesh_text,kv_heads",
    [("fsdp=4,tensor=2", 2), ("data=2,tensor=4", 2)],
    ids=["kv-heads-split", "kv-heads-repeated"],
)
def test_cudnn_wrapper_runs_per_device_without_communication(mesh_text, kv_heads):
    """The cuDNN path's shard_map over batch and heads, with XLA's attention standing in for cuDNN on CPU: the
    numbers of dot_attention (segment ids included), and no collective at all in the compiled program. With 2 kv
    heads on tensor=4, K/V are repeated to the query heads first (the same numbers)."""
    mesh, rules = make_mesh(mesh_text), make_rules(3)
    q, k, v, dout = _inputs(4, 64, 8, kv_heads, 16, seed=3)
    seg = np.repeat(np.array([[1, 2, 0]] * 4, np.int32), [30, 30, 4], axis=1)
    batch_axis = "fsdp" if "fsdp" in mesh_text else "data"
    split = jax.NamedSharding(mesh, jax.P(batch_axis, None, "tensor"))
    kv_split = split if kv_heads >= mesh.shape["tensor"] else jax.NamedSharding(mesh, jax.P(batch_axis))
    args = [jax.device_put(x, s) for x, s in zip((q, k, v, dout), (split, kv_split, kv_split, split), strict=True)]

    def fused(q, k, v):
        with use_rules(rules, mesh):
            return cudnn_attention(q, k, v, jnp.asarray(seg), implementation="xla")

    compiled = _out_and_grads(fused).lower(*args).compile()
    got = compiled(*args)
    want = _out_and_grads(lambda q, k, v: dot_attention(q, k, v, seg))(q, k, v, dout)
    _assert_close(got, want)
    # The region spans every mesh axis (cuDNN's partitioner needs that on GPU); the size-1 ones leave an all-reduce
    # over groups of one device in the backward, which moves nothing (XLA:GPU removes it; the CPU backend keeps it).
    collectives = [c.opcode for c in collective_report(compiled).collectives if c.group_size != 1]
    if kv_heads >= mesh.shape["tensor"]:
        assert collectives == [], collectives
    else:  # K/V replicated over tensor: their gradient is gathered and summed over the query heads sharing them
        assert "all-to-all" not in collectives and "collective-permute" not in collectives, collectives


@pytest.mark.parametrize("backward_inside", [False, True], ids=["grad-outside", "vjp-inside"])
def test_cudnn_wrapper_inside_a_partly_manual_region(backward_inside):
    """As in a pipeline stage (manual over data and fsdp, tensor automatic) or accumulation over replica axes: the
    wrapper nests a region over the axes still automatic, forward and backward (the kernel's vjp taken per device),
    with XLA's attention standing in for cuDNN on CPU. The numbers of dot_attention, the gradients taken outside
    the region and (as 1F1B does) inside it, with a cotangent that varies over the manual axes."""
    mesh, rules = make_mesh("data=2,fsdp=2,tensor=2"), make_rules(3)
    q, k, v, dout = _inputs(4, 64, 4, 2, 16, seed=5)
    seg = jnp.asarray(np.repeat(np.array([[1, 2]] * 4, np.int32), [40, 24], axis=1))
    tokens = jax.P(("data", "fsdp"))  # tensor stays automatic: the wrapper splits the heads over it

    def per_stage(q, k, v, dout, seg):
        with use_rules(rules, mesh):
            attention = lambda q, k, v: cudnn_attention(q, k, v, seg, implementation="xla")  # noqa: E731
            if not backward_inside:
                return (attention(q, k, v),)
            out, vjp = jax.vjp(attention, q, k, v)
            return (out, *vjp(dout))

    region = jax.shard_map(
        per_stage, mesh=mesh, in_specs=(tokens,) * 5,
        out_specs=(tokens,) * (4 if backward_inside else 1), axis_names={"data", "fsdp"},
    )  # fmt: skip
    if backward_inside:
        got = jax.jit(region)(q, k, v, dout, seg)
    else:
        got = _out_and_grads(lambda q, k, v: region(q, k, v, dout, seg)[0])(q, k, v, dout)
    want = _out_and_grads(lambda q, k, v: dot_attention(q, k, v, seg))(q, k, v, dout)
    _assert_close(got, want)


# --- which kernel runs ---------------------------------------------------------------------------------------


def test_auto_picks_ring_cudnn_or_blockwise():
    defaults = {"context": 1, "platform": "cpu", "dtype": "bfloat16", "head_dim": 64}
    choose = lambda **kw: choose_attention("auto", **{**defaults, **kw})  # noqa: E731
    assert choose() == "blockwise"
    assert choose(context=4) == "ring"
    assert choose(platform="cuda", head_dim=128) == "cudnn"
    assert choose(platform="cuda", head_dim=64, dtype="float16") == "cudnn"
    assert choose(platform="cuda", head_dim=64, dtype="float32") == "blockwise"  # cuDNN has no float32 kernel
    assert choose(platform="cuda", head_dim=96 + 4) == "blockwise"  # not a multiple of 8
    assert choose(platform="tpu", head_dim=128) == "blockwise"


@pytest.mark.parametrize(
    "kind,settings,message",
    [
        ("cudnn", dict(platform="cpu"), "--attention cudnn needs an NVIDIA GPU, not cpu"),
        ("cudnn", dict(dtype="float32"), "cuDNN attention needs a bfloat16 or float16 compute dtype, not float32"),
        ("cudnn", dict(head_dim=256), "cuDNN attention needs head_dim a multiple of 8 up to 128, not 256"),
        ("ring", dict(), "--attention ring needs a context axis > 1 in the mesh"),
        ("dot", dict(context=2), "--attention dot cannot split the sequence over context=2"),
        ("blockwise", dict(context=4), "--attention blockwise cannot split the sequence over context=4"),
        ("flash", dict(), "unknown attention 'flash'"),
    ],
)
def test_an_explicit_kernel_that_cannot_run_is_one_clear_error(kind, settings, message):
    settings = {"context": 1, "platform": "cuda", "dtype": "bfloat16", "head_dim": 64, **settings}
    with pytest.raises(SpmdkitError, match=re.escape(message)) as info:
        choose_attention(kind, **settings)
    assert "\n" not in str(info.value)


def test_the_trainer_names_the_kernel_it_runs(tmp_path):
    from spmdkit.train.config import MeshSettings, RunSettings, TrainConfig
    from spmdkit.train.loop import Trainer
    from spmdkit.train.reporting.report import describe_run

    run = RunSettings(steps=1, batch_size=8, seq_len=1024, run_dir=str(tmp_path), progress=False)
    trainer = Trainer(TrainConfig(mesh=MeshSettings(mesh="fsdp=8"), run=run), log=lambda _: None)
    kernels = [line for line in describe_run(trainer).splitlines() if line.startswith("kernels")]
    assert kernels == ["kernels      attention blockwise (auto); loss over 2 chunk(s) of 512 positions"]
    trainer.checkpointer.close()


def test_train_command_refuses_cudnn_on_cpu(tmp_path):
    refused = run_spmdkit("train", "--cpu-devices", "8", "--attention", "cudnn", "--run-dir", str(tmp_path / "run"))
    assert refused.returncode == 2
    assert error_lines(refused.stderr) == [
        "spmdkit: error: --attention cudnn needs an NVIDIA GPU, not cpu: use blockwise (or auto)"
    ]


# Reads of the platform, the backend or the device kind: the model runs the kernel its config names, decided for the
# run's devices outside it (`spmdkit.train.step.program.build_program`, the benchmark, the planner).
DEVICE_READS = {"devices", "local_devices", "default_backend", "get_backend", "platform", "platform_version"}
DEVICE_READS |= {"device_kind", "compute_capability", "device_facts", "xla_bridge", "device_platform"}


def test_no_module_under_models_reads_the_platform():
    import ast
    import pathlib

    import spmdkit.models

    reads = []
    for path in sorted(pathlib.Path(spmdkit.models.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = {getattr(node, "attr", None)}  # x.platform, jax.devices(), ...; and what is imported
            names |= {part for alias in getattr(node, "names", []) for part in alias.name.split(".")}
            names |= set((getattr(node, "module", None) or "").split("."))
            reads += [f"{path.name}:{node.lineno} {name}" for name in sorted(names & DEVICE_READS)]
    assert not reads, reads


# --- the training step -----------------------------------------------------------------------------------------


def _three_steps(attention: str) -> tuple[list[float], list[np.ndarray]]:
    """Losses and final parameters of 3 steps on fsdp=4,tensor=2 (seq 64 in blocks of 16: 4 x 4 blocks)."""
    config = TransformerConfig(
        dtype="float32", heads=8, kv_heads=4, head_dim=8, attention=attention, attention_block=16
    )
    mesh, rules = make_mesh("fsdp=4,tensor=2"), make_rules(3)
    state = create_train_state(config, make_optimizer(OptimizerConfig(warmup_steps=1), 3), mesh, rules)
    step = make_train_step(state, mesh, rules)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (8, 65)).astype(np.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.tile(np.arange(64, dtype=np.int32), (8, 1)),
    }
    current, losses = state.state, []
    for _ in range(3):
        current, metrics = step(current, batch)
        losses.append(float(metrics["loss"]))
    return losses, [np.asarray(x) for x in jax.tree.leaves(current[0])]


def test_training_step_with_blockwise_equals_dot():
    losses, params = _three_steps("blockwise")
    base_losses, base_params = _three_steps("dot")
    assert losses[-1] < losses[0]
    for got, want in zip(losses, base_losses, strict=True):
        assert abs(got - want) / abs(want) < 1e-5
    for got, want in zip(params, base_params, strict=True):
        assert np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30) < 1e-5
