"""Bad input across the commands, as a table: argv -> exit code and message fragment. Every case must end as one
line (`spmdkit: error: ...`, no traceback, no usage dump; `ckpt verify` reports damage and exits 1), and leave every
file of the fixture directory as it was, with nothing new written.

The commands run in this process (`spmdkit.cli.main`), which is fast because every case fails before JAX computes;
the resume refusals build the model state first (one small compilation). The Hugging Face models the `import-hf`
and `--init-from` cases read are transformers' own saves, then damaged as downloads and hand edits are; the
prepared dataset is `spmdkit data prepare`'s.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from support import file_hashes, flip_byte, read_only_dir

from spmdkit.checkpoint.manager import Checkpointer
from spmdkit.cli import main
from spmdkit.cli.train import parse
from spmdkit.data.config import DataConfig
from spmdkit.data.stream import make_data
from spmdkit.errors import SpmdkitError
from spmdkit.sharding.mesh import MeshConfig, make_mesh
from spmdkit.sharding.rules import make_rules
from spmdkit.train.config import (
    CheckpointSettings,
    MeshSettings,
    ModelSettings,
    OptimizerConfig,
    RunSettings,
    TrainConfig,
    apply_overrides,
    config_from_json,
)  # fmt: skip
from spmdkit.train.step.optimizer import make_optimizer
from spmdkit.train.step.program import resolve_config
from spmdkit.train.step.state import abstract_train_state

TRAIN = "train --steps 2 --seq-len 32 --batch-size 8 --dtype float32 --eval-every 0 --no-progress --mesh fsdp=8"
RUN = [*TRAIN.split(), "--run-dir", "{D}/run"]  # the run of {D}/run/checkpoints (step 4)
FRESH = [*TRAIN.split(), "--run-dir", "{D}/fresh"]  # a run directory that does not exist yet
PREPARE = ["--tokenizer", "bytes", "--out", "{D}/new", "--no-progress"]
IMPORT = ["--out", "{D}/new"]
CHAT = ["--chat", "--seq-len", "64", "--out", "{D}/new", "--no-progress", "--tokenizer"]

TOML = {
    "bad-syntax.toml": "[run\nsteps = 3\n",
    "bool-steps.toml": "[run]\nsteps = true\n",
    "fail-steps.toml": '[run]\nfail_steps = ["a"]\n',
    "no-section.toml": "[nosuch]\nsteps = 3\n",
    "no-key.toml": "[run]\nnosuch = 3\n",
    "table-value.toml": "[run.steps]\nx = 1\n",
    "bad-choice.toml": '[model]\ndtype = "f8"\n',
}

CASES = [
    # -- train: values (parsed by tyro, checked by the config dataclasses)
    ([*FRESH, "--steps", "0"], 2, "--steps must be at least 1"),
    ([*FRESH, "--steps", "abc"], 2, "--steps/--run.steps: invalid literal for int()"),
    ([*FRESH, "--seed", "-1"], 2, "--seed -1 must be >= 0"),
    ([*FRESH, "--lr", "nan"], 2, "learning rate nan must be a positive number"),
    ([*FRESH, "--lr", "-1"], 2, "learning rate -1.0 must be a positive number"),
    ([*FRESH, "--max-bad-steps", "0"], 2, "--max-bad-steps 0 must be at least 1"),
    ([*FRESH, "--max-bad-steps", "-3"], 2, "--max-bad-steps -3 must be at least 1"),
    ([*FRESH, "--eval-every", "-1"], 2, "--eval-every -1 must be >= 0"),
    ([*FRESH, "--weight-decay", "-0.1"], 2, "--weight-decay -0.1 must be >= 0"),
    ([*FRESH, "--clip-norm", "0"], 2, "--clip-norm 0.0 must be positive"),
    ([*FRESH, "--peak-tflops", "-5"], 2, "--peak-tflops -5.0 must be positive"),
    ([*FRESH, "--optimizer.b1", "2.0"], 2, "AdamW b1=2.0 must be in [0, 1)"),
    ([*FRESH, "--optimizer.eps", "-1"], 2, "AdamW eps=-1.0 must be positive"),
    ([*FRESH, "--optimizer.name", "sgd"], 2, "invalid choice 'sgd' for --optimizer.name"),
    ([*FRESH, "--optimizer.muon-beta", "0.9"], 2, "--optimizer.muon-beta is a Muon setting: add --optimizer.name muon"),
    ([*FRESH, "--optimizer.name", "muon", "--optimizer.offload"], 2, "--optimizer.offload moves AdamW's moments only"),
    ([*FRESH, "--virtual-stages", "0"], 2, "--virtual-stages 0 must be at least 1"),
    ([*FRESH, "--microbatches", "0"], 2, "--microbatches 0 must be >= 1"),
    ([*FRESH, "--grad-accum", "0"], 2, "--grad-accum must be at least 1"),
    ([*FRESH, "--microbatches", "2"], 2, "--microbatches counts a pipeline's microbatches: without one, set --grad"),
    ([*FRESH, "--log-every", "0"], 2, "--log-every must be at least 1"),
    ([*FRESH, "--profile-steps", "3:5"], 2, "--profile-steps 3:5 lies past --steps 2: profile steps within 1:2"),
    ([*FRESH, "--keep", "0"], 2, "--keep must be at least 1"),
    ([*FRESH, "--checkpoint-every", "-1"], 2, "--checkpoint-every must be >= 0"),
    ([*FRESH, "--health.step-timeout", "-1"], 2, "--health.step-timeout must be >= 0"),
    ([*FRESH, "--health.straggler-windows", "0"], 2, "--health.straggler-windows must be at least 1"),
    ([*FRESH, "--checkpoint.local-every", "2"], 2, "--checkpoint.local-dir None and --checkpoint.local-every 2 go"),
    ([*FRESH, "--zero", "4"], 2, "invalid choice '4' for --zero/--mesh.zero: expected one of 0, 1, 2, 3"),
    ([*FRESH, "--dtype", "float8"], 2, "invalid choice 'float8' for --dtype/--model.dtype"),
    ([*FRESH, "--bogus-flag"], 2, "unrecognized arguments: --bogus-flag"),
    ([*FRESH, "--model", "huge"], 2, "unknown model preset 'huge'"),
    ([*FRESH, "--model.layers", "0"], 2, "model layers=0 must be positive"),
    ([*FRESH, "--model.kv-heads", "3"], 2, "heads=8 is not a multiple of kv_heads=3"),
    ([*FRESH, "--data.eval-fraction", "1.5"], 2, "eval_fraction=1.5 is out of range"),
    # -- train: mesh and layout
    ([*FRESH, "--mesh", "data=3"], 2, "has 3 devices but 8 are present"),
    ([*FRESH, "--mesh", "fsdp=4,bogus=2"], 2, "bogus"),
    ([*FRESH, "--dcn", "fsdp=2"], 2, "--dcn fsdp=2 says axes span nodes, but this run has one process"),
    ([*FRESH, "--batch-size", "3"], 2, "over data x fsdp x expert = 8 devices"),
    # -- train: --config files
    ([*FRESH, "--config", "{D}/missing.toml"], 2, "missing.toml does not exist"),
    ([*FRESH, "--config", "{D}/latin1.toml"], 2, "is not valid UTF-8 TOML"),
    ([*FRESH, "--config", "{D}/bad-syntax.toml"], 2, "is not valid UTF-8 TOML"),
    ([*FRESH, "--config", "{D}/bool-steps.toml"], 2, "bool-steps.toml: run.steps=True must be of type int"),
    ([*FRESH, "--config", "{D}/fail-steps.toml"], 2, "run.fail_steps=('a',) must be of type tuple[int, ...]"),
    ([*FRESH, "--config", "{D}/no-section.toml"], 2, "no-section.toml: unknown config section [nosuch]"),
    ([*FRESH, "--config", "{D}/no-key.toml"], 2, "no-key.toml: unknown config key run.nosuch"),
    ([*FRESH, "--config", "{D}/bad-choice.toml"], 2, "bad-choice.toml: model.dtype='f8' must be of type Literal["),
    ([*FRESH, "--config", "{D}/table-value.toml"], 2, "run.steps={{'x': 1}} must be of type int"),
    # -- train: paths
    ([*TRAIN.split(), "--run-dir", "{D}/afile"], 2, "--run-dir {D}/afile is a file: pass a directory"),
    ([*TRAIN.split(), "--run-dir", "{D}/afile/sub"], 2, "lies under {D}/afile, which is a file"),
    ([*FRESH, "--checkpoint-dir", "{D}/afile"], 2, "--checkpoint-dir {D}/afile is a file"),
    ([*TRAIN.split(), "--run-dir", "{D}/readonly/run"], 2, "--run-dir {D}/readonly/run is not writable"),
    # -- train: data
    ([*FRESH, "--data", "{D}/missing.bin"], 2, "missing.bin' not found"),
    ([*FRESH, "--data", "{D}/tokens.txt"], 2, "has unknown extension '.txt'"),
    ([*FRESH, "--data", "{D}/odd.bin"], 2, "not a multiple of 2 (uint16)"),
    ([*FRESH, "--data", "{D}/floats.npy"], 2, "holds float32 values"),
    ([*FRESH, "--data", "{D}/big-ids.npy"], 2, "holds token id 300 but vocab_size is 264"),
    ([*FRESH, "--data", "{D}/tiny.npy"], 2, "shorter than one sequence"),
    ([*FRESH, "--data", "{D}/short.npy", "--eval-every", "5"], 2, "or pass --eval-every 0 to train without"),
    # -- train: resuming the run in {D}/run (saved at step 4 with batch 8 x 32, seed 0, the stdlib data)
    ([*RUN, "--no-resume"], 2, "--no-resume, but {D}/run/checkpoints already holds step 4 of an earlier run"),
    ([*RUN, "--steps", "6", "--batch-size", "16"], 2, "was saved with --batch-size 8, this run has 16"),
    ([*RUN, "--steps", "6", "--seq-len", "64"], 2, "was saved with --seq-len 32, this run has 64"),
    ([*RUN, "--steps", "6", "--seed", "1"], 2, "was saved with --seed 0, this run has 1"),
    ([*RUN, "--steps", "6", "--data", "synthetic"], 2, "was saved with --data stdlib, this run has synthetic"),
    ([*RUN, "--steps", "6", "--model.layers", "2", "--allow-config-change", "layers"], 2, "does not match this model"),
    # the model's function and the optimizer: refused unless --allow-config-change names the field
    ([*RUN, "--steps", "6", "--model.layers", "2"], 2, "optimizer settings (--model.layers 4 -> 2): pass the saved"),
    ([*RUN, "--steps", "6", "--model.activation", "gelu"], 2, "optimizer settings (--model.activation silu -> gelu)"),
    ([*RUN, "--steps", "6", "--model.rope-theta", "500000"], 2, "settings (--model.rope-theta 10000.0 -> 500000.0)"),
    ([*RUN, "--steps", "6", "--model.norm-eps", "0.1"], 2, "optimizer settings (--model.norm-eps 1e-05 -> 0.1)"),
    ([*RUN, "--steps", "6", "--model.sliding-window", "4"], 2, "optimizer settings (--model.sliding-window 0 -> 4)"),
    ([*RUN, "--steps", "6", "--model.attention-softcap", "2"], 2, "settings (--model.attention-softcap 0.0 -> 2.0)"),
    ([*RUN, "--steps", "6", "--model.z-loss", "0.5"], 2, "optimizer settings (--model.z-loss 0.0 -> 0.5): pass"),
    (
        [
            *RUN,
            "--steps",
            "6",
            "--model.logit-softcap",
            "1",
            "--model.z-loss",
            "0.5",
            "--allow-config-change",
            "z_loss",
        ],
        2,
        "optimizer settings (--model.logit-softcap 0.0 -> 1.0): pass the saved values to continue it",
    ),
    ([*RUN, "--steps", "6", "--lr", "0.0005"], 2, "optimizer settings (--lr 0.003 -> 0.0005): pass the saved values"),
    ([*RUN, "--steps", "6", "--allow-config-change", "nosuch"], 2, "--allow-config-change nosuch: not a model or"),
    ([*RUN, "--steps", "6", "--allow-config-change", "remat"], 2, "--allow-config-change remat: not a model or"),
    # -- train: --init-from (HF models of vocab 128: the synthetic data fits them)
    ([*FRESH, "--init-from", "{D}/missing"], 2, "{D}/missing does not exist: pass a Hugging Face model directory"),
    ([*FRESH, "--init-from", "{D}/empty"], 2, "{D}/empty is neither a Hugging Face model directory nor an spmdkit"),
    ([*FRESH, "--init-from", "{D}/gpt2"], 2, "model_type='gpt2' is not a family spmdkit runs"),
    ([*FRESH, "--init-from", "{D}/hf", "--model.layers", "3"], 2, "--model.layers 3 conflicts with --init-from"),
    ([*FRESH, "--init-from", "{D}/hf", "--model", "125m"], 2, "--model 125m conflicts with --init-from"),
    ([*FRESH, "--init-from", "{D}/run", "--model.embed", "48"], 2, "--model.embed 48 conflicts with --init-from"),
    ([*FRESH, "--init-from", "{D}/sharded", "--data", "synthetic"], 2, "missing shard {D}/sharded/model-00002-of"),
    ([*FRESH, "--init-from", "{D}/hf-quantized", "--data", "synthetic"], 2, "quantization_config is not supported"),
    ([*FRESH, "--init-from", "{D}/hf"], 2, "the stdlib source needs vocab_size >= 264"),
    # -- train: --lora (adapters on frozen --init-from weights)
    ([*FRESH, "--lora.rank", "4"], 2, "--lora.rank trains adapters on frozen weights: give them with --init-from"),
    ([*FRESH, "--lora.rank", "4", "--lora.targets", "q,qkv"], 2, "--lora.targets 'q,qkv': qkv is not a projection"),
    ([*FRESH, "--init-from", "{D}/hf", "--lora.rank", "4", "--overlap-tp"], 2, "--lora does not run with --overlap-tp"),
    (
        [*FRESH, "--init-from", "{D}/hf", "--lora.rank", "4", "--optimizer.name", "muon"],
        2,
        "--lora does not run with --optimizer.name muon",
    ),
    # -- train: --data DIR (a prepared dataset)
    ([*FRESH, "--data", "{D}/texts"], 2, "{D}/texts is not a prepared dataset (it is a directory without dataset"),
    ([*FRESH, "--data", "{D}/empty"], 2, "{D}/empty is not a prepared dataset"),
    ([*FRESH, "--data", "{D}/ds-badjson"], 2, "ds-badjson/dataset.json is not JSON"),
    ([*FRESH, "--data", "{D}/ds-noshard"], 2, "ds-noshard/tokens-00000.bin is missing"),
    ([*FRESH, "--data", "{D}/ds", "--seq-len", "8192"], 2, "rows of seq_len 8192, fewer than one global batch"),
    ([*FRESH, "--data", "{D}/ds", "--model.vocab-size", "100"], 2, "vocab_size 100 is smaller than the 264 ids"),
    # -- data prepare / inspect / verify
    (["data", "prepare", "{D}/missing.txt", *PREPARE], 2, "input '{D}/missing.txt' not found"),
    (["data", "prepare", "{D}/texts", "--tokenizer", "nope", "--out", "{D}/new"], 2, "tokenizer 'nope' not found"),
    (["data", "prepare", "{D}/texts", "--tokenizer", "bpe:abc", "--out", "{D}/new"], 2, "use bpe:N with N in"),
    (["data", "prepare", "{D}/texts", "--tokenizer", "{D}/afile", "--out", "{D}/new"], 2, "not a tokenizers"),
    (["data", "prepare", "{D}/texts", "--tokenizer", "{D}/empty", "--out", "{D}/new"], 2, "has no tokenizer.json"),
    (["data", "prepare", "{D}/texts", "--tokenizer", "bytes", "--out", "{D}/ds"], 2, "--out {D}/ds already exists"),
    (["data", "prepare", "{D}/texts", "--tokenizer", "bytes", "--out", "{D}/afile"], 2, "{D}/afile already exists"),
    (["data", "prepare", "{D}/texts", "--tokenizer", "bytes", "--out", "{D}/afile/ds"], 2, "which is a file"),
    (["data", "prepare", "{D}/texts", "--tokenizer", "bytes", "--out", "{D}/readonly/ds"], 2, "is not writable"),
    (["data", "prepare", "{D}/texts", *PREPARE, "--shard-tokens", "0"], 2, "--shard-tokens 0 must be positive"),
    (["data", "prepare", "{D}/texts", *PREPARE, "--glob", "*.nothing"], 2, "no files match --glob '*.nothing'"),
    (["data", "prepare", "{D}/docs.jsonl", *PREPARE], 2, "docs.jsonl:1: no key 'text' (keys: body): pass --text-key"),
    (["data", "prepare", "{D}/latin1.txt", *PREPARE], 2, "latin1.txt:1: not UTF-8 (byte 0xe9 at offset 3)"),
    (["data", "prepare", "{D}/texts", *PREPARE, "--dtype", "uint8"], 2, "argument --dtype: invalid choice: 'uint8'"),
    (["data", "prepare", "{D}/texts", "--out", "{D}/new"], 2, "the following arguments are required: --tokenizer"),
    (["data", "prepare", "{D}/nomsg.jsonl", *CHAT, "{D}/chat-tok"], 2, "nomsg.jsonl:1: no key 'messages' (keys: text)"),
    (
        ["data", "prepare", "{D}/system.jsonl", *CHAT, "{D}/chat-tok"],
        2,
        "system.jsonl:1: the chat template refuses it: System role not supported",
    ),
    (["data", "prepare", "{D}/system.jsonl", *CHAT, "{D}/nochat-tok"], 2, "no chat template (no chat_template.jinja,"),
    (["data", "verify", "{D}/chat-flipped"], 2, "{D}/chat-flipped/mask-00000.bin is damaged at token offset 0"),
    (["data", "inspect", "{D}/chat-short"], 2, "chat-short/mask-00000.bin does not hold one byte per token of its"),
    (["data", "inspect", "{D}/missing"], 2, "{D}/missing is not a prepared dataset"),
    (["data", "verify", "{D}/ds-noshard"], 2, "ds-noshard/tokens-00000.bin is missing"),
    # -- ckpt import-hf / export
    (["ckpt", "import-hf", "{D}/empty", *IMPORT], 2, "{D}/empty is neither a Hugging Face model directory"),
    (["ckpt", "import-hf", "{D}/missing", *IMPORT], 2, "{D}/missing does not exist"),
    (["ckpt", "import-hf", "{D}/afile", *IMPORT], 2, "{D}/afile is not a .safetensors file, an index or config"),
    (["ckpt", "import-hf", "{D}/run", *IMPORT], 2, "{D}/run is an spmdkit checkpoint, not a Hugging Face model"),
    (
        ["ckpt", "import-hf", "{D}/gpt2", *IMPORT],
        2,
        "model_type='gpt2' is not a family spmdkit runs (llama, mistral, qwen2, qwen3, gemma, ",
    ),
    (["ckpt", "import-hf", "{D}/sharded", *IMPORT], 2, "missing shard {D}/sharded/model-00002-of-"),
    (["ckpt", "import-hf", "{D}/sharded/model.safetensors.index.json", *IMPORT], 2, "(listed in model.safetensors"),
    (["ckpt", "import-hf", "{D}/hf-quantized", *IMPORT], 2, "config.json: quantization_config is not supported"),
    (["ckpt", "import-hf", "{D}/hf-no-config", *IMPORT], 2, "holds safetensors files but no config.json"),
    (["ckpt", "import-hf", "{D}/hf-bad-config", *IMPORT], 2, "hf-bad-config/config.json is not valid JSON"),
    (["ckpt", "import-hf", "{D}/hf", "--out", "{D}/texts"], 2, "{D}/texts is not empty: pass a new directory"),
    (["ckpt", "import-hf", "{D}/hf", "--out", "{D}/afile"], 2, "{D}/afile is a file: pass a new directory"),
    (["ckpt", "import-hf", "{D}/hf", "--out", "{D}/afile/sub"], 2, "lies under {D}/afile, which is a file"),
    (["ckpt", "import-hf", "{D}/hf", "--out", "{D}/readonly/x"], 2, "{D}/readonly is not writable"),
    (["ckpt", "import-hf", "{D}/hf", *IMPORT, "--mesh", "fsdp=3"], 2, "has 3 devices but 8 are present"),
    (["ckpt", "export", "{D}/run", "--out", "{D}/run"], 2, "--out {D}/run is {D}/run, which this command reads"),
    (["ckpt", "export", "{D}/run", "--out", "{D}/afile"], 2, "{D}/afile already exists and is not empty"),
    (["ckpt", "export", "{D}/run", "--out", "{D}/afile/hf"], 2, "lies under {D}/afile, which is a file"),
    (["ckpt", "export", "{D}/run", "--out", "{D}/readonly/hf"], 2, "{D}/readonly is not writable"),
    (["ckpt", "export", "{D}/missing", "--out", "{D}/new"], 2, "{D}/missing does not exist"),
    (["ckpt", "export", "{D}/empty", "--out", "{D}/new"], 2, "no checkpoint steps in {D}/empty"),
    (["ckpt", "export", "{D}/run", "--out", "{D}/new", "--step", "7"], 2, "step 7 is not in {D}/run/checkpoints"),
    (["ckpt", "export", "{D}/damaged", "--out", "{D}/new"], 2, "step 4 in {D}/damaged is damaged"),
    # -- ckpt inspect / verify / reshard
    (["ckpt", "inspect", "{D}/missing"], 2, "does not exist: check the path"),
    (["ckpt", "inspect", "{D}/afile"], 2, "{D}/afile is a file: pass a directory"),
    (["ckpt", "inspect", "{D}/empty"], 2, "no checkpoint steps in {D}/empty"),
    (["ckpt", "inspect", "{D}/run", "--step", "99"], 2, "step 99 is not in {D}/run/checkpoints"),
    (["ckpt", "inspect", "{D}/run", "--step", "x"], 2, "argument --step: invalid int value: 'x'"),
    (["ckpt", "verify", "{D}/missing"], 2, "does not exist: check the path"),
    (["ckpt", "verify", "{D}/empty"], 2, "no checkpoint steps in"),
    (["ckpt", "verify", "{D}/damaged"], 1, "step 4: DAMAGED (checksum mismatch in model/embedding"),
    (["ckpt", "reshard", "{D}/missing", "--mesh", "fsdp=8", "--out", "{D}/new"], 2, "does not exist"),
    (["ckpt", "reshard", "{D}/run", "--mesh", "fsdp=8", "--out", "{D}/afile"], 2, "{D}/afile is a file"),
    (["ckpt", "reshard", "{D}/run", "--mesh", "fsdp=8", "--out", "{D}/run"], 2, "--out {D}/run is {D}/run, which"),
    (["ckpt", "reshard", "{D}/run", "--mesh", "bogus=8", "--out", "{D}/new"], 2, "bogus"),
    (["ckpt", "reshard", "{D}/run", "--mesh", "fsdp=3", "--out", "{D}/new"], 2, "has 3 devices but 8 are present"),
    (["ckpt", "reshard", "{D}/run", "--mesh", "fsdp=8", "--out", "{D}/new", "--step", "3"], 2, "step 3 is not in"),
    (["ckpt", "reshard", "{D}/damaged", "--mesh", "fsdp=8", "--out", "{D}/new"], 2, "step 4 in {D}/damaged is damaged"),
    (["ckpt", "reshard", "{D}/run", "--out", "{D}/new"], 2, "the following arguments are required: --mesh"),
    (["ckpt"], 2, "the following arguments are required"),
    (["ckpt", "bogus"], 2, "invalid choice: 'bogus'"),
    # -- plan
    (["plan", "--devices", "0"], 2, "--devices, --seq-len and --batch-size must be positive"),
    (["plan", "--zero", "7"], 2, "--zero 7 is not one of 0, 1, 2, 3"),
    (["plan", "--pipeline-schedule", "bogus"], 2, "unknown --pipeline-schedule 'bogus'"),
    (["plan", "--model", "nope"], 2, "unknown model preset 'nope'"),
    (["plan", "--device-type", "nope"], 2, "nope"),
    (["plan", "--mesh", "fsdp=3", "--devices", "8"], 2, "fsdp=3"),
    (["plan", "--efficiency", "2"], 2, "--efficiency in (0, 1]"),
    (["plan", "--top", "0"], 2, "--top must be positive"),
    (["plan", "--gpus", "64"], 2, "unrecognized arguments: --gpus 64"),
    (["plan", "--seq-len", "abc"], 2, "argument --seq-len: invalid int value: 'abc'"),
    (["plan", "--model", "125m", "--plot", "{D}/missing/plan.png"], 2, "directory {D}/missing does not exist"),
    (["plan", "--model", "125m", "--plot", "{D}/empty"], 2, "--plot {D}/empty is a directory"),
    (["plan", "--model", "125m", "--plot", "{D}/plan.nope"], 2, "Format 'nope' is not supported"),
    # -- launch
    (["launch", "--processes", "2", "--port", "99999", "--", "spmdkit", "train"], 2, "--port 99999 is not a TCP port"),
    (["launch", "--processes", "0", "--", "spmdkit", "train"], 2, "--processes 0 and --devices-per-process None"),
    (["launch", "--processes", "2", "--devices-per-process", "0", "--", "spmdkit"], 2, "must be >= 1"),
    (["launch", "--processes", "2", "--", "no-such-command-xyz"], 2, "command 'no-such-command-xyz' not found"),
    (["launch", "--processes", "2"], 2, "no command to run"),
    (["launch", "--processes", "2", "--", "spmdkit", "train", "--cpu-devices", "8"], 2, "mismatched device counts"),
    (["launch", "--processes", "2", "--grace", "-1", "--", "spmdkit", "train"], 2, "--grace -1.0 must be >= 0"),
    (["launch", "--processes", "2", "--max-restarts", "-1", "--", "spmdkit"], 2, "--max-restarts -1 must be in 0-100"),
    (["launch", "--slurm", "--processes", "2", "--", "spmdkit"], 2, "--slurm takes --nodes K"),
    (["launch", "--nodes", "2", "--", "spmdkit"], 2, "--nodes goes with --slurm; a local run takes --processes N"),
    # -- bench
    (["bench", "--steps", "-1"], 2, "--steps -1 must be at least 1"),
    (["bench", "--warmup", "-1"], 2, "--warmup -1 must be at least 0"),
    (["bench", "--batch-size", "0"], 2, "--batch-size 0 must be at least 1"),
    (["bench", "--microbatches", "0"], 2, "--microbatches 0 must be at least 1"),
    (["bench", "--model", "nope"], 2, "unknown model preset 'nope'"),
    (["bench", "--dtype", "float8"], 2, "model.dtype='float8' must be of type Literal["),
    (["bench", "--out", "{D}/afile"], 2, "--out {D}/afile is a file"),
    (["bench", "--strategies", "nope"], 2, "invalid choice: 'nope'"),
    # -- the command itself
    (["bogus"], 2, "unknown command 'bogus'"),
]


# Run directories, outputs and checkpoint files (issue 26): one writer per run directory ({D}/locked: its lock held by
# this process), no output into a command's own input or a directory it does not own, iterator states and configs
# covered by the step's checksums, and the one-line messages of generate / eval. Fixtures: `_guarded_fixtures`.
IN_USE = "is in use by spmdkit train (pid {PID} on host"
CASES += [
    # -- one writer per run directory
    ([*TRAIN.split(), "--run-dir", "{D}/locked"], 2, "--run-dir {D}/locked " + IN_USE),
    ([*FRESH, "--checkpoint-dir", "{D}/locked/checkpoints"], 2, "lies in the run directory {D}/locked, which is in"),
    (["ckpt", "export", "{D}/run", "--out", "{D}/locked/hf"], 2, "--out {D}/locked/hf lies in the run directory"),
    (["ckpt", "reshard", "{D}/run", "--mesh", "fsdp=8", "--out", "{D}/locked/new"], 2, "{D}/locked, which " + IN_USE),
    (["ckpt", "import-hf", "{D}/hf", "--out", "{D}/locked/imported"], 2, "{D}/locked, which " + IN_USE),
    # -- no command writes into a directory it does not own
    ([*TRAIN.split(), "--run-dir", "{D}/hf"], 2, "--run-dir {D}/hf holds a Hugging Face model's config.json"),
    ([*TRAIN.split(), "--run-dir", "{D}/userdir"], 2, "{D}/userdir holds a config.json that is not an spmdkit run's"),
    ([*TRAIN.split(), "--run-dir", "{D}/texts"], 2, "{D}/texts holds files that are not an spmdkit run's (a.txt)"),
    ([*TRAIN.split(), "--run-dir", "{D}/ds"], 2, "{D}/ds holds files that are not an spmdkit run's"),
    (["ckpt", "export", "{D}/run", "--out", "{D}/run", "--force"], 2, "--out {D}/run is {D}/run, which this command"),
    (["ckpt", "export", "{D}/run", "--out", "{D}/run/checkpoints", "--force"], 2, "lies inside {D}/run, which this"),
    (["ckpt", "export", "{D}/run", "--out", "{D}", "--force"], 2, "--out {D} contains {D}/run, which this command"),
    (["ckpt", "export", "{D}/run/checkpoints", "--out", "{D}/run/checkpoints/hf", "--force"], 2, "lies inside"),
    (
        ["ckpt", "export", "{D}/run", "--out", "{D}/texts", "--force"],
        2,
        "only an earlier export, but {D}/texts holds a",
    ),
    (
        ["ckpt", "export", "{D}/run", "--out", "{D}/nockpt", "--force"],
        2,
        "{D}/nockpt holds metrics.jsonl: it is not one",
    ),
    (["ckpt", "export", "{D}/run", "--out", "{D}/afile", "--force"], 2, "{D}/afile is a file: it is not one"),
    (["ckpt", "export", "{D}/run", "--out", "{D}/hf", "--force"], 2, "{D}/hf has no .spmdkit-export (a directory spmd"),
    (["ckpt", "export", "{D}/run", "--out", "{D}/damaged/hf"], 2, "lies inside the checkpoint directory {D}/damaged"),
    (["ckpt", "reshard", "{D}/run", "--mesh", "fsdp=8", "--out", "{D}/run/checkpoints/new"], 2, "lies inside {D}/run"),
    (["ckpt", "reshard", "{D}/run", "--mesh", "fsdp=8", "--out", "{D}"], 2, "--out {D} contains {D}/run"),
    (["ckpt", "reshard", "{D}/run", "--mesh", "fsdp=8", "--out", "{D}/damaged/new"], 2, "checkpoint directory {D}/dam"),
    (["ckpt", "import-hf", "{D}/hf", "--out", "{D}/hf/ckpt"], 2, "--out {D}/hf/ckpt lies inside {D}/hf, which this"),
    (["ckpt", "import-hf", "{D}/hf/model.safetensors", "--out", "{D}/hf/ckpt"], 2, "lies inside {D}/hf, which"),
    (
        ["ckpt", "import-hf", "{D}/hf", "--out", "{D}/damaged/imported"],
        2,
        "inside the checkpoint directory {D}/damaged",
    ),
    # -- import-hf: an index naming shard files outside its model directory
    (["ckpt", "import-hf", "{D}/hf-escape", *IMPORT], 2, "to '../hf/model.safetensors', outside the model directory"),
    (["ckpt", "import-hf", "{D}/hf-absolute", *IMPORT], 2, "outside the model directory {D}/hf-absolute: refused"),
    (["ckpt", "import-hf", "{D}/hf-symlink", *IMPORT], 2, "outside the model directory {D}/hf-symlink: refused"),
    ([*FRESH, "--init-from", "{D}/hf-escape", "--data", "synthetic"], 2, "outside the model directory {D}/hf-escape"),
    # -- checkpoints: the data-iterator state and the config are checksummed, and the iterator state bounded
    (["ckpt", "verify", "{D}/bad-iter"], 1, "step 4: DAMAGED (checksum mismatch in data/process_0-of-1.json)"),
    (["ckpt", "verify", "{D}/bad-config"], 1, "step 4: DAMAGED (checksum mismatch in config/metadata)"),
    (["ckpt", "verify", "{D}/old-iter"], 1, "says next_index 1000000000000, but step 4 has read 4 batches"),
    (["ckpt", "export", "{D}/bad-iter", "--out", "{D}/new"], 2, "step 4 in {D}/bad-iter is damaged (checksum mismatch"),
    (["ckpt", "reshard", "{D}/old-iter", "--mesh", "fsdp=8", "--out", "{D}/new"], 2, "{D}/old-iter is damaged (data/"),
    # -- a step directory where a checkpoint directory is expected
    (
        ["ckpt", "inspect", "{D}/run/checkpoints/4"],
        2,
        "is step 4 of the checkpoint directory {D}/run/checkpoints: pass",
    ),
    (["ckpt", "verify", "{D}/run/checkpoints/4"], 2, "pass {D}/run/checkpoints (verify reads every step)"),
    (["ckpt", "export", "{D}/run/checkpoints/4", "--out", "{D}/new"], 2, "pass {D}/run/checkpoints with --step 4"),
    (["ckpt", "reshard", "{D}/run/checkpoints/4", "--mesh", "fsdp=8", "--out", "{D}/new"], 2, "is step 4 of the"),
    (["generate", "{D}/run/checkpoints/4", "--prompt", "hi"], 2, "{D}/run/checkpoints/4 is step 4 of the checkpoint"),
    # -- generate / eval: one line each, before and after the model is read
    (["generate", "{D}/run", "--prompt-file", "/dev/zero"], 2, "--prompt-file /dev/zero is larger than 1 MiB"),
    (["generate", "{D}/run", "--chat", "--prompt", "hi"], 2, "--chat: prompt 1 is not JSON (Expecting value at column"),
    (["generate", "{D}/run", "--chat", "--prompt", '["hi"]'], 2, "message 1 of 'messages' is not an object"),
    (["generate", "{D}/run", "--prompt-file", "{D}/big-prompt.txt"], 2, "big-prompt.txt is larger than 1 MiB"),
    (["generate", "{D}/nockpt", "--prompt", "hi"], 2, "{D}/nockpt is an spmdkit run directory without checkpoints"),
    (["eval", "{D}/nockpt"], 2, "{D}/nockpt is an spmdkit run directory without checkpoints"),
    (["eval", "{D}/run", "--seq-len", "0"], 2, "--seq-len 0 must be at least 1"),
    (["eval", "{D}/run", "--seq-len", "-5"], 2, "--seq-len -5 must be at least 1"),
    (["eval", "{D}/run", "--batch-size", "0"], 2, "--batch-size 0 must be at least 1"),
    (
        ["generate", "{D}/run", "--prompt", "hi", "--max-new-tokens", "1000000000"],
        2,
        "--max-new-tokens 1000000000 does not fit: the longest prompt has 3 tokens and the model's context is 32",
    ),
    (["generate", "{D}/run-notok", "--prompt", "hi"], 2, "{D}/run-notok/checkpoints/hf/tokenizer.json is missing"),
    (["eval", "{D}/run-notok"], 2, "{D}/run-notok/checkpoints/hf/tokenizer.json is missing"),
    (["nonsense"], 2, "'nonsense': choose one of train, data, ckpt, plan, compile, launch, bench, generate, eval"),
    # -- data: inputs, outputs and prepared datasets checked when opened
    (["data", "prepare", "{D}/texts", "--glob", "/etc/*", *PREPARE], 2, "--glob '/etc/*' must be a pattern inside"),
    (["data", "prepare", "{D}/texts", "--glob", "../*", *PREPARE], 2, "--glob '../*' must be a pattern inside"),
    (["data", "prepare", "{D}/texts", "{D}/texts", *PREPARE], 2, "INPUT {D}/texts is given again"),
    (["data", "prepare", "{D}/texts/a.txt", "{D}/texts", *PREPARE], 2, "{D}/texts/a.txt lies inside INPUT {D}/texts"),
    (
        ["data", "prepare", "{D}/texts", "--tokenizer", "bytes", "--out", "{D}/texts/out", "--no-progress"],
        2,
        "--out {D}/texts/out lies inside INPUT {D}/texts",
    ),
    (["data", "prepare", "{D}/lone.jsonl", *PREPARE], 2, "'text' holds a lone surrogate (\\ud800 at character 1)"),
    (["data", "verify", "{D}/ds-pickled"], 2, "documents.npy is not a plain numeric .npy array"),
    (["data", "inspect", "{D}/ds-pickled"], 2, "documents.npy is not a plain numeric .npy array"),
    ([*FRESH, "--data", "{D}/ds-pickled"], 2, "documents.npy is not a plain numeric .npy array"),
    (["data", "verify", "{D}/ds-escape"], 2, "names the file '../../x.bin', which is not a plain name inside"),
    (["data", "inspect", "{D}/ds-absolute"], 2, "which is not a plain name inside the dataset"),
    ([*FRESH, "--data", "{D}/ds-escape"], 2, "names the file '../../x.bin', which is not a plain name inside"),
    (["data", "verify", "{D}/ds-nosha"], 2, "dataset.json shard 0 lacks or mangles sha256"),
    (["data", "verify", "{D}/ds-flipped"], 2, "{D}/ds-flipped/tokens-00000.bin is damaged at token offset 0"),
    ([*FRESH, "--data", "{D}/ds-flipped"], 2, "{D}/ds-flipped/tokens-00000.bin is damaged at token offset 0"),
    ([*FRESH, "--data", "{D}/ds", "--model.vocab-size", "128"], 2, "the model's vocab_size 128 is smaller than the"),
]

# Outputs a command owns and sizes bounded before anything is allocated (issue 41): one line naming the limit.
LIMIT = "is above spmdkit's limit of"
CASES += [
    (
        ["data", "prepare", "{D}/texts", *PREPARE[:2], "--out", "{D}/run/checkpoints/100"],
        2,
        "--out {D}/run/checkpoints/100 lies inside the checkpoint directory {D}/run/checkpoints",
    ),
    (["data", "prepare", "{D}/texts", *PREPARE, "--workers", "1000"], 2, "--workers 1000: pass 1 to"),
    (["data", "prepare", "{D}/texts", *PREPARE, "--workers", "-1"], 2, "--workers -1: pass 1 to"),
    (["compile", "--model", "tiny", "--devices", "100000000"], 2, f"--devices 100,000,000 {LIMIT} 65,536 devices"),
    (["compile", "--devices", "65536", "--devices-per-host", "131072"], 2, f"--devices-per-host 131,072 {LIMIT}"),
    (["compile", "--model", "tiny", "--seq-len", "100000000"], 2, f"--seq-len 100,000,000 {LIMIT} 4,194,304 tokens"),
    (["compile", "--model", "llama3-70b", "--seq-len", "10000000"], 2, f"--seq-len 10,000,000 {LIMIT} 4,194,304"),
    (["compile", "--batch-size", "100000000"], 2, "--batch-size 100,000,000 x --seq-len 128 is 12,800,000,000 tokens"),
    (["compile", "--mesh", "pipeline=2,data=4", "--microbatches", "100000"], 2, f"--microbatches 100,000 {LIMIT}"),
    (["compile", "--grad-accum", "100000"], 2, f"--grad-accum 100,000 {LIMIT} 4,096 microbatches per step"),
    (["plan", "--model", "tiny", "--devices", "100000000"], 2, f"--devices 100,000,000 {LIMIT} 65,536 devices"),
    (["plan", "--model", "tiny", "--gpus-per-node", "100000"], 2, f"--gpus-per-node 100,000 {LIMIT} 65,536"),
    (["plan", "--model", "tiny", "--seq-len", "100000000"], 2, f"--seq-len 100,000,000 {LIMIT} 4,194,304"),
    (["plan", "--model", "tiny", "--batch-size", "100000000"], 2, "tokens per step, above spmdkit's limit of 2^31 - 1"),
    (["plan", "--model", "tiny", "--microbatches", "100000"], 2, f"--microbatches 100,000 {LIMIT} 4,096"),
    (["bench", "--seq-len", "100000000"], 2, f"--seq-len 100,000,000 {LIMIT} 4,194,304"),
    ([*FRESH, "--cpu-devices", "100000000"], 2, f"--cpu-devices 100,000,000 {LIMIT} 4,096 simulated CPU devices"),
    ([*FRESH, "--seq-len", "100000000"], 2, f"--seq-len 100,000,000 {LIMIT} 4,194,304 tokens"),
    ([*FRESH, "--batch-size", "100000000"], 2, "--batch-size 100,000,000 x --seq-len 32 is 3,200,000,000 tokens"),
    ([*FRESH, "--grad-accum", "100000000"], 2, f"--grad-accum 100,000,000 {LIMIT} 4,096 microbatches per step"),
    ([*FRESH, "--microbatches", "100000000"], 2, f"--microbatches 100,000,000 {LIMIT} 4,096 microbatches"),
    (["eval", "{D}/run", "--seq-len", "100000000"], 2, f"--seq-len 100,000,000 {LIMIT} 4,194,304 tokens"),
    (["generate", "{D}/run", "--prompt", "hi", "--max-len", "100000000"], 2, f"--max-len 100,000,000 {LIMIT}"),
    (["bench", "--out", "{D}/run/checkpoints/results"], 2, "lies inside the checkpoint directory {D}/run/checkpoints"),
]


def _texts_and_datasets(d: Path) -> None:
    """Text inputs, a prepared dataset (`ds`, byte tokens) and two damaged copies of it."""
    (d / "texts").mkdir()
    (d / "texts" / "a.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 150)
    (d / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1") * 20)
    (d / "docs.jsonl").write_text('{"body": "no text key"}\n')
    prepare = ["data", "prepare", str(d / "texts"), "--tokenizer", "bytes", "--out", str(d / "ds"), "--no-progress"]
    assert main(prepare) == 0
    shutil.copytree(d / "ds", d / "ds-badjson")
    (d / "ds-badjson" / "dataset.json").write_text('{"format": ')
    shutil.copytree(d / "ds", d / "ds-noshard")
    (d / "ds-noshard" / "tokens-00000.bin").unlink()
    _damaged_datasets(d)


def _damaged_datasets(d: Path) -> None:
    """Copies of `ds` damaged as the audit found them: a pickled index, shard paths leaving the dataset, a shard
    entry without its sha256, a flipped bit in a shard; and a JSONL record holding a lone surrogate."""
    shutil.copytree(d / "ds", d / "ds-pickled")
    np.save(d / "ds-pickled" / "documents.npy", np.array([{"offsets": 0}], dtype=object), allow_pickle=True)
    for name, path in (("ds-escape", "../../x.bin"), ("ds-absolute", str(d / "ds" / "tokens-00000.bin"))):
        shutil.copytree(d / "ds", d / name)
        _edit_json(d / name / "dataset.json", lambda m, path=path: m["shards"][0].update(file=path))
    shutil.copytree(d / "ds", d / "ds-nosha")
    _edit_json(d / "ds-nosha" / "dataset.json", lambda m: m["shards"][0].pop("sha256"))
    shutil.copytree(d / "ds", d / "ds-flipped")
    with open(d / "ds-flipped" / "tokens-00000.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 0x10]))
    (d / "lone.jsonl").write_text('{"text": "\\ud800 half a pair"}\n')
    _chat_inputs(d)


def _chat_inputs(d: Path) -> None:
    """Tokenizer directories with Gemma 2's released chat template (no system role) and without a template, and
    conversations: one without `messages`, one opening with a system message."""
    from hf_reference import save_tokenizer

    for name in ("chat-tok", "nochat-tok"):
        save_tokenizer(d / name, 64)
    template = Path(__file__).parent / "chat_templates" / "google-gemma-2-2b-it.jinja"
    (d / "chat-tok" / "chat_template.jinja").write_bytes(template.read_bytes())
    (d / "nomsg.jsonl").write_text('{"text": "no messages"}\n')
    messages = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}]
    (d / "system.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    (d / "chat.jsonl").write_text(json.dumps({"messages": messages[1:] + [{"role": "assistant", "content": "w3"}]}))
    argv = ["data", "prepare", str(d / "chat.jsonl"), *CHAT[:-3], str(d / "chat"), "--tokenizer", str(d / "chat-tok")]
    assert main(argv) == 0
    for name in ("chat-flipped", "chat-short"):  # a flipped mask bit; a mask cut short
        shutil.copytree(d / "chat", d / name)
    mask = (d / "chat-flipped" / "mask-00000.bin").read_bytes()
    (d / "chat-flipped" / "mask-00000.bin").write_bytes(bytes([mask[0] ^ 1]) + mask[1:])
    (d / "chat-short" / "mask-00000.bin").write_bytes(mask[:-1])


def _hf_models(d: Path) -> None:
    """transformers' own saves: a Llama, a GPT-2, a sharded Llama missing a shard, and Llamas whose config.json is
    quantised, missing, or cut short."""
    from hf_reference import edit_config, save_model
    from transformers import GPT2Config, LlamaConfig

    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    save_model(LlamaConfig(**shape), d / "hf")
    save_model(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64), d / "gpt2")
    save_model(LlamaConfig(**shape), d / "sharded", max_shard_size="20KB")
    sorted((d / "sharded").glob("model-*-of-*.safetensors"))[1].unlink()
    for name in ("hf-quantized", "hf-no-config", "hf-bad-config"):
        shutil.copytree(d / "hf", d / name)
    edit_config(d / "hf-quantized", quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    (d / "hf-no-config" / "config.json").unlink()
    (d / "hf-bad-config" / "config.json").write_text('{"model_type": "llama",')


def _edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def _guarded_fixtures(d: Path):
    """What the run-directory and checkpoint cases read (see IN_USE above); returns the lock held on {D}/locked."""
    from safetensors import safe_open

    from spmdkit.rundir.lock import RunLock

    shutil.copytree(d / "run", d / "locked")
    (d / "userdir").mkdir()
    (d / "userdir" / "config.json").write_text('{"lr": 0.1}\n')
    (d / "nockpt").mkdir()  # a run killed before its first checkpoint
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(d / "run" / name, d / "nockpt" / name)
    shutil.copytree(d / "run", d / "run-notok")  # its tokenizer.json lost
    (d / "run-notok" / "checkpoints" / "hf").mkdir()
    (d / "run-notok" / "checkpoints" / "hf" / "tokenizer_config.json").write_text("{}\n")
    (d / "big-prompt.txt").write_text("a" * (2**20 + 1))
    with safe_open(str(d / "hf" / "model.safetensors"), framework="np") as handle:
        names = list(handle.keys())
    for name, target in (("hf-escape", "../hf/model.safetensors"), ("hf-absolute", str(d / "hf" / "model.safetensors")),
                         ("hf-symlink", "model-00001-of-00001.safetensors")):  # fmt: skip
        (d / name).mkdir()
        shutil.copy(d / "hf" / "config.json", d / name / "config.json")
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, target)}
        (d / name / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "hf-symlink" / "model-00001-of-00001.safetensors").symlink_to(d / "hf" / "model.safetensors")
    edited = {"next_index": 10**12}
    for name in ("bad-iter", "bad-config", "old-iter"):
        shutil.copytree(d / "run" / "checkpoints", d / name)
    (d / "bad-iter" / "4" / "data" / "process_0-of-1.json").write_text(json.dumps(edited))
    _edit_json(d / "bad-config" / "4" / "config" / "metadata", lambda c: c["run"].update(seed=1))
    (d / "old-iter" / "4" / "data" / "process_0-of-1.json").write_text(json.dumps(edited))  # saved before digests:
    _edit_json(d / "old-iter" / "4" / "_CHECKPOINT_METADATA", lambda m: m["custom_metadata"]["checksums"].pop("items"))
    return RunLock(d / "locked", "spmdkit train")


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    """Files the cases read: a run with a checkpoint (step 4), a damaged copy, TOML files, token files, a file."""
    d = tmp_path_factory.mktemp("bad-input")
    (d / "afile").write_text("not a directory\n")
    (d / "empty").mkdir()
    for name, text in TOML.items():
        (d / name).write_text(text)
    (d / "latin1.toml").write_bytes("[run]\nsteps = 3 # caf\xe9\n".encode("latin-1"))
    (d / "tokens.txt").write_text("1 2 3\n")
    (d / "odd.bin").write_bytes(b"\x01\x02\x03")
    np.save(d / "floats.npy", np.zeros(4000, np.float32))
    np.save(d / "big-ids.npy", np.full(4000, 300, np.uint16))
    np.save(d / "tiny.npy", np.arange(10, dtype=np.uint16))
    np.save(d / "short.npy", (np.arange(2000) % 200).astype(np.uint16))  # eval split: 100 tokens, < one batch
    _texts_and_datasets(d)
    _hf_models(d)

    config, _ = parse([*[a.format(D=d) for a in RUN[1:]]])
    mesh = make_mesh(config.mesh.mesh)
    model = config.model.build()
    _, abstract, shardings = abstract_train_state(
        model, make_optimizer(config.optimizer, config.run.steps), mesh, make_rules(3, False)
    )
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(x.shape).astype(x.dtype) if x.dtype.kind == "f" else np.zeros(x.shape, x.dtype)
              for x in jax.tree.leaves(abstract)]  # fmt: skip
    state = jax.tree.unflatten(
        jax.tree.structure(abstract),
        [jax.device_put(v, s) for v, s in zip(values, jax.tree.leaves(shardings), strict=True)],
    )
    data = make_data(config.data, seq_len=32, global_batch=8, vocab_size=model.vocab_size, seed=0)
    for _ in range(4):
        next(data)
    checkpointer = Checkpointer(d / "run" / "checkpoints", every=0)
    saved = resolve_config(config)  # as the trainer saves it: every model and optimizer setting given its value
    checkpointer.save(4, state, data.iterator, json.loads(saved.to_json()), force=True)
    checkpointer.close()
    (d / "run" / "config.json").write_text(saved.to_json())  # a refused resume must leave these as they are
    (d / "run" / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": {6 - s / 4}}}\n' for s in range(1, 5)))
    shutil.copytree(d / "run" / "checkpoints", d / "damaged")
    flip_byte(d / "damaged" / "4" / "state", "model.embedding")
    held = _guarded_fixtures(d)
    readonly = read_only_dir(d / "readonly")
    yield d, readonly
    held.release()
    if os.geteuid() == 0:
        subprocess.run(["umount", "-l", str(d / "readonly")], capture_output=True)
    else:
        (d / "readonly").chmod(0o755)


def _id(case):
    argv = " ".join(case[0]).replace("{D}/", "")
    return argv.replace(" ".join(TRAIN.split()[1:]), "...")


@pytest.mark.parametrize("argv, code, fragment", CASES, ids=[_id(c) for c in CASES])
def test_bad_input(fixture_dir, capsys, monkeypatch, argv, code, fragment):
    d, readonly = fixture_dir
    if "readonly" in " ".join(argv) and not readonly:
        pytest.skip("cannot make a read-only directory here")
    monkeypatch.chdir(d)  # anything written to a relative default path would show up below
    monkeypatch.setenv("PATH", f"{Path(os.sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    before = file_hashes(d)
    got = main([a.format(D=d) for a in argv])
    out, err = capsys.readouterr()
    fragment = fragment.format(D=d, PID=os.getpid())
    assert got == code, (out[-2000:], err[-2000:])
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("spmdkit: error: "), err[-3000:]
        assert fragment in err, err
    else:  # `ckpt verify` found damage: its report, on stdout
        assert fragment in out and not err, (out, err)
    assert "Traceback" not in out + err and "usage:" not in err
    assert file_hashes(d) == before  # nothing changed, nothing written


@pytest.mark.parametrize(
    "argv", [["compile", "--model", "tiny", "--devices", "100000000"], ["data", "prepare", "x", "--tokenizer", "bytes",
             "--out", "y", "--workers", "1000"]], ids=["compile", "prepare"],
)  # fmt: skip
def test_a_size_beyond_its_limit_is_refused_before_it_takes_memory(tmp_path, argv):
    """Before issue 41 these ran for minutes and took 11.4 GB and 4 GB of host memory: now one line, the command's
    peak resident size under 1 GB. A small Python process runs it and reports its children's peak: a child forked
    from this test process would count this process's memory as its own (Linux keeps the peak across exec)."""
    code = (
        "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, done.returncode); print(done.stderr, end='')"
    )
    done = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "spmdkit", *argv], cwd=tmp_path,
                          capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    first, err = done.stdout.split("\n", 1)
    peak, returncode = (int(x) for x in first.split())
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    assert returncode == 2 and err.startswith("spmdkit: error: ") and err.count("\n") == 1, err
    assert "limit" in err or "pass 1 to" in err, err
    assert peak < 2**30, f"peak RSS {peak / 2**20:.0f} MiB"


