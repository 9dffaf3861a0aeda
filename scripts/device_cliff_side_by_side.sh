#!/usr/bin/env bash
# device_cliff_side_by_side.sh -- runs on an H200 machine after `source scripts/device_setup.sh`:
# cliff-64 with and without max_tokens (equal output lengths, `:no-max`) for Tangram 0.25 and
# stock triton, then cliff-64 with max_tokens for stock flashinfer; merged into
# $R/never-slower.json by device_never_slower.sh's merge step. About 20 minutes. Start it in
# the background and poll $R/progress:
#   setsid nohup bash scripts/device_cliff_side_by_side.sh > /tmp/cl.log 2>&1 &
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
export R=${R:-/tmp/cl}
SYSTEMS="tangram:0.25 baseline" WL=cliff:64,cliff:64:no-max T=${T:-420} CAP_S=840 \
  bash scripts/device_never_slower.sh
SYSTEMS="baseline-flashinfer" WL=cliff:64 T=${T:-420} CAP_S=600 bash scripts/device_never_slower.sh
