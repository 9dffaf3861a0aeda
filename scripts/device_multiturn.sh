#!/usr/bin/env bash
# device_multiturn.sh -- runs on a two-H200 machine after `source scripts/device_setup.sh`:
# bench.multiturn with the baseline on GPU 0 and the Tangram systems on GPU 1 at the same time
# (same model, flags and memory per GPU), then `merge` into $OUT/multiturn-h200.json.
# If a Tangram system fails to start with CUDA graphs, it is rerun once with --disable-cuda-graph
# (recorded as system name + "-eager" in the JSON).
# Env: WL (workloads), TSYS (tangram systems; set empty: baseline only, one GPU), BASE_T /
# TANG_T (per-workload timeout, s), CAP_S (whole bench, s), BASE_BACKEND (triton).
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=/tmp/mt; mkdir -p "$R" "${OUT:=/tmp/out}"  # at most 8 files may come back: copy a few
COMMON="--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 128 --disable-prefill-cuda-graph --cuda-graph-max-bs 128"
WL=${WL:-cliff:64,prefill:16x8192,cliff:32}
bench() {  # GPU SYSTEMS OUTPUT TIMEOUT [extra server flags]; all cut at ${CAP_S:-520} s
  CUDA_VISIBLE_DEVICES=$1 timeout -s INT "${CAP_S:-520}" python3 -m tangram_sglang.bench.multiturn --model-path "$MODEL" \
    --device cuda --profile "$PROFILE" --systems "$2" --server-args "$COMMON ${5:-}" \
    --baseline-args "--attention-backend ${BASE_BACKEND:-triton}" \
    --workloads "$WL" --workload-timeout-s "$4" --startup-timeout-s 400 --log-dir "$R" \
    --output "$3"
}
bench 0 baseline "$R/mt-baseline.json" "${BASE_T:-260}" > "$R/mt-baseline.out" 2>&1 &
b=$!
if [ -n "${BASE2_BACKEND:-}" ]; then  # a second stock run on GPU 1 (e.g. flashinfer)
  BASE_BACKEND=$BASE2_BACKEND bench 1 "baseline-$BASE2_BACKEND" "$R/mt-baseline2.json" "${BASE_T:-260}" > "$R/mt-baseline2.out" 2>&1 &
  c=$!
fi
if [ -z "${TSYS-x}" ]; then :; else bench 1 "${TSYS:-tangram:0.25,tangram:0.5}" "$R/mt-tangram.json" "${TANG_T:-200}" > "$R/mt-tangram.out" 2>&1
if python3 -c "import json,sys; d=json.load(open('$R/mt-tangram.json')); sys.exit(0 if any(s.get('error') and 'startup_s' not in s for s in d['systems'].values()) else 1)"; then
  echo "tangram failed to start with CUDA graphs; rerunning tangram:0.25 eager"
  grep -E "Error|error|Traceback" "$R"/multiturn-tangram-r0.25.server.log | tail -20
  cp "$R"/multiturn-tangram-r0.25.server.log "$R/graph-fail.server.log"
  TSYS=tangram:0.25 bench 1 tangram:0.25 "$R/mt-tangram-eager.json" "${TANG_T:-200}" --disable-cuda-graph > "$R/mt-tangram-eager.out" 2>&1
fi
fi
wait $b
if [ -n "${c:-}" ]; then wait $c; fi
cat "$R"/mt-*.out | grep "\[multiturn\]"
python3 -m tangram_sglang.bench.multiturn merge $(ls "$R"/mt-*.json) --output "$OUT/multiturn-h200.json"
cat "$R"/mt-*.out > "$OUT/bench.out"
for f in "$R"/*.server.log; do echo "=== $f"; grep -E "Error|Traceback|error|Capture|max_total_num_tokens=|Tangram KV pool|retract" "$f" | head -40; grep -E "Decode batch|Prefill batch" "$f" | awk 'NR % 25 == 0' | tail -60; tail -15 "$f"; done > "$OUT/server-logs.txt" 2>&1
