#!/usr/bin/env bash
# Step time, tokens/s and MFU of `spmdkit train --model 1b` on one NVIDIA GPU with each attention kernel (cudnn,
# blockwise, dot): 20 steps each, read from the run's metrics.jsonl (the last logged window: steps 16-20, after
# compilation and warm-up). dot holds [batch, heads, seq, seq] scores, so the like-for-like rows use a shape all
# three fit (seq 1024, batch 4); cudnn and blockwise run at seq 2048, batch 8 too.
# Usage: bash scripts/gpu_kernel_mfu.sh OUT_DIR   (spmdkit importable; the run directories are deleted after)
set -uo pipefail
out=${1:-gpu-mfu}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
run() {  # NAME SEQ BATCH ATTENTION
  local dir
  dir=$(mktemp -d)
  python3 -m spmdkit train --model 1b --mesh fsdp=1 --steps 20 --log-every 5 --eval-every 0 --no-progress \
    --seq-len "$2" --batch-size "$3" --attention "$4" --run-dir "$dir/run" > "$out/$1.log" 2>&1 || echo "$1: exit $?"
  cp "$dir/run/metrics.jsonl" "$out/$1.jsonl" 2>/dev/null
  rm -rf "$dir"
}
run cudnn-1024x4 1024 4 cudnn
run blockwise-1024x4 1024 4 blockwise
run dot-1024x4 1024 4 dot
run cudnn-2048x8 2048 8 cudnn
run blockwise-2048x8 2048 8 blockwise
python3 - "$out" <<'PY'
import json, pathlib, sys
print("| run | step s | tokens/s | TFLOP/s | MFU |\n|---|---|---|---|---|")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.jsonl")):
    last = json.loads(path.read_text().splitlines()[-1])
    print(f"| {path.stem} | {last['step_time_s']:.3f} | {last['tokens_per_sec']:,.0f} | "
          f"{last['tflops_per_device']:.1f} | {last['mfu']:.1%} |")
PY
