#!/usr/bin/env bash
# Measured step, tokens/s, MFU and kernel time per kind on one NVIDIA H100, beside the roofline of the same compiled
# program (issue #42): `1b` at 8 x 2048 and a 4-layer `llama3-8b` (8B's widths) at 2 x 8192, cuDNN attention, remat
# none where it fits, else the least recomputing policy that does (the deviceless `spmdkit compile` decides first,
# on the CPU, while the GPU works). Each run: 22 steps; steps 11-20 timed (the metrics line of step 20, logged every
# 10), steps 21-22 traced with jax.profiler (--profile-steps) and the program dumped (--dump-hlo);
# scripts/profile_kinds.py reduces the trace to the roofline's kinds. Under 8 minutes on one H100.
#
# Usage: bash scripts/gpu_profile.sh OUT_DIR     (from the repository root; DRY_RUN=1: print the commands only)
# Writes OUT_DIR/MODEL-none.json (the deviceless compile and roofline), OUT_DIR/MODEL-REMAT/{train.log,kinds.md,
# kinds.json,run/} per run and OUT_DIR/summary.md. ONE_B, EIGHT_B, COMMON: the runs' flags, overridable (a CPU
# smoke test: tiny models, COMMON="--mesh fsdp=1").
# Packages the GPU machine lacks travel as wheels in .whl/ (see the device README): installed here when present.
set -uo pipefail
out=${1:-}
if [ -z "$out" ] || [ "$out" = "-h" ] || [ "$out" = "--help" ]; then
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
  [ -z "$out" ] && exit 2 || exit 0
fi
py=${PYTHON:-python3}
exec 3>&1  # run_cmd's dry-run lines go here, past the commands' own redirections
run_cmd() { if [ -n "${DRY_RUN:-}" ]; then echo "+ $*" >&3; else "$@"; fi; }
if [ -z "${DRY_RUN:-}" ]; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  fi
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  "$py" -c "import spmdkit.cli.train" || { echo "gpu_profile: spmdkit does not import here: carry the missing" \
    "packages as wheels in .whl/"; exit 3; }
fi
mkdir -p "$out"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
ONE_B=${ONE_B:-"--model 1b --seq-len 2048 --batch-size 8"}
EIGHT_B=${EIGHT_B:-"--model llama3-8b --model.layers 4 --seq-len 8192 --batch-size 2"}
COMMON=${COMMON:-"--mesh fsdp=1 --attention cudnn"}

decide() {  # NAME FLAGS: the deviceless compile at remat none, in the background (JSON in OUT/NAME-none.json)
  local name=$1; shift
  run_cmd env JAX_PLATFORMS=cpu "$py" -m spmdkit compile --target h100 --devices 1 --json --roofline $COMMON "$@" \
    --model.remat none > "$out/$name-none.json" 2> "$out/$name-none.err"
}
policy() {  # NAME: "none" if it fits, else the remat policy the compile found to fit (empty: none does)
  [ -n "${DRY_RUN:-}" ] && { echo none; return; }
  "$py" -c 'import json, sys; r = json.load(open(sys.argv[1])); print("none" if r["fits"] else r["remat_that_fits"] or "")' \
    "$out/$1-none.json" 2> /dev/null
}
train() {  # NAME REMAT FLAGS
  local name=$1 remat=$2; shift 2
  local dir="$out/$name-$remat"
  mkdir -p "$dir"
  run_cmd "$py" -m spmdkit train $COMMON "$@" --model.remat "$remat" --steps 22 --log-every 10 --eval-every 0 \
    --no-progress --profile-steps 21:22 --dump-hlo --run-dir "$dir/run" > "$dir/train.log" 2>&1 \
    || echo "$name-$remat: spmdkit train exited $?" | tee -a "$out/summary.md"
  run_cmd "$py" scripts/profile_kinds.py "$dir/run" --steps 2 --target h100 --json "$dir/kinds.json" > "$dir/kinds.md" \
    2> "$dir/kinds.err"
}

measure() {  # NAME FLAGS: once its compile has decided the remat policy
  local name=$1 remat; shift
  remat=$(policy "$name")
  [ "$remat" != none ] && echo "$name: remat none does not fit one H100 (compiled): ${remat:-no policy} does" \
    >> "$out/summary.md"
  [ -n "$remat" ] && train "$name" "$remat" "$@"
}

: > "$out/summary.md"
decide 1b $ONE_B & first=$!
decide 8b-4layers $EIGHT_B & second=$!
wait $first
measure 1b $ONE_B
wait $second
measure 8b-4layers $EIGHT_B
[ -n "${DRY_RUN:-}" ] && exit 0
"$py" - "$out" >> "$out/summary.md" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| run | step s (steps 11-20) | tokens/s | MFU (989 TFLOP/s) | roofline step s | roofline MFU |")
print("|---|---|---|---|---|---|")
for run in sorted(p for p in out.iterdir() if (p / "run" / "metrics.jsonl").exists()):
    rows = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = next((r for r in rows if r.get("step") == 20), rows[-1])
    kinds = json.loads((run / "kinds.json").read_text())["roofline"] if (run / "kinds.json").exists() else {}
    mfu, predicted = (f"{r['mfu']:.1%}" if r.get("mfu") else "-" for r in (timed, kinds))
    print(f"| {run.name} | {timed['step_time_s']:.3f} | {timed['tokens_per_sec']:,.0f} | {mfu} | "
          f"{kinds.get('step_seconds', 0):.3f} | {predicted} |")
for run in sorted(out.glob("*/kinds.md")):
    print(f"\n### {run.parent.name}: kernel time per kind (trace of steps 21-22) beside the roofline\n")
    print(run.read_text())
PY
cat "$out/summary.md"
