#!/usr/bin/env bash
# device_prefill_overlap.sh -- runs on an H200 machine after `source scripts/device_setup.sh`:
# the prefill workload (16 x 8192 tokens at once, 1 output token) on stock SGLang (triton) with
# and without overlap scheduling and on Tangram (which turns overlap off), each server's
# scheduler process sampled by py-spy (.pyspy/ with the py-spy wheel copied next to the
# checkout). Where does
# Tangram's prefill time beyond stock's go? Writes $OUT/prefill-<label>.json (bench results)
# and $OUT/<label>.spy (py-spy raw stacks, read with scripts/spy_summary.py).
# Env: RATIO (Tangram kept ratio, 0.25), WL (prefill:16x8192), CAP_S (per bench, 240).
set -u -o pipefail
# without these each run below fails at once and spy() then waits 300 s for a scheduler
: "${MODEL:?source scripts/device_setup.sh first (MODEL)}" "${PROFILE:?source scripts/device_setup.sh first (PROFILE)}"
R=/tmp/pf; mkdir -p "$R" "${OUT:=/tmp/out}"
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .pyspy/*.whl || exit 1
SPY=/tmp/pyspy/bin/py-spy
COMMON="--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 128 --disable-cuda-graph"
spy() {  # LABEL: sample the scheduler from its start to its exit
  local pid=
  for _ in $(seq 1 600); do pid=$(pgrep -f 'sglang::scheduler' | head -1); [ -n "$pid" ] && break; sleep 0.5; done
  [ -n "$pid" ] && $SPY record --nonblocking -r 200 -d 400 -p "$pid" -f raw -o "$OUT/$1.spy" > "$R/$1.spy.log" 2>&1
}
run() {  # LABEL SYSTEM BASELINE_ARGS
  spy "$1" & local s=$!
  timeout -s INT "${CAP_S:-240}" python3 -m tangram_sglang.bench.multiturn --model-path "$MODEL" \
    --device cuda --profile "$PROFILE" --systems "$2" --server-args "$COMMON" \
    --baseline-args "$3" --workloads "${WL:-prefill:16x8192}" --workload-timeout-s 120 \
    --startup-timeout-s 300 --log-dir "$R/$1" --output "$OUT/prefill-$1.json" 2>&1 | grep "\[multiturn\]"
  wait $s; tail -2 "$R/$1.spy.log"
}
run stock-overlap baseline "--attention-backend triton"
run stock-no-overlap baseline "--attention-backend triton --disable-overlap-schedule"
run tangram tangram:"${RATIO:-0.25}" ""
