"""The layout planner: textbook figures, agreement with the code it restates, and the compiler's own numbers.

The compiler proof compiles the real train step of six strategies on the 8 simulated CPU devices (once each,
module cache) and holds the planner's per-device state bytes and collective operand bytes to within 10% of
`compiled.memory_analysis()` and `collective_report(compiled)`.
"""

import functools
import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest
from support import autodiff_kept_bytes

from spmdkit.cli.plan import main as plan_main
from spmdkit.errors import SpmdkitError
from spmdkit.models.config import TransformerConfig
from spmdkit.models.presets import PRESETS
from spmdkit.plan.devices import AXES, DEVICES, device_for_kind, make_device, parse_mesh
from spmdkit.plan.estimate import estimate
from spmdkit.plan.layout import parameters, sharded
from spmdkit.sharding.strategy import Strategy
from spmdkit.tools.strategies import STRATEGIES

CONFIG = TransformerConfig(dtype="float32", heads=8, kv_heads=8, head_dim=8)
MOE_CONFIG = PRESETS["tiny-moe"].replace(dtype="float32")  # 4 layers: 2 dense, 2 MoE of 8 experts (top 2)
BATCH, SEQ = 8, 32
# the layouts of the compiler proof ("cp": the K/V ring's collective-permutes; "ep": MoE (MOE_CONFIG), all-to-alls
# of the dispatch buffers)
COMPILED = ["dp", "fsdp", "zero1", "tp", "tp_sp", "data_fsdp_tensor", "cp", "ep"]


# --- textbook figures, computed here from first principles ---------------------------------------------------


def _state_per_param(model: TransformerConfig) -> float:
    """Parameters + gradients + optimizer bytes per parameter the planner gives one unsharded device, less the
    chunked loss's float32 accumulator of the LM head's gradient [embed, vocab], which the gradients hold at the
    step's peak (the loss phase of a short sequence) beside the head's own gradient."""
    e = estimate(model, {}, device="h100", batch_size=1, seq_len=128)
    state = e.memory["parameters"] + e.memory["gradients"] + e.memory["optimizer"]
    return (state - 4 * model.embed * model.vocab_size) / model.num_params()


def test_mixed_precision_adam_is_16_bytes_per_parameter():
    # float32 master weights (4) + float32 gradients (4) + AdamW's two float32 moments (8) = 16 bytes/parameter
    assert _state_per_param(PRESETS["70b"]) == pytest.approx(4 + 4 + 2 * 4)
    seventy = 16 * PRESETS["70b"].num_params()
    seven = 16 * PRESETS["7b"].num_params()
    assert seventy == pytest.approx(16 * 70e9, rel=0.01)  # 1.12 TB
    assert 16 * 70e9 == pytest.approx(1.12e12) and 16 * 7e9 == pytest.approx(112e9)
    assert seven == pytest.approx(112e9, rel=0.04)  # the 7b preset has 6.74B parameters
    assert estimate("7b", {}, batch_size=1, seq_len=128).state_bytes == pytest.approx(12 * PRESETS["7b"].num_params())


def test_pipeline_bubble_p4_m8_is_27_percent():
    e = estimate(PRESETS["7b"], Strategy("pipeline=4,fsdp=2", microbatches=8), batch_size=16)
    assert e.bubble == pytest.approx(3 / 11)  # (P-1)/(M+P-1)
    assert round(100 * e.bubble, 1) == 27.3
    interleaved = estimate(
        PRESETS["7b"],
        Strategy("pipeline=4,fsdp=2", microbatches=8, schedule="interleaved", virtual_stages=2),
        batch_size=16,
    )
    assert interleaved.bubble == pytest.approx(3 / 19)  # (P-1)/(vM+P-1)


