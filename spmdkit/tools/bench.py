"""Benchmark every parallelism strategy: speed, per-device memory, and collective traffic against the planner.

For each strategy whose mesh fits the devices present: build the sharded train state, compile the train step once
(timed, ahead of time), warm up, time N steps (`jax.block_until_ready` on each), and read the compiled program:
`memory_analysis()` (argument and temp bytes per device) and the HLO collectives (`collective_report`), which are
set next to `spmdkit.plan.estimate`'s predicted bytes for the same layout. Results go to a Markdown table and JSON.

`configure_platform()` must run before JAX computes anything (it may run after `import jax`): 8 simulated CPU
devices when no GPU is present; the latency-hiding scheduler and collective-combine thresholds in XLA_FLAGS on GPU
(XLA reads them when the backend starts). `scripts/benchmark.py` and `spmdkit bench` both call it first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from spmdkit.data.sources import SyntheticSource
from spmdkit.distributed.initialize import FORCED_COUNT
from spmdkit.distributed.platform import gpu_present
from spmdkit.errors import SpmdkitError
from spmdkit.inspect.hlo import collective_report
from spmdkit.models.attention_choice import choose_attention
from spmdkit.models.config import TransformerConfig
from spmdkit.models.presets import model_preset
from spmdkit.parallel.context.zigzag import zigzag_batch
from spmdkit.plan.devices import DEVICES, device_for_kind
from spmdkit.plan.estimate import estimate
from spmdkit.plan.limits import check_sizes
from spmdkit.rundir.ownership import check_output
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.mesh_config import MeshConfig, format_sizes
from spmdkit.sharding.rules import make_rules
from spmdkit.sharding.strategy import mesh_text
from spmdkit.targets.device_facts import compute_capability, device_platform
from spmdkit.targets.flags import GPU_XLA_FLAGS, add_xla_flags
from spmdkit.tools.strategies import STRATEGIES as TABLE
from spmdkit.tools.strategies import Strategy
from spmdkit.train.config import OptimizerConfig
from spmdkit.train.reporting.metrics import peak_flops, throughput
from spmdkit.train.step.optimizer import make_optimizer
from spmdkit.train.step.pipeline import pipeline_schedule
from spmdkit.train.step.state import create_train_state
from spmdkit.train.step.train_step import batch_shardings, make_train_step

# The strategies `spmdkit bench` runs (from the one table, `spmdkit.tools.strategies`): "one_device" runs on the
# first device alone, "pp" is 1F1B over --microbatches, under "ep" every MLP is an 8-expert top-2 MoE.
STRATEGIES: dict[str, Strategy] = {
    name: TABLE[name]
    for name in ("one_device", "dp", "fsdp", "zero1", "tp", "tp_sp", "data_fsdp_tensor", "cp", "pp", "ep", "fsdp_tp")
}
DEFAULT_STRATEGIES = [s for s in STRATEGIES if s != "fsdp_tp"]
PEER_STRATEGIES = ["fsdp", "fsdp_tp"]
CPU_DEVICES = 8


def configure_platform() -> str:
    """The GPU flags on a GPU host, else `CPU_DEVICES` simulated CPU devices (unless XLA_FLAGS already forces a
    count); returns "gpu" or "cpu". When JAX's backend is already running it is too late: report what it has."""
    if gpu_present():
        add_xla_flags(GPU_XLA_FLAGS)
        return "gpu"
    try:
        jax.config.update("jax_platforms", "cpu")
        if not FORCED_COUNT.search(os.environ.get("XLA_FLAGS", "")):
            jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
    except RuntimeError:  # the backend already started (e.g. in a test session)
        return jax.default_backend()
    return "cpu"


