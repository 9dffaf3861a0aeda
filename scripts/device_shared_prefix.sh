#!/usr/bin/env bash
# device_shared_prefix.sh -- runs on a two-H200 machine after `source scripts/device_setup.sh`:
# the shared-prefix workloads side by side, stock triton on GPU 0 and Tangram 0.25 with grid
# segmentation (TANGRAM_GRID_SEGMENTS=1, grid = --chunked-prefill-size) on GPU 1, same flags and
# memory, then `merge` into $OUT/shared-prefix-h200.json, whose summary holds
# shared_context_ratio_vs_stock, system_prompt_ratio_vs_stock and the hit rates (shared_prefix).
#   long-context-shared-64x4: one 16,384-token context for 64 clients, 4 rounds (64 in, 128 out)
#   system-prompt-64x4: a 2,048-token system prompt for 64 clients, then ShareGPT rounds
#                       (capped at 64 tokens in, 128 out)
# Env: CHUNK (--chunked-prefill-size = the grid, tokens; 2048: the system prompt is one cell),
#      T (per-workload timeout, s), CAP_S (each bench, s), G1 (GPU of Tangram: 1; on a one-GPU
#      machine set G1=0 and the two run one after another).
set -u -o pipefail
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=/tmp/sp; mkdir -p "$R" "${OUT:=/tmp/out}"
CHUNK=${CHUNK:-2048}
COMMON="--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 128 --disable-prefill-cuda-graph --cuda-graph-max-bs 128 --chunked-prefill-size $CHUNK"
bench() {  # GPU SYSTEMS OUTPUT GRID
  CUDA_VISIBLE_DEVICES=$1 TANGRAM_GRID_SEGMENTS=$4 timeout -s INT "${CAP_S:-450}" \
    python3 -m tangram_sglang.bench.multiturn --model-path "$MODEL" --device cuda \
    --profile "$PROFILE" --systems "$2" --server-args "$COMMON" \
    --baseline-args "--attention-backend triton" \
    --workloads long-context:64x4,system-prompt:64x4 --shared-context --context-tokens 16384 \
    --request-length 64 --output-length 128 --workload-timeout-s "${T:-150}" \
    --startup-timeout-s 400 --log-dir "$R" --output "$3"
}
if [ "${G1:-1}" = 0 ]; then
  bench 0 baseline "$R/sp-stock.json" 0 > "$R/sp-stock.out" 2>&1
  bench 0 tangram:0.25 "$R/sp-tangram.json" 1 > "$R/sp-tangram.out" 2>&1
else
  bench 0 baseline "$R/sp-stock.json" 0 > "$R/sp-stock.out" 2>&1 &
  b=$!
  bench "${G1:-1}" tangram:0.25 "$R/sp-tangram.json" 1 > "$R/sp-tangram.out" 2>&1
  wait $b
fi
cat "$R"/sp-*.out | grep "\[multiturn\]"
parts=$(ls "$R"/sp-*.json 2>/dev/null)
if [ -z "$parts" ]; then echo "device_shared_prefix: no result in $R (see $R/sp-*.out)" >&2
else python3 -m tangram_sglang.bench.multiturn merge $parts --output "$OUT/shared-prefix-h200.json"; fi
cat "$R"/sp-*.out > "$OUT/bench.out"
for f in "$R"/*.server.log; do echo "=== $f"; grep -E "Error|Traceback|max_total_num_tokens=|Tangram KV pool|retract" "$f" | head -40; grep -E "Prefill batch" "$f" | head -20; tail -15 "$f"; done > "$OUT/server-logs.txt" 2>&1
