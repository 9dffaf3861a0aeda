#!/usr/bin/env bash
# device_no_max_tokens.sh -- runs THERE (nvidia-h200, one GPU) after `source scripts/device_setup.sh`:
# stock SGLang (triton) then Tangram 0.25, one after the other on GPU 0, with requests that set NO
# max_tokens (bench.multiturn --no-max-tokens: max_new_tokens null, temperature 1, each output
# exactly its drawn length, geometric with the round's output length, 128, as mean, the same on
# both systems: min_new_tokens, then one biased stop id). Two workloads per system:
#   long-context:256x1  256 clients x one 2048+64-token prompt (concurrency: how many the pool
#                       admits at once; --max-running-requests 256 so memory is the limit)
#   cliff:64            the issue-7 cliff (16k context + 3 rounds), throughput
# then $OUT/no-max-tokens-h200.json (summary.concurrency: peak running requests per system and
# workload; summary.cliff_throughput_ratio_64_clients: Tangram 0.25 / stock output tok/s).
# About 7 min: 2 starts x ~45 s, stock cliff cut at T s (default 160), Tangram's ~70 s.
# Env: WL (workloads), T (per-workload timeout, s), CAP_S (whole bench, s), SYSTEMS.
set -u -o pipefail
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=/tmp/nmt; mkdir -p "$R" "${OUT:=/tmp/out}"
COMMON="--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 256 --disable-prefill-cuda-graph --cuda-graph-max-bs 128"
WL=${WL:-long-context:256x1,cliff:64}
case ",$WL," in *,cliff:64,*) MAIN=cliff-64 ;; *) MAIN=$(echo "${WL%%,*}" | tr : -) ;; esac
CUDA_VISIBLE_DEVICES=${GPU:-0} timeout -s INT "${CAP_S:-450}" python3 -m tangram_sglang.bench.multiturn \
  --model-path "$MODEL" --device cuda --profile "$PROFILE" --systems "${SYSTEMS:-baseline,tangram:0.25}" \
  --server-args "$COMMON" --baseline-args "--attention-backend triton" --no-max-tokens \
  --workloads "$WL" --context-tokens 2048 --max-parallel 512 \
  --main-workload "$MAIN" --workload-timeout-s "${T:-160}" --startup-timeout-s 400 \
  --log-dir "$R" --output "$OUT/no-max-tokens-h200.json" > "$R/bench.out" 2>&1
grep "\[multiturn\]" "$R/bench.out"
python3 -c "import json; s=json.load(open('$OUT/no-max-tokens-h200.json'))['summary']; print(json.dumps({k: s.get(k) for k in ('concurrency', 'cliff_throughput_ratio_64_clients', 'max_concurrency_ratio', 'missing')}, indent=1))"
cp "$R/bench.out" "$OUT/bench.out"
for f in "$R"/*.server.log; do echo "=== $f"; grep -E "Error|Traceback|error|max_total_num_tokens=|Tangram KV pool|retract|capped to|KV pages" "$f" | head -40; grep -E "Decode batch" "$f" | awk 'NR % 25 == 0' | tail -40; tail -10 "$f"; done > "$OUT/server-logs.txt" 2>&1
