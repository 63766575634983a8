"""FP8 training (`--model.fp8`): the numerics of one scaled FP8 projection, a 300-step run against bf16, an exact
resume with the scales, the refusals, and the FP8 GEMMs XLA:GPU compiles for every dense matmul of the blocks."""

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import TRAIN_TINY
from flax import nnx
from support import compile_in_parallel, error_lines, run_spmdkit

from spmdkit.checkpoint.manager import Checkpointer
from spmdkit.models.fp8 import HISTORY, Fp8Meta, Fp8Scales, project
from spmdkit.train.reporting.metrics import read_metrics

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def test_a_projection_in_fp8_is_the_quantized_product_and_hands_back_new_scales():
    """y = x W with x, W rounded to e4m3 at scale 1 (an empty history): exactly the product of the rounded operands
    (computed here with ml_dtypes, not spmdkit); the "gradients" of the meta are the new amax histories (|x|, |W|,
    |dy| maxima at position 0) and scales."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 8, 32)).astype(np.float32)
    w = rng.normal(size=(32, 4, 16)).astype(np.float32) * 0.2
    with nnx.use_eager_sharding(False):  # a module outside any model or mesh
        scales = Fp8Scales(history=8)
    graphdef, meta = nnx.split(scales)
    cotangent = rng.normal(size=(2, 8, 4, 16)).astype(np.float32) * 1e-2

    def f(x, w, meta):
        return jnp.sum(project("bse,ehd->bshd", x, w, nnx.merge(graphdef, meta)) * cotangent)

    y = project("bse,ehd->bshd", jnp.asarray(x), jnp.asarray(w), scales)
    rounded = lambda a: a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # noqa: E731
    np.testing.assert_allclose(y, np.einsum("bse,ehd->bshd", rounded(x), rounded(w)), rtol=1e-5, atol=1e-5)
    assert np.abs(y - np.einsum("bse,ehd->bshd", x, w)).max() > 1e-4  # it did quantize
    _, _, new = jax.grad(f, argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(w), meta)
    assert new["input_history"][...][0] == pytest.approx(np.abs(x).max())
    assert new["kernel_history"][...][0] == pytest.approx(np.abs(w).max())
    assert new["grad_history"][...][0] == pytest.approx(np.abs(cotangent).max(), rel=1e-2)
    assert np.all(new["input_history"][...][1:] == 0) and new["input_scale"][...][0] == 1.0  # empty history: 1
    with pytest.raises(ValueError, match="not a projection"):
        project("bse,hde->bsh", jnp.asarray(x), jnp.zeros((4, 16, 32)), scales)


def _fp8_meta(flat: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flat.items() if "_fp8" in k}


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _read_state(run_dir, step: int) -> dict:
    checkpointer = Checkpointer(run_dir / "checkpoints", read_only=True)
    try:
        return _flat(checkpointer.read_state(step))
    finally:
        checkpointer.close()


def test_300_steps_in_fp8_end_within_3_percent_of_bf16(trained_tiny, tmp_path):
    """`tiny` on the embedded data, the session's bf16 run (tests/conftest.py) against the same command with
    `--model.fp8`: the same seed and batches, the final loss within 3%; the scales moved off their initial 1."""
    run_dir = tmp_path / "fp8"
    result = run_spmdkit("train", *TRAIN_TINY, "--model.fp8", "True", "--run-dir", str(run_dir), timeout=1800,
                         env={"XLA_FLAGS": ""})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dense matmuls in FP8" in result.stdout
    bf16 = {r["step"]: r["loss"] for r in read_metrics(trained_tiny)}
    fp8 = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    assert max(fp8) == max(bf16) == 300
    assert abs(fp8[300] - bf16[300]) <= 0.03 * bf16[300], (fp8[300], bf16[300])
    assert fp8[300] < 0.5 * fp8[1]  # it learned
    meta = _fp8_meta(_read_state(run_dir, 300))
    assert len(meta) == 7 * 6 and all(v.shape[0] == 4 for v in meta.values())  # 7 projections x 6, x 4 layers
    scales = [v for k, v in meta.items() if k.endswith("_scale']")]
    assert all(np.all(s > 0) for s in scales) and any(np.any(s != 1.0) for s in scales)


FP8_RUN = ("--model", "tiny", "--model.fp8", "True", "--cpu-devices", "4", "--mesh", "data=2,fsdp=2", "--seq-len",
           "32", "--batch-size", "8", "--grad-accum", "2", "--log-every", "1", "--eval-every", "0", "--no-progress",
           "--checkpoint-every", "3")  # fmt: skip


def test_a_resumed_fp8_run_is_bit_identical_scales_and_histories_included(tmp_path):
    """6 steps straight against 3 steps, then the same command for 6 (resuming from step 3), with gradient
    accumulation over a replica axis (the per-device amaxes meet in a max): every loss, parameter, moment, scale
    and amax history equal."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for run_dir, steps in ((straight, "6"), (resumed, "3"), (resumed, "6")):
        result = run_spmdkit("train", *FP8_RUN, "--steps", steps, "--run-dir", str(run_dir))
        assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from step 3" in result.stdout + result.stderr
    losses = [{r["step"]: r["loss"] for r in read_metrics(d)} for d in (straight, resumed)]
    assert losses[0] == losses[1] and sorted(losses[0]) == list(range(1, 7))
    a, b = _read_state(straight, 6), _read_state(resumed, 6)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    histories = {k: v for k, v in _fp8_meta(a).items() if k.endswith("_history']")}
    assert histories and all(v.shape[-1] == HISTORY for v in histories.values())
    assert all(np.count_nonzero(v[:, :]) == 6 * v.shape[0] for v in histories.values())  # one amax per step


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--model", "tiny-moe"), "fp8 covers dense models"),
        (("--mesh", "pipeline=2,data=2", "--microbatches", "2"), "--model.fp8 does not run with a pipeline axis"),
    ],
)
def test_fp8_refuses_what_it_does_not_cover_in_one_line(tmp_path, flags, message):
    result = run_spmdkit("train", "--model.fp8", "True", "--cpu-devices", "4", *flags, "--steps", "1",
                         "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 2 and len(error_lines(result.stderr)) == 1, result.stderr[-2000:]
    assert message in error_lines(result.stderr)[0]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_generation_of_an_fp8_run_reads_its_parameters(tmp_path):
    """An FP8 run's checkpoint holds the scales beside the parameters; generation (bf16) reads the parameters."""
    run_dir = tmp_path / "run"
    result = run_spmdkit("train", *FP8_RUN, "--steps", "3", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    out = run_spmdkit("generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "4", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(json.loads(out.stdout)["tokens"]) == 4


def test_meta_is_state_not_a_parameter():
    """The scales are not `nnx.Param`s: no optimizer moments, no weight decay, not counted as parameters."""
    from spmdkit.models import Transformer
    from spmdkit.models.presets import PRESETS

    config = PRESETS["tiny"].replace(fp8=True)
    model = Transformer(config, rngs=nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert params == config.num_params() == PRESETS["tiny"].num_params()
    assert len(jax.tree.leaves(nnx.state(model, Fp8Meta))) == 7 * 6


# llama3-8b's structure (GQA, SwiGLU, untied head, llama3 RoPE) at shapes that compile in seconds
SMALL_8B = ("--model llama3-8b --model.layers 2 --model.embed 256 --model.heads 8 --model.kv-heads 2 "
            "--model.head-dim 32 --model.mlp 512 --model.vocab-size 1024 --seq-len 256 --batch-size 16")  # fmt: skip
_DOT = re.compile(r"%?([\w.\-]+)\s*=\s*\S+\s+dot\(([^)]*)\)")
_DEF = re.compile(r"%?([\w.\-]+)\s*=\s*(\(?[a-z0-9]+)\[")


def _dots(text: str) -> list[tuple[bool, str]]:
    """(FP8 operands?, the op_name it was traced from) of every dot in a compiled GPU program (the dots XLA kept
    as dots, inside GEMM fusions, and those it made cuBLAS calls of, which keep their `dot` in a fused form)."""
    types = {m.group(1): m.group(2).strip("(") for m in _DEF.finditer(text)}
    dots = []
    for line in text.splitlines():
        if match := _DOT.search(line):
            operands = [o.strip().lstrip("%") for o in match.group(2).split(",")]
            source = re.search(r'op_name="([^"]*)"', line)
            dots.append((all(types.get(o, "").startswith("f8") for o in operands), source.group(1) if source else ""))
    return dots


def test_every_dense_matmul_of_the_blocks_compiles_to_an_fp8_gemm_on_h100(mesh="fsdp=4,tensor=2"):
    """The train step compiled for 8 x H100 with `--model.fp8`: each of the 7 projections of a block runs forward,
    data-gradient and weight-gradient GEMMs on FP8 operands (>= 21 in the layer loop), the only GEMMs left in bf16
    or f32 are the LM head's (the attention is cuDNN's); without the flag there is none."""
    from spmdkit.cli.train import parse_flags
    from spmdkit.inspect.levers import fp8_gemms
    from spmdkit.targets import target_devices
    from spmdkit.targets.flags import gpu_compiler_options
    from spmdkit.tools.gpu_compile import attention_in_hlo, lower_train_step
    from spmdkit.train.config import TrainConfig
    from spmdkit.train.step.program import build_program

    devices = target_devices("h100", 8, 8)
    flags = {fp8: f"{SMALL_8B} --mesh {mesh}" + (" --model.fp8 True" if fp8 else "") for fp8 in (True, False)}
    lowered = [lower_train_step(build_program(parse_flags(f.split(), TrainConfig()), devices)) for f in flags.values()]
    compiled = compile_in_parallel(lowered, gpu_compiler_options())
    texts = {fp8: c.as_text() for fp8, c in zip(flags, compiled, strict=True)}
    assert all(attention_in_hlo(text) == "cudnn" for text in texts.values())
    dots = _dots(texts[True])
    assert sum(fp8 for fp8, _ in dots) >= 21, dots
    assert [source for fp8, source in dots if not fp8 and "bse,ev->bsv" not in source] == []
    assert fp8_gemms(texts[True])["instructions"] >= 21
    assert not any(fp8 for fp8, _ in _dots(texts[False])) and fp8_gemms(texts[False])["instructions"] == 0


def test_the_planner_runs_the_projections_at_the_fp8_peak():
    """llama3-8b on 8 x H100, full remat: FP8 takes the projections' FLOPs (forward, backward and the recomputed
    forward) from the bf16 peak (989 TFLOP/s) to the FP8 one (1,979); MFU is over the peak of that mix."""
    from spmdkit.models.presets import PRESETS
    from spmdkit.plan.estimate import estimate

    model, tokens = PRESETS["llama3-8b"].replace(remat="full"), 8 * 8192
    bf16, fp8 = (estimate(model.replace(fp8=on), "fsdp=8", batch_size=8, seq_len=8192) for on in (False, True))
    projections = 32 * (4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336)  # q, k, v, o + gate, up, down weights
    fp8_flops = 6 * projections * tokens * 4 / 3
    saved = fp8_flops * (1 / 989e12 - 1 / 1979e12) / 8 / 0.5  # 8 devices at the default 50% of peak
    assert bf16.compute_s - fp8.compute_s == pytest.approx(saved, rel=1e-6)
    share = 6 * projections / model.flops_per_token(8192)
    peak = 1 / (share / 1979e12 + (1 - share) / 989e12)
    assert fp8.mfu == pytest.approx(model.flops_per_token(8192) * tokens / (fp8.step_s * 8 * peak), rel=1e-9)
    assert bf16.memory == fp8.memory  # the scales are KBs; the FP8 copies of operands are temporaries
