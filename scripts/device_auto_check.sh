#!/usr/bin/env bash
# Lazy auto on a GPU, end to end (issue 35): incremental once, then `--mode auto -v` twice on one jaxspec cache (the
# first run builds trees in the background; the second finds them in the persistent compile cache), on a random
# checkpoint of the default model's shape with the real tokenizer (.device/tokenizer.tar.gz, as scripts/device_check.sh).
# Usage (repository root): OUT=out/device_auto NEW=96 COUNT=8 scripts/device_auto_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/device_auto}; NEW=${NEW:-96}; COUNT=${COUNT:-8}; PY=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site"
else
  export PYTHONPATH="$PWD"
fi
export JAXSPEC_CACHE=${JAXSPEC_CACHE:-/tmp/jaxspec-auto-cache} TF_CPP_MIN_LOG_LEVEL=2
tok=/tmp/device_check_tokenizer ckpt=/tmp/device_check_ckpt
rm -rf "$tok" && mkdir -p "$tok" && tar -xzf .device/tokenizer.tar.gz -C "$tok" || exit 4
"$PY" scripts/device_check.py checkpoint "$ckpt" --tokenizer "$tok" --shape smollm2-135m || exit 4
"$PY" scripts/device_check.py prompts "$OUT/prompts.jsonl" --count "$COUNT" --warmup 1 > /dev/null
for run in incremental auto1 auto2; do
  mode=${run%[12]}
  echo "== $run"
  "$PY" -m jaxspec.cli generate --model "$ckpt" --prompt-file "$OUT/prompts.jsonl" --max-new-tokens "$NEW" \
    --max-batch 1 --mode "$mode" -v --output "$OUT/$run.jsonl" > "$OUT/$run.log" 2>&1
  grep "^\[jaxspec\]" "$OUT/$run.log" | grep -v "step: tree" | tail -n 12
  "$PY" - "$OUT/$run.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if not json.loads(l)["id"].startswith("warmup")]
ms = [1e3 * r["seconds"] / max(len(r["token_ids"]), 1) for r in rows]
trees = {}
for r in rows:
    for k, v in r["tree"].items():
        trees[k] = trees.get(k, 0) + v
print(f"median {statistics.median(ms):.3f} ms/token, per request {[round(m, 2) for m in ms]}, "
      f"tokens/step {sum(len(r['token_ids']) for r in rows) / sum(r['llm_steps'] for r in rows):.2f}, trees {trees}")
PY
done