def test_llama3_405b_like_fits_on_16k_h100s_with_tp8_pp16():
    model = PRESETS["405b"].replace(layers=128, remat="full")  # 405B-like: 128 layers so PP=16 divides them
    layout = Strategy("fsdp=128,pipeline=16,tensor=8", zero=1, sequence_parallel=True)
    e = estimate(model, layout, device="h100", batch_size=2048, seq_len=8192)
    E, H, K, d, F, V = model.embed, model.heads, model.kv_heads, model.head_dim, model.mlp, model.vocab_size
    per_layer = E * d * (2 * H + 2 * K) + 3 * E * F + 2 * E
    # layers split over pipeline and tensor (norms only over pipeline), embedding and head over tensor only
    layers = model.layers * (per_layer - 2 * E) / (16 * 8) + model.layers * 2 * E / 16
    assert e.memory["parameters"] == pytest.approx(4 * (layers + 2 * V * E / 8 + E), rel=1e-6)
    assert e.memory["optimizer"] == pytest.approx(2 * e.memory["parameters"] / 128, rel=0.01)  # ZeRO-1 over 128
    assert e.fits and e.total_memory < 80e9
    assert 0 < e.mfu < 1 and e.bubble == pytest.approx(15 / (16 + 15))


# --- what the planner restates from the code --------------------------------------------------------------


def test_mesh_axes_and_parsing_agree_with_the_mesh_module():
    from spmdkit.sharding.mesh import AXES as MESH_AXES
    from spmdkit.sharding.mesh import MeshConfig

    assert AXES == MESH_AXES
    for text, devices in [("data=2,fsdp=2,tensor=2", 8), ("tensor=4,fsdp=-1", 16), ("pipeline=2", 2)]:
        assert parse_mesh(text, devices) == MeshConfig.parse(text).resolve(devices)
    for bad in ["data=2,data=2", "tensr=2", "data=x", "data=3"]:
        with pytest.raises(SpmdkitError):
            parse_mesh(bad, 8)


BIASED_TIED = CONFIG.replace(qkv_bias=True, o_bias=True, mlp_bias=True, tie_embeddings=True)


GEMMA_LIKE = CONFIG.replace(post_norm=True, norm_plus_one=True, qk_norm=True, sliding_window=8, window_pattern="LG")
OLMO_LIKE = CONFIG.replace(pre_norm=False, post_norm=True, qk_norm=True, qk_norm_scope="layer")
QWEN2_MOE_LIKE = MOE_CONFIG.replace(shared_expert=True, shared_expert_gate=True, expert_mlp=48, shared_expert_mlp=80)


@pytest.mark.parametrize(
    "config",
    [CONFIG, MOE_CONFIG.replace(shared_expert=True), BIASED_TIED, GEMMA_LIKE, OLMO_LIKE, QWEN2_MOE_LIKE],
    ids=["dense", "moe", "biased-tied", "gemma-like", "olmo-like", "qwen2-moe-like"],
)
def test_parameter_inventory_matches_the_model(config):
    from flax import nnx

    from spmdkit.models import Transformer
    from spmdkit.sharding.partition import abstract_state

    _, state = abstract_state(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    real = {}
    for path, variable in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in (path[:-1] if path[-1] == "scale" else path))  # norms hold a `scale`
        real[name] = (tuple(variable.get_value().shape), tuple(variable.out_sharding))
    assert {name: (shape, names) for name, shape, names in parameters(config)} == real
    assert 4 * config.num_params() == sum(s.nbytes for s in sharded(config, tuple(parse_mesh("").items()), 3))


def test_peak_flops_come_from_the_device_table():
    assert device_for_kind("NVIDIA H100 80GB HBM3") is DEVICES["h100"]
    assert device_for_kind("TPU v5 lite") is DEVICES["tpu-v5e"] and device_for_kind("TPU v5p") is DEVICES["tpu-v5p"]
    assert device_for_kind("cpu") is None  # MFU on a CPU is unknown


