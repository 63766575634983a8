"""What watching a long job costs per step: the watchdog, the per-process timing, the local checkpoint tier.

Each variant is a real `spmdkit train` run of `tiny` (seq 64, batch 16, 60 steps, logged every 10; a small step,
so the figures are upper bounds of the overhead on a real model), run in interleaved rounds, and read from its
`metrics.jsonl` (the median `step_time_s` of the windows after the first two):

- `2 x 2, no watchdog`: `spmdkit launch --processes 2 --devices-per-process 2`, both health timeouts 0 (the
  watchdog's threads are not started);
- `2 x 2, watchdog`: the same with the default timeouts (two threads per process, the key-value store written at
  most twice a second);
- `1 x 8` and `1 x 8, local tier every 2`: one process of 8 devices, without and with `--checkpoint.local-dir`
  (a synchronous save every 2 steps), checkpoints to the persistent directory only at the end; and, to compare,
  `1 x 8, persistent every 2` (an asynchronous save to the persistent directory every 2 steps).

The per-process timing (stragglers) is one `process_allgather` of a float per logged step; its cost is timed
directly: 200 calls in a 2-process job.

    python scripts/bench_resilience.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
TRAIN = "train --model tiny --mesh fsdp={devices} --steps 60 --seq-len 64 --batch-size 16 --eval-every 0"
TRAIN += " --log-every 10 --checkpoint-every 0 --no-progress"
LAUNCH = f"{BIN}/spmdkit launch --processes 2 --devices-per-process 2 -- {BIN}/spmdkit"
OFF = " --health.step-timeout 0 --health.phase-timeout 0"
VARIANTS = {
    "2 x 2, no watchdog": (LAUNCH, 4, OFF),
    "2 x 2, watchdog": (LAUNCH, 4, ""),
    "1 x 8": (f"{BIN}/spmdkit", 8, " --cpu-devices 8"),
    "1 x 8, local tier every 2": (f"{BIN}/spmdkit", 8, " --cpu-devices 8 --checkpoint.local-every 2"),
    "1 x 8, persistent every 2": (f"{BIN}/spmdkit", 8, " --cpu-devices 8 --checkpoint-every 2"),
}
GATHER = """
import time, numpy as np, spmdkit.distributed
spmdkit.distributed.join()
from jax.experimental import multihost_utils
multihost_utils.process_allgather(np.float32(0))
start = time.perf_counter()
for _ in range(200):
    multihost_utils.process_allgather(np.float32(1.5))
print("GATHER_MS", (time.perf_counter() - start) / 200 * 1e3)
"""


def step_time(name: str, workdir: Path) -> float:
    """The median step time (s) of one run of variant `name`."""
    command, devices, extra = VARIANTS[name]
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    if "local tier" in name:
        extra += f" --checkpoint.local-dir {run_dir / 'local'}"
    argv = f"{command} {TRAIN.format(devices=devices)}{extra} --run-dir {run_dir / 'run'}".split()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode:
        raise SystemExit(f"{name} failed: {done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records[3:])


def gather_ms(workdir: Path) -> float:
    script = workdir / "gather.py"
    script.write_text(GATHER)
    argv = [f"{BIN}/spmdkit", "launch", "--processes", "2", "--devices-per-process", "2", "--", sys.executable]
    done = subprocess.run(
        [*argv, str(script)], capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    return float(next(line.split()[-1] for line in done.stdout.splitlines() if "GATHER_MS" in line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):  # interleaved: a slow moment of the machine hits every variant alike
            for name in VARIANTS:
                times[name].append(step_time(name, Path(work)))
        gather = gather_ms(Path(work))
    print(f"| variant | step time, min of {args.rounds} rounds' medians (ms) | against its baseline |")
    print("|---|---|---|")
    for name, baseline in zip(VARIANTS, ("2 x 2, no watchdog",) * 2 + ("1 x 8",) * 3, strict=True):
        best, base = min(times[name]), min(times[baseline])
        print(f"| {name} | {best * 1e3:.1f} | {best / base - 1:+.1%} |")
    print(f"\nper-process timing: one process_allgather of a float per logged step, {gather:.2f} ms (2 processes)")


if __name__ == "__main__":
    main()
