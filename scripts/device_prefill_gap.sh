#!/usr/bin/env bash
# device_prefill_gap.sh -- runs on a GPU machine after `source scripts/device_setup.sh`: where a
# 16k-token prompt's prefill spends its time at ratio 1.0, Tangram beside stock flashinfer
# (benchmarks/RESULTS.md, issue 18: cliff-64's last 4% sits in these prefills). bench.prefill_trace,
# 16 prompts of 16,384 tokens in 8,192-token chunks (the second chunk reads the first as
# history), one output token, under SGLang's profiler, for each system; about 4 minutes.
# Results in $R (trace-<system>.json, the trace folders, a line per system in $R/progress).
# Start it in the background and poll:
#   setsid nohup bash scripts/device_prefill_gap.sh > /tmp/pg.log 2>&1 &
# Env: R (default /tmp/pg), PROMPTS (16), LEN (16384), CHUNK (8192), PROFILE.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/pg}
mkdir -p "$R"
COMMON="--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 128 --disable-prefill-cuda-graph --cuda-graph-max-bs 128 --chunked-prefill-size ${CHUNK:-8192}"
for s in "stock:--attention-backend flashinfer" \
  "tangram:--tangram --tangram-profile $PROFILE --tangram-target-ratio 1.0"; do
  name=${s%%:*}
  echo "$(date -u +%T) trace $name" >> "$R/progress"
  timeout 400 python3 -m tangram_sglang.bench.prefill_trace --model-path "$MODEL" \
    --label "$name-r1.0" --server-args "$COMMON ${s#*:}" --num-prompts "${PROMPTS:-16}" \
    --prompt-len "${LEN:-16384}" --top 25 --trace-dir "$R/trace-$name" \
    --json "$R/trace-$name.json" > "$R/trace-$name.out" 2>&1
  tail -5 "$R/trace-$name.out" >> "$R/progress"
done
echo "$(date -u +%T) done" >> "$R/progress"