def test_planner_imports_neither_jax_nor_matplotlib():
    # The whole `spmdkit plan` path: every command's parser and the planner (numpy: the pipeline's schedule tables).
    code = (
        "import sys, spmdkit.cli, spmdkit.cli.plan; spmdkit.cli.usage(); spmdkit.cli.plan.parse(['--devices', '8']); "
        "heavy = {m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'optax', 'orbax', 'grain', 'matplotlib'}; "
        "print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_user_errors_are_one_line_spmdkit_errors():
    for kwargs in [
        {"mesh": "tensor=3"},  # heads=8 not divisible by 3
        {"mesh": "pipeline=3"},  # 4 layers do not split into 3 stages
        {"mesh": "data=8", "batch_size": 4},
        {"mesh": Strategy("data=8", zero=5)},
        {"mesh": "expert=2"},  # expert parallelism of a dense model
        {"mesh": Strategy("pipeline=2", schedule="zigzag")},
        {"mesh": "expert=2,pipeline=2", "model": MOE_CONFIG},  # spmdkit's pipeline runs dense blocks only
        {"mesh": "expert=3", "model": MOE_CONFIG},  # 8 experts
        {"mesh": "expert=2", "model": MOE_CONFIG.replace(dispatch="dense")},
        {"mesh": "expert=4,data=2", "model": MOE_CONFIG, "batch_size": 4},  # the batch splits over expert too
    ]:
        mesh, model = kwargs.pop("mesh"), kwargs.pop("model", CONFIG)
        with pytest.raises(SpmdkitError) as info:
            estimate(model, mesh, **kwargs)
        assert "\n" not in str(info.value)
    with pytest.raises(SpmdkitError):
        make_device("tpu-v9")
    with pytest.raises(SpmdkitError):
        make_device("custom", hbm_gb=80)
    assert make_device("custom", hbm_gb=80, peak_tflops=100, intra_node_gbs=100, inter_node_gbs=10).hbm_bytes == 80e9


# --- the compiler's numbers ---------------------------------------------------------------------------------


def _config(mesh_text: str) -> TransformerConfig:
    if "expert" in mesh_text:
        return MOE_CONFIG
    return CONFIG.replace(attention="ring") if "context" in mesh_text else CONFIG


@functools.cache
def compiled_step(name):
    """The compiled train step of strategy `name` on the 8 simulated devices, from abstract (unallocated) state."""
    from flax import nnx

    from spmdkit.models import Transformer
    from spmdkit.sharding.mesh import make_mesh
    from spmdkit.sharding.partition import abstract_state, state_shardings
    from spmdkit.sharding.rules import make_rules
    from spmdkit.train.step.optimizer import OptimizerConfig, make_optimizer
    from spmdkit.train.step.state import TrainState, train_state_shardings
    from spmdkit.train.step.train_step import batch_shardings, make_train_step

    strategy = STRATEGIES[name]
    mesh, rules = make_mesh(strategy.mesh), make_rules(strategy.zero, strategy.sequence_parallel)
    tx = make_optimizer(OptimizerConfig(warmup_steps=1), 3)

    def make():
        model = Transformer(_config(strategy.mesh), rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef, abstract = abstract_state(make)
    shardings = train_state_shardings(abstract, mesh, rules)
    params = nnx.state(nnx.merge(graphdef, abstract)[0], nnx.Param)
    grad_shardings = state_shardings(params, mesh, rules.optimizer if rules.gradients_like_optimizer else rules.params)
    leaves, treedef = jax.tree.flatten(abstract)
    specs = jax.tree.unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True)
        ],
    )
    step = make_train_step(TrainState(graphdef, specs, shardings, grad_shardings), mesh, rules)
    batch = {
        k: jax.ShapeDtypeStruct((BATCH, SEQ), np.int32, sharding=s) for k, s in batch_shardings(mesh, rules).items()
    }
    # The backend (LLVM) optimisation level does not change the HLO passes or the buffers; it halves compile time.
    options = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    return step.lower(specs, batch).compile(compiler_options=options), mesh


