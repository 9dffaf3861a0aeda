#!/usr/bin/env bash
# device_kvzip.sh -- runs on a GPU machine after `source scripts/device_setup.sh`: what the
# `kvzip` scorer (KVzip's replay in the extend forward, its scores from
# kernels/replay_scores.py) costs beside `kvzip-lite`, issue 20's cost figures. Most important
# first, so that a run cut short keeps what matters:
#   1. the GPU tests (tests/kernels and tests/unit, -m gpu, short tracebacks: $R/gpu-tests.txt),
#      then every case of the replay-score kernel compiled ($R/replay-tests.txt);
#   2. one layer of replay scores, the kernel against the torch scorer (bench.replay_scores);
#   3. the prefill wall of 4 prompts of 16,384 tokens under each scorer's synthetic 0.25 profile
#      (bench.prefill_trace --no-trace; a server each; $R/wall-<scorer>.json);
#   4. cliff:64 side by side: Tangram 0.25 under `kvzip`, under `kvzip-lite`, and stock triton
#      ($R/cliff-kvzip, $R/cliff-lite, $R/cliff-stock: both Tangram runs are named
#      tangram-r0.25, so they stay in their own folders). About 9 minutes. CLIFF=0 skips it;
#   5. sharegpt:64x4 under `kvzip` beside stock flashinfer ($R/sharegpt). About 4 minutes.
#      SHAREGPT=0 skips it.
# Start it in the background, then poll $R/progress:
#   setsid nohup bash scripts/device_kvzip.sh > /tmp/kvzip.log 2>&1 &
# Env: R (result folder, default /tmp/kvzip), CLIFF=0, SHAREGPT=0.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/kvzip}
mkdir -p "$R"
SYN=$PWD/calibration/synthetic
COMMON="--load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 128 --disable-prefill-cuda-graph --cuda-graph-max-bs 128"
echo "$(date -u +%T) GPU tests" >> "$R/progress"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels tests/unit \
  > "$R/gpu-tests.txt" 2>&1
tail -3 "$R/gpu-tests.txt" >> "$R/progress"
# every case of the replay-score kernel compiled (float32 at 1e-4, the 16-bit dtypes, NaN)
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/kernels/test_replay_scores_triton.py > "$R/replay-tests.txt" 2>&1
tail -3 "$R/replay-tests.txt" >> "$R/progress"
echo "$(date -u +%T) replay scores, one layer" >> "$R/progress"
timeout 120 python3 -m tangram_sglang.bench.replay_scores --tokens 8192 > "$R/replay-scores.json" 2>&1
tail -1 "$R/replay-scores.json" >> "$R/progress"
for scorer in kvzip kvzip-lite; do
  echo "$(date -u +%T) prefill wall, $scorer" >> "$R/progress"
  timeout 420 python3 -m tangram_sglang.bench.prefill_trace --model-path "$MODEL" --label "$scorer" \
    --server-args "$COMMON --tangram --tangram-profile $SYN/llama3.1-8b-$scorer-r0.25.json" \
    --num-prompts 4 --prompt-len 16384 --no-trace --json "$R/wall-$scorer.json" \
    > "$R/wall-$scorer.txt" 2>&1
  grep -o '"wall_s": [0-9.]*' "$R/wall-$scorer.json" >> "$R/progress" || tail -3 "$R/wall-$scorer.txt" >> "$R/progress"
done
if [ "${CLIFF:-1}" = 1 ]; then
  PROFILE=$SYN/llama3.1-8b-kvzip-r0.25.json SYSTEMS="tangram:0.25" WL=cliff:64 T=300 CAP_S=600 \
    R=$R/cliff-kvzip bash scripts/device_never_slower.sh
  PROFILE=$SYN/llama3.1-8b-kvzip-lite-r0.25.json SYSTEMS="tangram:0.25" WL=cliff:64 T=300 \
    CAP_S=600 R=$R/cliff-lite bash scripts/device_never_slower.sh
  SYSTEMS="baseline" WL=cliff:64 T=300 CAP_S=600 R=$R/cliff-stock bash scripts/device_never_slower.sh
  cat "$R"/cliff-*/progress | grep "\[multiturn\].*tok/s" >> "$R/progress"
fi
if [ "${SHAREGPT:-1}" = 1 ]; then
  PROFILE=$SYN/llama3.1-8b-kvzip-r0.25.json SYSTEMS="tangram:0.25 baseline-flashinfer" \
    WL=sharegpt:64x4 T=300 CAP_S=400 R=$R/sharegpt bash scripts/device_never_slower.sh
  grep "\[multiturn\].*tok/s" "$R/sharegpt/progress" >> "$R/progress"
fi
echo "$(date -u +%T) done" >> "$R/progress"
