"""Pipeline parallelism: schedule tables, same numbers as one device, HLO traffic, executed FLOPs, memory, errors.

Toy model: 8 residual MLP layers (d=16) scanned inside each chunk, a linear head with mean cross-entropy.
Compilations are cached per (mesh, schedule, M) and shared between tests to keep the file fast.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.errors import SpmdkitError
from spmdkit.inspect.flops import hlo_flops
from spmdkit.inspect.hlo import collective_report
from spmdkit.inspect.roofline import roofline
from spmdkit.parallel.pipeline import schedule as ps
from spmdkit.parallel.pipeline.program import (
    deinterleave_layers,
    from_microbatches,
    interleave_layers,
    pipeline_value_and_grad,
    to_microbatches,
)
from spmdkit.parallel.pipeline.schedule import check_layers, make_schedule
from spmdkit.sharding.mesh import make_mesh

DIM, LAYERS, VOCAB, ROWS, SEQ = 16, 8, 8, 4, 2  # ROWS = global rows per microbatch
TOKENS = 12  # vocabulary of the embedding stage (embed_fn)
MESHES = ("pipeline=4,data=2", "pipeline=2,fsdp=2,tensor=2")
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2}


def stage_fn(params: dict, x: jax.Array) -> jax.Array:
    """Residual MLP layers of one chunk: params leaves [layers, ...], x [rows, seq, dim]."""

    def layer(x, w):
        return x + jnp.tanh(x @ w["w1"] + w["b1"]) @ w["w2"], None

    return jax.lax.scan(layer, x, params)[0]


def loss_fn(head: dict, y: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(y @ head["w"])
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def make_model():
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (LAYERS, DIM, 2 * DIM)) / 4,
        "b1": jax.random.normal(k[1], (LAYERS, 2 * DIM)) / 4,
        "w2": jax.random.normal(k[2], (LAYERS, 2 * DIM, DIM)) / 6,
    }
    return params, {"w": jax.random.normal(k[3], (DIM, VOCAB)) / 4}


def make_batch(m: int):
    k = jax.random.split(jax.random.key(m), 2)
    return jax.random.normal(k[0], (m, ROWS, SEQ, DIM)), jax.random.randint(k[1], (m, ROWS, SEQ), 0, VOCAB)


def make_tokens(m: int):
    """Token ids [M, rows, seq] and an embedding table [TOKENS, DIM] for the embed_fn tests."""
    k = jax.random.split(jax.random.key(100 + m), 2)
    return jax.random.randint(k[0], (m, ROWS, SEQ), 0, TOKENS), jax.random.normal(k[1], (TOKENS, DIM)) / 2


def embed_fn(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """tokens [rows, seq] -> [rows, seq, dim]."""
    return jnp.take(table, tokens, axis=0)


def reference_loss(params, head, inputs, targets):
    """The plain sequential model on one device: mean over microbatches of the per-microbatch loss."""
    ys = jax.vmap(lambda x: stage_fn(params, x))(inputs)
    return jnp.mean(jax.vmap(lambda y, t: loss_fn(head, y, t))(ys, targets))


@functools.cache
def reference(m: int, embed: bool = False):
    """Loss and grads of the plain program: w.r.t. (params, head, inputs), or (params, head, table) if embed."""
    params, head = make_model()
    inputs, targets = make_batch(m)
    if not embed:
        return jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1, 2)))(params, head, inputs, targets)
    tokens, table = make_tokens(m)

    def loss(params, head, table):
        return reference_loss(params, head, embed_fn(table, tokens), targets)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, head, table)


def place_params(mesh, params, v):
    """Interleave the layer dim and shard it over pipeline; MLP hidden dim over tensor (automatic axis)."""
    specs = {"w1": P("pipeline", None, "tensor"), "b1": P("pipeline", "tensor"), "w2": P("pipeline", "tensor")}
    params = interleave_layers(params, mesh.shape["pipeline"], v)
    return {k: jax.device_put(a, NamedSharding(mesh, specs[k])) for k, a in params.items()}


@functools.cache
def compiled_step(mesh_text: str, kind: str, m: int, remat: bool = False, embed: bool = False):
    """(compiled pipeline step, placed args, schedule) for one config; `embed`: token ids in, embed_fn on stage 0."""
    mesh = make_mesh(mesh_text)
    sched = make_schedule(kind, mesh.shape["pipeline"], m, VIRTUAL[kind])
    params, head = make_model()
    inputs, targets = make_batch(m)
    tokens, table = make_tokens(m)
    inputs, extra = (tokens, (table,)) if embed else (inputs, ())
    batch = NamedSharding(mesh, P(None, ("data", "fsdp")))
    args = (place_params(mesh, params, VIRTUAL[kind]), head, jax.device_put(inputs, batch), targets, *extra)

    def step(p, h, x, t, *table):
        kw = dict(embed_fn=embed_fn, embed_params=table[0]) if table else {}
        return pipeline_value_and_grad(stage_fn, loss_fn, p, h, x, t, mesh=mesh, schedule=sched, remat=remat, **kw)

    return jax.jit(step).lower(*args).compile(), args, sched


def assert_close(actual, expected, rtol=1e-5):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        scale = float(jnp.max(jnp.abs(e)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=0, atol=rtol * scale)


# ---------------------------------------------------------------- schedules as data


@pytest.mark.parametrize("P_", [2, 4])
@pytest.mark.parametrize("M", [4, 8, 16])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_bubble_fraction_matches_theory(kind, M, P_):
    v = 2 if kind == "interleaved" else 1
    sched = make_schedule(kind, P_, M, v)
    theory = (P_ - 1) / (v * M + P_ - 1)
    assert sched.bubble_fraction() == pytest.approx(theory)
    assert sched.num_ticks == 2 * (v * M + P_ - 1)


def replay(sched: ps.Schedule) -> np.ndarray:
    """Run the table in Python with tagged messages; check every read; return peak live stash per stage."""
    T, Pn, _ = sched.table.shape
    C, tab = sched.num_chunks, sched.table
    stash = [dict() for _ in range(Pn)]
    grads = [dict() for _ in range(Pn)]
    live = np.zeros((T, Pn), int)
    done = {}
    for t in range(T):
        for s in range(Pn):
            row = tab[t, s]
            # What the neighbours sent last tick: a forward of chunk c feeds chunk c+1 on stage (c+1) % P.
            prev, nxt = tab[t - 1, (s - 1) % Pn] if t else None, tab[t - 1, (s + 1) % Pn] if t else None
            x_msg = g_msg = None
            if prev is not None and prev[ps.OP] == ps.FORWARD:
                c = prev[ps.CHUNK] * Pn + (s - 1) % Pn
                x_msg = (prev[ps.MB], c + 1) if c + 1 < C else None
            if nxt is not None and nxt[ps.OP] == ps.BACKWARD:
                c = nxt[ps.CHUNK] * Pn + (s + 1) % Pn
                g_msg = (nxt[ps.MB], c - 1) if c > 0 else None
            assert (row[ps.RECV_X] >= 0) == (x_msg is not None), (t, s)
            assert (row[ps.RECV_G] >= 0) == (g_msg is not None), (t, s)
            if x_msg:
                assert row[ps.RECV_X] not in stash[s], "stash slot overwritten before its backward"
                stash[s][row[ps.RECV_X]] = x_msg
            if g_msg:
                assert row[ps.RECV_G] not in grads[s], "cotangent slot overwritten before use"
                grads[s][row[ps.RECV_G]] = g_msg
            live[t, s] = len(stash[s])
        for s in range(Pn):
            row = tab[t, s]
            if row[ps.OP] == ps.IDLE:
                continue
            m, c = int(row[ps.MB]), int(row[ps.CHUNK]) * Pn + s
            assert row[ps.FIRST] == (c == 0) and row[ps.LAST] == (c == C - 1)
            if c > 0:
                assert stash[s].get(row[ps.SLOT]) == (m, c), "read a stash slot that was not written"
            if row[ps.OP] == ps.FORWARD:
                assert ("F", m, c) not in done
                done["F", m, c] = t
            else:
                assert done["F", m, c] < t and ("B", m, c) not in done
                if c > 0:
                    del stash[s][row[ps.SLOT]]
                if c < C - 1:
                    assert grads[s].pop(row[ps.GRAD_SLOT]) == (m, c), "read a cotangent slot that was not written"
                done["B", m, c] = t
    assert len(done) == 2 * sched.num_microbatches * C
    assert all(not d for d in stash + grads)
    return live.max(axis=0)


@pytest.mark.parametrize(
    "kind,P_,M,v",
    [("gpipe", 4, 4, 1), ("gpipe", 2, 3, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 16, 1),
     ("1f1b", 2, 5, 1), ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3)],
)  # fmt: skip
def test_replay_schedule(kind, P_, M, v):
    sched = make_schedule(kind, P_, M, v)
    peak = replay(sched)
    np.testing.assert_array_equal(peak, sched.peak_stash())
    assert sched.num_stash_slots == max(1, peak.max())
    if kind == "1f1b":
        assert peak.max() <= P_  # the 1F1B memory bound
    if kind == "gpipe":  # forwards consume their input in the tick it arrives (the autodiff loop relies on it)
        fwd = (sched.table[:, :, ps.OP] == ps.FORWARD) & (sched.table[:, :, ps.FIRST] == 0)
        np.testing.assert_array_equal(sched.table[:, :, ps.RECV_X][fwd], sched.table[:, :, ps.SLOT][fwd])
        assert peak.max() == M


def test_format_and_plot(tmp_path):
    sched = make_schedule("1f1b", 4, 8)
    text = sched.format()
    lines = text.splitlines()
    assert len(lines) == 1 + 4 and lines[1].split()[2:6] == ["F0", "F1", "F2", "F3"]
    assert lines[4].split()[2:8] == [".", ".", ".", "F0", "B0", "F1"]
    assert "F3.1" in make_schedule("interleaved", 4, 8, 2).format()
    path = tmp_path / "schedule.png"
    make_schedule("interleaved", 4, 8, 2).plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_interleave_layout():
    layers = jnp.arange(16)
    stacked = interleave_layers(layers, 2, 2)  # 4 chunks of 4 layers: stage 0 holds chunks 0, 2
    np.testing.assert_array_equal(stacked, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
    np.testing.assert_array_equal(deinterleave_layers(stacked, 2, 2), layers)
    np.testing.assert_array_equal(interleave_layers(layers, 4, 1), layers)
    x = jnp.arange(24).reshape(12, 2)
    np.testing.assert_array_equal(from_microbatches(to_microbatches(x, 3)), x)


# ---------------------------------------------------------------- same numbers as one device


@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("mesh_text", MESHES)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_matches_one_device(kind, mesh_text, m):
    compiled, args, sched = compiled_step(mesh_text, kind, m)
    loss, (g_stage, g_head, g_inputs) = compiled(*args)
    ref_loss, ref_grads = reference(m)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    g_stage = deinterleave_layers(g_stage, sched.num_stages, sched.virtual_stages)
    assert_close((g_stage, g_head, g_inputs), ref_grads)


def test_gpipe_remat_matches_one_device():
    compiled, args, _ = compiled_step(MESHES[1], "gpipe", 4, remat=True)
    loss, grads = compiled(*args)
    ref_loss, ref_grads = reference(4)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_close(grads, ref_grads)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_embed_fn_matches_one_device(kind):
    """Token ids in, embedding on stage 0: loss and grads of stages, head and embedding table as one device."""
    compiled, args, sched = compiled_step(MESHES[0], kind, 4, embed=True)
    loss, (g_stage, g_head, g_table) = compiled(*args)
    ref_loss, ref_grads = reference(4, embed=True)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    g_stage = deinterleave_layers(g_stage, sched.num_stages, sched.virtual_stages)
    assert g_table.shape == (TOKENS, DIM)
    assert_close((g_stage, g_head, g_table), ref_grads)


@pytest.mark.parametrize("kind,mesh_text", [("gpipe", MESHES[0]), ("1f1b", MESHES[1]), ("interleaved", MESHES[0])])
def test_three_adam_steps_match(kind, mesh_text):
    compiled, (params, head, inputs, targets), sched = compiled_step(mesh_text, kind, 4)
    tx = optax.adam(1e-2)

    @jax.jit
    def apply(grads, state, weights):
        updates, state = tx.update(grads, state)
        return optax.apply_updates(weights, updates), state

    ref_weights = make_model()
    ref_state = tx.init(ref_weights)
    weights, state = (params, head), tx.init((params, head))
    ref_grad = jax.jit(jax.grad(reference_loss, argnums=(0, 1)))
    for _ in range(3):
        _, (g_stage, g_head, _) = compiled(*weights, inputs, targets)
        weights, state = apply((g_stage, g_head), state, weights)
        ref_weights, ref_state = apply(ref_grad(*ref_weights, *make_batch(4)), ref_state, ref_weights)
    params, head = weights
    params = deinterleave_layers(params, sched.num_stages, sched.virtual_stages)
    assert_close((params, head), ref_weights)


# ---------------------------------------------------------------- right traffic, right memory


def collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(opcode, result shape) of every collective in compiled HLO text."""
    pattern = re.compile(
        r"=\s*(\(?[a-z0-9]+\[[^=]*?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
        r"(?:-start)?\("
    )
    out = []
    for line in hlo.splitlines():
        match = pattern.search(line)
        if match:
            dims = re.match(r"\(?[a-z0-9]+\[([0-9,]*)\]", match.group(1)).group(1)
            out.append((match.group(2), tuple(int(d) for d in dims.split(",") if d)))
    return out


