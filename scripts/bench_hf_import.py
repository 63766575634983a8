"""Benchmark `spmdkit ckpt import-hf` on a 1B-shaped sharded bfloat16 checkpoint: wall time and peak host memory.

The script writes the checkpoint itself (random bfloat16 weights in the `llama3.2-1b` preset's shape, with
`safetensors` directly, in shards of `--shard-mb` plus `model.safetensors.index.json`, and the config.json
`spmdkit.interop.hf_config` writes for that model), then runs the import in a fresh process and reads that
process's peak resident set size (`ru_maxrss` of the child). The import must not hold two copies of the weights:
the target is peak RSS <= 1.3 x the checkpoint's size. `--load` also measures `spmdkit.load_model` of the Hugging
Face directory and of the imported checkpoint, on one device and on 8 (fsdp): the target is peak RSS <= 1.2 x the
weights.

    python scripts/bench_hf_import.py --dir /tmp/bench-hf --load --keep   # generates once, then reuses the files
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from spmdkit.interop.hf_config_writer import hf_config
from spmdkit.interop.tensor_names import tensor_maps
from spmdkit.models.presets import model_preset

GB = 1e9


def generate(directory: Path, preset: str, shard_bytes: int) -> int:
    """Random bfloat16 weights of `preset` as a sharded Hugging Face checkpoint in `directory`; returns its bytes."""
    model = model_preset(preset)
    rng = np.random.default_rng(0)
    names = [(m, name) for m in tensor_maps(model, "llama") for name in m.hf_names()]
    shards, current, size = [], {}, 0
    for m, name in names:
        noise = rng.standard_normal(m.hf_shape, dtype=np.float32)
        value = 1 + 0.1 * noise if m.path[-1] == "scale" else noise / np.sqrt(m.hf_shape[-1])
        value = value.astype(ml_dtypes.bfloat16)
        if current and size + value.nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = value
        size += value.nbytes
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    shards += [current] if current else []
    directory.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in shard}
        total += sum(v.nbytes for v in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    tokens = {"bos_token_id": 128000, "eos_token_id": 128001}
    config = hf_config(model, dtype="bfloat16", max_positions=model.max_positions, tokens=tokens)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return total


def run_measured(command: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of that process alone, its output) of a command in a fresh process."""
    with tempfile.TemporaryFile("w+") as output:
        started = time.perf_counter()
        child = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        elapsed = time.perf_counter() - started
        output.seek(0)
        text = output.read()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(command)} failed:\n{text[-4000:]}")
    return elapsed, usage.ru_maxrss * 1024, text  # ru_maxrss is in KiB on Linux


LOAD = """
import os, sys, time
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_num_cpu_devices", int(sys.argv[2]))
from spmdkit import load_model
from spmdkit.sharding import make_mesh, MeshConfig
mesh = make_mesh(MeshConfig(fsdp=int(sys.argv[2]))) if int(sys.argv[2]) > 1 else None
started = time.perf_counter()
model = load_model(sys.argv[1], mesh, dtype="bfloat16")
jax.block_until_ready(model.embedding[...])
print(f"loaded in {time.perf_counter() - started:.1f} s")
"""


def measure_load(path: Path, devices: int, size: int, what: str) -> None:
    """Peak RSS of `spmdkit.load_model(path)` in a fresh process on `devices` simulated CPU devices (fsdp)."""
    elapsed, peak, output = run_measured([sys.executable, "-c", LOAD, str(path), str(devices)])
    print(
        f"load_model({what}, {devices} device(s)): {elapsed:.1f} s ({output.strip().splitlines()[-1]}), "
        f"peak RSS {peak / GB:.2f} GB = {peak / size:.2f} x the weights"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/spmdkit-bench-hf", help="where the checkpoint is generated")
    parser.add_argument("--preset", default="llama3.2-1b", help="model shape (default: llama3.2-1b, 1.24B)")
    parser.add_argument("--shard-mb", type=int, default=500, help="shard size in MB (default: 500)")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices the import shards over")
    parser.add_argument("--load", action="store_true", help="also measure spmdkit.load_model in a fresh process")
    parser.add_argument("--keep", action="store_true", help="keep the generated and imported checkpoints")
    args = parser.parse_args()
    source, out = Path(args.dir) / "hf", Path(args.dir) / "imported"
    if not (source / "model.safetensors.index.json").is_file():
        started = time.perf_counter()
        size = generate(source, args.preset, args.shard_mb * 10**6)
        print(f"generated {size / GB:.2f} GB in {time.perf_counter() - started:.0f} s: {source}")
    size = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "spmdkit", "ckpt", "import-hf", str(source), "--out", str(out)]
    command += ["--cpu-devices", str(args.cpu_devices)]
    elapsed, peak, _ = run_measured(command)
    print(
        f"import-hf ({args.cpu_devices} device(s)): {elapsed:.1f} s, peak RSS {peak / GB:.2f} GB = "
        f"{peak / size:.2f} x the checkpoint "
        f"({size / GB:.2f} GB)"
    )
    if args.load:  # the Hugging Face directory, and the checkpoint import-hf wrote from it
        for path, what in ((source, "Hugging Face directory"), (out, "imported checkpoint")):
            for devices in (1, 8):
                measure_load(path, devices, size, what)
    if not args.keep:
        shutil.rmtree(Path(args.dir), ignore_errors=True)


if __name__ == "__main__":
    main()
