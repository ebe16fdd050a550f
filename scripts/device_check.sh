#!/usr/bin/env bash
# One device check (issue 35 item 5, issue 36): on a machine with a GPU, within a time budget (default 450 s)
# and a 64 MiB working tree, measures and prints one markdown table of
#   1. LLM step cost curves (`jaxspec bench step-costs`, random weights, T = 1..128 tree tokens): the default
#      model's shape (smollm2-135m) in float32 and bfloat16, LLaMA-7B shape in bfloat16, against the card's HBM
#      limit (weight bytes / bandwidth), and the lowering variants where they matter (models/lowering.py);
#   2. a batch curve at 7B shape (1, 4, 16, 64 rows: ms per step and tokens/s; K/V writes by row and by scatter);
#   3. end-to-end `jaxspec generate` incremental vs auto (default flags) vs a fixed and a dynamic tree, at batch 1
#      and 8, on a random-weight checkpoint of the default model's shape written here with the real tokenizer
#      (.device/tokenizer.tar.gz, made where the GGUF is: `python scripts/device_check.py tokenizer .device/tokenizer.tar.gz`).
# Parts run in order of importance, each bounded by `timeout` and the budget left; one cut short keeps the points it
# measured and is named in the table. Everything lands under $OUT (CSV, JSONL, logs, report.md, summary.json).
#
# Usage (repository root): scripts/device_check.sh [BANDWIDTH_TBS]
#   OUT=out/device               where results go
#   DEVICE_CHECK_QUICK=1         a few minutes on a CPU: tiny shapes, few T, few tokens (tests the script)
#   DEVICE_CHECK_BUDGET=450      seconds for all parts together
#   BANDWIDTH_TBS                default from nvidia-smi: H200 4.8, H100 3.35 (PCIe 2.0, NVL 3.9); else none
# Wheels in .whl/ (scripts/fetch_device_wheels.sh) are installed to $DEVICE_CHECK_SITE (/tmp/site) first, for an
# image without them.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-out/device}
QUICK=${DEVICE_CHECK_QUICK:-0}
BUDGET=${DEVICE_CHECK_BUDGET:-450}
PY=${PYTHON:-python3}
SITE=${DEVICE_CHECK_SITE:-/tmp/site}  # where carried wheels are installed
START=$(date +%s)
mkdir -p "$OUT/e2e" "$OUT/logs"
say() { echo "[device_check +$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

if [ "$QUICK" = 1 ]; then
  SMALL=tiny; BIG=tiny; CURVE=1,4,16; SHORT=1,16; ROWS=1,4; REPEATS=3; LAYERS=(--layers 2)
  NEW=8; COUNT=3; BATCHES=(1 4); MODES=(incremental auto tree); E2E_CAP=240
  AUTO_SSM=(--ssm layers:1 --ssm ngram); TREE_SSM=(--ssm layers:1 --ssm ngram:3); DYN_SSM=(--ssm layers:1)
else
  SMALL=smollm2-135m; BIG=llama-7b; CURVE=1,4,8,16,32,64,128; SHORT=1,16,64; ROWS=1,4,16,64; REPEATS=10; LAYERS=()
  NEW=96; COUNT=8; BATCHES=(1 8); MODES=(incremental auto tree dynamic); E2E_CAP=170
  AUTO_SSM=(); TREE_SSM=(--ssm drafter --ssm ngram:3); DYN_SSM=(--ssm drafter)
fi

# 3. end to end: a random checkpoint of the default model's shape with the real tokenizer
e2e() {
  local ckpt=/tmp/device_check_ckpt tok=/tmp/device_check_tokenizer
  if [ ! -f .device/tokenizer.tar.gz ]; then
    echo "no .device/tokenizer.tar.gz (make it where the GGUF is: python scripts/device_check.py tokenizer" \
      ".device/tokenizer.tar.gz, and carry .device)"
    return 3
  fi
  rm -rf "$tok" && mkdir -p "$tok" && tar -xzf .device/tokenizer.tar.gz -C "$tok" || return 4
  "$PY" scripts/device_check.py checkpoint "$ckpt" --tokenizer "$tok" --shape smollm2-135m ${LAYERS[@]+"${LAYERS[@]}"} || return 4
  local b mode
  for b in "${BATCHES[@]}"; do
    "$PY" scripts/device_check.py prompts "$OUT/e2e/prompts_b$b.jsonl" --count "$COUNT" --warmup "$b" > /dev/null
    for mode in "${MODES[@]}"; do
      local flags=()
      # -v on incremental only: it names the device, precision and lowering; under auto it would also calibrate
      # every tree up front, which is not the default lazy path being measured
      case $mode in
        auto) flags=(--mode auto ${AUTO_SSM[@]+"${AUTO_SSM[@]}"}) ;;
        tree) flags=(--mode tree "${TREE_SSM[@]}" --expansion "1,1,1;1,1,1,1,1,1") ;;
        dynamic) flags=(--mode tree "${DYN_SSM[@]}" --expansion dynamic:32) ;;
        *) flags=(--mode incremental -v) ;;
      esac
      local run="${mode}_b$b" t0 rc
      echo "generate $run: ${flags[*]}"
      t0=$(date +%s.%N)
      "$PY" -m jaxspec.cli generate --model "$ckpt" --prompt-file "$OUT/e2e/prompts_b$b.jsonl" \
        --max-new-tokens "$NEW" --max-batch "$b" --output "$OUT/e2e/$run.jsonl" "${flags[@]}" \
        > "$OUT/e2e/$run.log" 2>&1
      rc=$?
      grep "^\[jaxspec\]" "$OUT/e2e/$run.log" | grep -v "^\[jaxspec\] step:" | tail -n 6
      "$PY" - "$OUT/e2e/$run.meta.json" "$run" "$mode" "$b" "$rc" "$t0" "${flags[*]}" <<'EOF'
