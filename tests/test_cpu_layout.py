"""The layouts spmdkit picks for XLA:CPU (`spmdkit.models.cpu_layout`): the head's backward products run as row-major
bfloat16 products, and with fewer tokens than vocab rows the head runs vocab-parallel over FSDP's axis and the
embedding lookup trades rows; values and gradients equal the one-device reference, and the compiled program shows
the traffic each choice is for.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdkit.inspect import collective_report
from spmdkit.models import TransformerConfig
from spmdkit.models.cpu_layout import dense
from spmdkit.models.layers import embed_tokens
from spmdkit.models.loss import lm_loss
from spmdkit.models.transformer import cross_entropy, head_logits
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules

CONFIG = TransformerConfig(dtype="float32", vocab_size=1024, embed=64, loss_chunk=0)
BATCH, SEQ = 8, 32  # 256 tokens against 1,024 vocab rows: the vocab-parallel head and the lookup by rows


@functools.cache
def _inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SEQ, CONFIG.embed), dtype=np.float32)
    scale = (1 + 0.1 * rng.standard_normal(CONFIG.embed)).astype(np.float32)
    head = (rng.standard_normal((CONFIG.embed, CONFIG.vocab_size)) / 8).astype(np.float32)
    targets = rng.integers(0, CONFIG.vocab_size, (BATCH, SEQ)).astype(np.int32)
    return x, scale, head, targets


def _rel(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want))) / np.max(np.abs(np.asarray(want))))


def test_dense_gives_the_einsums_values_and_gradients():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 6, 16), dtype=np.float32), rng.standard_normal((16, 24), dtype=np.float32)
    cotangent = rng.standard_normal((4, 6, 24), dtype=np.float32)

    def pulled(f):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(cotangent))

    want = pulled(lambda x, w: jnp.einsum("bse,ev->bsv", x, w))
    for groups in (1, 2, 4):  # the weight's gradient as a sum over token groups
        for got, expected in zip(pulled(lambda x, w, g=groups: dense(x, w, g)), want, strict=True):
            assert _rel(got, expected) < 1e-6


def _dot_forms(text: str) -> list[bool]:
    """For each dot of compiled HLO `text`: whether it is a row-major A . B (the lhs contracts its last dim, the rhs
    its first after the batch dims), the one form XLA:CPU's YNNPACK runs in bfloat16 (jaxlib 0.12)."""
    ranks = {name: len(dims.split(",")) for name, dims in re.findall(r"%([\w.\-]+) = \w+\[([\d,]+)\]", text)}
    forms = []
    for lhs, rest in re.findall(r" dot\(%([\w.\-]+), %[\w.\-]+\), (.*)", text):
        field = dict(re.findall(r"(\w+_dims)=\{([\d,]*)\}", rest))
        batch = len([d for d in field.get("rhs_batch_dims", "").split(",") if d])
        lhs_last = field["lhs_contracting_dims"] == str(ranks[lhs] - 1)
        forms.append(lhs_last and field["rhs_contracting_dims"] == str(batch))
    return forms


def test_the_heads_backward_products_are_row_major():
    """XLA folds a transposed operand into the dot's dimensions; XLA:CPU then runs such a bfloat16 product in float32
    on converted copies. `dense` lays the transposed operand out first: every product of the forward and the backward
    is a row-major A . B, where the plain einsum's backward has the folded forms."""
    x, w = jnp.ones((2, 64, 32), jnp.bfloat16), jnp.ones((32, 128), jnp.float32)

    def forms(f) -> list[bool]:
        grad = jax.grad(lambda x, w: (f(x, w).astype(jnp.float32) ** 2).sum(), argnums=(0, 1))
        return _dot_forms(jax.jit(grad).lower(x, w).compile().as_text())

    assert forms(lambda x, w: dense(x, w, 2)) == [True] * 3
    assert not all(forms(lambda x, w: jnp.einsum("bse,ev->bsv", x, w.astype(jnp.bfloat16))))


def _reference(x, scale, head, targets):
    return cross_entropy(head_logits(x, scale, head, CONFIG), targets)


@pytest.mark.parametrize("mesh_text", ["fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2"])
def test_the_vocab_parallel_head_equals_the_one_device_reference(mesh_text):
    """The head [embed, vocab] split by vocab rows over fsdp, the tokens gathered: the same loss and gradients, and no
    collective moves the head whole (its gathers and its gradient's reduction are gone)."""
    mesh, rules = make_mesh(mesh_text), make_rules(3)
    x, scale, head, targets = _inputs()

    def loss(x, s, h):
        with use_rules(rules, mesh):
            return lm_loss(x, s, h, targets, CONFIG)[0]

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    value, grads = step(x, scale, head)
    want_value, want_grads = jax.jit(jax.value_and_grad(_reference, argnums=(0, 1, 2)))(x, scale, head, targets)
    assert abs(float(value) - float(want_value)) <= 1e-6 * abs(float(want_value))
    for name, g, w in zip(("x", "norm scale", "head"), grads, want_grads, strict=True):
        assert _rel(g, w) < 1e-5, (name, _rel(g, w))
    report = collective_report(step.lower(x, scale, head).compile())
    head_per_tensor_shard = head.nbytes / mesh.shape["tensor"]
    assert report.collectives
    assert all(max(c.operand_bytes, c.result_bytes) < head_per_tensor_shard for c in report.collectives)


def test_the_embedding_lookup_trades_rows_instead_of_gathering_the_table():
    mesh, rules = make_mesh("fsdp=8"), make_rules(3)
    table = np.random.default_rng(2).standard_normal((CONFIG.vocab_size, CONFIG.embed), dtype=np.float32)
    tokens = _inputs()[3]
    table_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp"))
    token_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    table, tokens = jax.device_put(table, table_sharding), jax.device_put(tokens, token_sharding)

    def embedded_sum(table, tokens):
        with use_rules(rules, mesh):
            return (embed_tokens(table, tokens, "float32") ** 2).sum()

    # the gradient leaves sharded like the table, as a train step's does
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    step = jax.jit(jax.value_and_grad(embedded_sum), out_shardings=(replicated, table_sharding))
    value, grad = step(table, tokens)
    want_value, want_grad = jax.value_and_grad(lambda t: (jnp.take(t, tokens, axis=0) ** 2).sum())(np.asarray(table))
    assert abs(float(value) - float(want_value)) <= 1e-6 * abs(float(want_value)) and _rel(grad, want_grad) < 1e-6
    report = collective_report(step.lower(table, tokens).compile())
    assert report.count("all-to-all") >= 2
    assert all(max(c.operand_bytes, c.result_bytes) < table.nbytes / 8 for c in report.collectives)  # nor summed
