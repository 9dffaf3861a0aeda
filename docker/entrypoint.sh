#!/usr/bin/env bash
# Start SGLang with Tangram in the container (docker/Dockerfile's ENTRYPOINT):
#
#   python -m sglang.launch_server --tangram --model-path $TANGRAM_MODEL_PATH \
#       [--tangram-profile $TANGRAM_PROFILE] --host $TANGRAM_HOST --port $TANGRAM_PORT [ARGS...]
#
# Environment (defaults in brackets):
#   TANGRAM_MODEL_PATH  HF model folder, mounted read-only  [/models/model]
#   TANGRAM_PROFILE     budget profile JSON; empty = the shipped profile that matches the model
#                       (calibration/<model>/), else start-up stops with the calibrate command  []
#   TANGRAM_HOST        [0.0.0.0]         TANGRAM_PORT  [30000]
#   TANGRAM_PYTHON      the interpreter with the patched sglang  [python]
#   DRY_RUN=1           print the command (shell-quoted) instead of running it
# Arguments are appended to the command (any sglang or --tangram-* flag, e.g.
# --tangram-target-ratio 0.3 --mem-fraction-static 0.85).
#   entrypoint.sh --healthcheck   exit 0 when http://127.0.0.1:$TANGRAM_PORT/health answers 200
set -euo pipefail

model_path=${TANGRAM_MODEL_PATH:-/models/model}
profile=${TANGRAM_PROFILE:-}
host=${TANGRAM_HOST:-0.0.0.0}
port=${TANGRAM_PORT:-30000}
python=${TANGRAM_PYTHON:-python}

fail() {
  echo "tangram entrypoint: $*" >&2
  exit 2
}

if [[ ${1:-} == --healthcheck ]]; then
  exec "$python" -c 'import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=5).status == 200 else 1)
except OSError as exc:
    print(f"unhealthy: {sys.argv[1]}: {exc}", file=sys.stderr)
    sys.exit(1)' "http://127.0.0.1:${port}/health"
fi

if [[ ! $port =~ ^[0-9]{1,5}$ ]] || ((10#$port < 1 || 10#$port > 65535)); then
  fail "TANGRAM_PORT must be a port number in 1..65535, got '$port'"
fi
[[ -d $model_path ]] || fail "TANGRAM_MODEL_PATH=$model_path is not a folder: mount the HF model \
folder there (docker run -v /path/to/model:$model_path:ro, or MODEL_DIR in docker/compose.yaml)"
[[ -f $model_path/config.json ]] || fail "TANGRAM_MODEL_PATH=$model_path has no config.json: \
mount the HF model folder itself (the one holding config.json and the weights) there"
if [[ -n $profile && ! -f $profile ]]; then
  fail "TANGRAM_PROFILE=$profile is not a file: mount the profile JSON there, or unset \
TANGRAM_PROFILE to use the shipped profile of the model (calibrate one: README 'Serve your model')"
fi

cmd=("$python" -m sglang.launch_server --tangram --model-path "$model_path")
if [[ -n $profile ]]; then
  cmd+=(--tangram-profile "$profile")
fi
cmd+=(--host "$host" --port "$port" "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
