#!/usr/bin/env bash
# device_gate.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: what the
# kvzip-gate scorer costs in the prefill and in serving, beside the other scorers (issue 20).
#   1. bench.prefill_profile at 0.25 with the synthetic profiles of kvzip-gate, kvzip-lite and
#      ada-snapkv (selection and layer cost per case; the gate's weights are random there, which
#      costs what real ones cost);
#   2. cliff:64 and sharegpt:64x4, side by side: stock triton, stock flashinfer, Tangram 0.25 with
#      the kvzip-gate profile, Tangram 0.25 with the kvzip-lite profile (about 20 minutes).
# Results in $R (prefill-*.txt/.json, ns/never-slower.json, ns-lite/).
#   setsid nohup bash scripts/device_gate.sh > /tmp/gate.log 2>&1 &
# Env: R (result folder), CASES, NS=0 skips part 2.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/gate}
mkdir -p "$R"
CASES=${CASES:-1x8192,16x1024,16x300-1500,64x100-1500,64x256+1024}
SYN=$PWD/calibration/synthetic
for scorer in kvzip-gate kvzip-lite ada-snapkv; do
  echo "$(date -u +%T) prefill $scorer" >> "$R/progress"
  timeout 300 python3 -m tangram_sglang.bench.prefill_profile \
    --profile "$SYN/llama3.1-8b-$scorer-r0.25.json" --target-ratio 0.25 --cases "$CASES" \
    --json "$R/prefill-$scorer.json" > "$R/prefill-$scorer.txt" 2>&1
  tail -6 "$R/prefill-$scorer.txt" >> "$R/progress"
done
if [ "${NS:-1}" = 1 ]; then
  PROFILE=$SYN/llama3.1-8b-kvzip-gate-r0.25.json SYSTEMS="tangram:0.25 baseline baseline-flashinfer" \
    WL=sharegpt:64x4,cliff:64 T=300 CAP_S=720 R=$R/ns bash scripts/device_never_slower.sh
  PROFILE=$SYN/llama3.1-8b-kvzip-lite-r0.25.json SYSTEMS="tangram:0.25" \
    WL=sharegpt:64x4,cliff:64 T=300 CAP_S=720 R=$R/ns-lite bash scripts/device_never_slower.sh
fi
echo "$(date -u +%T) done" >> "$R/progress"
