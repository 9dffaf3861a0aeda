#!/usr/bin/env bash
# device_select.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: what the
# prefill selection (scorer + per-head top-k) costs on ShareGPT-like mixed-length batches and
# what it does to ShareGPT traffic, then the new tokens' attention through FlashInfer
# (TANGRAM_PREFILL_ATTENTION=flashinfer) at full KV on cliff-64. Most important first, so a run
# cut short still answers the main question. About 30 minutes (parts 1-4 took 26). Results in $R.
#   1. bench.prefill_profile, kvzip-lite profile (the shipped default scorer until 2026-12-07),
#      scoring kernels off and on (TANGRAM_SCORE_KERNEL); the faster setting on 16x300-1500 is
#      the one the servers below run (written to $R/score-kernel);
#   2. the GPU tests of the scoring kernels and of the FlashInfer new-token attention;
#   3. sharegpt:64x4: stock triton, Tangram 0.25 with the kvzip-lite profile, Tangram 0.25 with
#      the ada-snapkv profile (the earlier runs' profile), side by side;
#   4. cliff:64 at full KV: Tangram 1.0 with FlashInfer prefill against stock flashinfer;
#   5. bench.prefill_profile for ada-snapkv (kernels off and on). The per-layer extend cost of
#      each TANGRAM_PREFILL_ATTENTION setting is scripts/device_prefill_auto.sh's.
#   setsid nohup bash scripts/device_select.sh > /tmp/sel.log 2>&1 &
# Env: R (result folder), CASES, SHAREGPT=0 / CLIFF1=0 skip parts 3 / 4.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/sel}
mkdir -p "$R"
CASES=${CASES:-64x1024,8x4096,16x600,16x300-1500,64x100-1500,64x256+1024}
SYN=$PWD/calibration/synthetic
profile() { # scorer kernel
  echo "$(date -u +%T) prefill $1 kernel=$2" >> "$R/progress"
  TANGRAM_SCORE_KERNEL=$2 timeout 300 python3 -m tangram_sglang.bench.prefill_profile \
    --profile "$SYN/llama3.1-8b-$1-r0.25.json" --target-ratio 0.25 --cases "$CASES" \
    --json "$R/prefill-$1-$2.json" > "$R/prefill-$1-$2.txt" 2>&1
  tail -8 "$R/prefill-$1-$2.txt" >> "$R/progress"
}
profile kvzip-lite 0
profile kvzip-lite 1
python3 scripts/pick_score_kernel.py "$R/prefill-kvzip-lite-0.json" "$R/prefill-kvzip-lite-1.json" \
  16x300-1500 > "$R/score-kernel" 2>> "$R/progress" || echo 0 > "$R/score-kernel"
export TANGRAM_SCORE_KERNEL
TANGRAM_SCORE_KERNEL=$(cat "$R/score-kernel")
echo "$(date -u +%T) servers run TANGRAM_SCORE_KERNEL=$TANGRAM_SCORE_KERNEL" >> "$R/progress"
echo "$(date -u +%T) gpu tests" >> "$R/progress"
timeout 300 python3 -m pytest -q tests/kernels/test_new_token_attention.py \
  tests/kernels/test_window_scores_triton.py > "$R/gpu-tests.txt" 2>&1
tail -2 "$R/gpu-tests.txt" >> "$R/progress"
if [ "${SHAREGPT:-1}" = 1 ]; then
  PROFILE=$SYN/llama3.1-8b-kvzip-lite-r0.25.json SYSTEMS="baseline tangram:0.25" \
    WL=sharegpt:64x4 T=300 CAP_S=400 R=$R/sharegpt-kvzip-lite bash scripts/device_never_slower.sh
  PROFILE=$SYN/llama3.1-8b-ada-snapkv-r0.25.json SYSTEMS="tangram:0.25" \
    WL=sharegpt:64x4 T=300 CAP_S=400 R=$R/sharegpt-ada-snapkv bash scripts/device_never_slower.sh
fi
if [ "${CLIFF1:-1}" = 1 ]; then
  TANGRAM_PREFILL_ATTENTION=flashinfer PROFILE=$SYN/llama3.1-8b-ada-snapkv-r0.25.json \
    SYSTEMS="tangram:1.0 baseline-flashinfer" WL=cliff:64 WL1=cliff:64 T=300 CAP_S=420 \
    R=$R/cliff1 bash scripts/device_never_slower.sh
fi
profile ada-snapkv 0
profile ada-snapkv 1
echo "$(date -u +%T) done" >> "$R/progress"
