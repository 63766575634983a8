"""The benchmark driver: one compilation per strategy, the table's columns, and HLO traffic matching the planner."""

import dataclasses
import json

import jax
import pytest

from spmdkit.models import TransformerConfig
from spmdkit.tools import bench

TINY = TransformerConfig(dtype="float32", heads=8, kv_heads=8, head_dim=8)
SETUP = bench.Setup(TINY, batch_size=8, seq_len=32, steps=2, warmup=1)


def test_train_step_compiles_once_across_five_steps():
    """Five calls of the jitted step with same-shaped (different) batches: one XLA compilation, no retracing."""
    setup = bench.Setup(TINY.replace(layers=2), batch_size=8, seq_len=16, steps=4, warmup=1)
    built = bench.build("one_device", setup)
    step, batches, state = built["step"], built["batches"], built["state"].state
    assert len(batches) == 2 and batches[0]["inputs"].shape == batches[1]["inputs"].shape
    with bench.count_compiles() as compiles:
        for i in range(5):
            state, metrics = step(state, batches[i % 2])
            jax.block_until_ready(metrics)
            if i == 0:
                assert len(compiles) == 1  # the first call compiles...
    assert len(compiles) == 1  # ...and the next four reuse it
    assert step._cache_size() == 1


@pytest.fixture(scope="module")
def rows():
    return bench.benchmark(["dp", "fsdp"], SETUP, log=lambda _: None)


def test_smoke_run_fills_every_column(rows, tmp_path):
    assert [r["strategy"] for r in rows] == ["dp", "fsdp"]
    for row in rows:
        assert row["compiles"] == 1  # the timed steps never recompile
        assert row["step_ms_min"] <= row["step_ms"] <= row["step_ms_max"]
        assert row["tokens_per_s"] > 0 and row["tflops_per_device"] > 0
        assert row["mfu"] is None  # CPU: no known peak
        assert row["argument_bytes"] > 0 and row["hlo_collective_bytes"] > 0
    table = bench.markdown_table(rows)
    header = table.splitlines()[0]
    assert all(title in header for title, _ in bench.COLUMNS)
    assert len(table.splitlines()) == 2 + len(rows) and "n/a" in table  # MFU column
    md, js = bench.write_results(rows, {"model": "tiny", "platform": "cpu"}, tmp_path, "smoke")
    assert table in md.read_text()
    assert json.loads(js.read_text())["rows"][1]["strategy"] == "fsdp"


@pytest.mark.parametrize("index", [0, 1], ids=["dp", "fsdp"])
def test_hlo_traffic_matches_the_planner(rows, index):
    row = rows[index]
    assert 0.95 <= row["traffic_ratio"] <= 1.05, (row["hlo_by_opcode"], row["plan_by_opcode"])


def test_argument_bytes_match_the_planned_state(rows):
    """Arguments = parameters + AdamW state (as planned) + this device's share of the batch."""
    for row in rows:
        replicas = 8
        batch = 3 * SETUP.batch_size * SETUP.seq_len * 4 // replicas
        assert row["argument_bytes"] - batch == pytest.approx(row["plan_state_bytes"], rel=0.01)
    dp, fsdp = rows
    assert fsdp["argument_bytes"] < dp["argument_bytes"] / 7  # all but the norm scales sharded 8 ways


def test_attention_flag_picks_the_kernel_and_skips_meshes_that_cannot_run_it(rows):
    assert [row["attention"] for row in rows] == ["blockwise", "blockwise"]  # auto on CPU
    assert bench.kernel_for(SETUP, {"context": 4, "fsdp": 2}) == "ring"
    logs = []
    assert bench.benchmark(["cp"], dataclasses.replace(SETUP, attention="dot"), log=logs.append) == []
    assert logs == [
        "skip cp: --attention dot cannot split the sequence over context=4: the ring runs its own kernel; use "
        "--attention auto, or --context-parallel ulysses (the kernel per device), or drop context"
    ]


def test_strategies_fit_only_their_device_count():
    assert bench.fits("one_device", 1) and bench.fits("dp", 8) and bench.fits("pp", 8)
    assert not bench.fits("dp", 1) and not bench.fits("data_fsdp_tensor", 4)


def test_existing_xla_flags_win(monkeypatch):
    count = "--xla_force_host_platform_device_count"
    monkeypatch.setenv("XLA_FLAGS", f"{count}=4 --xla_gpu_pipeline_all_gather=default")
    bench.add_xla_flags((f"{count}=8", *bench.GPU_XLA_FLAGS))
    flags = bench.os.environ["XLA_FLAGS"].split()
    assert f"{count}=4" in flags and f"{count}=8" not in flags
    assert "--xla_gpu_pipeline_all_gather=default" in flags and "--xla_gpu_pipeline_all_gather=on" not in flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
