#!/usr/bin/env bash
# device_history.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: what
# TANGRAM_HISTORY_ATTENTION=flashinfer (the history part of a split extend through FlashInfer's
# paged prefill, kernels/history_attention.py) needs before it becomes the default. Most
# important first:
#   1. the GPU tests of the paged history and of the new-token attention (correctness, LSE);
#   2. bench.prefill_profile at ratio 1.0 with the history through triton and flashinfer on
#      cases with long and short histories (per-layer extend cost; `paged_history` says which
#      cases got a plan);
#   3. cliff:64 side by side: stock flashinfer, Tangram 1.0 (history through Tangram's kernel),
#      Tangram 1.0 (history through FlashInfer) (about 12 minutes; CLIFF=0 skips it);
#   4. sharegpt:64x4: stock triton, Tangram 0.25 and Tangram 1.0 with the history through
#      FlashInfer (SHAREGPT=0 skips it).
# Results in $R (gpu-tests.txt, history-*.txt/.json, triton/, flashinfer/, sharegpt/ runs).
#   setsid nohup bash scripts/device_history.sh > /tmp/history.log 2>&1 &
# Env: R (result folder), CASES, CLIFF=0, SHAREGPT=0.
set -u
R=${R:-/tmp/history}
mkdir -p "$R"
SYN=$PWD/calibration/synthetic
echo "$(date -u +%T) gpu tests" >> "$R/progress"
timeout 300 python3 -m pytest -q -m gpu tests/kernels/test_history_attention.py \
  tests/kernels/test_new_token_attention.py > "$R/gpu-tests.txt" 2>&1
tail -2 "$R/gpu-tests.txt" >> "$R/progress"
for h in triton flashinfer; do
  echo "$(date -u +%T) extend cost, history $h" >> "$R/progress"
  TANGRAM_HISTORY_ATTENTION=$h timeout 300 python3 -m tangram_sglang.bench.prefill_profile \
    --profile "$SYN/llama3.1-8b-kvzip-lite-r0.25.json" --target-ratio 1.0 \
    --cases "${CASES:-1x8192+8192,1x256+16384,4x2048+2048,16x1024+1024,64x128+1024}" \
    --json "$R/history-$h.json" > "$R/history-$h.txt" 2>&1
  tail -7 "$R/history-$h.txt" >> "$R/progress"
done
export PROFILE=$SYN/llama3.1-8b-kvzip-lite-r0.25.json
if [ "${CLIFF:-1}" = 1 ]; then
  SYSTEMS="baseline-flashinfer tangram:1.0" WL=cliff:64 WL1=cliff:64 T=300 CAP_S=420 \
    R=$R/triton bash scripts/device_never_slower.sh
  TANGRAM_HISTORY_ATTENTION=flashinfer SYSTEMS="tangram:1.0" WL=cliff:64 WL1=cliff:64 T=300 \
    CAP_S=420 R=$R/flashinfer bash scripts/device_never_slower.sh
fi
if [ "${SHAREGPT:-1}" = 1 ]; then
  # stock ignores the switch; Tangram 0.25's batches rarely get a plan (compressed histories):
  # its run shows the pinned new-token plan (RESULTS, 07:10 UTC 2026-12-05)
  TANGRAM_HISTORY_ATTENTION=flashinfer SYSTEMS="baseline tangram:0.25 tangram:1.0" \
    WL=sharegpt:64x4 WL1=sharegpt:64x4 T=300 CAP_S=300 R=$R/sharegpt \
    bash scripts/device_never_slower.sh
fi
echo "$(date -u +%T) done" >> "$R/progress"
