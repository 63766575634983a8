"""Multi-token prediction (`--model.mtp-depth D`, `spmdkit.models.mtp`): the loss of the D modules equals DeepSeek-V3's
formula written out per document (packed rows, loss masks: a target of the next document is never scored), the
objective adds `mtp_weight` x their mean, a mesh with gradient accumulation starts from one device's losses and
lowers the MTP loss, and what MTP does not run with is refused in one line."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from support import pieces_as_rows

from spmdkit.data.packing import pack_documents
from spmdkit.errors import SpmdkitError
from spmdkit.models import Transformer, TransformerConfig
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.train.step.optimizer import OptimizerConfig, make_optimizer
from spmdkit.train.step.program import check_levers
from spmdkit.train.step.state import create_train_state
from spmdkit.train.step.train_step import make_train_step, objective

S = 16
LENGTHS = [1, 2, S - 1, S + 3, 3 * S, 5, 7, S, 9, 4, 2 * S + 1, 3, 11]  # 1- and 2-token documents: nothing to score
CONFIG = TransformerConfig(
    dtype="float32", vocab_size=96, embed=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64, attention="dot",
    mtp_depth=2, mtp_weight=0.25,
)  # fmt: skip


@functools.cache
def packed() -> tuple[dict[str, np.ndarray], list[tuple[int, int, int]]]:
    """(packed batch: int32 [8, S] fields, pieces: (row, start in row, tokens)), padding rows to 8."""
    rng = np.random.default_rng(0)
    fields, row_pieces = pack_documents([rng.integers(1, CONFIG.vocab_size, n) for n in LENGTHS], S)
    rows = -(-len(fields["inputs"]) // 8) * 8
    fields = {k: np.pad(v, ((0, rows - len(v)), (0, 0))).astype(np.int32) for k, v in fields.items()}
    return fields, [(r, start, n) for r, row in enumerate(row_pieces) for start, _, _, n in row]


def _model(config: TransformerConfig = CONFIG) -> Transformer:
    return Transformer(config, rngs=nnx.Rngs(0))  # as `create_train_state` builds it with seed 0


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + CONFIG.norm_eps) * w


def _pieces() -> dict[str, np.ndarray]:
    """The pieces alone, one per row from column 0 at their positions, zero-padded at the end."""
    return pieces_as_rows(*packed(), S)


@nnx.jit(static_argnums=3)
def _depth(model: Transformer, x: jax.Array, positions: jax.Array, k: int) -> jax.Array:
    """Block k (0-based) of the MTP stack alone on x [rows, S, embed]."""
    graphdef, stack = nnx.split(model.mtp.blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[k], stack))(x, positions)[0]


def _reference(model: Transformer) -> float:
    """The MTP loss written out piece by piece (a document's tokens in one row, alone, at their positions): for
    depth k, position j of a piece of n tokens scores t_{j+k+1} (target j + k) when j + k < n and target j + k is
    scored; h'^k = M_k [norm_e(Emb(t_{j+k})); norm_h(h^{k-1})], h^k = block_k(h'^k), logits = head(norm_k(h^k));
    each depth's sum over the batch's scored tokens, then the mean over depths."""
    pieces, lengths = _pieces(), [n for _, _, n in packed()[1]]
    params = {name: np.asarray(v) for name, v in nnx.to_pure_dict(nnx.state(model.mtp, nnx.Param)).items()
              if name != "blocks"}  # fmt: skip
    table, head = np.asarray(model.embedding[...]), np.asarray(model.lm_head[...])
    h = np.asarray(nnx.jit(lambda m, t, p: m.hidden(t, p)[0])(model, pieces["inputs"], pieces["positions"]))
    sums = np.zeros(CONFIG.mtp_depth)
    for k in range(1, CONFIG.mtp_depth + 1):
        ahead = np.zeros_like(pieces["inputs"])
        for row, n in enumerate(lengths):
            ahead[row, : max(n - k, 0)] = pieces["inputs"][row, k:n]
        p = {name: value[k - 1] for name, value in params.items()}
        x = _rms(table[ahead], p["enorm"]) @ p["eh_proj"][0] + _rms(h, p["hnorm"]) @ p["eh_proj"][1]
        h = np.asarray(_depth(model, x, pieces["positions"], k - 1))
        log_p = np.asarray(jax.nn.log_softmax(_rms(h, p["head_norm"]) @ head, axis=-1))
        for row, n in enumerate(lengths):
            for j in range(n - k):
                if pieces["loss_mask"][row, j + k]:
                    sums[k - 1] -= log_p[row, j, pieces["targets"][row, j + k]]
    return float(np.mean(sums / packed()[0]["loss_mask"].sum()))


@pytest.fixture(scope="module")
def one_device() -> dict[str, float]:
    """The objective and metrics of the packed batch on one device (`objective`, jitted)."""
    total, metrics = nnx.jit(objective)(_model(), packed()[0])
    return {"total": float(total), **{k: float(v) for k, v in metrics.items()}}


def test_the_batch_has_pieces_shorter_than_the_depth_and_documents_that_meet_in_a_row():
    fields, pieces = packed()
    assert min(n for _, _, n in pieces) <= CONFIG.mtp_depth
    assert (fields["segment_ids"].max(axis=1) >= 3).any()


@pytest.mark.parametrize("config", [CONFIG, CONFIG.replace(experts=4, top_k=2, moe_every=2, shared_expert=True)])
def test_the_parameter_count_and_the_planners_inventory_hold_the_mtp_modules(config):
    """`num_params` and the planner's parameter list count what the model builds, the MTP modules included (dense,
    and a block of the last layer's kind: here mixture of experts), and the FLOPs per token count each module's
    block, eh_proj and its pass through the shared LM head (6 x their matmul weights per token beside the main
    model's)."""
    from spmdkit.plan.layout import parameters

    model = nnx.eval_shape(lambda: _model(config))
    built = {
        ".".join(map(str, p)).removesuffix(".scale"): v.shape for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    assert any(name.startswith("mtp.") for name in built)
    assert built == {name: shape for name, shape, _ in parameters(config)}
    assert config.num_params() == sum(int(np.prod(shape)) for shape in built.values())
    plain, e, later = (
        config.replace(mtp_depth=0),
        config.embed,
        config.layers + (config.moe_every if config.experts else 1),
    )
    flops = lambda layers: plain.replace(layers=layers).flops_per_token(S)  # noqa: E731
    block = flops(later) - flops(later - 1)  # one more layer of the last layer's kind
    extra = config.flops_per_token(S) - plain.flops_per_token(S)
    assert extra == pytest.approx(config.mtp_depth * (block + 6 * (config.vocab_size * e + 2 * e * e)), rel=1e-12)


def test_the_mtp_loss_is_deepseeks_formula_per_document_and_joins_the_objective(one_device):
    model = _model()
    reference = _reference(model)
    assert one_device["mtp_loss"] == pytest.approx(reference, rel=1e-5)
    assert one_device["total"] == pytest.approx(one_device["loss"] + CONFIG.mtp_weight * reference, rel=1e-5)
    # The main model starts as it would without MTP (its parameters are drawn first) and computes the same logits.
    plain, tokens = _model(CONFIG.replace(mtp_depth=0)), packed()[0]["inputs"]
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(plain(tokens)))


def test_a_mesh_with_gradient_accumulation_trains_from_one_devices_losses(one_device):
    """data=2,fsdp=2,tensor=2 under ZeRO-1 with 2 microbatches: each piece divides by its share of the batch's
    scored tokens, so the first step's losses are one device's; the MTP parameters shard by their logical axes
    like the blocks' (tensor splits the MTP block's heads and MLP); the MTP loss falls."""
    mesh, rules = make_mesh("data=2,fsdp=2,tensor=2"), make_rules(1)
    tx = make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=0), 20)
    state = create_train_state(CONFIG, tx, mesh, rules, seed=0)
    q = nnx.to_pure_dict(state.state)[0]["mtp"]["blocks"]["attention"]["q"]
    assert q.sharding.shard_shape(q.shape)[2] == CONFIG.heads // 2
    step = make_train_step(state, mesh, rules, grad_accum=2, keys=tuple(packed()[0]))
    losses = []
    for i in range(8):
        state.state, metrics = step(state.state, packed()[0])
        losses.append(float(metrics["mtp_loss"]))
        if i == 0:
            assert losses[0] == pytest.approx(one_device["mtp_loss"], rel=1e-5)
            assert float(metrics["loss"]) == pytest.approx(one_device["loss"], rel=1e-5)
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0]