def test_mixtral_is_46_7b_parameters_12_9b_active():
    mixtral = PRESETS["mixtral-8x7b"]
    assert mixtral.moe_layers == 32
    assert mixtral.num_params() == pytest.approx(46.7e9, rel=0.002)
    assert mixtral.num_params(active=True) == pytest.approx(12.9e9, rel=0.002)
    # 16 bytes per parameter (float32 weights, gradients, two AdamW moments): 747 GB of training state
    assert _state_per_param(mixtral) == pytest.approx(4 + 4 + 2 * 4)


def test_moe_padding_costs_flops_and_dispatch_buffers_cost_memory():
    # Dropless under EP pads every expert to the whole sequence (E x S slots instead of top_k x S tokens).
    capacity_, dropless = (
        estimate(PRESETS["mixtral-8x7b"].replace(dispatch=d), "fsdp=8,expert=8", batch_size=64, seq_len=4096)
        for d in ("capacity", "dropless")
    )
    assert dropless.compute_s > 1.5 * capacity_.compute_s and dropless.mfu < capacity_.mfu
    assert dropless.collective_bytes["all-to-all"] == pytest.approx(8 / 2.5 * capacity_.collective_bytes["all-to-all"])
    assert dropless.memory["activations"] > capacity_.memory["activations"]


@pytest.mark.parametrize("name", COMPILED)
def test_planner_matches_the_compiled_step(name):
    from spmdkit.inspect.hlo import collective_report

    compiled, mesh = compiled_step(name)
    strategy = STRATEGIES[name]
    planned = estimate(_config(strategy.mesh), strategy, device="cpu", batch_size=BATCH, seq_len=SEQ)
    # inputs, targets, positions: int32 [batch, seq], batch over data x fsdp, sequence over context
    batch_bytes = 3 * BATCH * SEQ * 4 // (mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["context"])
    state = compiled.memory_analysis().argument_size_in_bytes - batch_bytes
    traffic = collective_report(compiled).bytes()
    assert planned.state_bytes == pytest.approx(state, rel=0.10), f"{name}: state {planned.state_bytes} vs {state}"
    predicted = sum(planned.collective_bytes.values())
    assert predicted == pytest.approx(traffic, rel=0.10), f"{name}: collectives {predicted} vs {traffic}"


def test_planner_predicts_the_all_to_alls_of_expert_parallelism():
    """tiny-moe on expert=4,data=2: per MoE layer 4 all-to-alls (dispatch and return, forward and backward) of the
    dispatch buffer [B/(D X), E, C, embed] = [1, 8, ceil(1.25 x 32 x 2 / 8) = 10, 64] float32 = 20,480 bytes."""
    from spmdkit.inspect.hlo import collective_report

    compiled, _ = compiled_step("ep")
    report = collective_report(compiled)
    planned = estimate(MOE_CONFIG, "expert=4,data=2", device="cpu", batch_size=BATCH, seq_len=SEQ)
    assert report.count("all-to-all", executed=True) == 4 * MOE_CONFIG.moe_layers
    assert planned.collective_bytes["all-to-all"] == 4 * MOE_CONFIG.moe_layers * 1 * 8 * 10 * 64 * 4
    assert planned.collective_bytes["all-to-all"] == pytest.approx(report.bytes("all-to-all"), rel=0.02)
    # The expert weights' gradients are reduced over data (2) only, not over expert. The other weights' state is
    # sharded over expert like fsdp (ZeRO-3): their gradients are reduce-scattered over expert (4), their shards
    # summed over data (2), and the weights gathered over expert.
    expert_grads = 3 * 4 * MOE_CONFIG.moe_layers * 2 * MOE_CONFIG.embed * MOE_CONFIG.mlp  # 2 of 8 experts here
    found: dict[tuple[str, int], int] = {}
    for c in report.collectives:
        found[c.opcode, c.group_size] = found.get((c.opcode, c.group_size), 0) + c.operand_bytes * c.executions
    assert found["all-reduce", 2] > expert_grads and found["reduce-scatter", 4] > 0 and found["all-gather", 4] > 0
    reductions = planned.collective_bytes["all-reduce"] + planned.collective_bytes["reduce-scatter"]
    assert reductions == pytest.approx(report.bytes("all-reduce") + report.bytes("reduce-scatter"), rel=0.05)


