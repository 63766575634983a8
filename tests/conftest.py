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


# A trained model for the tests that need one (generation, evaluation), shared by the whole session.
import pytest  # noqa: E402
from support import run_spmdkit  # noqa: E402

TRAIN_TINY = ("--model", "tiny", "--cpu-devices", "8", "--mesh", "fsdp=4,tensor=2", "--steps", "300")
TRAIN_TINY += ("--eval-every", "0", "--log-every", "100", "--no-progress")


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """Run directory of `tiny` trained 300 steps on the default data (the stdlib as bytes; loss ~1.8 nats/byte),
    FSDP x TP on 8 simulated devices, with its checkpoints. Trained once per session, on first use. The run gets
    XLA's optimised CPU code (not this session's -O0): compiling takes ~10 s longer, each step runs ~8x faster."""
    run_dir = tmp_path_factory.mktemp("trained-tiny") / "run"
    result = run_spmdkit("train", *TRAIN_TINY, "--run-dir", str(run_dir), timeout=1800, env={"XLA_FLAGS": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir
