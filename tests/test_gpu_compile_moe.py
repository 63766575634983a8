"""The experts' GEMMs of MoE train steps compiled for 8 x H100 by XLA:GPU on this machine without a GPU (#39):
with `--moe-dispatch auto` the expert matmuls execute the routed FLOPs (each token through its top_k experts)
times at most 1.3, counted from the compiled program's dots, forward, remat recompute and backward alike, and
`spmdkit compile` names how they compiled (`moe_gemm`) and which dispatch ran.

Tiny steps with experts over the whole node (`expert=8`, seq 128, remat full): a Mixtral-shaped one (8 experts,
top-2) and a GPT-OSS-shaped one (32 experts, top-4, router and expert biases, the clamped SwiGLU). Dropless there
would pad every expert to whole sequences (E / k = 4 and 8 x the routed FLOPs; `tests/test_gpu_compile.py` shows
its dense ragged_dot on one batch shard), so `auto` runs capacity 1.25. Both compile once, two at a time.
"""

import functools

import pytest
from support import in_parallel

from spmdkit.cli.train import parse_flags
from spmdkit.tools.gpu_compile import compile_for_target, format_report
from spmdkit.train.config import TrainConfig

STEP = "--seq-len 128 --batch-size 16 --mesh expert=8 --model.remat full --moe-dispatch auto"
GPT_OSS = (
    "--model.experts 32 --model.top-k 4 --model.moe-every 1 --model.router-bias True --model.expert-bias True "
    "--model.swiglu-limit 7.0"
)
SHAPES = {"mixtral": f"--model tiny-moe {STEP}", "gpt_oss": f"--model tiny-moe {GPT_OSS} {STEP}"}
# DeepSeek-V3's pieces on a tiny step: latent attention, sigmoid routing within groups, the correction bias moved by
# auxiliary-loss-free balancing, one multi-token-prediction module (an MoE block: its experts are not routed FLOPs
# of the main model's count)
DEEPSEEK = (
    "--model tiny-moe --model.kv-lora-rank 16 --model.kv-heads 8 --model.head-dim 16 --model.qk-rope-head-dim 8 "
    "--model.rope-interleave True --model.router-score sigmoid --model.router-groups 2 --model.router-top-groups 1 "
    f"--model.balance-rate 0.001 --model.mtp-depth 1 {STEP}"
)


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    shapes = {**SHAPES, "deepseek": DEEPSEEK}
    configs = {name: parse_flags(flags.split(), TrainConfig()) for name, flags in shapes.items()}
    done = in_parallel([functools.partial(compile_for_target, config, "h100") for config in configs.values()])
    return dict(zip(configs, done, strict=True))


@pytest.mark.parametrize("shape", SHAPES)
def test_auto_dispatch_executes_at_most_1_3_x_the_routed_expert_flops(reports, shape):
    report = reports[shape]
    gemm, model = report["moe_gemm"], parse_flags(SHAPES[shape].split(), TrainConfig()).model.build()
    assert gemm["dispatch"] == "capacity" and gemm["kind"] == "dense" and gemm["dense"] > 0, gemm
    assert gemm["dispatch_reason"].startswith("capacity 1.25: 1.25 x the routed FLOPs; dropless pads"), gemm
    # the routed FLOPs, from the model's shape: 6 E F k per token and MoE layer forward, run twice (full remat),
    # and 12 E F k backward; 16 x 128 tokens over 8 devices
    per_pass = 6 * model.embed * model.routed_mlp * model.top_k * model.moe_layers * 16 * 128 / 8
    assert gemm["remat_factor"] == 2 and gemm["recompute_flops"] > 0
    assert gemm["routed_flops"] == pytest.approx(4 * per_pass)
    assert gemm["ratio"] <= 1.3 and gemm["forward_ratio"] <= 1.3 and gemm["backward_ratio"] <= 1.3, gemm
    assert gemm["forward_flops"] + gemm["recompute_flops"] + gemm["backward_flops"] == gemm["flops"]
    text = format_report(report)
    assert f"MoE GEMMs    dense: {gemm['ratio']:.2f} x the routed FLOPs" in text and "run twice (remat)" in text
    assert report["fits"] and report["collectives"]["all-to-all"]["executions"] > 0


def test_a_deepseek_shaped_step_with_balancing_and_mtp_compiles_with_cudnn_and_fits(reports):
    """Latent attention runs cuDNN's fused kernel, the step fits, and the expert GEMMs stay at capacity's 1.25 x
    the routed FLOPs, the MTP module's MoE block counted among the routed blocks."""
    report = reports["deepseek"]
    assert report["fits"] and report["attention_kernel"] == "cudnn", report["attention_kernel"]
    assert report["moe_gemm"]["dispatch"] == "capacity" and report["moe_gemm"]["ratio"] <= 1.3
