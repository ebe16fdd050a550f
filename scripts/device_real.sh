#!/usr/bin/env bash
# The real default model on a GPU (issue 80), in two calls of the device tool, because the 98 MB GGUF cannot travel
# in one 64 MiB call:
#   scripts/device_real.sh costs PART1   keeps PART1 (the GGUF's first bytes) in /tmp/real, installs the carried wheels
#                                        (.whl), and measures the LLaMA-7B-shape bf16 step and tree passes against the
#                                        card's bandwidth limit (random weights: `jaxspec bench step-costs`);
#   scripts/device_real.sh e2e PART2 DIR appends PART2, checks the GGUF's md5, then runs `jaxspec generate` on DIR's
#                                        prompts_b1.jsonl / prompts_b16.jsonl: --mode incremental and the default
#                                        (auto), at --max-batch 1 and 16, each twice on its own compile cache (run 1 on
#                                        a fresh cache, run 2 the measured one), then `jaxspec serve` at its defaults
#                                        on a fresh cache and again on the next start (ready seconds), in that order.
# Every part is bounded by what is left of DEVICE_REAL_BUDGET seconds (default 420); what ran lands in
# $OUT/real.tar.gz (logs, JSONL, CSV) and the tables in $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PHASE=$1
OUT=${OUT:-out/device_real}
BUDGET=${DEVICE_REAL_BUDGET:-420}
PY=${PYTHON:-python3}
START=$(date +%s)
W=/tmp/real  # kept on the warm machine between the two calls
GGUF=$W/SmolLM2-135M-Instruct.Q4_1.gguf
MD5=a1231443440b107ff29f02bdb38c9d0a
mkdir -p "$OUT" "$W/logs"
export PYTHONPATH="$ROOT:/tmp/site" TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
say() { echo "[device_real +$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# bounded NAME CAP CMD...: runs CMD within min(CAP, budget left - 20), its output in $W/logs/NAME.log
bounded() {
  local name=$1 cap=$2 t; shift 2
  t=$(( $(left) - 20 )); [ "$cap" -lt "$t" ] && t=$cap
  if [ "$t" -lt 10 ]; then say "skip $name: budget spent"; echo "$name skipped" >> "$W/parts.txt"; return 124; fi
  say "start $name (up to $t s)"
  local t0 rc; t0=$(date +%s.%N)
  timeout -k 5 "$t" "$@" > "$W/logs/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))")" >> "$W/parts.txt"
  say "end $name: exit $rc"
  grep -E "^\[jaxspec\] (prepared|start-up|host|[0-9]+ (requests|executable)|device|learned)|ready in|Error|error:" \
    "$W/logs/$name.log" | grep -v "step: tree" | tail -n 14
  return $rc
}
finish() {
  "$PY" - "$W" <<'EOF' > "$W/summary.txt" 2>&1
import subprocess, sys
from pathlib import Path
w = Path(sys.argv[1])
print((w / "parts.txt").read_text() if (w / "parts.txt").exists() else "no parts")
for d in ("r1", "r2"):
    if (w / d).is_dir():
        subprocess.run([sys.executable, "scripts/device_check.py", "e2e", str(w / d)], capture_output=True)
        f = w / d / "e2e.csv"
        print(f"== {d}\n" + (f.read_text() if f.exists() else "no runs"))
for f in sorted(w.glob("costs_*.csv")):
    print(f"== {f.name}\n{f.read_text()}")
EOF
  cat "$W/summary.txt"
  cp "$W/summary.txt" "$OUT/"
  tar -czf "$OUT/real_$PHASE.tar.gz" -C "$W" --exclude '*.gguf' --exclude part1 .
  say "done: $OUT"
}

if [ "$PHASE" = costs ]; then
  cp "$2" "$W/part1"
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || say "wheel install failed"
  fi
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$W/gpu.txt"
  "$PY" -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$W/gpu.txt"
  bounded costs_7b_bf16 150 "$PY" -m jaxspec.cli bench step-costs --shape llama-7b --dtype bfloat16 --draft-tokens 1 \
    --tokens 1,16,64 --repeats 10 --output "$W/costs_7b_bf16.csv"
  bounded costs_smollm2_fp32 60 "$PY" -m jaxspec.cli bench step-costs --shape smollm2-135m --dtype float32 \
    --draft-tokens 1 --tokens 1,2,4,8,16,32,64 --repeats 10 --output "$W/costs_smollm2_fp32.csv"
  finish
  exit 0
fi

# e2e: the real GGUF
cat "$W/part1" "$2" > "$GGUF" && rm -f "$W/part1"
[ "$(md5sum "$GGUF" | cut -d' ' -f1)" = "$MD5" ] || { say "GGUF md5 mismatch"; exit 3; }
PROMPTS=$3
gen() {  # gen BATCH MODE RUN: one `jaxspec generate`, on the mode's own compile cache
  local b=$1 mode=$2 run=$3 name="${2}_b${1}"
  mkdir -p "$W/$run"
  local t0; t0=$(date +%s.%N)
  JAXSPEC_CACHE=/tmp/jc_$mode bounded "${name}_$run" 170 "$PY" -m jaxspec.cli generate --model "$GGUF" \
    --prompt-file "$PROMPTS/prompts_b$b.jsonl" --max-new-tokens 96 --max-batch "$b" --mode "$mode" -v \
    --output "$W/$run/$name.jsonl"
  local rc=$?
  cp "$W/logs/${name}_$run.log" "$W/$run/$name.log"
  "$PY" - "$W/$run/$name.meta.json" "$name" "$mode" "$b" "$rc" "$t0" <<'EOF'
import json, sys, time
out, run, mode, b, rc, t0 = sys.argv[1:7]
json.dump({"run": run, "mode": mode, "batch": int(b), "rc": int(rc), "wall_s": round(time.time() - float(t0), 1),
           "flags": f"--mode {mode} --max-batch {b}"}, open(out, "w"))
EOF
}
for b in 1 16; do
  for mode in incremental auto; do
    gen "$b" "$mode" r1
    gen "$b" "$mode" r2
  done
done

serve() {  # serve RUN: `jaxspec serve` at its defaults until /health answers, then stopped
  local run=$1 t0 up=""
  t0=$(date +%s.%N)
  local cap=$(( $(left) - 25 ))
  if [ "$cap" -lt 20 ]; then say "skip serve_$run: budget spent"; echo "serve_$run skipped" >> "$W/parts.txt"; return; fi
  say "start serve_$run (up to $cap s)"
  JAXSPEC_CACHE=/tmp/jc_serve "$PY" -m jaxspec.cli serve --model "$GGUF" --port 8931 -v > "$W/logs/serve_$run.log" 2>&1 &
  local pid=$!
  while [ $(( $(date +%s) - ${t0%.*} )) -lt "$cap" ] && kill -0 $pid 2> /dev/null; do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8931/health', timeout=2)" 2> /dev/null; then
      up=$(python3 -c "import time; print(round(time.time() - $t0, 1))"); break
    fi
    sleep 1
  done
  kill -INT $pid 2> /dev/null; sleep 3; kill -9 $pid 2> /dev/null
  echo "serve_$run health_after_s=${up:-none} cap=$cap" >> "$W/parts.txt"
  say "serve_$run: /health after ${up:-never} s"
  grep -E "prepared|ready in|executables|Error" "$W/logs/serve_$run.log" | tail -n 8
}
serve fresh
serve next
finish
