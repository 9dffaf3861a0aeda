#!/usr/bin/env bash
# device_prefill_auto.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: what
# TANGRAM_PREFILL_ATTENTION=auto (the FlashInfer split where metadata.split_pays says it pays)
# needs before it becomes the default. Most important first:
#   1. the GPU tests of the FlashInfer new-token attention (correctness, base-2 LSE);
#   2. bench.prefill_profile at ratio 1.0 for triton, flashinfer and auto on the cases around the
#      split's threshold (per-layer extend cost);
#   3. sharegpt:64x4 and cliff:64, side by side: stock triton, stock flashinfer, Tangram 0.25 and
#      Tangram 1.0 with auto (kvzip-lite profile; about 20 minutes).
# About 25 minutes. Results in $R (gpu-tests.txt, split-*.txt/.json, ns/never-slower.json).
#   setsid nohup bash scripts/device_prefill_auto.sh > /tmp/auto.log 2>&1 &
# Env: R (result folder), SPLIT_CASES, NS=0 skips part 3.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/auto}
mkdir -p "$R"
SYN=$PWD/calibration/synthetic
echo "$(date -u +%T) gpu tests" >> "$R/progress"
timeout 300 python3 -m pytest -q tests/kernels/test_new_token_attention.py > "$R/gpu-tests.txt" 2>&1
tail -2 "$R/gpu-tests.txt" >> "$R/progress"
for pa in triton flashinfer auto; do
  echo "$(date -u +%T) extend cost, $pa" >> "$R/progress"
  # the history in Tangram's kernel: the cases compare the new tokens' attention alone
  TANGRAM_HISTORY_ATTENTION=triton TANGRAM_PREFILL_ATTENTION=$pa timeout 300 \
    python3 -m tangram_sglang.bench.prefill_profile \
    --profile "$SYN/llama3.1-8b-ada-snapkv-r0.25.json" --target-ratio 1.0 \
    --cases "${SPLIT_CASES:-1x8192,16x1024,64x128+4096,1x8192+8192,16x1024+1024,4x2048+2048}" \
    --json "$R/split-$pa.json" > "$R/split-$pa.txt" 2>&1
  tail -7 "$R/split-$pa.txt" >> "$R/progress"
done
if [ "${NS:-1}" = 1 ]; then
  TANGRAM_HISTORY_ATTENTION=triton TANGRAM_PREFILL_ATTENTION=auto \
    PROFILE=$SYN/llama3.1-8b-kvzip-lite-r0.25.json \
    SYSTEMS="tangram:0.25 baseline baseline-flashinfer tangram:1.0" WL=sharegpt:64x4,cliff:64 \
    WL1=sharegpt:64x4,cliff:64 T=300 CAP_S=720 R=$R/ns bash scripts/device_never_slower.sh
fi
echo "$(date -u +%T) done" >> "$R/progress"