def test_at_least_sixty_cases_over_every_command():
    commands = {argv[0] for argv, _, _ in CASES}
    assert len(CASES) >= 60 and commands >= {"train", "data", "ckpt", "plan", "launch", "bench"}
    ckpt = {argv[1] for argv, _, _ in CASES if argv[0] == "ckpt" and len(argv) > 1}
    assert ckpt >= {"inspect", "verify", "reshard", "export", "import-hf"}
    train = " ".join(" ".join(argv) for argv, _, _ in CASES if argv[0] == "train")
    assert "--init-from" in train and "--data {D}/ds" in train


# ----------------------------------------------------------------------------------------------- library calls

LIBRARY = [
    (lambda d: RunSettings(steps=2.5), "run.steps=2.5 must be of type int"),
    (lambda d: RunSettings(steps="10"), "run.steps='10' must be of type int"),
    (lambda d: RunSettings(fail_steps=("a",)), "run.fail_steps=('a',) must be of type tuple[int, ...]"),
    (lambda d: RunSettings(progress="no"), "run.progress='no' must be of type bool"),
    (lambda d: OptimizerConfig(lr="a"), "optimizer.lr='a' must be of type float"),
    (lambda d: MeshSettings(zero=5), "mesh.zero=5 must be of type Literal[0, 1, 2, 3]"),
    (lambda d: MeshSettings(pipeline_schedule="x"), "mesh.pipeline_schedule='x' must be of type Literal["),
    (lambda d: CheckpointSettings(keep=1.5), "checkpoint.keep=1.5 must be of type int"),
    (lambda d: ModelSettings(layers=2.5), "model.layers=2.5 must be of type int | None"),
    (lambda d: TrainConfig(data=DataConfig(source=3)), "data.source=3 must be of type str"),
    (lambda d: TrainConfig(run=3), "config section run must be a RunSettings"),
    (lambda d: apply_overrides(TrainConfig(), {"run": {"steps": "x"}}), "run.steps='x' must be of type int"),
    (lambda d: apply_overrides(TrainConfig(), {"runs": {}}), "unknown config section [runs]"),
    (lambda d: config_from_json("not json"), "a saved config is not valid JSON"),
    (lambda d: config_from_json("[1]"), "a saved config must be a JSON object of sections"),
    (lambda d: make_mesh("fsdp=3"), "mesh fsdp=3 has 3 devices but 8 are present"),
    (lambda d: make_mesh(MeshConfig.parse("fsdp=8", "fsdp=2")), "--dcn fsdp=2 says axes span nodes"),
    (lambda d: Checkpointer(d / "afile"), "is a file: pass a directory"),
    (lambda d: Checkpointer(d / "missing", read_only=True), "does not exist: check the path"),
    (lambda d: Checkpointer(d / "new", keep=0), "--keep 0 must be at least 1"),
]


@pytest.mark.parametrize("call, fragment", LIBRARY, ids=[f for _, f in LIBRARY])
def test_library_calls_raise_one_line_spmdkit_errors(fixture_dir, call, fragment):
    d, _ = fixture_dir
    before = file_hashes(d)
    with pytest.raises(SpmdkitError) as info:
        call(d)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert file_hashes(d) == before
