#!/usr/bin/env bash
# device_never_slower.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: the
# "never slower than stock" comparison, side by side in one run. Each system is one server
# (same model, same flags, same memory), started, loaded with every workload, stopped; the
# systems run one after another on GPU 0, and the parts are merged into $R/never-slower.json
# (summary: sharegpt_ratio_vs_best_stock, ratio1_min_ratio_vs_stock,
# cliff_throughput_ratio_64_clients, vs_best_stock).
#
# Start it in the background so it outlives the shell that started it, then poll:
#   setsid nohup bash scripts/device_never_slower.sh > /tmp/ns.log 2>&1 &
#   ... later: cat /tmp/ns/progress; cp /tmp/ns/never-slower.json $OUT/
# Env: SYSTEMS (space-separated bench.multiturn systems, default below; tangram:1.0 runs the
#      workloads in WL1), WL (workloads), WL1 (workloads of tangram:1.0), T (per-workload
#      timeout, s), CAP_S (each system's bench, s; give 900 with --trace-steps: it covers the
#      traced repeat and the trace's reading too), R (result folder), BENCH_ARGS (more
#      bench.multiturn flags, e.g. "--context-tokens 16384" for mixed:N).
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/ns}
mkdir -p "$R"
COMMON="--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 128 --disable-prefill-cuda-graph --cuda-graph-max-bs 128"
WL=${WL:-sharegpt:64x4,cliff:64}
WL1=${WL1:-sharegpt:64x4}
SYSTEMS=${SYSTEMS:-tangram:0.25 baseline baseline-flashinfer tangram:1.0}
for sys in $SYSTEMS; do
  name=${sys/:/-r}
  wl=$WL
  if [ "$sys" = "tangram:1.0" ]; then wl=$WL1; fi
  main=${wl%%,*}
  echo "$(date -u +%T) start $sys ($wl, profile $(basename "$PROFILE"))" >> "$R/progress"
  CUDA_VISIBLE_DEVICES=0 timeout -s INT "${CAP_S:-720}" python3 -m tangram_sglang.bench.multiturn \
    --model-path "$MODEL" --device cuda --profile "$PROFILE" --systems "$sys" \
    --server-args "$COMMON" --baseline-args "--attention-backend triton" \
    --workloads "$wl" --main-workload "${main//:/-}" --workload-timeout-s "${T:-300}" \
    --startup-timeout-s 400 --log-dir "$R" --output "$R/mt-$name.json" ${BENCH_ARGS:-} \
    > "$R/mt-$name.out" 2>&1
  grep "\[multiturn\]" "$R/mt-$name.out" >> "$R/progress"
done
python3 -m tangram_sglang.bench.multiturn merge $(ls "$R"/mt-*.json) --output "$R/never-slower.json" \
  >> "$R/progress" 2>&1
for f in "$R"/*.server.log; do
  echo "=== $f"
  grep -E "Error|Traceback|error|Capture|max_total_num_tokens=|Tangram KV pool|Tangram decode|extend attention|overlap|retract|paged-history plan|prefill ready" "$f" | head -40
  grep -E "Decode batch" "$f" | awk 'NR % 25 == 0' | tail -20
  tail -8 "$f"
done > "$R/server-logs.txt" 2>&1
echo "$(date -u +%T) done" >> "$R/progress"