def test_1f1b_hlo_traffic():
    compiled, args, _ = compiled_step(MESHES[0], "1f1b", 8)
    ops = collectives(compiled.as_text())
    activation = (ROWS // 2, SEQ, DIM)  # one microbatch on one data shard
    permutes = [shape for op, shape in ops if op == "collective-permute"]
    assert permutes and all(shape == activation for shape in permutes)
    assert len(permutes) == 2  # forward and backward ppermute, once in the rolled loop
    assert not [op for op, _ in ops if op in ("all-gather", "all-to-all", "reduce-scatter")]
    # One reduction after the loop (loss, head, stage grads over data, input grads over pipeline); none per tick.
    assert len([op for op, _ in ops if op == "all-reduce"]) <= 4


def hand_flops(kind: str, mesh_text: str, v: int, m: int) -> list[int]:
    """Matmul FLOPs per device of each stage, counted from the toy model's shapes: a layer's two matmuls cost 2 x
    tokens x DIM x 2DIM each forward (halved per device over `tensor`, which splits the hidden dim), the head 2 x
    tokens x DIM x VOCAB (replicated over `tensor`); a backward is twice its forward. GPipe runs every chunk's
    forward and backward; 1F1B and interleaved recompute the forward in the backward, except for the last chunk
    (its forward tick is skipped: the backward computes forward, head and loss once)."""
    sizes = make_mesh(mesh_text).shape
    tokens = ROWS // (sizes.get("data", 1) * sizes.get("fsdp", 1)) * SEQ  # a microbatch's tokens on one device
    layer, head = 2 * 2 * tokens * DIM * 2 * DIM // sizes.get("tensor", 1), 2 * tokens * DIM * VOCAB
    stages = sizes["pipeline"]
    lc, last = LAYERS // (stages * v), stages * v - 1
    per_stage = []
    for s in range(stages):
        chunks = [s + j * stages for j in range(v)]
        passes = [3 if kind == "gpipe" or c == last else 4 for c in chunks]  # forward, recompute, backward (2)
        per_stage.append(m * sum(n * lc * layer + 3 * head * (c == last) for n, c in zip(passes, chunks, strict=True)))
    return per_stage


# Interleaved on MESHES[0] has one-layer chunks: no loop, and XLA drops the recompute's output matmul (unused).
@pytest.mark.parametrize(
    "kind,mesh_text", [(k, m) for m in MESHES for k in VIRTUAL if (k, m) != ("interleaved", MESHES[0])]
)
def test_flops_count_the_branches_the_schedule_runs(kind, mesh_text):
    """`hlo_flops` with the schedule's branch runs: the executed matmul FLOPs per device, the mean over the
    devices and the busiest one, equal to hand counts; without them every branch counts on every tick."""
    compiled, _, sched = compiled_step(mesh_text, kind, 8)
    stages = hand_flops(kind, mesh_text, sched.virtual_stages, 8)
    flops = hlo_flops(compiled, branches={ps.TICK_SCOPE: sched.branch_runs()})
    assert (flops["matmul"], flops["busiest"]) == (sum(stages) / len(stages), max(stages))
    assert hlo_flops(compiled)["matmul"] > 2 * max(stages)  # every branch of the tick's switch, every tick


def test_roofline_and_collectives_count_what_the_schedule_runs():
    """A 1F1B pipeline's executed FLOPs per device are the model's (3 x the forward of the device's share of the
    tokens, counted from the toy model's shapes) times its remat factor (4/3: the backward recomputes the chunk
    forward), well within 1.5x of it (every branch on every tick: 8 ticks x 4 branches); the roofline's kernels
    hold the busiest stage's FLOPs; collectives inside the tick's switch count as the schedule runs them."""
    compiled, _, sched = compiled_step(MESHES[1], "1f1b", 8)
    branches = {ps.TICK_SCOPE: sched.branch_runs()}
    sizes, m = make_mesh(MESHES[1]).shape, 8
    forward = m * ROWS * SEQ * (LAYERS * 2 * 2 * DIM * 2 * DIM + 2 * DIM * VOCAB)  # every microbatch, one device
    model = 3 * forward / (sizes["pipeline"] * sizes["tensor"] * sizes["fsdp"])  # per device
    executed = hlo_flops(compiled, branches=branches)
    assert model <= executed["matmul"] <= 1.5 * model * 4 / 3
    assert hlo_flops(compiled)["matmul"] > 1.5 * model * 4 / 3  # every branch counted: the bound fails
    found = roofline(compiled, 1e12, 1e12, branches=branches)
    assert sum(k.flops * k.runs for k in found.kernels) == executed["busiest"]
    assert {"gemm", "collective"} <= set(found.by_kind())
    weighted, every = collective_report(compiled, branches), collective_report(compiled)
    assert weighted.count("all-reduce", executed=True) < every.count("all-reduce", executed=True)


def test_flops_of_the_toy_model_under_fsdp():
    """The same model without a pipeline, batch and weights sharded over fsdp=8: 3 x the forward's FLOPs of the
    device's tokens (no conditional: mean and busiest are one)."""
    mesh, (params, head), (inputs, targets) = make_mesh("fsdp=8"), make_model(), make_batch(8)
    shard = {"w1": P(None, None, "fsdp"), "b1": P(None, "fsdp"), "w2": P(None, "fsdp")}
    params = {k: jax.device_put(a, NamedSharding(mesh, shard[k])) for k, a in params.items()}
    inputs, targets = (jax.device_put(a, NamedSharding(mesh, P("fsdp"))) for a in (inputs, targets))
    step = jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1)))
    flops = hlo_flops(step.lower(params, head, inputs, targets).compile())
    tokens = ROWS * SEQ  # one microbatch of the 8 on each device
    expected = 3 * (LAYERS * 2 * 2 * tokens * DIM * 2 * DIM + 2 * tokens * DIM * VOCAB)
    assert flops["matmul"] == flops["busiest"] == expected


