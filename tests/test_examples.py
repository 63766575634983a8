"""Every script in examples/ runs and proves what it says: the collectives, the bytes, the one-device loss.

The examples run in this process (`runpy`), sharing the JAX that conftest started with 8 CPU devices; each
test asserts on the facts `main()` returns and checks that the example printed them.
"""

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    """(facts returned by examples/<name>.py's main(), what it printed)."""
    if str(EXAMPLES) not in sys.path:  # as `python examples/<name>.py` would: its `import common` finds common.py
        sys.path.insert(0, str(EXAMPLES))
    namespace = runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="example")
    facts = namespace["main"]()
    return facts, capsys.readouterr().out


def same(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * abs(b)


def test_every_example_is_tested_and_listed():
    tests = "".join(path.read_text() for path in Path(__file__).parent.glob("test_*.py"))
    readme = (EXAMPLES / "README.md").read_text()
    for script in sorted(p.stem for p in EXAMPLES.glob("*.py") if p.stem != "common"):  # common: shared helpers
        assert f'run_example("{script}"' in tests, (
            f"no test runs examples/{script}.py: add one to tests/test_examples.py"
        )
        assert f"python examples/{script}.py" in readme, f"examples/README.md does not list {script}.py"


def test_dp(capsys):
    facts, out = run_example("dp", capsys)
    assert set(facts["collectives"]) == {"all-reduce"}
    # one all-reduce of exactly the gradient bytes (fused into a few buffers) plus the float32 loss
    assert facts["gradient_bytes"] <= facts["all_reduce_bytes"] <= facts["gradient_bytes"] + 64
    assert facts["param_bytes_per_device"] == facts["gradient_bytes"]  # every device holds everything
    batch_bytes = 3 * 32 * 4  # inputs, targets, positions: one int32 [1, 32] row each
    assert facts["argument_bytes_per_device"] == facts["param_bytes_per_device"] + batch_bytes  # memory_analysis agrees
    assert same(facts["loss"], facts["one_device_loss"])
    assert f"{facts['all_reduce_bytes']:,}" in out and f"{facts['loss']:.6f}" in out


def test_fsdp(capsys):
    facts, out = run_example("fsdp", capsys)
    traffic = facts["collectives"]
    assert traffic["all-gather"]["executions"] > 0
    assert traffic["reduce-scatter"]["operand_bytes"] >= 0.99 * facts["param_bytes_total"]  # every gradient
    assert "all-to-all" not in traffic or traffic["all-to-all"]["executions"] == 0
    assert traffic["all-reduce"]["operand_bytes"] < 0.01 * facts["param_bytes_total"]  # only norms and the loss
    assert facts["param_bytes_per_device"] <= facts["param_bytes_total"] / 8 * 1.05
    assert facts["argument_bytes_per_device"] == facts["param_bytes_per_device"] + 3 * 32 * 4  # + the batch row
    assert same(facts["loss"], facts["one_device_loss"])
    assert "reduce-scatter" in out and f"{facts['param_bytes_per_device']:,} per device" in out


def test_zero1(capsys):
    facts, out = run_example("zero1", capsys)
    traffic, grads = facts["collectives"], facts["gradient_bytes"]
    assert facts["param_bytes_per_device"] == grads  # parameters whole on every device
    assert facts["optimizer_bytes_per_device"] <= facts["one_device_optimizer_bytes"] / 8 * 1.05
    # every gradient is summed across devices (mostly reduce-scattered: each device updates only its slice) ...
    assert traffic["reduce-scatter"]["operand_bytes"] + traffic["all-reduce"]["operand_bytes"] >= grads
    # ... and each device all-gathers its updated 1/8 of the parameters
    assert abs(traffic["all-gather"]["operand_bytes"] - grads / 8) <= 0.05 * grads / 8
    assert all(same(a, b) for a, b in zip(facts["losses"], facts["one_device_losses"], strict=True))
    assert facts["losses"][1] < facts["losses"][0]
    assert "all-gather" in out and f"{facts['optimizer_bytes_per_device']:,}" in out


def test_hsdp(capsys):
    facts, out = run_example("hsdp", capsys)
    assert facts["collectives"]["all-gather"]["executions"] > 0
    by_group = facts["bytes_by_group"]
    # gradients: reduce-scattered inside a group of 4, then only those quarters all-reduced across the 2 replicas
    assert [k for k in by_group if k.startswith("reduce-scatter")] == ["reduce-scatter x4"]
    assert by_group["all-reduce x2"] == pytest.approx(by_group["reduce-scatter x4"] / 4, rel=0.01)
    assert (
        abs(facts["param_bytes_per_device"] - facts["param_bytes_total"] / 4) <= 0.05 * facts["param_bytes_total"] / 4
    )
    assert same(facts["loss"], facts["one_device_loss"])
    assert "all-gather" in out and f"{facts['loss']:.6f}" in out


def test_tp_sp(capsys):
    facts, out = run_example("tp_sp", capsys)
    tp, sp, layers = facts["tp_collectives"], facts["sp_collectives"], facts["layers"]
    assert set(tp) == {"all-reduce"} and tp["all-reduce"]["executions"] >= 2 * layers  # attention + MLP per layer
    # SP: each block's all-reduce becomes a reduce-scatter and an all-gather; only the loss's scalars are all-reduced
    assert sp["reduce-scatter"]["executions"] >= 2 * layers and sp["all-gather"]["executions"] >= 2 * layers
    assert sp["all-reduce"]["operand_bytes"] < 0.02 * tp["all-reduce"]["operand_bytes"]
    assert facts["param_bytes_per_device"] <= facts["param_bytes_total"] / 8 * 1.05
    assert same(facts["tp_loss"], facts["one_device_loss"]) and same(facts["sp_loss"], facts["one_device_loss"])
    assert "TP + SP forward" in out and "reduce-scatter" in out


def test_context_ring_attention(capsys):
    facts, out = run_example("context_ring_attention", capsys)
    assert facts["collectives"]["collective-permute"]["executions"] > 0
    assert facts["all_gather_group_sizes"] == [8]  # parameter gathers over fsdp x context only: K/V never gathered
    assert facts["argument_bytes_per_device"] == facts["param_bytes_per_device"] + 3 * 4 * 8 * 4  # + [4, 8] int32 x 3
    assert same(facts["loss"], facts["one_device_loss"])
    assert "collective-permute" in out and f"{facts['loss']:.6f}" in out


def test_context_ulysses(capsys):
    facts, out = run_example("context_ulysses", capsys)
    exchanges = facts["collectives"]["all-to-all"]
    assert exchanges["executions"] == 8 * 2 and "collective-permute" not in facts["collectives"]  # 2 layers
    assert facts["all_to_all_operand_bytes"] == sorted({facts["q_bytes"], facts["kv_bytes"]})
    assert same(facts["loss"], facts["one_device_loss"])
    assert "all-to-all" in out and f"{facts['loss']:.6f}" in out


def test_pipeline_1f1b(capsys):
    facts, out = run_example("pipeline_1f1b", capsys)
    assert set(facts["collectives"]) <= {"collective-permute", "all-reduce"}  # all-reduce: grads after the loop
    assert facts["permute_operand_bytes"] == [facts["activation_bytes"]]
    assert facts["bubble"] == pytest.approx(3 / 11)
    assert same(facts["loss"], facts["one_device_loss"]) and facts["grad_error"] < 1e-5
    assert "stage 3:" in out and "collective-permute" in out


def test_bring_your_own_model(capsys):
    facts, out = run_example("bring_your_own_model", capsys)
    assert facts["specs"] == {"w_in": "('fsdp', 'tensor')", "w_out": "('tensor', 'fsdp')"}
    assert facts["param_bytes_per_device"] == facts["param_bytes_total"] // 8
    assert facts["collectives"]["all-gather"]["executions"] > 0 and facts["collectives"]["all-reduce"]["executions"] > 0
    assert same(facts["loss"], facts["one_device_loss"])
    assert "w_in" in out and f"{facts['loss']:.6f}" in out


def test_expert_parallel(capsys):
    facts, out = run_example("expert_parallel", capsys)
    assert facts["all_to_all"] == 2 * facts["moe_layers"]  # to the experts' devices and back, per MoE layer
    assert facts["expert_weight_fraction_per_device"] == pytest.approx(0.25)  # 2 of 8 experts on each device
    assert same(facts["loss"], facts["dense_loss"])
    assert same(facts["load_balance_loss"], facts["dense_load_balance_loss"])
    assert sum(facts["expert_load"]) == pytest.approx(1.0, abs=1e-3)
    assert "all-to-all" in out and f"{facts['loss']:.6f}" in out
