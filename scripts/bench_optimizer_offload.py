"""Optimizer-state host offload (`--optimizer.offload`), measured: the per-device memory of a model's train step
compiled for 8 x H100 with and without it (device bytes, host bytes, the planner's optimizer share), and the CPU
step time of `tiny` with and without it.

    python scripts/bench_optimizer_offload.py gpu --model llama3-8b --seq-len 2048 --batch-size 8
    python scripts/bench_optimizer_offload.py cpu --steps 20

`gpu` needs the `gpu-aot` extra (compile-only devices, no GPU); `cpu` runs on 8 simulated CPU devices.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def gpu(args: argparse.Namespace) -> None:
    from spmdkit.cli.train import parse_flags
    from spmdkit.targets import target_devices
    from spmdkit.targets.flags import gpu_compiler_options
    from spmdkit.tools.gpu_compile import lower_train_step, memory_bytes, planner_estimate
    from spmdkit.train.config import TrainConfig
    from spmdkit.train.step.program import build_program

    devices = target_devices("h100", 8, 8)
    flags = f"--model {args.model} --mesh {args.mesh} --model.remat {args.remat} --seq-len {args.seq_len}"
    flags += f" --batch-size {args.batch_size}"
    results = {}
    for offload in (False, True):
        started = time.perf_counter()
        program = build_program(parse_flags((flags + " --optimizer.offload" * offload).split(), TrainConfig()), devices)
        memory = memory_bytes(lower_train_step(program).compile(compiler_options=gpu_compiler_options()))
        plan = planner_estimate(program, "h100")
        results[offload] = memory
        print(
            f"offload={offload}: device {memory['total'] / 1e9:.3f} GB (temp {memory['temp'] / 1e9:.3f}), host "
            f"{memory['host'] / 1e9:.3f} GB; planner: optimizer {plan.memory['optimizer'] / 1e9:.3f} GB, device "
            f"{plan.total_memory / 1e9:.3f} GB, host {plan.host_bytes / 1e9:.3f} GB; compile "
            f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
    saved = results[False]["total"] - results[True]["total"]
    print(f"device memory saved per device: {saved / 1e9:.3f} GB")


def cpu(args: argparse.Namespace) -> None:
    import jax
    import numpy as np

    from spmdkit.cli.train import parse_flags
    from spmdkit.train.config import TrainConfig
    from spmdkit.train.step.program import build_program

    for offload in (False, True, False, True):
        flags = f"--model {args.model} --mesh fsdp=4,tensor=2 --seq-len 128 --batch-size 16"
        program = build_program(parse_flags((flags + " --optimizer.offload" * offload).split(), TrainConfig()))
        keys = program.batch_keys()
        state = program.create_state()
        step, batch = program.train_step(state, keys), program.abstract_batch(keys)
        tokens = np.random.default_rng(0).integers(0, program.model_config.vocab_size, (16, 129), dtype=np.int32)
        values = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.tile(np.arange(128), (16, 1))}
        batch = {k: jax.device_put(values[k].astype(np.int32), batch[k].sharding) for k in keys}
        current, times = state.state, []
        for _ in range(args.steps + 1):
            started = time.perf_counter()
            current, metrics = step(current, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - started)
        print(f"offload={offload}: median step {statistics.median(times[1:]) * 1e3:.1f} ms over {args.steps} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("gpu", "cpu"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--remat", default="full")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    args.model = args.model or ("llama3-8b" if args.what == "gpu" else "tiny")
    gpu(args) if args.what == "gpu" else cpu(args)


if __name__ == "__main__":
    main()
