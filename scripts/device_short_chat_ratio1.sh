#!/usr/bin/env bash
# device_short_chat_ratio1.sh -- runs on a GPU machine after `source scripts/device_setup.sh`:
# short chats at ratio 1.0 against stock flashinfer (issue 18's lowest ratio-1.0 figure), and
# which Triton builds still land after start-up. Most important first:
#   1. the GPU tests (tests/kernels and tests/unit, -m gpu, short tracebacks: $R/gpu-tests.txt;
#      unless GPU_TESTS=0);
#   2. `short-chat:64x6` PAIRS times, alternating: Tangram 1.0 then stock flashinfer ($R/round1,
#      with Tangram 0.25 after them; stock flashinfer and Tangram 0.25 also run
#      `sharegpt:64x4` there, for its first round's TTFT), then again ($R/round2, ...), through
#      device_never_slower.sh;
#   3. the later-turn trace (64 cached 1,024-token chats, each sent again with 128 new tokens at
#      once) for Tangram 1.0 and stock flashinfer (device_turn_trace.sh, $R/trace-*);
#   3b. on an H200 (or CLIFF=1), in place of part 3 (unless TRACE=1): `cliff:64` for Tangram
#      1.0 and stock flashinfer ($R/cliff), after round 1;
#   4. $R/builds.txt: every "Triton built" line of each Tangram server log
#      (kernels/build_log.py), each marked "serving" when it comes after SGLang's "The server is
#      fired up" line (the bench's warm-up conversations included), else "start-up"; the
#      measured runs' own builds are each result's `triton_builds` (counted in progress).
# About 19 minutes on a fresh machine. $R.tgz packs $R (one file to copy out).
# Start it in the background, then poll $R/progress:
#   setsid nohup bash scripts/device_short_chat_ratio1.sh > /tmp/sc1.log 2>&1 &
# Env: R (result folder, default /tmp/sc1), TRACE=0 skips part 3, CLIFF=1 runs part 3b, PAIRS
# (alternating Tangram 1.0 / stock flashinfer short-chat pairs of part 2, default 2; about 3
# minutes each after the first), GPU_TESTS=0 skips part 1 (when the kernels have not changed
# since their last GPU run), EXTRAS=0 leaves Tangram 0.25 and ShareGPT out of round 1.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
R=${R:-/tmp/sc1}
mkdir -p "$R"
# On an H200 the cliff (stock's KV capacity binds) runs in place of the trace (the two together
# take about 30 minutes): the cliff's ratio-1.0 figure belongs in multiturn-h200.json.
on_h200=0
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && on_h200=1
CLIFF=${CLIFF:-$on_h200}
TRACE=${TRACE:-$((1 - CLIFF))}
if [ "${GPU_TESTS:-1}" = 1 ]; then
  echo "$(date -u +%T) GPU tests" >> "$R/progress"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels tests/unit \
    > "$R/gpu-tests.txt" 2>&1
  tail -1 "$R/gpu-tests.txt" >> "$R/progress"
else
  echo "$(date -u +%T) GPU tests skipped (GPU_TESTS=$GPU_TESTS)" >> "$R/progress"
fi
for round in $(seq 1 "${PAIRS:-2}"); do
  systems="tangram:1.0 baseline-flashinfer" wl=short-chat:64x6
  if [ "$round" = 1 ] && [ "${EXTRAS:-1}" = 1 ]; then systems="$systems tangram:0.25" wl=$wl,sharegpt:64x4; fi
  SYSTEMS="$systems" WL=$wl WL1=short-chat:64x6 T=300 CAP_S=400 \
    R="$R/round$round" bash scripts/device_never_slower.sh
  grep "\[multiturn\].*tok/s" "$R/round$round/progress" >> "$R/progress"
  if [ "$round" = 1 ] && [ "$CLIFF" = 1 ]; then
    SYSTEMS="tangram:1.0 baseline-flashinfer" WL=cliff:64 WL1=cliff:64 T=300 CAP_S=400 \
      R="$R/cliff" bash scripts/device_never_slower.sh
    grep "\[multiturn\].*tok/s" "$R/cliff/progress" >> "$R/progress"
  fi
done
python3 - "$R"/round*/never-slower.json >> "$R/progress" <<'PY'
import json, statistics, sys
ratios = []
for path in sys.argv[1:]:
    try:
        ratios.append(json.load(open(path))["summary"]["ratio1_per_workload"]["short-chat-64x6"])
    except (OSError, ValueError, KeyError, TypeError):
        print(f"short-chat pair: no ratio in {path}")
if ratios:
    pairs = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"short-chat Tangram 1.0 / stock flashinfer: pairs {pairs}; median {statistics.median(ratios):.3f}")
PY
if [ "$TRACE" = 1 ]; then
  WHICH="tangram1 stock-flashinfer" N=64 L=1024 E=128 D=0 T=300 R="$R" \
    bash scripts/device_turn_trace.sh
fi
for log in "$R"/round*/*tangram*.server.log "$R"/cliff/*tangram*.server.log "$R"/server-tangram*.log; do
  [ -f "$log" ] || continue
  awk -v file="$log" '/The server is fired up/ {up = 1}
    /Triton built/ {print (up ? "serving" : "start-up") "\t" file "\t" $0}' "$log"
done > "$R/builds.txt"
measured=$(python3 - "$R"/round*/mt-tangram-*.json "$R"/cliff/mt-tangram-*.json <<'PY'
import json, sys
total, read = 0, 0
for path in sys.argv[1:]:
    try:
        systems = json.load(open(path))["systems"]
    except (OSError, ValueError, KeyError):
        continue
    read += 1
    for system in systems.values():
        for run in (system.get("workloads") or {}).values():
            total += len(run.get("triton_builds") or [])
print(total if read else "n/a")
PY
)
echo "$(date -u +%T) builds after start-up: $(grep -c '^serving' "$R/builds.txt"), in measured runs: $measured" >> "$R/progress"
# the profiler's raw traces stay behind (large); their summaries are $R/trace-*-turns.json
tar -C "$(dirname "$R")" --exclude=trace-tangram1 --exclude=trace-stock-flashinfer -czf "$R.tgz" \
  "$(basename "$R")"
echo "$(date -u +%T) done" >> "$R/progress"
