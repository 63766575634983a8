"""Fixtures the checkpoint test modules share: a small model's abstract train state, its shardings on a mesh, random
states placed on them, a synthetic data stream, and the `spmdkit` command run in this process."""

import jax
import numpy as np
import pytest
from flax import nnx

from spmdkit.data.config import DataConfig
from spmdkit.data.stream import make_data
from spmdkit.models import Transformer, TransformerConfig
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.partition import abstract_state
from spmdkit.sharding.rules import make_rules
from spmdkit.train.step.optimizer import OptimizerConfig, make_optimizer
from spmdkit.train.step.state import train_state_shardings

MODEL = TransformerConfig(dtype="float32")
RULES = make_rules(3, False)


@pytest.fixture(scope="module")
def abstract():
    """The abstract train state (model and optimizer) of MODEL."""
    tx = make_optimizer(OptimizerConfig(), 10)

    def make():
        model = Transformer(MODEL, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return abstract_state(make)[1]


def shardings_for(abstract, mesh, devices=None):
    """The train state's shardings on the mesh `mesh` ("fsdp=4,tensor=2") of `devices`."""
    return train_state_shardings(abstract, make_mesh(mesh, devices), RULES)


def random_state(abstract, shardings, seed):
    """A train-state tree with random values, placed on `shardings` (no compilation needed)."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(abstract)
    values = []
    for leaf, sharding in zip(leaves, jax.tree.leaves(shardings), strict=True):
        if leaf.dtype.kind == "f":
            value = rng.standard_normal(leaf.shape).astype(leaf.dtype)
        else:
            value = rng.integers(0, 100, leaf.shape).astype(leaf.dtype)
        values.append(jax.device_put(value, sharding))
    return treedef.unflatten(values)


def synthetic_stream():
    """A small synthetic data stream (its iterator is what a checkpoint's data item saves)."""
    return make_data(DataConfig(source="synthetic"), seq_len=8, global_batch=2, vocab_size=50, seed=0)


def run_cli(capsys, *args):
    """(exit code, stdout, stderr) of `spmdkit ARGS` run in this process."""
    from spmdkit.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err
