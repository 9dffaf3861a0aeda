#!/usr/bin/env bash
# device_decode_waves.sh -- runs on a GPU machine after `source scripts/device_setup.sh`: does a
# decode launch sized to whole waves of resident CTAs decode faster at cliff-64's shape?
# (TANGRAM_DECODE_CTAS_PER_SM, config.decode_ctas_per_sm; benchmarks/RESULTS.md, issue 18.)
# Most important first, so that a run cut short keeps what matters:
#   1. bench.kernels, one layer, 8 and 23 rows of 16k tokens at ratio 1.0, for each value of
#      CTAS (default "8 28 12 3"; $R/kernels-c<value>.json, a line per case in $R/progress),
#      about 3 minutes. KERNELS=0 skips it;
#   2. cliff:64, Tangram 1.0 under TANGRAM_DECODE_CTAS_PER_SM=$BEST (a preset, default 12: the
#      server's default, chosen from an H100 sweep; not read from part 1's figures) and stock
#      flashinfer ($R/cliff, merged into $R/cliff/never-slower.json), about 13 minutes.
#      CLIFF=0 skips it;
#   3. sharegpt:64x4, Tangram 1.0 and 0.25 under $BEST beside both stock backends
#      ($R/sharegpt), about 7 minutes. SHAREGPT=0 skips it.
# Start it in the background, then poll $R/progress:
#   setsid nohup bash scripts/device_decode_waves.sh > /tmp/dw.log 2>&1 &
# Env: R (result folder, default /tmp/dw), CTAS, KERNELS=0, BEST, CLIFF=0, SHAREGPT=0, CAP_S,
# PROFILE.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/dw}
mkdir -p "$R"
export PROFILE=${PROFILE:-$PWD/calibration/synthetic/llama3.1-8b-kvzip-lite-r0.25.json}
BEST=${BEST:-12}
[ "${KERNELS:-1}" = 1 ] || CTAS=" "  # a blank list: no kernel case
for c in ${CTAS:-8 28 12 3}; do
  echo "$(date -u +%T) kernels, TANGRAM_DECODE_CTAS_PER_SM=$c" >> "$R/progress"
  TANGRAM_DECODE_CTAS_PER_SM=$c timeout 300 python3 -m tangram_sglang.bench.kernels \
    --shapes equal --batches 8,23 --contexts 16384 --budgets 1.0 --json "$R/kernels-c$c.json" \
    > "$R/kernels-c$c.txt" 2>&1
  grep -E "^ *(shape|equal) " "$R/kernels-c$c.txt" >> "$R/progress" \
    || tail -3 "$R/kernels-c$c.txt" >> "$R/progress"
done
if [ "${CLIFF:-1}" = 1 ]; then
  echo "$(date -u +%T) cliff:64, Tangram under TANGRAM_DECODE_CTAS_PER_SM=$BEST" >> "$R/progress"
  TANGRAM_DECODE_CTAS_PER_SM=$BEST SYSTEMS="tangram:1.0 baseline-flashinfer" WL=cliff:64 \
    WL1=cliff:64 T=300 CAP_S=${CAP_S:-600} R=$R/cliff bash scripts/device_never_slower.sh
  cat "$R/cliff/progress" >> "$R/progress"
fi
if [ "${SHAREGPT:-1}" = 1 ]; then
  echo "$(date -u +%T) sharegpt:64x4, Tangram under TANGRAM_DECODE_CTAS_PER_SM=$BEST" >> "$R/progress"
  TANGRAM_DECODE_CTAS_PER_SM=$BEST SYSTEMS="tangram:1.0 tangram:0.25 baseline baseline-flashinfer" \
    WL=sharegpt:64x4 WL1=sharegpt:64x4 T=300 CAP_S=${CAP_S:-600} R=$R/sharegpt \
    bash scripts/device_never_slower.sh
  cat "$R/sharegpt/progress" >> "$R/progress"
fi
echo "$(date -u +%T) done" >> "$R/progress"
