"""Test setup, before JAX is imported anywhere: 8 simulated CPU devices, XLA's quick compile settings and a
compilation cache shared by the whole session (the `spmdkit` subprocesses the tests start inherit the last two).

- `-O0` for XLA's CPU backend (LLVM): it halves compile time, and the HLO passes, buffers and collectives the
  proofs read are the same (the backend optimises only the generated machine code).
- A persistent compilation cache in a fresh directory per session: a program compiled by one test (or one
  subprocess) is loaded, not compiled again, by the next that builds the same program.
"""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
CACHE = tempfile.mkdtemp(prefix="spmdkit-tests-jax-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE, ignore_errors=True)