# --- the command ---------------------------------------------------------------------------------------------


def _plan(*argv: str) -> int:
    return plan_main(argv)


def test_plan_recommends_a_fitting_layout_for_70b_on_64_h100(capsys):
    assert _plan("--model", "70b", "--devices", "64", "--device-type", "h100", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    best = out["recommended"]
    assert best["fits"] and math.prod(best["mesh"].values()) == 64
    assert best["mesh"]["tensor"] <= 8 and out["explanation"]  # tensor parallelism never leaves a node
    assert [c["step_s"] for c in out["candidates"]] == sorted(c["step_s"] for c in out["candidates"])


def test_plan_with_a_mesh_prints_details_and_plots(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert _plan("--model", "7b", "--devices", "8", "--mesh", "fsdp=8", "--zero", "3", "--plot", str(png)) == 0
    out = capsys.readouterr().out
    assert "fsdp=8" in out and "activations" in out and "reduce-scatter" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SpmdkitError):
        _plan("--model", "7b", "--devices", "8", "--mesh", "fsdp=4")
    with pytest.raises(SpmdkitError):
        _plan("--model", "405b", "--devices", "8")  # nothing fits


def test_plan_recommends_expert_parallelism_for_mixtral_on_64_h100(capsys):
    assert _plan("--model", "mixtral-8x7b", "--devices", "64", "--device-type", "h100", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    best = out["recommended"]
    assert best["fits"] and math.prod(best["mesh"].values()) == 64
    assert best["mesh"]["expert"] > 1 and 8 % best["mesh"]["expert"] == 0 and best["mesh"]["pipeline"] == 1
    assert best["mesh"]["expert"] * best["mesh"]["tensor"] <= 8  # EP inside a node: the all-to-alls on NVLink
    assert best["traffic"]["expert"]["link"] == "nvlink" and best["collective_bytes"]["all-to-all"] > 0
    assert "Expert parallelism over" in out["explanation"] and "all-to-all" in out["explanation"]


def test_spmdkit_plan_command_answers():
    cmd = [sys.executable, "-m", "spmdkit", "plan", "--model", "70b", "--devices", "64", "--device-type", "h100"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "recommended: " in out.stdout and "tensor=" in out.stdout


@pytest.mark.parametrize("remat", ["none", "dots_saveable", "dots_with_no_batch_dims_saveable", "full"])
def test_planner_keeps_what_autodiff_saves_per_layer_and_token(remat):
    """The residuals the planner counts per token and layer (`activation_bytes`: for remat none the norms' float32
    inputs and x/rms(x), six [mlp] arrays, ...) are those JAX's autodiff saves for the scanned blocks of a bfloat16
    model: the residuals of the step's vjp (shapes only, nothing runs) that carry the [layers] and batch dims. On
    CPU the kernel is the blockwise one, whose block scores dots_saveable keeps."""
    from spmdkit.plan.memory import activation_bytes

    seq = 256
    config = TransformerConfig(dtype="bfloat16", embed=128, layers=2, heads=8, kv_heads=2, head_dim=16, mlp=384)
    config = config.replace(vocab_size=512, remat=remat)
    kept, per_layer = autodiff_kept_bytes(config, seq=seq)
    assert kept == activation_bytes(config, 1, False, 1, seq, "cpu")[0], sorted(map(str, per_layer))
