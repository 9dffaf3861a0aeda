#!/usr/bin/env bash
# device_tp.sh -- runs on a two-H200 machine (nvidia-h200-x2) after
# `source scripts/device_setup.sh`: `--tangram --tp-size 2` against stock SGLang at
# `--tp-size 2`, both on GPUs 0+1, one server at a time.
#  1. Greedy identity with real small weights: Qwen2.5-1.5B (2 KV heads, 12 query heads: one KV
#     head per rank) converted from the GGUF pieces carried next to the checkout (as
#     device_sanity.sh), a profile synthesized for it and served with --tangram-target-ratio 1.0
#     (every head keeps every token). Greedy multi-turn chats, stock TP=2 vs Tangram TP=2: the
#     output token ids must be identical. Output: $OUT/tp-identity.json (exit 1 on a mismatch).
#  2. Cliff workload past stock TP=2's KV capacity (Llama-3.1-8B-shaped dummy weights, $MODEL and
#     $PROFILE from device_setup.sh): bench.multiturn baseline vs tangram:0.25, both with
#     --tp-size 2. Target: Tangram output tok/s >= 3x stock on cliff-64.
#     Output: $OUT/multiturn-tp2.json, $OUT/bench-tp2.out, $OUT/server-logs-tp2.txt.
# Env: STEPS (identity,cliff), MODEL_NAME (qwen2.5-1.5b), NAME_DIR (qwen15), SOURCE_PROFILE
#      (calibration/qwen2.5-0.5b/ada-snapkv-r0.25.json), WL (cliff:64), CAP_S (each bench, s),
#      T (per-workload timeout, s), TANGRAM_CACHE_DIR (/tmp/tangram-cache).
set -u -o pipefail
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
STEPS=${STEPS:-identity,cliff}
mkdir -p "${OUT:=/tmp/out}" /tmp/tp
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
status=0

if [[ ,$STEPS, == *,identity,* ]]; then
  NAME=${MODEL_NAME:-qwen2.5-1.5b}
  DIR=.carry/${NAME_DIR:-qwen15}
  export TANGRAM_CACHE_DIR=${TANGRAM_CACHE_DIR:-/tmp/tangram-cache} HF_HUB_OFFLINE=1
  want=$(awk 'NR==1{print $1}' "$DIR/SHA256" 2>/dev/null)
  [ -n "$want" ] || { echo "device_tp: no $DIR/SHA256 (carry the GGUF pieces)" >&2; exit 1; }
  # shellcheck disable=SC2046  # piece paths have no spaces (pNN/chunkNN)
  python3 -m tangram_sglang.models convert "$NAME" --sha256 "$want" \
    --gguf $(ls -d "$DIR"/p*/* | sort) || exit 1
  folder=$(python3 -m tangram_sglang.models path "$NAME") || exit 1
  python3 scripts/synthesize_profile.py --config "$folder" \
    --source "${SOURCE_PROFILE:-calibration/qwen2.5-0.5b/ada-snapkv-r0.25.json}" \
    --output /tmp/tp/profile.json || exit 1
  timeout -s INT 560 python3 - "$folder" /tmp/tp/profile.json "$OUT/tp-identity.json" <<'EOF' || status=1
import json, sys
import requests
from transformers import AutoTokenizer
from tangram_sglang.serving import SGLangServer

folder, profile, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(folder)
chats = [
    ["My name is Ada and I keep bees in Lyon.", "What is my name?", "Where do I keep them?"],
    ["Write three sentences about the sea.", "Now make them rhyme.", "Summarise in five words."],
    ["List the planets in order.", "Which is the largest?", "How many moons does it have?"],
]
common = ["--tp-size", "2", "--mem-fraction-static", "0.8", "--disable-cuda-graph"]


def run(args, log):
    ids = []
    with SGLangServer(folder, common + args, device="cuda", log_path=log,
                      startup_timeout_s=400) as server:
        for chat in chats:
            messages, per_chat = [], []
            for turn in chat:
                messages.append({"role": "user", "content": turn})
                prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
                resp = requests.post(f"{server.base_url}/generate", timeout=120, json={
                    "input_ids": prompt,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 96},
                }).json()
                per_chat.append(resp["output_ids"])
                reply = tok.decode(resp["output_ids"], skip_special_tokens=True)
                messages.append({"role": "assistant", "content": reply})
            ids.append(per_chat)
        info = server.server_info()
    return ids, info


stock, _ = run(["--attention-backend", "triton"], "/tmp/tp/stock-identity.log")
tangram, info = run(["--tangram", "--tangram-profile", profile, "--tangram-target-ratio", "1.0"],
                    "/tmp/tp/tangram-identity.log")
same = stock == tangram
report = {"identical": same, "stock": stock, "tangram": tangram,
          "tangram_summary": info.get("tangram")}
json.dump(report, open(out, "w"), indent=1)
print(f"[tp-identity] identical={same} turns={sum(len(c) for c in stock)} "
      f"summary={info.get('tangram')}")
sys.exit(0 if same else 1)
EOF
  grep -hE "Error|Traceback|Tangram KV pool|max_total_num_tokens=" /tmp/tp/*-identity.log | head -20
fi

if [[ ,$STEPS, == *,cliff,* ]]; then
  R=/tmp/tp/mt
  mkdir -p "$R"
  COMMON="--tp-size 2 --load-format dummy --sampling-backend pytorch --mem-fraction-static 0.8 --context-length 20480 --max-running-requests 128 --disable-prefill-cuda-graph --cuda-graph-max-bs 128"
  timeout -s INT "${CAP_S:-580}" python3 -m tangram_sglang.bench.multiturn --model-path "$MODEL" \
    --device cuda --profile "$PROFILE" --systems baseline,tangram:0.25 \
    --server-args "$COMMON" --baseline-args "--attention-backend triton" \
    --workloads "${WL:-cliff:64}" --workload-timeout-s "${T:-240}" --startup-timeout-s 400 \
    --log-dir "$R" --output "$OUT/multiturn-tp2.json" > "$OUT/bench-tp2.out" 2>&1 || status=1
  grep "\[multiturn\]" "$OUT/bench-tp2.out"
  for f in "$R"/*.server.log; do echo "=== $f"; grep -E "Error|Traceback|error|max_total_num_tokens=|Tangram KV pool|Tangram: profile|retract" "$f" | head -40; grep -E "Decode batch|Prefill batch" "$f" | awk 'NR % 25 == 0' | tail -40; tail -15 "$f"; done > "$OUT/server-logs-tp2.txt" 2>&1
fi
exit $status
