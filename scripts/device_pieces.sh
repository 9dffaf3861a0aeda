#!/usr/bin/env bash
# device_pieces.sh -- model pieces kept between calls on the GPU machine:
#   bash scripts/device_pieces.sh stash .carry/DIR     # in each call that carries a piece
#   bash scripts/device_pieces.sh restore .carry/DIR   # the pieces back, listed in join order
# A carried path lasts for its own call only (the next call's copy of the checkout drops it), so
# each call that carries one .carry/DIR/pNN (the first also SHA256, `python -m
# tangram_sglang.models pieces`) stashes it, and the call that converts restores them first
# (device_accuracy.sh and device_sanity.sh do). Env: STASH (/tmp/<DIR's name>-pieces).
set -u -o pipefail
MODE=${1:-}
DIR=${2:-}
[ -n "$DIR" ] || { echo "usage: device_pieces.sh stash|restore .carry/DIR" >&2; exit 2; }
STASH=${STASH:-/tmp/$(basename "$DIR")-pieces}

# restore: the stashed pieces copied into $DIR where this call carried none of that name;
# prints the pieces in join order, or fails naming the fix (a gap in p00..pNN, a STASH that is
# not a folder)
stash_is_folder() {
  [ ! -e "$STASH" ] || [ -d "$STASH" ] || {
    echo "device_pieces: STASH=$STASH is not a folder: unset STASH or point it at a folder" >&2
    return 1
  }
}

restore() {
  local f i=0
  stash_is_folder || return 1
  if [ -d "$STASH" ]; then  # what this call carried wins; the stash fills in the rest
    mkdir -p "$DIR" || return 1
    for f in "$STASH"/*; do
      [ -e "$f" ] || continue
      [ -e "$DIR/${f##*/}" ] || cp -r "$f" "$DIR"/ || return 1
    done
  fi
  compgen -G "$DIR/p*/*" > /dev/null || { echo "device_pieces: no $DIR/pNN/* pieces" >&2; return 1; }
  for f in $(ls -d "$DIR"/p* | sort); do  # p00, p01, ... with no gap
    [ "${f##*/}" = "$(printf 'p%02d' $i)" ] || {
      echo "device_pieces: pieces $(ls "$DIR" | grep '^p' | paste -sd' ') are not p00..pNN" \
        "in order: carry the missing ones (a stale $STASH: rm -rf $STASH and stash again)" >&2
      return 1
    }
    i=$((i + 1))
  done
  ls -d "$DIR"/p*/* | sort
}

# stash: keep what this call carried under $DIR in $STASH (another GGUF's SHA256 starts it
# afresh)
stash() {
  compgen -G "$DIR/*" > /dev/null ||
    { echo "device_pieces: stash: nothing under $DIR (carry a $DIR/pNN)" >&2; return 1; }
  stash_is_folder || return 1
  if [ -f "$DIR/SHA256" ] && [ -f "$STASH/SHA256" ] && ! cmp -s "$DIR/SHA256" "$STASH/SHA256"; then
    echo "device_pieces: stash: another GGUF's SHA256 was stashed; starting $STASH afresh"
    rm -rf "$STASH"
  fi
  mkdir -p "$STASH" && cp -r "$DIR"/. "$STASH"/ || return 1
  echo "device_pieces: stashed in $STASH: $(ls "$STASH" | paste -sd' ')"
}

case "$MODE" in
  stash) stash ;;
  restore) restore ;;
  *) echo "usage: device_pieces.sh stash|restore .carry/DIR" >&2; exit 2 ;;
esac
