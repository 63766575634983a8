"""Helpers the test modules share: running the `spmdkit` command as a user does, and the files and directories it
must leave alone (their hashes, a read-only directory)."""

import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

BIN = str(Path(sys.executable).parent)  # this environment's `spmdkit` and `python`


def run_spmdkit(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m spmdkit ARGS` in a fresh process (it inherits the session's compile flags and cache)."""
    return subprocess.run(
        [sys.executable, "-m", "spmdkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def job_env(**extra: str) -> dict[str, str]:
    """The test's environment for a launched job: no job variables of an outer launcher (SLURM_*, OMPI_*,
    SPMDKIT_*), this environment's `spmdkit` on PATH, the CPU platform, and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "SPMDKIT_"))}
    return {**env, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "JAX_PLATFORMS": "cpu", **extra}


def error_lines(stderr: str) -> list[str]:
    """The one-line errors `spmdkit` printed."""
    return [line for line in stderr.splitlines() if line.startswith("spmdkit: error:")]


def stored_values(state_dir) -> dict[str, list[tuple[str, int, int]]]:
    """Where Orbax stored each array of a step's `state/` item: 'model.embedding' -> [(data file, offset, length)]
    of its chunks, read from the OCDBT B+tree (TensorStore's own `ocdbt.dump`)."""
    import tensorstore as ts

    base = ts.KvStore.open(f"file://{os.path.abspath(state_dir)}/").result()
    found: dict[str, list[tuple[str, int, int]]] = {}

    def visit(location: str, prefix: bytes) -> None:  # keys and prefixes in a node are relative to its prefix
        for entry in ts.ocdbt.dump(base, location).result()["entries"]:
            if "location" in entry:  # an interior node's child
                visit(entry["location"], prefix + entry["subtree_common_prefix"])
            elif "indirect_value" in entry:
                key = (prefix + entry["key"]).decode()
                _, where, name, offset, length = entry["indirect_value"].split(":")
                found.setdefault(key.split("/")[0], []).append(
                    (os.path.join(state_dir, where, name), int(offset), int(length))
                )

    manifest = ts.ocdbt.dump(base).result()
    visit(manifest["versions"][-1]["root"]["location"], b"")
    return found


def flip_byte(state_dir, array: str) -> None:
    """Flip one bit of one byte in the middle of the stored (compressed) bytes of `array` ('model.embedding')."""
    path, offset, length = stored_values(state_dir)[array][0]
    with open(path, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)[0]
        f.seek(offset + length // 2)
        f.write(bytes([byte ^ 0x04]))


def autodiff_kept_bytes(config, batch: int = 3, seq: int = 256) -> tuple[float, list]:
    """(bytes per token and layer, the arrays) of the residuals JAX's autodiff keeps for `config`'s scanned blocks:
    those of the train objective's vjp (shapes only, nothing runs) that carry the [layers] and batch dims. `batch`
    should be no weight's dim (3 by default), so that the batch dim marks the activations."""
    import jax
    import numpy as np
    from flax import nnx

    from spmdkit.models import Transformer
    from spmdkit.train.step.train_step import objective

    graphdef, params, rest = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((batch, seq), np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))

    def residuals(params, tokens):
        data = {"inputs": tokens, "targets": tokens, "positions": positions}
        return jax.vjp(lambda p: objective(nnx.merge(graphdef, p, rest), data)[0], params)[1]

    saved = jax.tree.leaves(jax.eval_shape(residuals, params, tokens))
    per_layer = [x for x in saved if x.shape[:1] == (config.layers,) and batch in x.shape[1:3]]
    return sum(x.size * x.dtype.itemsize for x in per_layer) / (config.layers * batch * seq), per_layer


def in_parallel(calls: list) -> list:
    """`[call() for call in calls]`, two (or as many as there are cores) at a time in threads: XLA compiles, and a
    subprocess runs, outside the GIL, so a 2-core machine runs a module's compiles about 1.6 x faster."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        return list(pool.map(lambda call: call(), calls))


def compile_in_parallel(lowered: list, options: dict) -> list:
    """`[l.compile(compiler_options=options) for l in lowered]`, two at a time (`in_parallel`)."""
    return in_parallel([functools.partial(one.compile, compiler_options=options) for one in lowered])


def file_hashes(directory: Path) -> dict[str, str]:
    """relative path -> sha256 of every file (and '<dir>' for every directory) under `directory`."""
    found = {}
    for path in sorted(directory.rglob("*")):
        key = str(path.relative_to(directory))
        found[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "<dir>"
    return found


def read_only_dir(path: Path) -> bool:
    """Make `path` a directory this process cannot write: file modes, or (as root) a read-only tmpfs."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        return True
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def pieces_as_rows(fields: dict, pieces: list[tuple[int, int, int]], length: int) -> dict:
    """Packed documents one per row: for each (row, start, n) of `pieces`, the packed `fields`' inputs, targets,
    positions and loss_mask [rows, length] at row[start : start + n], copied to column 0 of its own row and
    zero-padded after (causal attention never lets a token see what follows it)."""
    import numpy as np

    out = {k: np.zeros((len(pieces), length), np.int32) for k in ("inputs", "targets", "positions", "loss_mask")}
    for i, (r, start, n) in enumerate(pieces):
        for k in out:
            out[k][i, :n] = fields[k][r, start : start + n]
    return out
