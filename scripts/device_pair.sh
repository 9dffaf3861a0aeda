#!/usr/bin/env bash
# device_pair.sh -- runs on a two-H200 machine after `source scripts/device_setup.sh`: two
# bench.multiturn runs at the same time, SYS0 on GPU 0 and SYS1 on GPU 1 (same model, flags and
# memory per GPU; device_multiturn.sh's flags), then `merge` into $OUT/multiturn-part.json.
# With PROFILE_CASES set, GPU 1 first runs bench.prefill_profile on those cases (the extend
# path's per-stage times, $OUT/prefill-profile.json and $OUT/trace.txt).
# Env: SYS0 (baseline; empty = none), SYS1 (tangram:0.25; empty = none), WL (workloads), T0/T1
#      (per-workload timeout, s), CAP_S (each bench, s), PROFILE_CASES (e.g.
#      1x8192,64x384+16384; empty = none), G1 (GPU of SYS1 and the profile: 1; on a one-GPU
#      machine set G1=0 and run SYS0 and SYS1 one after another).
set -u -o pipefail
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=/tmp/mt; mkdir -p "$R" "${OUT:=/tmp/out}"
COMMON="--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 128 --disable-prefill-cuda-graph --cuda-graph-max-bs 128"
WL=${WL:-cliff:64,prefill:16x8192,cliff:32}
bench() {  # GPU SYSTEMS OUTPUT TIMEOUT
  CUDA_VISIBLE_DEVICES=$1 timeout -s INT "${CAP_S:-540}" python3 -m tangram_sglang.bench.multiturn \
    --model-path "$MODEL" --device cuda --profile "$PROFILE" --systems "$2" \
    --server-args "$COMMON" --baseline-args "--attention-backend triton" \
    --workloads "$WL" --workload-timeout-s "$4" --startup-timeout-s 400 --log-dir "$R" \
    --output "$3"
}
b=
if [ -n "${SYS0-baseline}" ]; then
  bench 0 "${SYS0-baseline}" "$R/mt-gpu0.json" "${T0:-300}" > "$R/mt-gpu0.out" 2>&1 &
  b=$!
fi
if [ -n "${PROFILE_CASES:-}" ]; then
  CUDA_VISIBLE_DEVICES=${G1:-1} timeout 240 python3 -m tangram_sglang.bench.prefill_profile \
    --profile "$PROFILE" --target-ratio 0.25 --cases "$PROFILE_CASES" \
    --json "$OUT/prefill-profile.json" --trace-table "$OUT/trace.txt" 2>&1 | grep -v -i warn
fi
if [ -n "${SYS1-tangram:0.25}" ]; then
  bench "${G1:-1}" "${SYS1-tangram:0.25}" "$R/mt-gpu1.json" "${T1:-240}" > "$R/mt-gpu1.out" 2>&1
fi
if [ -n "$b" ]; then wait $b; fi
cat "$R"/mt-*.out | grep "\[multiturn\]"
parts=$(ls "$R"/mt-*.json 2>/dev/null)
if [ -z "$parts" ]; then echo "device_pair: no bench wrote $R/mt-*.json (see $R/mt-*.out)" >&2
else python3 -m tangram_sglang.bench.multiturn merge $parts --output "$OUT/multiturn-part.json"; fi
cat "$R"/mt-*.out > "$OUT/bench.out"
for f in "$R"/*.server.log; do echo "=== $f"; grep -E "Error|Traceback|error|Capture|max_total_num_tokens=|Tangram KV pool|retract" "$f" | head -40; grep -E "Prefill batch" "$f" | head -20; grep -E "Decode batch" "$f" | awk 'NR % 25 == 0' | tail -30; tail -15 "$f"; done > "$OUT/server-logs.txt" 2>&1
