#!/usr/bin/env bash
# device_history.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: the
# history part of a split extend through FlashInfer's paged prefill (kernels/history_attention.py,
# TANGRAM_HISTORY_ATTENTION=auto by default on CUDA, flashinfer by name here) side by side with
# stock and with Tangram's history kernel. Most important first:
#   1. the GPU tests of the paged history and of the new-token attention (correctness, LSE,
#      the start-up run); they also build FlashInfer's prefill module and warm Triton's cache,
#      so the servers below start faster (a first server on a fresh machine took 125-270 s);
#   2. cliff:64 side by side: CLIFF_SYSTEMS (default Tangram 1.0 with the history through
#      FlashInfer, then stock flashinfer: about 13 minutes; add "tangram:0.25 baseline" for the
#      compressed figure, about 8 more); CLIFF=0 skips it; TRITON_CLIFF=1 adds Tangram 1.0
#      with the history through Tangram's kernel, about 6 minutes more;
#   3. bench.prefill_profile at ratio 1.0 with the history through triton and flashinfer on
#      cases with long and short histories (per-layer extend cost; `paged_history` says which
#      cases ran the plan; EXTEND_COST=0 skips it);
#   4. sharegpt:64x4: SHAREGPT_SYSTEMS (default stock triton, Tangram 1.0 with the history
#      through FlashInfer, Tangram 0.25: about 9 minutes; add baseline-flashinfer for the
#      better stock, about 3 more); SHAREGPT=0 skips it.
# Results in $R (gpu-tests.txt, cliff/, history-*.txt/.json, sharegpt/). Each server's bench is
# capped at CAP_S (default 600 s: start-up, warm-up conversations and the workload). About 28
# minutes in all at earlier runs' lengths, up to about 66 at every cap: in a 30-minute device
# session run SHAREGPT=0 (parts 1-3) and ShareGPT in the next.
#   setsid nohup bash scripts/device_history.sh > /tmp/history.log 2>&1 &
# Env: R (result folder), CASES, CLIFF=0, CLIFF_SYSTEMS, TRITON_CLIFF=1, EXTEND_COST=0,
# SHAREGPT=0, SHAREGPT_SYSTEMS, CAP_S.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/history}
mkdir -p "$R"
SYN=$PWD/calibration/synthetic
CAP=${CAP_S:-600}
echo "$(date -u +%T) gpu tests" >> "$R/progress"
timeout 400 python3 -m pytest -q -m gpu tests/kernels/test_history_attention.py \
  tests/kernels/test_new_token_attention.py > "$R/gpu-tests.txt" 2>&1
tail -2 "$R/gpu-tests.txt" >> "$R/progress"
export PROFILE=$SYN/llama3.1-8b-kvzip-lite-r0.25.json
if [ "${CLIFF:-1}" = 1 ]; then
  # stock servers ignore the switch
  TANGRAM_HISTORY_ATTENTION=flashinfer SYSTEMS="${CLIFF_SYSTEMS:-tangram:1.0 baseline-flashinfer}" \
    WL=cliff:64 WL1=cliff:64 T=300 CAP_S=$CAP R=$R/cliff bash scripts/device_never_slower.sh
  if [ "${TRITON_CLIFF:-0}" = 1 ]; then
    TANGRAM_HISTORY_ATTENTION=triton SYSTEMS="tangram:1.0" WL=cliff:64 WL1=cliff:64 T=300 \
      CAP_S=$CAP R=$R/cliff-triton bash scripts/device_never_slower.sh
  fi
fi
for h in triton flashinfer; do
  [ "${EXTEND_COST:-1}" = 1 ] || break
  echo "$(date -u +%T) extend cost, history $h" >> "$R/progress"
  TANGRAM_HISTORY_ATTENTION=$h timeout 300 python3 -m tangram_sglang.bench.prefill_profile \
    --profile "$SYN/llama3.1-8b-kvzip-lite-r0.25.json" --target-ratio 1.0 \
    --cases "${CASES:-1x8192+8192,1x256+16384,4x2048+2048,16x1024+1024,64x128+1024}" \
    --json "$R/history-$h.json" > "$R/history-$h.txt" 2>&1
  tail -7 "$R/history-$h.txt" >> "$R/progress"
done
if [ "${SHAREGPT:-1}" = 1 ]; then
  # Tangram 0.25's batches rarely get a plan (compressed histories): its run shows the pinned
  # new-token plan (RESULTS, 07:10 UTC 2026-12-05)
  TANGRAM_HISTORY_ATTENTION=flashinfer \
    SYSTEMS="${SHAREGPT_SYSTEMS:-baseline tangram:1.0 tangram:0.25}" \
    WL=sharegpt:64x4 WL1=sharegpt:64x4 T=300 CAP_S=$CAP R=$R/sharegpt \
    bash scripts/device_never_slower.sh
fi
echo "$(date -u +%T) done" >> "$R/progress"