def test_memory_1f1b_flat_gpipe_grows():
    temp = {}
    for kind in ("gpipe", "1f1b"):
        for m in (8, 16):
            compiled, *_ = compiled_step(MESHES[0], kind, m)
            temp[kind, m] = compiled.memory_analysis().temp_size_in_bytes
    # The input-gradient accumulator [M, microbatch/D, seq, dim] is the only M-sized buffer of 1F1B
    # (it is as large as the inputs and the input_grads output); the stash stays at P slots.
    input_grad_growth = 8 * (ROWS // 2) * SEQ * DIM * 4
    growth_1f1b = temp["1f1b", 16] - temp["1f1b", 8]
    growth_gpipe = temp["gpipe", 16] - temp["gpipe", 8]
    assert growth_1f1b <= input_grad_growth
    assert growth_gpipe > 4 * input_grad_growth
    assert temp["gpipe", 8] > temp["1f1b", 8]


def test_embed_fn_1f1b_flat_gpipe_grows():
    """With the embedding on stage 0 (token ids in) no 1F1B buffer scales with M; GPipe's activations do."""
    temp = {}
    for kind in ("gpipe", "1f1b"):
        for m in (4, 16):
            compiled, *_ = compiled_step(MESHES[0], kind, m, embed=True)
            temp[kind, m] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["1f1b", 16] <= 1.05 * temp["1f1b", 4], temp
    assert temp["gpipe", 16] > 2 * temp["gpipe", 4], temp
    # Still one reduction after the loop (loss, head, stages over data, embedding table), none per tick.
    ops = collectives(compiled_step(MESHES[0], "1f1b", 16, embed=True)[0].as_text())
    assert len([op for op, _ in ops if op == "all-reduce"]) <= 4


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: make_schedule("zigzag", 4, 8), "unknown pipeline schedule"),
        (lambda: make_schedule("1f1b", 4, 2), "at least as many microbatches"),
        (lambda: make_schedule("interleaved", 4, 2, 2), "at least as many microbatches"),
        (lambda: make_schedule("interleaved", 4, 6, 2), "divisible by stages"),
        (lambda: make_schedule("1f1b", 4, 8, 2), "needs kind='interleaved'"),
        (lambda: make_schedule("gpipe", 0, 8), "must all be >= 1"),
        (lambda: check_layers(8, 4, 3), "8 layers cannot be split into 4 stages x 3 virtual"),
        (lambda: to_microbatches(jnp.zeros((10, 2)), 4), "does not split into 4 microbatches"),
    ],
)
def test_schedule_errors(call, match):
    with pytest.raises(SpmdkitError, match=match):
        call()


