#!/usr/bin/env bash
# device_sanity.sh -- runs on an H200 machine after `source scripts/device_setup.sh`: issue 7's
# sanity run with real weights. Converts the GGUF pieces of an embedded model copied to the GPU
# machine next to the checkout (.carry/$NAME_DIR/pNN/*, whole-file sha256 in
# .carry/$NAME_DIR/SHA256) with `python -m tangram_sglang.models convert`, synthesizes a budget
# profile for it from a calibrated one of the same family (scripts/synthesize_profile.py;
# calibration data is not copied there), then
# runs the README's main job on the GPU twice: `python -m tangram_sglang.demo --device cuda`
# with --tangram (replies, cached tokens, KV held vs full KV per turn) and with --full-kv.
# Output: $OUT/sanity-tangram.txt, $OUT/sanity-full-kv.txt, $OUT/sanity-profile.json.
# Env: MODEL_NAME (qwen2.5-1.5b), NAME_DIR (qwen15), SOURCE_PROFILE
#      (calibration/qwen2.5-0.5b/ada-snapkv-r0.25.json), TANGRAM_CACHE_DIR (/tmp/tangram-cache).
# Expects next to the checkout: .carry/$NAME_DIR/pNN (one 60 MiB piece each, within the GPU
# machine's 64 MiB transfer limit) and .carry/$NAME_DIR/SHA256, each carried in its own call
# and kept with `bash scripts/device_pieces.sh stash .carry/$NAME_DIR` (a carried path lasts
# for its own call only); this script restores them first.
set -u -o pipefail
NAME=${MODEL_NAME:-qwen2.5-1.5b}
DIR=.carry/${NAME_DIR:-qwen15}
SRC=${SOURCE_PROFILE:-calibration/qwen2.5-0.5b/ada-snapkv-r0.25.json}
export TANGRAM_CACHE_DIR=${TANGRAM_CACHE_DIR:-/tmp/tangram-cache} HF_HUB_OFFLINE=1
mkdir -p "${OUT:=/tmp/out}"
pieces=$(bash "$(dirname "${BASH_SOURCE[0]}")/device_pieces.sh" restore "$DIR") || exit 1
want=$(awk 'NR==1{print $1}' "$DIR/SHA256" 2>/dev/null)
[ -n "$want" ] || { echo "device_sanity: no $DIR/SHA256" >&2; exit 1; }
# shellcheck disable=SC2086  # piece paths have no spaces (pNN/chunkNN)
python3 -m tangram_sglang.models convert "$NAME" --sha256 "$want" --gguf $pieces || exit 1
folder=$(python3 -m tangram_sglang.models path "$NAME") || exit 1
python3 scripts/synthesize_profile.py --config "$folder" --source "$SRC" \
  --output "$OUT/sanity-profile.json" || exit 1
timeout -s INT 420 python3 -m tangram_sglang.demo --model "$NAME" --device cuda \
  --profile "$OUT/sanity-profile.json" --log /tmp/sanity-tangram.log 2>&1 | tee "$OUT/sanity-tangram.txt"
timeout -s INT 300 python3 -m tangram_sglang.demo --model "$NAME" --device cuda --full-kv \
  --log /tmp/sanity-full.log 2>&1 | tee "$OUT/sanity-full-kv.txt"
grep -E "Error|Traceback" /tmp/sanity-*.log | tail -20
