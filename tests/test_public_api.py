"""The public packages export exactly the names an importer needs, each resolvable and documented; the names
`spmdkit.sharding` exported before the shard_map programs moved to `spmdkit.parallel` are gone from it."""

import importlib
import inspect

import pytest

EXPECTED = {
    "spmdkit.sharding": [
        "AXES", "MeshConfig", "PRESETS", "Rules", "abstract_state", "constrain", "describe_parallelism",
        "init_sharded", "logical_to_spec", "make_mesh", "make_rules", "preset", "state_shardings", "use_rules",
    ],
    "spmdkit.parallel": [
        "ExpertWeights", "Schedule", "all_gather_matmul", "capacity", "deinterleave_layers", "dense_moe", "expert_ffn",
        "matmul_reduce_scatter",
        "from_microbatches", "from_zigzag", "interleave_layers", "make_schedule", "pipeline_value_and_grad",
        "ring_attention", "to_microbatches", "to_zigzag", "zigzag_batch", "zigzag_indices",
    ],
    "spmdkit.inspect": ["CollectiveReport", "collective_report", "parameter_rows", "parameter_table"],
    "spmdkit.interop": ["find_tokenizer_dir", "from_hf_config", "hf_config", "load_model", "load_params", "save_hf"],
    "spmdkit": ["generate", "load_model", "save_hf"],
}  # fmt: skip


@pytest.mark.parametrize("package", list(EXPECTED))
def test_all_is_exactly_the_public_api(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(EXPECTED[package])
    namespace: dict = {}
    exec(f"from {package} import *", namespace)  # what `import *` gives a user
    for name in EXPECTED[package]:
        assert getattr(module, name) is namespace[name]


def _own_docstring(obj: object) -> str:
    """The docstring written for `obj` itself: not inherited, not a dataclass's generated signature."""
    doc = (vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__) or ""
    return "" if doc.startswith(f"{obj.__name__}(") else doc.strip()


@pytest.mark.parametrize("package", list(EXPECTED))
def test_every_function_and_class_has_a_docstring(package):
    module = importlib.import_module(package)
    exported = [getattr(module, name) for name in EXPECTED[package]]
    undocumented = [
        obj.__name__
        for obj in exported
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and not _own_docstring(obj)
    ]
    assert not undocumented, f"{package} exports without a docstring: {undocumented}"


def test_moved_names_are_gone_from_sharding():
    import spmdkit.sharding

    for name in ("ring_attention", "pipeline_value_and_grad", "collective_report"):
        with pytest.raises(AttributeError, match=f"no attribute {name!r}"):
            getattr(spmdkit.sharding, name)


def test_import_spmdkit_stays_light():
    """`spmdkit.load_model` / `save_hf` load on first use: importing the package, the interop package and the run
    config (what the CLI parses with) imports no JAX."""
    import subprocess
    import sys

    code = "import sys, spmdkit, spmdkit.interop, spmdkit.train.config; assert 'jax' not in sys.modules, 'jax'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_transformer_builds_and_runs_on_one_device_without_a_mesh():
    """The first line a user writes: no mesh, no Flax switch. The logical names stay as metadata for sharding."""
    import jax.numpy as jnp
    from flax import nnx

    from spmdkit.models import Transformer
    from spmdkit.models.presets import model_preset

    config = model_preset("tiny")
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % config.vocab_size
    x, _ = model.hidden(tokens, jnp.broadcast_to(jnp.arange(8), (2, 8)))
    loss, _ = model.loss(x, tokens)
    assert x.shape == (2, 8, config.embed) and abs(float(loss) - float(jnp.log(config.vocab_size))) < 1.5
    assert model.embedding.out_sharding == ("vocab", "embed")


def test_the_train_steps_old_names_import_from_the_package_which_stays_light():
    """`spmdkit.train.step` was a module: its names import from the package for one release, lazily, so that the
    package's JAX-free module (`preflight`, which `spmdkit bench` loads at start-up) still imports no JAX."""
    import subprocess
    import sys

    from spmdkit.train.step import batch_shardings, loss_and_grads
    from spmdkit.train.step import train_step as module

    assert batch_shardings is module.batch_shardings and loss_and_grads is module.loss_and_grads
    probe = "import sys, spmdkit.train.step.preflight; print('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"
