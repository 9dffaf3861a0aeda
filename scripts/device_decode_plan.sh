#!/usr/bin/env bash
# device_decode_plan.sh -- runs on a GPU machine after `source scripts/device_setup.sh`: the
# decode split plans (TANGRAM_DECODE_PLAN: batch, the default, against table) side by side.
# Most important first, so that a run cut short by the machine's time keeps what matters:
#   1. cliff:64: Tangram 1.0 under batch and stock flashinfer (the better stock on cliff-64 on
#      both cards so far; $R/cliff), about 10 minutes. CLIFF=0 skips it;
#   2. sharegpt:64x4: Tangram 1.0 and 0.25 under batch and both stock backends ($R/sg-batch,
#      merged into $R/sg-batch/never-slower.json: the ratio is to the better stock backend,
#      which was triton on the H200 and flashinfer on the H100), about 8 minutes. SHAREGPT=0
#      skips it and part 3;
#   3. sharegpt:64x4: Tangram 1.0 under the table ($R/sg-table), merged with part 2's runs into
#      $R/sg-table/never-slower.json (the serving A/B of the two plans), about 2 minutes;
#   4. the decode kernel's tests on the GPU (every plan against the reference; the CUDA-graph
#      replay of a decode step under table and batch), about 2 minutes;
#   5. bench.kernels on chat-shaped batches (--shapes skewed: 64 rows of lognormal lengths, the
#      longest at 2,048 and 4,096 tokens, ratio 1.0 and 0.25), about 2 minutes. KERNELS=0
#      skips it.
# Results in $R; progress lines in $R/progress. Start it in the background, then poll:
#   setsid nohup bash scripts/device_decode_plan.sh > /tmp/dp.log 2>&1 &
# Env: R (result folder), CLIFF=0, SHAREGPT=0, KERNELS=0, CAP_S (each server's bench, s),
# PROFILE.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/dp}
mkdir -p "$R"
export PROFILE=${PROFILE:-$PWD/calibration/synthetic/llama3.1-8b-kvzip-lite-r0.25.json}
if [ "${CLIFF:-1}" = 1 ]; then
  SYSTEMS="tangram:1.0 baseline-flashinfer" WL=cliff:64 WL1=cliff:64 T=300 \
    CAP_S=${CAP_S:-600} R=$R/cliff bash scripts/device_never_slower.sh
  cat "$R/cliff/progress" >> "$R/progress"
fi
if [ "${SHAREGPT:-1}" = 1 ]; then
  TANGRAM_DECODE_PLAN=batch SYSTEMS="tangram:1.0 tangram:0.25 baseline baseline-flashinfer" \
    WL=sharegpt:64x4 WL1=sharegpt:64x4 T=300 CAP_S=${CAP_S:-600} R=$R/sg-batch \
    bash scripts/device_never_slower.sh
  cat "$R/sg-batch/progress" >> "$R/progress"
  TANGRAM_DECODE_PLAN=table SYSTEMS="tangram:1.0" WL=sharegpt:64x4 WL1=sharegpt:64x4 T=300 \
    CAP_S=${CAP_S:-600} R=$R/sg-table bash scripts/device_never_slower.sh
  python3 -m tangram_sglang.bench.multiturn merge "$R"/sg-table/mt-tangram-r1.0.json \
    "$R"/sg-batch/mt-baseline*.json --output "$R/sg-table/never-slower.json" \
    > "$R/sg-table/merge.txt" 2>&1 || echo "merge failed: $R/sg-table/merge.txt" >> "$R/progress"
  cat "$R/sg-table/progress" >> "$R/progress"
fi
echo "$(date -u +%T) gpu tests" >> "$R/progress"
timeout 400 python3 -m pytest -q tests/kernels/test_decode_triton.py \
  tests/kernels/test_backend_graph_gpu.py tests/kernels/test_kernels_gpu.py > "$R/gpu-tests.txt" 2>&1
tail -2 "$R/gpu-tests.txt" >> "$R/progress"
if [ "${KERNELS:-1}" = 1 ]; then
  echo "$(date -u +%T) kernel bench (skewed)" >> "$R/progress"
  timeout 400 python3 -m tangram_sglang.bench.kernels --shapes skewed --batches 64 \
    --contexts 2048,4096 --budgets 1.0,0.25 --json "$R/kernels-skewed.json" \
    > "$R/kernels-skewed.txt" 2>&1
  grep -A5 "shape batch" "$R/kernels-skewed.txt" >> "$R/progress"
fi
echo "$(date -u +%T) done" >> "$R/progress"
