#!/usr/bin/env bash
# device_auto_ab.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: does
# TANGRAM_PREFILL_ATTENTION=auto (the default) beat Tangram's own extend kernel (`triton`) once
# every server is warmed up (bench.multiturn --warmup-clients)? ShareGPT 64 x 4, kvzip-lite
# profile, one server after another, the Tangram settings interleaved so that neither gets the
# machine's first or warmest slot: stock triton, Tangram 0.25 triton, Tangram 0.25 auto, stock
# flashinfer, Tangram 1.0 auto, Tangram 1.0 triton. About 20 minutes. Results in
# $R/<part>/mt-*.json and $R/ab.json (the merge: Tangram settings keep the last run's key, so
# read the parts for the A/B).
#   setsid nohup bash scripts/device_auto_ab.sh > /tmp/ab.log 2>&1 &
# Env: R (result folder), WL (workloads, default sharegpt:64x4).
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/ab}
mkdir -p "$R"
export PROFILE=$PWD/calibration/synthetic/llama3.1-8b-kvzip-lite-r0.25.json
part() {  # part NAME PREFILL_ATTENTION SYSTEM
  echo "$(date -u +%T) $1" >> "$R/progress"
  # the history in Tangram's kernel in every part, so the A/B is the new tokens' attention alone
  TANGRAM_HISTORY_ATTENTION=triton TANGRAM_PREFILL_ATTENTION=$2 SYSTEMS=$3 WL=${WL:-sharegpt:64x4} \
    WL1=${WL:-sharegpt:64x4} \
    T=300 CAP_S=420 R=$R/$1 bash scripts/device_never_slower.sh > /dev/null 2>&1
  grep "\[multiturn\].*out tok/s" "$R/$1/progress" >> "$R/progress"
}
part 1-stock-triton triton baseline
part 2-t025-triton triton tangram:0.25
part 3-t025-auto auto tangram:0.25
part 4-stock-flashinfer triton baseline-flashinfer
part 5-t1-auto auto tangram:1.0
part 6-t1-triton triton tangram:1.0
python3 -m tangram_sglang.bench.multiturn merge "$R"/*/mt-*.json --output "$R/ab.json" \
  >> "$R/progress" 2>&1
echo "$(date -u +%T) done" >> "$R/progress"
