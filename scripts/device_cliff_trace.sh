#!/usr/bin/env bash
# device_cliff_trace.sh -- runs on an H200 machine after `source scripts/device_setup.sh`:
# the cliff-64 workload with max_tokens unset (device_no_max_tokens.sh, stock triton then
# Tangram 0.25), then a decode trace of short chats (bench.prefill_trace, 64 prompts of 200
# tokens kept whole, 128 out) for stock triton and Tangram 0.25. Results in $R; progress lines
# in $R/progress. Start it in the background and poll:
#   setsid nohup bash scripts/device_cliff_trace.sh > /tmp/ct.log 2>&1 &
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/ct}
mkdir -p "$R"
export OUT=$R
COMMON="--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 128 --disable-prefill-cuda-graph --cuda-graph-max-bs 128"
echo "$(date -u +%T) cliff no-max-tokens" >> "$R/progress"
WL=cliff:64 T=${T:-420} CAP_S=${CAP_S:-900} bash scripts/device_no_max_tokens.sh >> "$R/progress" 2>&1
for s in "stock:--attention-backend triton" \
  "tangram:--tangram --tangram-profile $PROFILE --tangram-target-ratio 0.25"; do
  name=${s%%:*}
  echo "$(date -u +%T) trace $name" >> "$R/progress"
  timeout 400 python3 -m tangram_sglang.bench.prefill_trace --model-path "$MODEL" \
    --label "$name-decode" --server-args "$COMMON ${s#*:}" --num-prompts 64 --prompt-len 200 \
    --output-len 128 --top 25 --trace-dir "$R/trace-$name" --json "$R/trace-$name-decode.json" \
    > "$R/trace-$name.out" 2>&1
  tail -5 "$R/trace-$name.out" >> "$R/progress"
done
echo "$(date -u +%T) done" >> "$R/progress"
