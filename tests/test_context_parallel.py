"""Ulysses, 2D (ring x Ulysses) and the window-aware ring: the numbers of dense one-device attention (forward and
gradients) on 8 simulated devices, the all-to-alls and K/V hops in the compiled program, the kernel choice and its
refusals, and training: the losses of an fsdp-only run, and a checkpoint of a ring run restored under Ulysses
bit-identically."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import error_lines, run_spmdkit

from spmdkit.cli.train import parse_flags
from spmdkit.errors import SpmdkitError
from spmdkit.inspect.hlo import collective_report
from spmdkit.kernels.attention_spec import AttentionSpec
from spmdkit.models.attention import KERNEL_TABLE, _fused_local, dot_attention
from spmdkit.models.attention_choice import choose_attention
from spmdkit.parallel.context.exchange import kv_repeat
from spmdkit.parallel.context.ring_attention import RingLayout, ring_attention
from spmdkit.parallel.context.ulysses import HeadParts, UlyssesLayout, choose_parts, ulysses_attention
from spmdkit.parallel.context.zigzag import from_zigzag, ring_balance, ring_steps, to_zigzag
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.tools.gpu_compile import lower_train_step
from spmdkit.train.config import TrainConfig
from spmdkit.train.step.program import build_program

RTOL = 1e-5

# (mesh, batch, seq, heads, kv_heads, head_dim, window, packed, causal). Context 8, 4 and 2 (with fsdp, and with
# tensor x fsdp under SP); kv heads fewer than, equal to and more than the degree (after the tensor split: kv 2 over
# tensor 2 leaves 1 per device for context 2); head_dim 64 and 128; causal, windowed, non-causal; packed rows.
CASES = [
    ("context=8", 1, 64, 8, 2, 64, 0, False, True),
    ("context=8", 1, 64, 16, 16, 128, 9, True, True),
    ("context=4,fsdp=2", 2, 32, 8, 4, 64, 0, True, True),
    ("context=4,fsdp=2", 2, 32, 8, 1, 128, 5, False, True),
    ("context=4,fsdp=2", 2, 32, 4, 4, 64, 0, False, False),
    ("context=2,tensor=2,fsdp=2", 2, 32, 8, 2, 64, 6, True, True),
    ("context=2,tensor=2,fsdp=2", 2, 32, 8, 8, 128, 0, False, True),
]


def _inputs(batch, seq, heads, kv_heads, head_dim, packed, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seq, heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((batch, seq, kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((batch, seq, kv_heads, head_dim), dtype=np.float32)
    dout = rng.standard_normal((batch, seq, heads, head_dim), dtype=np.float32)
    segments = None
    if packed:  # three documents of uneven lengths and a padded tail in every row
        segments = np.ones((batch, seq), np.int32)
        segments[:, seq // 3 :] = 2
        segments[:, seq // 2 + 1 :] = 3
        segments[:, seq - 3 :] = 0
    return q, k, v, dout, segments


def _out_and_grads(attention, segments, spec):
    def f(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segments, spec), q, k, v)
        return (out, *vjp(dout))

    return jax.jit(f)


def _assert_close(got, want):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / np.max(np.abs(np.asarray(w))))
        assert g.shape == w.shape and err < RTOL, (name, err)


@pytest.mark.parametrize("mesh_text,batch,seq,heads,kv_heads,head_dim,window,packed,causal", CASES)
def test_ulysses_equals_dense_attention(mesh_text, batch, seq, heads, kv_heads, head_dim, window, packed, causal):
    """Through the model's kernel table under the trainer's rules (SP on the tensor meshes): forward and gradients
    of dense one-device attention within 1e-5, with the blockwise kernel and with the dot kernel per device."""
    q, k, v, dout, segments = _inputs(batch, seq, heads, kv_heads, head_dim, packed)
    spec = AttentionSpec(causal=causal, window=window, block_q=16, block_k=8)
    want = _out_and_grads(dot_attention, segments, spec)(q, k, v, dout)
    mesh = make_mesh(mesh_text)
    rules = make_rules(3, sequence_parallel="tensor" in mesh_text)
    for kind in ("ulysses_blockwise", "ulysses_dot"):
        with use_rules(rules, mesh), jax.set_mesh(mesh):
            got = _out_and_grads(KERNEL_TABLE[kind], segments, spec)(q, k, v, dout)
        _assert_close(got, want)


# (mesh, batch, seq, heads, kv_heads, head_dim, parts, sinks): parts of 1 head inside a kv group, of whole groups,
# of a group each, under SP with tensor; the kv heads repeated for the degree (kv 1 on context 4); attention sinks
PART_CASES = [
    ("context=8", 1, 64, 16, 2, 64, 2, False),
    ("context=4,fsdp=2", 2, 32, 16, 4, 64, 2, True),
    ("context=4,fsdp=2", 2, 32, 16, 1, 128, 4, False),
    ("context=2,tensor=2,fsdp=2", 2, 32, 16, 4, 64, 2, True),
]


@pytest.mark.parametrize("mesh_text,batch,seq,heads,kv_heads,head_dim,parts,sinks", PART_CASES)
def test_ulysses_output_parts_project_to_the_dense_output(
    mesh_text, batch, seq, heads, kv_heads, head_dim, parts, sinks
):
    """The output in head parts, each part times its rows of a projection W [heads, head_dim, 24], summed: dense
    attention's output times W, forward and gradients (q, k, v and W) within 1e-5, packed and windowed, with and
    without sinks (each part attends with its heads' sinks)."""
    q, k, v, _, segments = _inputs(batch, seq, heads, kv_heads, head_dim, True)
    w = np.random.default_rng(1).standard_normal((heads, head_dim, 24), dtype=np.float32)
    dout = np.random.default_rng(2).standard_normal((batch, seq, 24), dtype=np.float32)
    logits = np.random.default_rng(3).standard_normal(heads, dtype=np.float32) if sinks else None
    spec = AttentionSpec(window=7)

    def projected(attention, **kw):
        def f(q, k, v, w):
            out = attention(q, k, v, segments, spec, logits, **kw)
            if isinstance(out, HeadParts):
                return sum(jnp.einsum("bshd,hde->bse", p, r) for p, r in zip(out.parts, out.rows(w), strict=True))
            return jnp.einsum("bshd,hde->bse", out, w)

        return jax.jit(lambda *a: (lambda out, vjp: (out, *vjp(dout)))(*jax.vjp(f, *a)))

    want = projected(dot_attention)(q, k, v, w)
    mesh = make_mesh(mesh_text)
    with use_rules(make_rules(3, sequence_parallel="tensor" in mesh_text), mesh), jax.set_mesh(mesh):
        got = projected(KERNEL_TABLE["ulysses_dot"], parts=parts)(q, k, v, w)
    _assert_close(got[:4], want[:4])
    assert np.max(np.abs(got[4] - want[4])) / np.max(np.abs(want[4])) < RTOL


def test_output_parts_are_chosen_where_they_apply():
    # llama3-8b on context=4, tensor=2: 4 heads per device after the exchange, 1 kv head: 2 parts of 2
    assert choose_parts(0, 32, 8, 2, 4) == 2 and choose_parts(1, 32, 8, 2, 4) == 1
    assert choose_parts(0, 32, 8, 2, 4, blocker="the output projection is FP8") == 1
    assert choose_parts(0, 12, 12, 1, 4) == 1  # 3 heads per device do not halve: whole, as auto
    with pytest.raises(SpmdkitError, match="parts of 2 heads cut the 3 query heads that share a kv head"):
        choose_parts(3, 12, 4, 1, 2)  # 6 heads per device, 3 per kv head
    with pytest.raises(SpmdkitError, match="--model.ulysses-parts 2: the output projection is FP8: use 1"):
        choose_parts(2, 32, 8, 2, 4, blocker="the output projection is FP8")


# (mesh, Ulysses factor, batch, seq, heads, kv_heads, head_dim, window, packed): a ring of context / U positions
# over Ulysses groups of U; kv heads fewer than U (repeated), equal, more; SP with tensor.
CASES_2D = [
    ("context=8", 2, 1, 64, 8, 2, 64, 0, False),
    ("context=8", 4, 1, 64, 8, 8, 128, 9, True),
    ("context=4,fsdp=2", 2, 2, 32, 4, 1, 64, 0, True),
    ("context=2,tensor=2,fsdp=2", 2, 2, 32, 8, 4, 64, 5, False),
]


@pytest.mark.parametrize("mesh_text,ulysses,batch,seq,heads,kv_heads,head_dim,window,packed", CASES_2D)
def test_2d_context_parallelism_equals_dense_attention(
    mesh_text, ulysses, batch, seq, heads, kv_heads, head_dim, window, packed
):
    """The ring kernel under rules with a Ulysses factor, inputs in the zigzag layout over the ring's positions:
    forward and gradients of dense one-device attention within 1e-5."""
    q, k, v, dout, segments = _inputs(batch, seq, heads, kv_heads, head_dim, packed)
    spec = AttentionSpec(window=window)
    want = _out_and_grads(dot_attention, segments, spec)(q, k, v, dout)
    mesh = make_mesh(mesh_text)
    positions = mesh.shape["context"] // ulysses
    zig = lambda x: None if x is None else np.asarray(to_zigzag(x, axis=1, n=positions))  # noqa: E731
    rules = make_rules(3, sequence_parallel="tensor" in mesh_text, ulysses=ulysses)
    with use_rules(rules, mesh), jax.set_mesh(mesh):
        got = _out_and_grads(KERNEL_TABLE["ring"], zig(segments), spec)(zig(q), zig(k), zig(v), zig(dout))
    _assert_close([np.asarray(from_zigzag(x, axis=1, n=positions)) for x in got], want)


def test_the_fused_kernel_runs_per_device_inside_ulysses():
    """The wrapper cuDNN runs in (`jax.nn.dot_product_attention` per device; its XLA implementation on CPU) under
    Ulysses: the numbers of dense attention, windowed and packed."""
    q, k, v, dout, segments = _inputs(2, 32, 8, 2, 64, packed=True)
    spec = AttentionSpec(window=7)
    local = functools.partial(_local_fused, implementation="xla")
    mesh = make_mesh("context=4,fsdp=2")
    attention = functools.partial(ulysses_attention, mesh=mesh, layout=UlyssesLayout(), local=local)
    with jax.set_mesh(mesh):
        got = _out_and_grads(attention, segments, spec)(q, k, v, dout)
    _assert_close(got, _out_and_grads(dot_attention, segments, spec)(q, k, v, dout))


def _local_fused(q, k, v, segments, spec, implementation):
    return _fused_local(q, k, v, segments, spec=spec, implementation=implementation)


def test_the_exchange_is_four_all_to_alls_forward_and_four_backward():
    """q, k, v in and the output back: 4 all-to-alls of activation size forward, their transposes backward, and
    nothing travels around a ring (no collective-permute); each moves one device's [batch, seq/C, heads, d]."""
    batch, seq, heads, head_dim = 2, 64, 8, 64
    q, k, v, dout, _ = _inputs(batch, seq, heads, heads, head_dim, packed=False)
    mesh = make_mesh("context=4,fsdp=2")
    attention = functools.partial(ulysses_attention, mesh=mesh)
    with jax.set_mesh(mesh):
        compiled = _out_and_grads(attention, None, AttentionSpec()).lower(q, k, v, dout).compile()
    report = collective_report(compiled)
    assert report.count("all-to-all") == 8 and report.count("collective-permute") == 0
    per_device = batch // 2 * seq // 4 * heads * head_dim * 4
    assert {c.operand_bytes for c in report.collectives if c.opcode == "all-to-all"} == {per_device}


def test_kv_heads_are_repeated_only_as_far_as_the_degree_needs():
    assert kv_repeat(8, 32, 8) == 1  # 8 kv heads over 8 devices: one each
    assert kv_repeat(2, 16, 8) == 4  # 2 kv heads, 8 devices: each repeated 4 times
    assert kv_repeat(6, 24, 4) == 2  # gcd(6, 4) = 2
    assert kv_repeat(1, 8, 2) == 2


# --- the choice ------------------------------------------------------------------------------------------------

GPU = {"platform": "cuda", "dtype": "bfloat16", "head_dim": 128}


def test_auto_runs_ulysses_around_cudnn_on_a_gpu_where_the_heads_split():
    assert choose_attention("auto", context=8, **GPU, head_split=4) == "ulysses_cudnn"
    assert choose_attention("auto", context=8, **GPU, head_split=0) == "ring"  # heads do not split: the ring
    assert choose_attention("auto", context=8, **{**GPU, "dtype": "float32"}, head_split=4) == "ring"
    assert choose_attention("auto", context=8, **{**GPU, "platform": "cpu"}, head_split=4) == "ring"
    explicit = {"context_parallel": "ulysses", "head_split": 2}
    assert choose_attention("auto", context=4, **{**GPU, "platform": "cpu"}, **explicit) == "ulysses_blockwise"
    assert choose_attention("dot", context=4, **{**GPU, "platform": "cpu"}, **explicit) == "ulysses_dot"
    assert choose_attention("cudnn", context=4, **GPU, head_split=2) == "ulysses_cudnn"
    assert choose_attention("ring", context=4, **GPU, head_split=2) == "ring"
    # a resolved choice resolves to itself (the traced model asks again, knowing no platform)
    assert (
        choose_attention("ulysses_cudnn", context=4, platform=None, dtype="bfloat16", head_dim=128) == "ulysses_cudnn"
    )


@pytest.mark.parametrize(
    "kind,settings,message",
    [
        ("auto", dict(context_parallel="ulysses", head_split=0), "--context-parallel ulysses: the heads do not split"),
        ("ring", dict(context_parallel="ulysses"), "--attention ring and --context-parallel ulysses contradict"),
        (
            "ulysses_dot",
            dict(context_parallel="ring"),
            "--attention ulysses_dot and --context-parallel ring contradict",
        ),
        ("dot", dict(context_parallel="ring"), "--attention dot cannot split the sequence over context=4"),
        ("auto", dict(context=1, context_parallel="ulysses"), "--context-parallel ulysses needs a context axis > 1"),
        ("auto", dict(context_parallel="usp"), "unknown --context-parallel 'usp'"),
    ],
)
def test_a_context_choice_that_cannot_run_is_one_clear_error(kind, settings, message):
    settings = {"context": 4, **GPU, "head_split": 2, **settings}
    with pytest.raises(SpmdkitError, match=re.escape(message)) as info:
        choose_attention(kind, **settings)
    assert "\n" not in str(info.value)


def test_ulysses_refuses_heads_that_do_not_split_in_one_line():
    q, k, v, _, _ = _inputs(2, 32, 6, 6, 8, packed=False)
    with pytest.raises(SpmdkitError, match=re.escape("Ulysses: heads=6 are not divisible by tensor x context = 4")):
        ulysses_attention(q, k, v, mesh=make_mesh("context=4,fsdp=2"))


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--mesh", "context=8", "--model.heads", "12", "--context-parallel", "ulysses"], "the heads do not split"),
        (
            ["--mesh", "pipeline=2,context=2,fsdp=2", "--context-parallel", "ulysses"],
            "pipeline and context parallelism together are not",
        ),
        (["--mesh", "fsdp=8", "--context-parallel", "ulysses"], "needs a context axis > 1 in the mesh"),
        (["--mesh", "context=4,fsdp=2", "--context-parallel", "2d"], "--context-parallel 2d takes --ulysses U"),
        (["--mesh", "context=4,fsdp=2", "--ulysses", "2"], "--ulysses only goes with it"),
        (["--mesh", "context=4,fsdp=2", "--context-parallel", "2d", "--ulysses", "3"], "--ulysses 3 must divide"),
        (["--mesh", "context=4,fsdp=2", "--context-parallel", "2d", "--ulysses", "4"], "strictly between 1 and it"),
        (["--mesh", "context=4,fsdp=2", "--model.ulysses-parts", "2"], "--model.ulysses-parts 2 needs Ulysses"),
        (
            ["--mesh", "context=4,fsdp=2", "--context-parallel", "ulysses", "--model.ulysses-parts", "3"],
            "the 2 heads each device attends do not split into 3 parts",
        ),
        (
            [
                "--mesh",
                "context=8",
                "--model.heads",
                "4",
                "--model.kv-heads",
                "4",
                "--context-parallel",
                "2d",
                "--ulysses",
                "8",
            ],
            "strictly between",
        ),
        (
            [
                "--mesh",
                "context=4,tensor=2",
                "--model.heads",
                "6",
                "--model.kv-heads",
                "2",
                "--context-parallel",
                "2d",
                "--ulysses",
                "2",
            ],
            "the 3 heads per tensor rank do not split over it",
        ),
    ],
)
def test_train_refuses_ulysses_where_it_cannot_run(tmp_path, flags, message):
    flags = ("--cpu-devices", "8", "--model", "tiny", "--steps", "2", *flags, "--run-dir", str(tmp_path / "r"))
    refused = run_spmdkit("train", *flags)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert len(error_lines(refused.stderr)) == 1 and message in refused.stderr
    assert not (tmp_path / "r").exists()