@pytest.mark.parametrize("mesh", ["pipeline=2,fsdp=4", "context=2,fsdp=4"])
def test_a_pipeline_or_context_axis_is_refused_in_one_line(mesh):
    with pytest.raises(SpmdkitError, match="--model.mtp-depth does not run with a") as error:
        check_levers(CONFIG, make_rules(3), make_mesh(mesh))
    assert "\n" not in str(error.value)


def test_bad_values_are_refused_in_one_line():
    for changes in ({"mtp_depth": -1}, {"mtp_weight": float("nan")}, {"fp8": True, "dtype": "bfloat16"}):
        with pytest.raises(SpmdkitError) as error:
            CONFIG.replace(**changes)
        assert "\n" not in str(error.value) and "mtp" in str(error.value)


def test_a_family_without_mtp_layers_exports_the_main_model_with_one_warning(tmp_path):
    from safetensors.numpy import load_file

    import spmdkit
    from spmdkit.errors import SpmdkitWarning

    with pytest.warns(SpmdkitWarning, match="multi-token-prediction") as caught:
        ours = spmdkit.save_hf(_model(), tmp_path / "mtp", max_positions=S)
    assert len([w for w in caught if issubclass(w.category, SpmdkitWarning)]) == 1
    plain = spmdkit.save_hf(_model(CONFIG.replace(mtp_depth=0)), tmp_path / "plain", max_positions=S)
    assert (ours / "config.json").read_text() == (plain / "config.json").read_text()
    got, want = (load_file(str(d / "model.safetensors")) for d in (ours, plain))
    assert got.keys() == want.keys() and all(got[k].tobytes() == want[k].tobytes() for k in want)
