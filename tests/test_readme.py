"""README.md runs as written: every ```python block (and the package docstring's example), each in a fresh process
on 8 simulated CPU devices (`JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=8`, as the README tells a CPU user), in a working
directory where the README's own quickstart command ran (2 steps instead of 60: the snippets read `runs/quickstart`).
Every `spmdkit` command the README gives parses, those that need 8 devices say `--cpu-devices 8`, and the SLURM
example trains with the layout `spmdkit plan` recommends (the figures in its comment included)."""

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import spmdkit
from spmdkit.cli import parse

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SNIPPET_ENV = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8"}


def code_blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", markdown, re.S | re.M)


def shell_commands(markdown: str) -> list[str]:
    """Every `spmdkit ...` command of the README's bash blocks (the part after `&&` on chained lines)."""
    lines = [line for block in code_blocks(markdown, "bash") for line in block.splitlines()]
    return [part.strip() for line in lines for part in line.split("&&") if part.strip().startswith("spmdkit ")]


def quickstart_command() -> list[str]:
    (command,) = [c for c in shell_commands(README) if "--run-dir runs/quickstart" in c]
    argv = shlex.split(command)
    argv[argv.index("--steps") + 1] = "2"  # the README's 60 steps: same run directory, same files
    return argv[1:]


@pytest.fixture(scope="module")
def readme_dir(tmp_path_factory) -> Path:
    """A working directory where the README's quickstart command ran (the `runs/quickstart` the snippets read)."""
    work = tmp_path_factory.mktemp("readme")
    done = subprocess.run(
        [sys.executable, "-m", "spmdkit", *quickstart_command(), "--no-progress"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return work


def run_snippet(code: str, cwd: Path) -> str:
    (cwd / "snippet.py").write_text(code)
    env = {**os.environ, **SNIPPET_ENV}
    done = subprocess.run([sys.executable, "snippet.py"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{code}\n---\n{done.stderr[-3000:]}"
    return done.stdout


PYTHON_BLOCKS = code_blocks(README, "python")


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs_as_written(index, readme_dir):
    out = run_snippet(PYTHON_BLOCKS[index], readme_dir)
    if "PatchMLP" in PYTHON_BLOCKS[index]:  # the own-module example: the same loss on 8 devices and on one
        (sharded, sharded_spec), (one, _) = re.findall(r"^\(([-\d.e]+), (P\(.*\))\)$", out, re.M)
        assert sharded_spec == "P('fsdp', 'tensor')" and float(one) == pytest.approx(float(sharded), rel=1e-5)


def test_package_docstring_example_runs(tmp_path):
    example = textwrap.dedent(spmdkit.__doc__.split("::\n", 1)[1])
    specs_and_losses = re.findall(r"^(P\(.*?\)) ([-\d.e]+)$", run_snippet(example, tmp_path), re.M)
    (sharded_spec, sharded), (_, one) = specs_and_losses
    assert sharded_spec == "P('fsdp', 'tensor')" and float(one) == pytest.approx(float(sharded), rel=1e-5)


def test_readme_commands_parse_and_say_how_to_run_on_a_cpu(capsys):
    commands = shell_commands(README)
    assert len(commands) >= 10
    for command in commands:
        argv = shlex.split(command, comments=True)
        try:
            parse(argv[1:])  # parses only: nothing runs
        except SystemExit as error:  # `--help` exits 0
            assert not error.code, f"README.md: `{command}`: {capsys.readouterr().err}"
        if argv[1] in ("train", "generate", "eval") and "--mesh" in argv:
            assert "--cpu-devices" in argv, f"README.md: `{command}` needs 8 devices but says nothing of --cpu-devices"


def test_slurm_example_uses_the_layout_spmdkit_plan_recommends():
    script = (ROOT / "scripts" / "slurm_70b_example.sh").read_text()
    (plan_command,) = re.findall(r"`(spmdkit plan [^`]+)` recommends", script)
    plan = subprocess.run(
        [sys.executable, "-m", "spmdkit", *shlex.split(plan_command)[1:], "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr[-2000:]
    best = json.loads(plan.stdout)["recommended"]
    srun = shlex.split(script[script.index("\nsrun ") :].replace("\\\n", " "))
    flag = {name: srun[srun.index(name) + 1] for name in ("--mesh", "--zero", "--remat", "--batch-size", "--seq-len")}
    mesh = ",".join(f"{axis}={size}" for axis, size in best["mesh"].items() if size > 1)
    assert flag == {
        "--mesh": mesh,
        "--zero": str(best["zero"]),
        "--remat": best["remat"],
        "--batch-size": str(best["batch_size"]),
        "--seq-len": str(best["seq_len"]),
    }
    assert ("--sequence-parallel" in srun) == best["sequence_parallel"]
    accumulation = srun[srun.index("--grad-accum") + 1] if "--grad-accum" in srun else "1"
    assert accumulation == str(best["microbatches"])
    figures = (
        f"~{best['total_memory'] / 1e9:.1f} of {best['hbm_bytes'] / 1e9:.0f} GB per GPU, ~{best['step_s']:.1f} s per "
        f"step, ~{round(best['tokens_per_s'], -2):,.0f} tokens/s, ~{best['mfu'] * 100:.0f}% MFU"
    )
    assert figures in " ".join(line.lstrip("# ") for line in script.splitlines()), figures