import json, sys, time
out, run, mode, b, rc, t0, flags = sys.argv[1:8]
json.dump({"run": run, "mode": mode, "batch": int(b), "rc": int(rc), "wall_s": round(time.time() - float(t0), 1),
           "flags": flags}, open(out, "w"))
EOF
      "$PY" scripts/device_check.py e2e "$OUT/e2e" > /dev/null  # kept current: a cut-short part keeps its runs
    done
  done
}
if [ "${1:-}" = __e2e ]; then  # the end-to-end part, run by the main script under `timeout`
  e2e
  exit $?
fi
: > "$OUT/parts.txt"


if compgen -G ".whl/*.whl" > /dev/null; then
  say "installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || say "wheel install failed"
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export TF_CPP_MIN_LOG_LEVEL=2 OUT QUICK
export JAXSPEC_CACHE=${JAXSPEC_CACHE:-/tmp/jaxspec-cache}  # calibrations and compiled executables, off the tree

GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
BW=${1:-${BANDWIDTH_TBS:-}}
if [ -z "$BW" ]; then
  case "$GPU" in
    *H200*) BW=4.8 ;;
    *H100*PCIe*) BW=2.0 ;;
    *H100*NVL*) BW=3.9 ;;
    *H100*) BW=3.35 ;;
    *) BW=0 ;;
  esac
fi
say "GPU: ${GPU:-none}; bandwidth ${BW} TB/s; budget ${BUDGET} s; quick=${QUICK}; out ${OUT}"
"$PY" - "$OUT/env.json" "$BW" "$QUICK" "$GPU" <<'EOF' || say "environment probe failed"
import json, sys, jax
out, bw, quick, gpu = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
d = jax.devices()[0]
env = {"device": f"{d.device_kind} x{jax.device_count()}", "platform": jax.default_backend(), "jax": jax.__version__,
       "nvidia_smi": gpu, "bandwidth_tbs": bw, "quick": quick}
json.dump(env, open(out, "w"), indent=1)
print(env)
EOF

# part NAME CAP_SECONDS COMMAND...: runs within min(CAP, budget left), output shown and logged; status to parts.txt
part() {
  local name=$1 cap=$2; shift 2
  local t; t=$(left); [ "$cap" -lt "$t" ] && t=$cap
  if [ "$t" -lt 15 ]; then
    say "skip $name: budget spent"; echo "$name skipped" >> "$OUT/parts.txt"; return
  fi
  say "start $name (up to ${t} s)"
  timeout -k 5 "$t" "$@" 2>&1 | tee "$OUT/logs/$name.log" | grep --line-buffered -v "^\s*$" | sed -u "s/^/  [$name] /"
  local rc=${PIPESTATUS[0]}
  case $rc in 0) echo "$name ok" >> "$OUT/parts.txt" ;; 124|137) echo "$name timeout" >> "$OUT/parts.txt" ;;
    *) echo "$name exit-$rc" >> "$OUT/parts.txt" ;; esac
  say "end $name: exit $rc"
}

costs() {  # costs NAME CAP ARGS...: one `jaxspec bench step-costs` into $OUT/costs_NAME.csv
  local name=$1 cap=$2; shift 2
  part "costs_$name" "$cap" "$PY" -m jaxspec.cli bench step-costs --draft-tokens 1 --output "$OUT/costs_$name.csv" "$@"
}

# 1. cost curves (this platform's default lowering), the most wanted numbers first
costs small_fp32 70 --shape "$SMALL" --dtype float32 --tokens "$CURVE" --repeats "$REPEATS"
costs big_bf16 100 --shape "$BIG" --dtype bfloat16 --tokens "$CURVE" --repeats "$REPEATS"
# the lowering variants at 7B shape: products behind barriers (the CPU form), scanned layers, blocked attention
costs big_bf16_variants 70 --shape "$BIG" --dtype bfloat16 --tokens "$SHORT" --repeats "$REPEATS" \
  --lowering dense=barrier --lowering layers=scan --lowering attention=blocks
# 2. the batch curve at 7B shape, K/V written by one scatter (GPU default) and by a loop over rows (CPU form)
costs big_bf16_rows 80 --shape "$BIG" --dtype bfloat16 --tokens 1 --batch "$ROWS" --repeats "$REPEATS" \
  --lowering "" --lowering kv_write=rows

# 3. end to end (this script again, as one command `timeout` can bound)
part e2e "$E2E_CAP" bash "$0" __e2e

# 1 (continued). the default model's shape in bf16, and its CPU forms, scanned layers and split q/k/v and gate/up
# kernels (a launch-bound step: the fused default's gain is measured here) in fp32
costs small_bf16 50 --shape "$SMALL" --dtype bfloat16 --tokens "$CURVE" --repeats "$REPEATS"
costs small_fp32_variants 60 --shape "$SMALL" --dtype float32 --tokens "$SHORT" --repeats "$REPEATS" \
  --lowering cpu --lowering layers=scan --lowering proj=split

ELAPSED=$(( $(date +%s) - START ))
say "all parts done in ${ELAPSED} s; the table:"
"$PY" scripts/device_check.py report "$OUT" --elapsed "$ELAPSED" --bandwidth "$BW"
