#!/usr/bin/env bash
# device_turn_trace.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: what a
# later turn on a long cached history costs, Tangram 0.25 then stock triton (bench.prefill_trace
# --turn-tokens: 32 cached 16k histories, each again plus 330 new tokens, one every 40 ms, 64
# output tokens). Results in $R; progress lines in $R/progress. Start it in the background:
#   setsid nohup bash scripts/device_turn_trace.sh > /tmp/tt.log 2>&1 &
# Env: WHICH, the systems in order, space-separated: tangram (0.25), tangram1 (ratio 1.0),
#      stock (triton), stock-flashinfer; "both" (default) = "tangram stock". N, L, E, D, T: the
#      number of histories, their length, the new tokens per turn, the stagger (ms), the timeout.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/tt}
mkdir -p "$R"
COMMON="--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 128 --disable-prefill-cuda-graph --cuda-graph-max-bs 128"
run() {
  name=$1
  shift
  echo "$(date -u +%T) turns $name" >> "$R/progress"
  timeout "${T:-420}" python3 -m tangram_sglang.bench.prefill_trace --model-path "$MODEL" \
    --label "$name-turns" --server-args "$COMMON $*" --num-prompts "${N:-32}" \
    --prompt-len "${L:-16384}" --turn-tokens "${E:-330}" --stagger-ms "${D:-40}" \
    --output-len 64 --top 60 --trace-dir "$R/trace-$name" --json "$R/trace-$name-turns.json" \
    > "$R/trace-$name.out" 2>&1
  echo "$(date -u +%T) rc=$? $name" >> "$R/progress"
  grep -E '"(wall_s|history_wall_s|traced_wall_s|warmup_wall_s|gpu_busy_ms|gpu_idle_ms)"' "$R/trace-$name.out" >> "$R/progress"
  cp "$R/trace-$name/$name-turns/server.log" "$R/server-$name.log" 2>/dev/null
}
WHICH=${WHICH:-both}
[ "$WHICH" = both ] && WHICH="tangram stock"
for which in $WHICH; do  # every name checked before the first server starts
  case "$which" in
    tangram | tangram1 | stock | stock-flashinfer) ;;
    *) echo "$0: WHICH=$which: use tangram, tangram1, stock or stock-flashinfer (or both)" >&2; exit 2 ;;
  esac
done
for which in $WHICH; do
  case "$which" in
    tangram) run tangram --tangram --tangram-profile "$PROFILE" --tangram-target-ratio 0.25 ;;
    tangram1) run tangram1 --tangram --tangram-profile "$PROFILE" --tangram-target-ratio 1.0 ;;
    stock) run stock --attention-backend triton ;;
    stock-flashinfer) run stock-flashinfer --attention-backend flashinfer ;;
  esac
done
echo "$(date -u +%T) done" >> "$R/progress"