def test_pipeline_argument_errors():
    mesh = make_mesh(MESHES[0])
    params, head = make_model()
    inputs, targets = make_batch(4)
    sched = make_schedule("1f1b", 4, 4)

    def run(fn=stage_fn, **overrides):
        kw = dict(stage_params=params, head_params=head, inputs=inputs, targets=targets, mesh=mesh, schedule=sched)
        kw.update(overrides)
        return pipeline_value_and_grad(fn, loss_fn, **kw)

    with pytest.raises(SpmdkitError, match="schedule has 2 stages but mesh axis pipeline=4"):
        run(schedule=make_schedule("1f1b", 2, 4))
    with pytest.raises(SpmdkitError, match="6 layers cannot be split"):
        run(stage_params=jax.tree.map(lambda a: a[:6], params))
    with pytest.raises(SpmdkitError, match="inputs must be"):
        run(inputs=inputs[:3])
    with pytest.raises(SpmdkitError, match="does not split over data"):
        run(inputs=jnp.zeros((4, 3, SEQ, DIM)))
    with pytest.raises(SpmdkitError, match="same shape and dtype"):
        run(fn=lambda p, x: x[..., :8])
    with pytest.raises(SpmdkitError, match="no axis 'stages'"):
        run(axis_name="stages")
    with pytest.raises(SpmdkitError, match="embed_params given without embed_fn"):
        run(embed_params=jnp.zeros((TOKENS, DIM)))
    tokens, table = make_tokens(4)
    with pytest.raises(SpmdkitError, match=r"embed_fn must map raw inputs int32\[2, 2\] to one array"):
        run(inputs=tokens, embed_fn=lambda e, t: (embed_fn(e, t),), embed_params=table)