# --- training -------------------------------------------------------------------------------------------------

TRAIN = ("--model", "tiny", "--cpu-devices", "8", "--dtype", "float32", "--batch-size", "8", "--seed", "3")
TRAIN += ("--log-every", "1", "--eval-every", "0", "--no-progress", "--lr", "3e-3")


def _losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


def _train(run_dir, steps, *flags):
    done = run_spmdkit("train", *TRAIN, "--steps", str(steps), "--run-dir", str(run_dir), *flags, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_training_under_ulysses_gives_the_fsdp_losses(tmp_path):
    """20 steps of `tiny` (8 heads, 4 kv heads): Ulysses on context=4,fsdp=2, on context=2,tensor=2,fsdp=2 with SP
    and on context=2,data=2,fsdp=2 accumulating 2 microbatches, and 2D (a ring of 2 positions over Ulysses pairs)
    on context=4,fsdp=2 give the losses of fsdp=8 (float32, 1e-5), and the run says which kernel ran."""
    base = _train(tmp_path / "fsdp", 20, "--mesh", "fsdp=8", "--checkpoint-every", "0")
    ulysses = _train(tmp_path / "u", 20, "--mesh", "context=4,fsdp=2", "--context-parallel", "ulysses")
    sp = ("--mesh", "context=2,tensor=2,fsdp=2", "--sequence-parallel", "--context-parallel", "ulysses")
    _train(tmp_path / "usp", 20, *sp, "--checkpoint-every", "0")
    # accumulating over a replica axis runs the model in a partly manual region: Ulysses nests in it
    accumulated = ("--mesh", "context=2,data=2,fsdp=2", "--grad-accum", "2", "--context-parallel", "ulysses")
    _train(tmp_path / "uacc", 20, *accumulated, "--checkpoint-every", "0")
    two_d = _train(tmp_path / "2d", 20, "--mesh", "context=4,fsdp=2", "--context-parallel", "2d", "--ulysses", "2")
    want = _losses(tmp_path / "fsdp")
    assert len(want) == 20 and want[-1] < want[0] and "attention blockwise" in base.stdout
    assert "attention ulysses_blockwise" in ulysses.stdout
    assert "Ulysses attention (all-to-alls, the output in 2 head parts)" in ulysses.stdout  # auto: 2 heads each
    assert "ring attention (zigzag) of Ulysses groups of 2 (2D)" in two_d.stdout
    for name in ("u", "usp", "uacc", "2d"):
        got = _losses(tmp_path / name)
        assert np.allclose(got, want, rtol=1e-5, atol=0), (name, got, want)


def test_a_ring_checkpoint_restores_under_ulysses_bit_identically(tmp_path):
    """The state a ring run saved is what a Ulysses run on the same mesh restores, array for array, bit for bit."""
    run_dir = tmp_path / "run"
    _train(run_dir, 4, "--mesh", "context=4,fsdp=2", "--context-parallel", "ring", "--checkpoint-every", "4")
    states = [_restored(run_dir, algorithm) for algorithm in ("ring", "ulysses")]
    assert states[0][1] == states[1][1] == 4
    for ring, ulysses in zip(states[0][0], states[1][0], strict=True):
        assert ring.dtype == ulysses.dtype and np.array_equal(ring, ulysses)


def _restored(run_dir, algorithm) -> tuple[list[np.ndarray], int]:
    from spmdkit.train.config import MeshSettings, ModelSettings, RunSettings, TrainConfig
    from spmdkit.train.loop import Trainer

    config = TrainConfig(
        model=ModelSettings(name="tiny", dtype="float32"),
        mesh=MeshSettings(mesh="context=4,fsdp=2", context_parallel=algorithm),
        run=RunSettings(steps=8, batch_size=8, seed=3, run_dir=str(run_dir), progress=False),
    )
    trainer = Trainer(config, log=lambda _: None)
    try:
        trainer.resume()
        return [np.asarray(x) for x in jax.tree.leaves(trainer.state.state)], trainer.start_step
    finally:
        trainer.release_lock()
        trainer.checkpointer.close()


# --- the window-aware ring ------------------------------------------------------------------------------------


def test_a_windowed_ring_takes_only_the_steps_its_window_reaches():
    # 8 positions, chunks of 8: a window of 16 reaches one chunk back and into the next; zigzag's late chunks sit
    # in reverse, so their neighbours arrive from the other way round the ring
    assert ring_steps(8, "zigzag", 8, 16) == (0, 1, 2, 6, 7)
    assert ring_steps(8, "none", 8, 16) == (0, 1)
    assert ring_steps(8, "zigzag", 8, 0) == tuple(range(8)) == ring_steps(8, "zigzag", 8, 16, causal=False)
    assert ring_balance([16, 16], 128, 8) == "contiguous"
    assert ring_balance([16, 0], 128, 8) == ring_balance([32, 32], 128, 8) == "zigzag"  # a global layer; too wide


@pytest.mark.parametrize("load_balance", ["zigzag", "none"])
@pytest.mark.parametrize("window,packed", [(16, False), (5, True), (40, False)])
def test_a_windowed_ring_equals_dense_attention(load_balance, window, packed):
    q, k, v, dout, segments = _inputs(1, 128, 4, 2, 16, packed)
    spec = AttentionSpec(window=window)
    want = _out_and_grads(dot_attention, segments, spec)(q, k, v, dout)
    mesh = make_mesh("context=8")
    zig = lambda x: x if x is None or load_balance == "none" else np.asarray(to_zigzag(x, axis=1, n=8))  # noqa: E731
    back = lambda x: x if load_balance == "none" else np.asarray(from_zigzag(x, axis=1, n=8))  # noqa: E731
    attention = functools.partial(ring_attention, mesh=mesh, layout=RingLayout(load_balance=load_balance))
    with jax.set_mesh(mesh):
        got = _out_and_grads(attention, zig(segments), spec)(zig(q), zig(k), zig(v), zig(dout))
    _assert_close([np.asarray(back(x)) for x in got], want)


def _permute_bytes(flags: str) -> int:
    program = build_program(parse_flags(f"--model tiny --seq-len 128 --batch-size 8 {flags}".split(), TrainConfig()))
    return collective_report(lower_train_step(program).compile()).bytes("collective-permute")


def test_a_windowed_model_sends_only_the_kv_it_reads(tmp_path):
    """A model windowed everywhere (window 16 = 1/8 of 128 tokens) on context=8: the ring takes the contiguous
    layout and one step of K/V each way, at least 4x fewer collective-permute bytes per step than the same model
    without the window (the compiled step's HLO), and trains to the losses of fsdp=8 with the same window."""
    windowed = _permute_bytes("--mesh context=8 --model.sliding-window 16")
    assert windowed > 0 and _permute_bytes("--mesh context=8") >= 4 * windowed
    window = ("--model.sliding-window", "16", "--seq-len", "128", "--checkpoint-every", "0")
    ring = _train(tmp_path / "ring", 12, "--mesh", "context=8", *window)
    _train(tmp_path / "fsdp", 12, "--mesh", "fsdp=8", *window)
    assert "ring attention (contiguous)" in ring.stdout
    assert np.allclose(_losses(tmp_path / "ring"), _losses(tmp_path / "fsdp"), rtol=1e-5, atol=0)
