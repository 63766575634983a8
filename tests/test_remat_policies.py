"""Named remat policies (`spmdkit.models.remat`): every preset and custom list computes what `full` computes, the
planner's bytes per token and layer are what JAX's autodiff keeps (`spmdkit.plan.remat_cost`), its order is the
order of the compiled XLA:GPU step's temporaries (8 x H100, compile-only), and bad names are one line.

Numerics: loss and gradients of a float32 model with q/k norms and pre- and post-norms (so that every name is read
by the backward), one compile per policy. XLA:CPU lowers the move to pinned host as a no-op, so there an offload
policy keeps its names on the device and computes the same numbers; the host transfers are checked in the GPU
program.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from support import autodiff_kept_bytes, compile_in_parallel

from spmdkit.cli import main
from spmdkit.cli.train import parse_flags
from spmdkit.errors import SpmdkitError
from spmdkit.models import Transformer, TransformerConfig, model_preset
from spmdkit.models.remat import ACTIVATION_NAMES, PRESETS, parse_remat
from spmdkit.plan.estimate import REMAT_ORDER, estimate
from spmdkit.plan.memory import activation_bytes
from spmdkit.plan.remat_cost import host_kept_bytes
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.targets import target_devices
from spmdkit.targets.flags import gpu_compiler_options
from spmdkit.tools.gpu_compile import lower_train_step, memory_bytes, planner_estimate
from spmdkit.train.config import TrainConfig
from spmdkit.train.step.program import build_program
from spmdkit.train.step.state import create_train_state
from spmdkit.train.step.train_step import make_train_step, objective

CUSTOM = "save:q_proj,context,mlp_hidden+offload:out_proj,mlp_up"
GPU_FLAGS = "--model tiny --model.layers 16 --seq-len 512 --batch-size 16 --mesh fsdp=8"
GPU_POLICIES = ("none", "minimal", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj", "full")
CONFIG = TransformerConfig(dtype="float32", layers=2, qk_norm=True, post_norm=True, qkv_bias=True)
NAMED = [p for p in PRESETS if parse_remat(p).kind == "names"] + [CUSTOM]


def _batch(config: TransformerConfig, batch: int = 4, seq: int = 32) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq + 1)).astype(np.int32)
    positions = np.tile(np.arange(seq, dtype=np.int32), (batch, 1))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions}


@functools.cache
def loss_and_grads(remat: str, config: TransformerConfig = CONFIG) -> tuple[float, list[np.ndarray]]:
    """The objective and its gradients for one batch under `remat` (the same initial weights for every policy)."""
    graphdef, params, rest = nnx.split(Transformer(config.replace(remat=remat), rngs=nnx.Rngs(0)), nnx.Param, ...)
    batch = _batch(config)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: objective(nnx.merge(graphdef, p, rest), batch)[0]))(params)
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize("remat", [p for p in PRESETS if p != "full"] + [CUSTOM])
def test_every_policy_computes_the_loss_and_gradients_of_full(remat):
    loss, grads = loss_and_grads(remat)
    full_loss, full_grads = loss_and_grads("full")
    assert np.isfinite(loss) and loss == pytest.approx(full_loss, abs=1e-5)
    assert len(grads) == len(full_grads)
    for got, want in zip(grads, full_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_none_keeps_the_gemm_outputs_and_no_elementwise_intermediate():
    """`none` (#42) recomputes no matmul but keeps no elementwise result between them: of the MLP's [mlp]-wide
    arrays the gate and up projections only (autodiff alone keeps six: those, sigmoid(gate), its derivative,
    silu(gate), their product), and no float32 [embed] norm input. The layer scan stacks, and XLA zero-fills, one
    buffer per kept array; every [layers]-stacked residual with the batch dim (3) counts."""
    config = TransformerConfig(dtype="bfloat16", embed=128, layers=2, heads=8, kv_heads=2, head_dim=16, mlp=384)
    _, kept = autodiff_kept_bytes(config.replace(vocab_size=512, remat="none"), seq=64)
    wide = [x for x in kept if x.shape[-1] == 384]
    assert len(wide) == 2 and all(x.dtype == np.dtype("bfloat16") for x in wide), wide
    assert not [x for x in kept if x.shape[-1] == 128 and x.dtype == np.float32], kept


def test_a_mixture_of_experts_with_a_shared_expert_takes_a_named_policy():
    moe = TransformerConfig(dtype="float32", layers=2, experts=4, top_k=2, shared_expert=True, dispatch="dense")
    loss, grads = loss_and_grads("minimal", moe)
    full_loss, full_grads = loss_and_grads("full", moe)
    assert loss == pytest.approx(full_loss, abs=1e-5)
    for got, want in zip(grads, full_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_sharded_train_step_with_an_offload_policy_loses_what_full_loses():
    """fsdp=4,tensor=2 (the names split over tensor), 3 SGD steps: the same losses as full."""
    mesh, rules = make_mesh("fsdp=4,tensor=2"), make_rules(3)
    losses = {}
    for remat in ("full", "offload_qkv_proj", CUSTOM):
        optimizer = optax.apply_if_finite(optax.sgd(0.5), 2**30)  # the step reads its notfinite_count
        state = create_train_state(CONFIG.replace(remat=remat), optimizer, mesh, rules)
        step, current, losses[remat] = make_train_step(state, mesh, rules), state.state, []
        for _ in range(3):
            current, metrics = step(current, _batch(CONFIG, batch=8))
            losses[remat].append(float(metrics["loss"]))
    assert losses["full"][-1] < losses["full"][0]
    for remat in ("offload_qkv_proj", CUSTOM):
        np.testing.assert_allclose(losses[remat], losses["full"], atol=1e-5)


@pytest.mark.parametrize("remat", NAMED)
def test_planner_keeps_what_autodiff_saves_under_a_named_policy(remat):
    """The residuals of the step's vjp (shapes only) that carry the [layers] and batch dims, per token and layer:
    the planner's device bytes (`activation_bytes`) plus its host bytes (offloaded names)."""
    seq = 256
    config = TransformerConfig(
        dtype="bfloat16", embed=128, layers=2, heads=8, kv_heads=2, head_dim=16, mlp=384, vocab_size=512
    ).replace(remat=remat)
    kept, per_layer = autodiff_kept_bytes(config, seq=seq)
    device = activation_bytes(config, 1, False, 1, seq, "cpu")[0]
    assert kept == device + host_kept_bytes(config, 1, False), sorted(map(str, per_layer))
    assert (host_kept_bytes(config, 1, False) > 0) == bool(parse_remat(remat).offloaded)


def _plan(model: str, remat: str):
    return estimate(model_preset(model).replace(remat=remat), "fsdp=8", batch_size=16, seq_len=4096)


def test_the_search_order_recomputes_more_and_keeps_less_at_each_step():
    """On an H100 (cuDNN attention) for 1b and llama3-8b: compute time rises and activation bytes fall along
    REMAT_ORDER; an offload policy keeps fewer device bytes than saving the same names, at the same compute."""
    for model in ("1b", "llama3-8b"):
        rows = [_plan(model, r) for r in REMAT_ORDER]
        compute = [e.compute_s for e in rows]
        kept = [e.memory["activations"] for e in rows]
        assert compute == sorted(compute) and kept == sorted(kept, reverse=True), (model, compute, kept)
        assert kept[0] > kept[-1] and compute[0] < compute[-1]
    offloaded, saved = _plan("1b", "offload_qkv_proj"), _plan("1b", "save_qkv_proj")
    assert offloaded.memory["activations"] < saved.memory["activations"] and offloaded.host_bytes > 0
    assert saved.host_bytes == 0 and offloaded.compute_s == saved.compute_s


@pytest.fixture(scope="module")
def gpu_steps() -> dict[str, tuple[dict, str, object]]:
    """remat -> (XLA:GPU memory_bytes, the compiled HLO text, the planner's estimate) of `GPU_FLAGS`' train step
    compiled for 8 x H100: 16 layers of `tiny` at seq 512, so that the layers' residuals dominate the temporaries."""
    h100, remats = target_devices("h100", 8, 8), (*GPU_POLICIES, "offload_qkv_proj", CUSTOM)
    programs = [
        build_program(parse_flags(f"{GPU_FLAGS} --model.remat {remat}".split(), TrainConfig()), h100)
        for remat in remats
    ]
    compiled = compile_in_parallel([lower_train_step(p) for p in programs], gpu_compiler_options())
    return {
        remat: (memory_bytes(c), c.as_text(), planner_estimate(p, "h100"))
        for remat, p, c in zip(remats, programs, compiled, strict=True)
    }


def test_xla_gpu_temporaries_lie_between_none_and_full_in_the_planners_order(gpu_steps):
    temp = {r: gpu_steps[r][0]["temp"] for r in GPU_POLICIES}
    planned = {r: gpu_steps[r][2].total_memory for r in GPU_POLICIES}
    assert all(temp["full"] <= temp[r] <= temp["none"] for r in GPU_POLICIES), temp
    for p in GPU_POLICIES:  # the planner's order is XLA's; planner ties (minimal = none of them here) may go either way
        for q in GPU_POLICIES:
            if planned[p] < planned[q]:
                assert temp[p] < temp[q], (p, q, temp, planned)
    assert all(gpu_steps[r][0]["host_temp"] == 0 and "S(5)" not in gpu_steps[r][1] for r in GPU_POLICIES)


def test_xla_gpu_offloads_to_pinned_host_what_the_planner_counts_as_host_bytes(gpu_steps):
    for remat in ("offload_qkv_proj", CUSTOM):
        memory, text, plan = gpu_steps[remat]
        assert "S(5)" in text  # the pinned-host memory space of the offloaded residuals' buffers
        assert memory["host_temp"] == pytest.approx(plan.host_bytes, rel=0.01) and plan.host_bytes > 0
    assert gpu_steps["offload_qkv_proj"][0]["temp"] < gpu_steps["save_qkv_proj"][0]["temp"]


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("save:nosuch", "unknown activation name 'nosuch' in remat policy 'save:nosuch': the names are q_proj"),
        ("bogus", "unknown remat policy 'bogus': choose one of none, full"),
        ("save:", "unknown activation name '(none)'"),
        ("keep:q_proj", "unknown remat policy 'keep:q_proj'"),
        ("save:q_proj+offload:q_proj", "both saves and offloads q_proj"),
    ],
)
def test_a_bad_policy_is_one_line(value, fragment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpmdkitError, match="remat policy"):
        TransformerConfig(remat=value)
    assert main(["train", "--model.remat", value, "--steps", "1", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("spmdkit: error: ") and fragment in err, err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


def test_every_name_and_preset_parses_from_the_command_line():
    for value in (*PRESETS, CUSTOM, "offload:" + ",".join(ACTIVATION_NAMES)):
        config = parse_flags(["--model.remat", value], TrainConfig())
        assert config.model.build().remat == value