@contextlib.contextmanager
def count_compiles() -> Iterator[list[float]]:
    """Collect the duration of every XLA backend compilation that happens inside the block."""
    durations: list[float] = []

    def listener(event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            durations.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield durations
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every strategy of one run shares."""

    model: Any  # TransformerConfig
    batch_size: int  # global, in sequences
    seq_len: int
    steps: int = 10
    warmup: int = 2
    microbatches: int = 8  # pipeline microbatches (PP only)
    device: str = "cpu"  # planner device name, for the predicted traffic and memory
    attention: str = "auto"  # the model's attention setting (auto, dot, blockwise, cudnn, ring)


def _batches(setup: Setup, context: int, count: int) -> list[dict]:
    """`count` synthetic batches (uniform tokens, `spmdkit.data.sources.SyntheticSource`), zigzagged over `context`
    for ring attention (1: natural order)."""
    out = []
    for k in range(count):
        src = SyntheticSource(setup.batch_size, setup.seq_len, setup.model.vocab_size, seed=0, stream=k)
        tokens = np.stack([src[i] for i in range(setup.batch_size)])
        positions = np.broadcast_to(np.arange(setup.seq_len, dtype=np.int32), (setup.batch_size, setup.seq_len))
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.ascontiguousarray(positions)}
        out.append(zigzag_batch(batch, context) if context > 1 else batch)
    return out


def build(name: str, setup: Setup) -> dict[str, Any]:
    """Mesh, rules, train state, jitted step and device batches of strategy `name` (nothing compiled yet)."""
    strategy = STRATEGIES[name]
    mesh = make_mesh(strategy.mesh, jax.devices()[:1]) if name == "one_device" else make_mesh(strategy.mesh)
    rules = make_rules(strategy.zero, strategy.sequence_parallel)
    context = mesh.shape["context"]
    model = model_for(setup, mesh.shape).replace(attention=kernel_for(setup, mesh.shape))  # the one choice
    pipelined = mesh.shape["pipeline"] > 1
    schedule = pipeline_schedule("1f1b", mesh, setup.microbatches, 1, model.layers) if pipelined else None
    tx = make_optimizer(OptimizerConfig(warmup_steps=1), setup.warmup + setup.steps)
    state = create_train_state(model, tx, mesh, rules)
    step = make_train_step(state, mesh, rules, pipeline=schedule)
    shardings = batch_shardings(mesh, rules)
    host = _batches(setup, context if model.attention == "ring" else 1, min(2, setup.steps + setup.warmup))
    batches = [{k: jax.device_put(v, shardings[k]) for k, v in b.items()} for b in host]
    return {"mesh": mesh, "rules": rules, "state": state, "step": step, "batches": batches, "model": model}


def model_for(setup: Setup, sizes: Any) -> Any:
    """The benchmark model on a mesh, with the setup's attention setting ("auto": ring attention under context > 1);
    under expert > 1 every MLP becomes 8 experts of the same width, top-2 (so a token's FLOPs double, and the MFU
    counts only those)."""
    model = setup.model.replace(attention=setup.attention)
    return model.replace(experts=8, top_k=2, moe_every=1) if sizes.get("expert", 1) > 1 else model


def kernel_for(setup: Setup, sizes: Any) -> str:
    """The attention kernel the strategy runs (SpmdkitError when the setup's choice cannot run on its mesh)."""
    model = model_for(setup, sizes)
    device = jax.devices()[0]
    return choose_attention(
        model.attention, context=sizes.get("context", 1), platform=device_platform(device), dtype=model.dtype,
        head_dim=model.head_dim, compute_capability=compute_capability(device), softcap=model.attention_softcap,
    )  # fmt: skip


def predicted(name: str, setup: Setup, sizes: dict[str, int]) -> Any:
    """The planner's estimate of the same layout (bytes per device per step) on mesh axis `sizes`."""
    count = setup.microbatches if sizes.get("pipeline", 1) > 1 else 1
    strategy = dataclasses.replace(STRATEGIES[name], mesh=mesh_text(sizes), microbatches=count)
    model = model_for(setup, sizes)
    return estimate(model, strategy, device=setup.device, batch_size=setup.batch_size, seq_len=setup.seq_len)


def run_strategy(name: str, setup: Setup) -> dict[str, Any]:
    """Compile, warm up and time one strategy; read memory and collectives from the compiled step."""
    built = build(name, setup)
    mesh, batches, state = built["mesh"], built["batches"], built["state"].state
    times = []
    with count_compiles() as compiles:
        start = time.perf_counter()
        compiled = built["step"].lower(state, batches[0]).compile()
        compile_s = time.perf_counter() - start
        for i in range(setup.warmup + setup.steps):
            start = time.perf_counter()
            state, metrics = compiled(state, batches[i % len(batches)])
            jax.block_until_ready((state, metrics))
            if i >= setup.warmup:
                times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    devices = mesh.devices.size
    tokens = setup.batch_size * setup.seq_len
    rates = throughput(tokens, step_s, built["model"].flops_per_token(setup.seq_len), devices, peak_flops())
    memory = compiled.memory_analysis()
    report = collective_report(compiled)
    plan = predicted(name, setup, dict(mesh.shape))
    hlo_bytes, plan_bytes = report.bytes(), sum(plan.collective_bytes.values())
    return {
        "strategy": name,
        "mesh": format_sizes(dict(mesh.shape)),
        "attention": built["model"].attention,  # the kernel `build` chose
        "devices": devices,
        "compile_s": compile_s,
        "compiles": len(compiles),  # XLA compilations from lowering to the last step: 1 (no retracing)
        "step_ms": 1e3 * step_s,
        "step_ms_min": 1e3 * min(times),
        "step_ms_max": 1e3 * max(times),
        "tokens_per_s": rates["tokens_per_sec"],
        "tflops_per_device": rates["tflops_per_device"],
        "mfu": rates["mfu"],
        "argument_bytes": memory.argument_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "plan_state_bytes": plan.state_bytes,
        "hlo_collective_bytes": hlo_bytes,
        "plan_collective_bytes": plan_bytes,
        "traffic_ratio": hlo_bytes / plan_bytes if plan_bytes else None,
        "hlo_by_opcode": {op: t["operand_bytes"] for op, t in report.by_opcode().items()},
        "plan_by_opcode": dict(plan.collective_bytes),
        "final_loss": float(metrics["loss"]),
    }


def fits(name: str, num_devices: int) -> bool:
    """Does the strategy's mesh use exactly the devices present (the 1-device baseline always fits)?"""
    sizes = [int(part.split("=")[1]) for part in STRATEGIES[name].mesh.split(",")]
    return name == "one_device" or math.prod(sizes) == num_devices


def benchmark(names: list[str], setup: Setup, log: Any = print) -> list[dict[str, Any]]:
    """Rows of `run_strategy` for the strategies that fit; skipped ones are logged."""
    rows = []
    for name in names:
        if not fits(name, jax.device_count()):
            log(f"skip {name}: mesh {STRATEGIES[name].mesh} needs a different device count than {jax.device_count()}")
            continue
        try:
            devices = 1 if name == "one_device" else jax.device_count()
            kernel_for(setup, MeshConfig.parse(STRATEGIES[name].mesh).resolve(devices))
        except SpmdkitError as error:
            log(f"skip {name}: {error}")
            continue
        log(f"{name} ({STRATEGIES[name].mesh}) ...")
        rows.append(run_strategy(name, setup))
        log(f"  compile {rows[-1]['compile_s']:.1f} s, step {rows[-1]['step_ms']:.1f} ms")
    return rows


COLUMNS = (
    ("strategy", "strategy"), ("mesh", "mesh"), ("attention", "attention"), ("compile s", "compile_s"),
    ("step ms (min-max)", "step_ms"), ("tokens/s", "tokens_per_s"), ("TFLOP/s/dev", "tflops_per_device"),
    ("MFU", "mfu"), ("arg MiB", "argument_bytes"), ("temp MiB", "temp_bytes"), ("plan state MiB", "plan_state_bytes"),
    ("HLO coll. MiB", "hlo_collective_bytes"), ("plan coll. MiB", "plan_collective_bytes"),
    ("HLO/plan", "traffic_ratio"),
)  # fmt: skip


def _cell(row: dict[str, Any], key: str) -> str:
    value = row[key]
    if key == "step_ms":
        return f"{value:.1f} ({row['step_ms_min']:.1f}-{row['step_ms_max']:.1f})"
    if value is None or isinstance(value, str):
        return "n/a" if value is None else value
    if key.endswith("bytes"):
        return f"{value / 2**20:.3f}"
    formats = {"mfu": "{:.1%}", "traffic_ratio": "{:.3f}", "tflops_per_device": "{:.4f}", "compile_s": "{:.1f}"}
    return formats.get(key, "{:,.1f}").format(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(title for title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(row, key) for _, key in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, stem: str) -> tuple[Path, Path]:
    """`out/stem.md` (a header and the table) and `out/stem.json` (meta + rows)."""
    out.mkdir(parents=True, exist_ok=True)
    header = ", ".join(f"{k} {v}" for k, v in meta.items() if k != "model")
    md, js = out / f"{stem}.md", out / f"{stem}.json"
    md.write_text(f"# {stem}\n\n{header}\n\nmodel: {meta['model']}\n\n{markdown_table(rows)}\n")
    js.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return md, js


def gpu_setup(steps: int) -> Setup:
    """~1B parameters (the `1b` preset), bf16, the largest batch the planner says fits each GPU's HBM."""
    known = device_for_kind(jax.devices()[0].device_kind)
    device = known.name if known else "h100"
    n, seq = jax.device_count(), 2048
    for remat in ("none", "full"):
        model = model_preset("1b").replace(dtype="bfloat16", remat=remat)
        best = 0
        for per_device in (1, 2, 4, 8, 16, 32, 64):
            plan = predicted("fsdp", Setup(model, per_device * n, seq, device=device), {"fsdp": n})
            best = per_device if plan.total_memory <= 0.9 * DEVICES[device].hbm_bytes else best
        if best >= 4 or model.remat_policy.full:
            return Setup(model, max(best, 1) * n, seq, steps=steps, warmup=2, device=device)
    raise AssertionError("unreachable")


def peer_model() -> Any:
    """The fixed configuration other toolkits can run too (Llama-style, 20.6M parameters; the MaxText harness in
    ../shared/bench/maxtext/side_by_side.sh calls this)."""
    return TransformerConfig(
        vocab_size=32_000, embed=256, layers=4, heads=4, kv_heads=4, head_dim=64, mlp=1024, dtype="bfloat16"
    )


def run(args: argparse.Namespace) -> int:
    """The benchmark as a command: set up, run, print and write the table."""
    check_sizes({"--batch-size": args.batch_size, "--seq-len": args.seq_len, "--microbatches": args.microbatches})
    check_output(args.out, [])  # not inside a checkpoint directory
    platform = configure_platform()

    if args.peer:
        setup = Setup(peer_model(), 8, 256, steps=args.steps or 20, warmup=args.warmup)
        names, stem = PEER_STRATEGIES, "peer"
    elif platform == "gpu" and not args.quick:
        setup, names, stem = gpu_setup(args.steps or 20), DEFAULT_STRATEGIES, "gpu"
    else:
        model = model_preset(args.model).replace(dtype=args.dtype)
        seq = 64 if args.quick else args.seq_len
        steps = args.steps or (5 if args.quick else 10)
        setup = Setup(model, args.batch_size, seq, steps=steps, warmup=1 if args.quick else args.warmup)
        names, stem = DEFAULT_STRATEGIES, "quick" if args.quick else "benchmark"
    setup = dataclasses.replace(setup, microbatches=args.microbatches, attention=args.attention)
    names = args.strategies or names
    start = time.perf_counter()
    rows = benchmark(names, setup, log=lambda text: print(text, flush=True))
    meta = {
        "platform": platform, "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
        "jax": jax.__version__, "model": dataclasses.asdict(setup.model), "params": setup.model.num_params(),
        "batch": setup.batch_size, "seq": setup.seq_len, "steps": setup.steps, "warmup": setup.warmup,
        "microbatches": setup.microbatches, "wall_s": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    md, js = write_results(rows, meta, Path(args.out), stem)
    print(markdown_table(rows))
    print(f"wrote {md} and {js} ({meta['wall_s']} s)")
    return 0
