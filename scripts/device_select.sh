#!/usr/bin/env bash
# device_select.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: what the
# prefill selection (scorer + per-head top-k) costs on ShareGPT-like mixed-length batches, for
# both synthetic 8B profiles (ada-snapkv, the benchmarks' default, and kvzip-lite, the shipped
# default scorer of real models), with the scoring kernels off and on (TANGRAM_SCORE_KERNEL:
# SnapKV's window mean, kvzip-lite's query max), then ShareGPT 64 x 4 with the kvzip-lite
# profile against stock triton; the new tokens' attention through FlashInfer
# (TANGRAM_PREFILL_ATTENTION=flashinfer): GPU tests, per-layer cost, cliff-64 at full KV against
# stock flashinfer. About 20 minutes. Results in $R (prefill-*.json/.txt, mt-*.json, cliff1/).
#   setsid nohup bash scripts/device_select.sh > /tmp/sel.log 2>&1 &
set -u
R=${R:-/tmp/sel}
mkdir -p "$R"
CASES=${CASES:-64x1024,8x4096,16x600,16x300-1500,64x100-1500,64x256+1024}
SYN=$PWD/calibration/synthetic
for scorer in ada-snapkv kvzip-lite; do
  for kernel in 0 1; do
    echo "$(date -u +%T) prefill $scorer kernel=$kernel" >> "$R/progress"
    TANGRAM_SCORE_KERNEL=$kernel timeout 300 python3 -m tangram_sglang.bench.prefill_profile \
      --profile "$SYN/llama3.1-8b-$scorer-r0.25.json" --target-ratio 0.25 --cases "$CASES" \
      --json "$R/prefill-$scorer-$kernel.json" > "$R/prefill-$scorer-$kernel.txt" 2>&1
    tail -8 "$R/prefill-$scorer-$kernel.txt" >> "$R/progress"
  done
done
# The new tokens' attention through FlashInfer's ragged prefill (TANGRAM_PREFILL_ATTENTION):
# correctness on the GPU, then the per-layer extend cost at full KV against Tangram's kernel.
echo "$(date -u +%T) prefill attention" >> "$R/progress"
timeout 300 python3 -m pytest -q -m gpu tests/kernels/test_new_token_attention.py \
  > "$R/gpu-new-tokens.txt" 2>&1
tail -2 "$R/gpu-new-tokens.txt" >> "$R/progress"
for pa in triton flashinfer; do
  TANGRAM_PREFILL_ATTENTION=$pa timeout 300 python3 -m tangram_sglang.bench.prefill_profile \
    --profile "$SYN/llama3.1-8b-ada-snapkv-r0.25.json" --target-ratio 1.0 \
    --cases "${SPLIT_CASES:-1x8192,16x1024,64x128+4096}" --json "$R/prefill-split-$pa.json" \
    > "$R/prefill-split-$pa.txt" 2>&1
  tail -6 "$R/prefill-split-$pa.txt" >> "$R/progress"
done
if [ "${SHAREGPT:-1}" = 1 ]; then
  PROFILE=$SYN/llama3.1-8b-kvzip-lite-r0.25.json SYSTEMS="tangram:0.25 baseline" \
    WL=sharegpt:64x4 T=300 CAP_S=400 R=$R bash scripts/device_never_slower.sh
fi
# Cliff-64 at full KV: Tangram 1.0 with the new tokens through FlashInfer against stock
# flashinfer (the better stock backend there), side by side (about 8 minutes; CLIFF1=0 skips).
if [ "${CLIFF1:-1}" = 1 ]; then
  TANGRAM_PREFILL_ATTENTION=flashinfer PROFILE=$SYN/llama3.1-8b-ada-snapkv-r0.25.json \
    SYSTEMS="tangram:1.0 baseline-flashinfer" WL=cliff:64 WL1=cliff:64 T=300 CAP_S=420 \
    R=$R/cliff1 bash scripts/device_never_slower.sh
fi
echo "$(date -u +%T) done" >> "$R/progress"
