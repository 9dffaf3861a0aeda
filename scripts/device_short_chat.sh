#!/usr/bin/env bash
# device_short_chat.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: the
# short-chat workload of the "never slower" comparison, with the trace that explains it. First
# the later-turn trace of both systems (64 cached 1,024-token chats, each sent again with 128
# new tokens at once: where the host makes the GPU wait), then `short-chat:64x6` side by side
# for Tangram 0.25, stock triton and Tangram 1.0 (stock flashinfer measured 0.62x of triton on
# this workload, 2026-12-01). About 15 minutes. Results in $R; progress lines in $R/progress.
# Start it in the background and poll:
#   setsid nohup bash scripts/device_short_chat.sh > /tmp/sc.log 2>&1 &
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
export R=${R:-/tmp/sc}
mkdir -p "$R"
WHICH=both N=64 L=1024 E=128 D=0 T=${T_TRACE:-300} bash scripts/device_turn_trace.sh
SYSTEMS="tangram:0.25 baseline tangram:1.0" WL=short-chat:64x6 WL1=short-chat:64x6 \
  T=${T:-300} CAP_S=${CAP_S:-600} bash scripts/device_never_slower.sh
