"""How long a checkpoint save blocks the training loop: async (`Checkpointer.save` returning) vs synchronous
(`save` + `wait`), median over a few saves.

The train state is the 125m preset's shape (float32 parameters + AdamW moments) with `--layers` blocks, random
values placed on the CPU devices (nothing is compiled). Usage:

    python scripts/bench_checkpoint_async.py [--layers 2] [--saves 3] [--cpu-devices 1] [--dir /tmp/bench_ckpt]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks of the 125m shape (12 = full)")
    parser.add_argument("--saves", type=int, default=3, help="saves per mode (the median is reported)")
    parser.add_argument("--cpu-devices", type=int, default=1, help="simulated CPU devices (mesh: all on fsdp)")
    parser.add_argument("--dir", default="", help="checkpoint directory (default: a fresh temporary one)")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import numpy as np
    from absl import logging
    from flax import nnx

    from spmdkit.checkpoint.manager import Checkpointer
    from spmdkit.models import Transformer
    from spmdkit.models.presets import model_preset
    from spmdkit.sharding.mesh import make_mesh
    from spmdkit.sharding.partition import abstract_state
    from spmdkit.sharding.rules import make_rules
    from spmdkit.train.config import OptimizerConfig
    from spmdkit.train.step.optimizer import make_optimizer
    from spmdkit.train.step.state import train_state_shardings

    logging.set_verbosity(logging.ERROR)
    config = model_preset("125m").replace(layers=args.layers, dtype="float32")
    tx = make_optimizer(OptimizerConfig(), 100)

    def make():
        model = Transformer(config, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    _, abstract = abstract_state(make)
    shardings = train_state_shardings(abstract, make_mesh(""), make_rules(3, False))
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(abstract)
    values = [
        jax.device_put(rng.standard_normal(x.shape, np.float32).astype(x.dtype), s)
        for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True)
    ]
    state = jax.block_until_ready(treedef.unflatten(values))
    total = sum(x.nbytes for x in values)
    print(
        f"train state: 125m shape with {args.layers} layers, {total / 2**20:.0f} MiB on {len(jax.devices())} device(s)"
    )

    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    results = {}
    try:
        for mode in ("async", "sync"):
            directory = os.path.join(root, mode)
            shutil.rmtree(directory, ignore_errors=True)
            checkpointer = Checkpointer(directory, every=0, keep=1)
            blocked, complete = [], []
            for step in range(args.saves + 1):  # the first save is a warm-up (thread pools, directories)
                start = time.perf_counter()
                checkpointer.save(step, state, force=True)
                returned = time.perf_counter()
                if mode == "sync":
                    checkpointer.wait()
                    returned = time.perf_counter()
                checkpointer.wait()
                done = time.perf_counter()
                if step:
                    blocked.append(returned - start)
                    complete.append(done - start)
            checkpointer.close()
            results[mode] = (statistics.median(blocked), statistics.median(complete))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    for mode, (blocked, complete) in results.items():
        print(
            f"{mode:>5}: loop blocked {blocked * 1e3:8.1f} ms per save (median of {args.saves}); save complete "
            f"after {complete * 1e3:8.1f} ms; {total / 2**20 / complete:.0f} MiB/s"
        )
    print(f"async blocks the loop {results['sync'][0] / results['async'][0]:.1f}x less than a synchronous save")


if __name__ == "__main__":
    main()
