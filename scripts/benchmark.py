"""Benchmark every strategy's speed, per-device memory and collective traffic against the planner's theory.

Run: python scripts/benchmark.py [--quick] [--peer] [--out DIR] [--steps N] [--strategies NAME ...]
(or `spmdkit bench ...`). Without an accelerator it simulates 8 CPU devices (an XLA_FLAGS device count you set
yourself is kept); on GPU it sets the XLA latency-hiding and collective-combine flags before JAX starts.
Writes DIR/{quick,benchmark,peer,gpu}.{md,json} and prints the table. See docs/benchmarks.md.
"""

from __future__ import annotations

import sys

from spmdkit.cli import main
from spmdkit.tools.bench import configure_platform

if __name__ == "__main__":
    configure_platform()  # before anything imports JAX
    sys.exit(main(["bench", *sys.argv[1:]]))
