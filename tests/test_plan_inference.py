"""The inference planner (`spmdkit plan --inference`): decode reads the weights and the KV cache every step, so it is
memory-bound until batching amortises the weights; tensor parallelism cuts latency, batching buys throughput.
Its per-device bytes are checked against a compiled decode step in tests/test_generate.py."""

import json
import math

import pytest

from spmdkit.cli import main
from spmdkit.errors import SpmdkitError
from spmdkit.models.presets import model_preset
from spmdkit.plan.devices import DEVICES
from spmdkit.plan.inference import MEMORY_EFFICIENCY, compute_bound_batch, decode_estimate, weight_bytes

H100 = DEVICES["h100"]


def bf16(name):
    return model_preset(name).replace(dtype="bfloat16", param_dtype="bfloat16")


def test_decode_step_reads_the_weight_and_cache_shards():
    """70B on tensor=8: a step reads 1/8 of the bf16 weights and of the KV cache (8 KV heads over 8 devices)."""
    m = bf16("70b")
    e = decode_estimate(m, {"tensor": 8}, H100, batch=1, context=4096)
    norms = (2 * m.layers + 1) * m.embed  # RMSNorm scales: replicated
    assert e.weights_read == pytest.approx(((m.num_params() - norms) / 8 + norms) * 2)
    assert e.kv_read == 2 * 80 * 4096 * 8 * 128 * 2 / 8
    assert e.memory_s == pytest.approx((e.weights_read + e.kv_read) / (3.35e12 * MEMORY_EFFICIENCY))
    assert e.bound == "memory" and e.fits and e.comm_s > 0


def test_tensor_parallelism_buys_latency_and_batching_buys_throughput():
    m = bf16("7b")
    latency = [decode_estimate(m, {"tensor": t}, H100, batch=1, context=1024).step_s for t in (1, 2, 4, 8)]
    assert latency == sorted(latency, reverse=True) and latency[0] / latency[-1] > 4
    rows = [decode_estimate(m, {"tensor": 2}, H100, batch=b, context=1024) for b in (1, 8, 64)]
    assert rows[0].tokens_per_s < rows[1].tokens_per_s < rows[2].tokens_per_s
    assert rows[1].step_s < 2 * rows[0].step_s  # memory-bound: 8x the tokens for much less than 8x the time
    replicas = decode_estimate(m, {"data": 8}, H100, batch=8, context=1024)
    assert replicas.comm_s == 0 and replicas.step_s == pytest.approx(latency[0], rel=0.05)


def test_decode_turns_compute_bound_at_the_predicted_batch():
    m = bf16("1b")
    star = compute_bound_batch(m, {"tensor": 1}, H100, context=64)
    assert star is not None and 8 < star < 4096
    below = decode_estimate(m, {"tensor": 1}, H100, batch=int(star / 2), context=64)
    above = decode_estimate(m, {"tensor": 1}, H100, batch=math.ceil(star * 2), context=64)
    assert (below.bound, above.bound) == ("memory", "compute")
    # at long context the cache's reads grow as fast as the FLOPs: memory-bound at any batch
    assert compute_bound_batch(bf16("7b"), {"tensor": 1}, H100, context=4096) is None


def test_moe_decode_reads_only_the_routed_experts():
    m = bf16("mixtral-8x7b")
    one, many = weight_bytes(m, {"tensor": 8}, local_batch=1), weight_bytes(m, {"tensor": 8}, local_batch=64)
    assert one < 0.5 * many and many == pytest.approx(weight_bytes(m, {"tensor": 8}), rel=1e-6)


def test_plan_inference_command(capsys):
    assert main(["plan", "--inference", "--model", "7b", "--devices", "8", "--seq-len", "1024", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)["inference"]
    assert [r["mesh"] for r in reports] == ["data=8", "data=4,tensor=2", "data=2,tensor=4", "tensor=8"]
    assert all(row["fits"] for r in reports for row in r["by_batch"])
    assert main(["plan", "--inference", "--model", "70b", "--mesh", "tensor=8", "--batch-size", "16"]) == 0
    text = capsys.readouterr().out
    assert "mesh tensor=8" in text and "prefill of a 4096-token prompt" in text


def test_plan_inference_refuses_fsdp_and_a_device_without_bandwidth():
    with pytest.raises(SpmdkitError, match="all-gather every weight"):
        decode_estimate(bf16("7b"), {"fsdp": 8}, H100, batch=8, context=128)
    with pytest.raises(SpmdkitError, match="--hbm-gbs"):
        main_args = ["plan", "--inference", "--device-type", "custom", "--hbm-gb", "80", "--peak-tflops", "100"]
        from spmdkit.cli.plan import main as plan_main

        plan_main(main_args[1:] + ["--intra-node-gbs", "100", "--inter-node-gbs", "10", "--mesh", "tensor=8"])
