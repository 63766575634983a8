"""The planner's LoRA (#40): `spmdkit plan --lora-rank` and the `Layout.lora` that `spmdkit compile` gives it. The
adapters' inventory, the state (the frozen base as stored; gradients and AdamW moments for the adapters only), a
quantized base as one more entry of `BASE_BYTES`, the search and its one-line refusals. No JAX, no compile: the
planner's LoRA bytes against XLA:GPU's are in tests/test_gpu_compile_lora.py (small) and the report of #40 (8B, 70B).
"""

import json
import math

import pytest

from spmdkit.cli.plan import main as plan_main
from spmdkit.errors import SpmdkitError
from spmdkit.models.lora_config import LoraConfig
from spmdkit.models.presets import model_preset
from spmdkit.plan.estimate import estimate
from spmdkit.plan.layout import adapters

LLAMA3_8B = model_preset("llama3-8b")  # 32 blocks, embed 4096, 32 heads and 8 kv heads of 128, mlp 14336


def adapter_count(rank: int, layers: int, embed: int, q: int, kv: int, mlp: int) -> int:
    """LoRA's parameters by hand: A [in, r] and B [r, out] of q, k, v, o, gate, up and down in every block."""
    pairs = [(embed, q), (embed, kv), (embed, kv), (q, embed), (embed, mlp), (embed, mlp), (mlp, embed)]
    return layers * rank * sum(i + o for i, o in pairs)


def test_the_adapters_are_an_a_and_b_beside_each_targeted_weight():
    found = {name: shape for name, shape, _ in adapters(LLAMA3_8B, LoraConfig(rank=16))}
    assert sum(math.prod(s) for s in found.values()) == adapter_count(16, 32, 4096, 4096, 1024, 14336)
    assert found["blocks.attention.o_lora_a"] == (32, 32, 128, 16)  # o contracts heads x head_dim
    assert found["blocks.attention.k_lora_b"] == (32, 16, 8, 128)
    assert found["blocks.mlp.down_lora_a"] == (32, 14336, 16)
    names = {name for name, _, _ in adapters(LLAMA3_8B, LoraConfig(rank=16, targets="q,v"))}
    assert names == {f"blocks.attention.{w}_lora_{x}" for w in "qv" for x in "ab"}


def test_only_the_adapters_have_gradients_and_moments():
    """8B on one device, remat full: the float32 base and adapters are the parameters; the adapters' float32
    gradient and two moments the rest of the state; none of the base's 2 x 32 GB of moments."""
    lora = LoraConfig(rank=16)
    adapters_n = adapter_count(16, 32, 4096, 4096, 1024, 14336)
    model = LLAMA3_8B.replace(remat="full")
    memory = estimate(model, "fsdp=1", batch_size=8, seq_len=4096, lora=lora).memory
    assert memory["parameters"] == pytest.approx(4 * (LLAMA3_8B.num_params() + adapters_n))
    assert memory["optimizer"] == pytest.approx(2 * 4 * adapters_n)
    assert memory["gradients"] == pytest.approx(4 * adapters_n)
    full = estimate(model, "fsdp=1", batch_size=8, seq_len=4096).memory
    assert full["optimizer"] == pytest.approx(2 * 4 * LLAMA3_8B.num_params())


def test_the_base_is_counted_as_stored():
    """bfloat16 parameters: a 2-byte base (and 2-byte adapters). QLoRA quantizes the blocks' seven projections
    only: int8 codes plus one float scale per output channel, nf4 codes at half a byte plus one scale per 64
    inputs; the embedding, norms and head stay float32. Counted by hand for llama3-8b (32 layers, E 4096,
    q/o 4096 x 4096, k/v 4096 x 1024, gate/up/down 4096 x 14336)."""
    n, adapters_n = LLAMA3_8B.num_params(), adapter_count(16, 32, 4096, 4096, 1024, 14336)
    bf16 = LLAMA3_8B.replace(param_dtype="bfloat16", remat="full")
    memory = estimate(bf16, "fsdp=1", batch_size=1, seq_len=4096, lora=LoraConfig(rank=16)).memory
    assert memory["parameters"] == pytest.approx(2 * (n + adapters_n))

    model = LLAMA3_8B.replace(remat="full")
    projections = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    out_channels = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)
    rest = 4 * (n - projections) + 4 * adapters_n
    expected = {"int8": projections + 4 * out_channels + rest, "nf4": projections * (0.5 + 4 / 64) + rest}
    for quantize, want in expected.items():
        lora = LoraConfig(rank=16, quantize=quantize)
        memory = estimate(model, "fsdp=1", batch_size=1, seq_len=4096, lora=lora).memory
        assert memory["parameters"] == pytest.approx(want), quantize


def test_a_lora_step_skips_the_frozen_weights_gradients():
    """The frozen matrices get no weight gradient: the compute is about 2/3 of a full fine-tune's under no remat
    (forward 2, input gradients 2 of the 6 FLOPs per weight and token; attention and the LM head's logits aside)."""
    model = LLAMA3_8B.replace(remat="none")
    full = estimate(model, "fsdp=8", batch_size=8, seq_len=4096)
    tuned = estimate(model, "fsdp=8", batch_size=8, seq_len=4096, lora=LoraConfig(rank=16))
    assert 0.6 < tuned.compute_s / full.compute_s < 0.75


def test_plan_lora_recommends_a_layout_for_70b_on_8_h100(capsys):
    plan_main("--model llama3-70b --devices 8 --lora-rank 16 --batch-size 16 --json".split())
    report = json.loads(capsys.readouterr().out)
    best = report["recommended"]
    assert best["fits"] and best["mesh"]["pipeline"] == 1
    assert best["memory"]["optimizer"] < 2e9  # the adapters' moments (the base's would be 70 GB per device)


@pytest.mark.parametrize(
    "args, message",
    [
        ("--model tiny-moe --lora-rank 4", "--lora-rank on a mixture-of-experts model is not supported yet"),
        ("--model tiny --lora-rank 4 --mesh pipeline=2,data=4", "--lora does not run with a pipeline axis"),
        ("--model tiny --lora-rank 4 --lora-targets q,qkv", "qkv is not a projection"),
        ("--model tiny --lora-rank 4 --inference", "--lora-rank plans training"),
    ],
)
def test_plan_lora_bad_input_is_one_line(args, message):
    with pytest.raises(SpmdkitError, match=message):
        plan_main(f"{args} --devices 8".split())
