#!/usr/bin/env bash
# device_decode_plan.sh -- runs on a GPU machine after `source scripts/device_setup.sh`: the
# decode split plans (TANGRAM_DECODE_PLAN: batch, the default, against table) side by side.
# Most important first:
#   1. the decode kernel's tests on the GPU (every plan against the reference; the CUDA-graph
#      replay of a decode step under table and batch), about 2 minutes;
#   2. bench.kernels on chat-shaped batches (--shapes skewed: 64 rows of lognormal lengths, the
#      longest at 2,048 and 4,096 tokens, ratio 1.0 and 0.25): the plans' decode time against
#      SGLang's Triton decode on the full KV and FlashInfer's decode, about 2 minutes;
#   3. sharegpt:64x4: both stock backends and Tangram 1.0 under the table ($R/sg-table; stock
#      servers ignore the switch), then Tangram 1.0 and 0.25 under batch ($R/sg-batch), each
#      merged against the stock runs ($R/sg-*/never-slower.json: the ratio is to the better
#      stock backend, which was triton on the H200 and flashinfer on the H100), about 11
#      minutes. SHAREGPT=0 skips it;
#   4. cliff:64: Tangram 1.0 under batch and stock flashinfer (the better stock on cliff-64 on
#      both cards so far; $R/cliff), about 11 minutes. CLIFF=0 skips it.
# Results in $R; progress lines in $R/progress. Start it in the background, then poll:
#   setsid nohup bash scripts/device_decode_plan.sh > /tmp/dp.log 2>&1 &
# Env: R (result folder), KERNELS=0 (skips part 2), SHAREGPT=0, CLIFF=0, CAP_S (each server's
# bench, s), PROFILE.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/dp}
mkdir -p "$R"
export PROFILE=${PROFILE:-$PWD/calibration/synthetic/llama3.1-8b-kvzip-lite-r0.25.json}
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
if [ "${SHAREGPT:-1}" = 1 ]; then
  TANGRAM_DECODE_PLAN=table SYSTEMS="baseline baseline-flashinfer tangram:1.0" WL=sharegpt:64x4 \
    WL1=sharegpt:64x4 T=300 CAP_S=${CAP_S:-600} R=$R/sg-table bash scripts/device_never_slower.sh
  TANGRAM_DECODE_PLAN=batch SYSTEMS="tangram:1.0 tangram:0.25" WL=sharegpt:64x4 \
    WL1=sharegpt:64x4 T=300 CAP_S=${CAP_S:-600} R=$R/sg-batch bash scripts/device_never_slower.sh
  python3 -m tangram_sglang.bench.multiturn merge "$R"/sg-batch/mt-*.json \
    "$R"/sg-table/mt-baseline*.json --output "$R/sg-batch/never-slower.json" \
    > "$R/sg-batch/merge.txt" 2>&1 || echo "merge failed: $R/sg-batch/merge.txt" >> "$R/progress"
  for part in sg-table sg-batch; do
    cat "$R/$part/progress" >> "$R/progress"
  done
fi
if [ "${CLIFF:-1}" = 1 ]; then
  SYSTEMS="tangram:1.0 baseline-flashinfer" WL=cliff:64 WL1=cliff:64 T=300 \
    CAP_S=${CAP_S:-600} R=$R/cliff bash scripts/device_never_slower.sh
  cat "$R/cliff/progress" >> "$R/progress"
fi
echo "$(date -u +%T) done" >> "$R/progress"
