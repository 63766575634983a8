"""A LoRA train step compiled for 4 x H100 by XLA:GPU on this machine without a GPU (#40): `spmdkit compile`'s
program (`build_program(..., abstract=True)`: the frozen base is shapes only, no `--init-from`), rank 4 on every
projection of `tiny`'s 4 blocks on fsdp=2,tensor=2. Compiled once for the module (a few seconds)."""

import jax
import pytest

from spmdkit.cli.train import parse_flags
from spmdkit.errors import SpmdkitError
from spmdkit.targets import gpu_target, target_devices
from spmdkit.targets.flags import gpu_compiler_options
from spmdkit.tools.gpu_compile import attention_in_hlo, lower_train_step, memory_bytes, planner_estimate
from spmdkit.train.config import TrainConfig
from spmdkit.train.step.program import build_program

FLAGS = "--model tiny --seq-len 128 --batch-size 8 --mesh fsdp=2,tensor=2 --lora.rank 4 --lora.alpha 8"
# tiny: embed 64, 8 heads and 4 kv heads of 8, mlp 256. Per block, A [in, 4] and B [4, out] of each projection:
# q 64 -> 8x8, k and v 64 -> 4x8, o 8x8 -> 64, gate and up 64 -> 256, down 256 -> 64 (hand count)
PER_BLOCK = sum(4 * (i + o) for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 256), (64, 256), (256, 64)])


@pytest.fixture(scope="module")
def compiled():
    """(program, optimized GPU HLO, memory) of the LoRA step on 4 compile-only H100s."""
    program = build_program(parse_flags(FLAGS.split(), TrainConfig()), target_devices("h100", 4, 4), abstract=True)
    step = lower_train_step(program).compile(compiler_options=gpu_compiler_options())
    return program, step.as_text(), memory_bytes(step)


def test_a_lora_step_compiles_for_h100_with_state_for_the_adapters_only(compiled):
    """The optimizer holds AdamW's two moments of the adapters and nothing of the base; cuDNN runs the attention;
    the step fits."""
    program, text, memory = compiled
    moments = [v for v in jax.tree.leaves(program.abstract_state().state[1]) if v.ndim]
    assert sum(v.size for v in moments) == 2 * 4 * PER_BLOCK
    assert attention_in_hlo(text) == "cudnn" and 0 < memory["total"] < gpu_target("h100").hbm_bytes


def test_the_planner_counts_the_lora_state_as_xla_does(compiled):
    """The planner's per-device parameters (the float32 base, split as the rules split it, and the adapters) and
    optimizer state (the adapters' moments) are XLA's argument bytes within 2% (the batch, 8 x 128 int32 x 2 / 2
    devices, is 4 KB of them); the gradients it counts are the adapters' alone."""
    program, _, memory = compiled
    planned = planner_estimate(program, "h100").memory
    assert planned["parameters"] + planned["optimizer"] == pytest.approx(memory["argument"], rel=0.02), planned
    assert planned["gradients"] <= 4 * 4 * PER_BLOCK  # float32 adapter gradients, at most whole on each device


def test_train_still_needs_the_base_weights():
    """Only a compile takes an abstract base: `spmdkit train`'s program refuses LoRA without `--init-from`."""
    with pytest.raises(SpmdkitError, match="--init-from"):
        build_program(parse_flags(FLAGS.split(), TrainConfig()), target_devices("h100", 4, 4))


def test_compile_decode_refuses_adapters_in_one_line():
    from spmdkit.cli.compile import parse

    with pytest.raises(SpmdkitError, match="--decode compiles generation, which runs merged weights"):
        parse("--decode --model tiny --lora.rank 4".split())
