#!/usr/bin/env bash
# device_setup.sh -- runs on the GPU machine, sourced at the start of every shell there:
#   source scripts/device_setup.sh
# Unpacks the stock sglang 0.5.17 wheelhouse copied to the GPU machine into /tmp/site, applies
# patches/ to that copy and checks that the `tangram` plugin entry point (tangram_sglang.egg-info
# copied beside the checkout, found through PYTHONPATH=$PWD) is visible. Expects next to the
# checkout: .carry/sglang/p1 and tangram_sglang.egg-info (docs/gpu-benchmarks.md).
# Writes the Llama-3.1-8B-shaped dummy model folder path to $MODEL and gives that folder a
# tokenizer (bench.dummy_tokenizer).
# A later call on the same warm machine that carries neither (its copies are gone then) reuses
# what an earlier call installed: the site under $SITE (stamped with the wheelhouse's MANIFEST)
# and a copy of the egg-info beside it ($SITE.tangram-egg-info, on no import path).
set -u
export SITE=${SITE:-/tmp/site}
if [ -f .carry/sglang/p1/install.sh ]; then
  rm -f "$SITE/.tangram-wheelhouse"  # stamped again only once this install has succeeded
  bash .carry/sglang/p1/install.sh .carry/sglang/p* || return 1
  cp .carry/sglang/p1/MANIFEST "$SITE/.tangram-wheelhouse" || return 1
elif compgen -G ".carry/sglang/p*" > /dev/null; then
  echo "device_setup: .carry/sglang holds parts but no p1/install.sh: carry .carry/sglang/p1 too" >&2
  return 1
elif [ -f "$SITE/.tangram-wheelhouse" ]; then
  echo "device_setup: no .carry/sglang in this call; reusing the wheelhouse an earlier call" \
    "installed in $SITE ($(grep sha256 "$SITE/.tangram-wheelhouse"))"
else
  echo "device_setup: .carry/sglang/p1 is missing and $SITE holds no earlier install: pass carry" \
    '[".carry/sglang/p1", "tangram_sglang.egg-info"] to this call' >&2
  return 1
fi
if [ -d tangram_sglang.egg-info ]; then
  rm -rf "$SITE.tangram-egg-info" && cp -r tangram_sglang.egg-info "$SITE.tangram-egg-info" ||
    return 1
elif [ -d "$SITE.tangram-egg-info" ]; then
  cp -r "$SITE.tangram-egg-info" tangram_sglang.egg-info || return 1
fi
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
python3 scripts/patches.py apply --site-packages "$SITE" || return 1
python3 -c "from importlib.metadata import entry_points as e; eps=[x.value for x in e(group='sglang.srt.plugins')]; print('plugins:', eps); assert any('tangram' in v for v in eps)" || return 1
export MODEL=$PWD/calibration/synthetic/llama3.1-8b-dummy
# its tokenizer (one word per id), so servers run without --skip-tokenizer-init: SGLang refuses
# min_new_tokens without one, and the requests without max_new_tokens need it
python3 -m tangram_sglang.bench.dummy_tokenizer "$MODEL" || return 1
# the synthetic 0.25 profile of kvzip-gate, the scorer real models are served with by default
# (an Ada-SnapKV one is beside it); a PROFILE already set is kept
export PROFILE=${PROFILE:-$PWD/calibration/synthetic/llama3.1-8b-kvzip-gate-r0.25.json}
