#!/usr/bin/env bash
# device_serve.sh -- runs on the GPU machine after `source scripts/device_setup.sh`: start one server on the
# dummy Llama-3.1-8B, smoke it (/generate x3, /server_info), optionally load it (loadgen.py
# from the wheelhouse folder .carry/sglang/p1), stop it.
#   bash scripts/device_serve.sh NAME [server flags...]     e.g. NAME=tangram-eager --tangram ...
# Env: PORT (30000), LOAD ("N IN OUT": loadgen.py prompts, input, output tokens; empty = none),
#      UP_S (400: seconds to wait for /health). Logs: $OUT/NAME.server.log, $OUT/NAME.*.json.
set -u
[ -n "${MODEL:-}" ] || { echo "$0: MODEL is unset: run 'source scripts/device_setup.sh' in this shell first (each device call starts a new shell)" >&2; exit 2; }
NAME=$1; shift
PORT=${PORT:-30000}; R=${OUT:-/tmp/out}; mkdir -p "$R"
ts=$(date +%s)
setsid python3 -m sglang.launch_server --model-path "$MODEL" --load-format dummy \
  --sampling-backend pytorch --host 127.0.0.1 --port "$PORT" \
  --mem-fraction-static 0.8 "$@" > "$R/$NAME.server.log" 2>&1 &
pid=$!
up=0
for _ in $(seq 1 $(( ${UP_S:-400} / 2 ))); do
  kill -0 $pid 2>/dev/null || break
  if python3 -c "import urllib.request as u,sys; sys.exit(0 if u.urlopen('http://127.0.0.1:$PORT/health',timeout=2).status==200 else 1)" 2>/dev/null; then up=1; break; fi
  sleep 2
done
echo "== $NAME: up=$up after $(( $(date +%s) - ts )) s"
grep -m2 -E "max_total_num_tokens=|Tangram KV pool" "$R/$NAME.server.log" | cut -c1-300
if [ $up = 1 ]; then
  python3 - "$PORT" "$R/$NAME.smoke.json" <<'PY'
import json, sys, time, urllib.request as u
port, out = sys.argv[1], sys.argv[2]
def post(path, body):
    req = u.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(u.urlopen(req, timeout=300).read())
res = []
for n in (5, 700, 3000):
    t = time.time()
    r = post("/generate", {"input_ids": list(range(1000, 1000 + n)), "sampling_params": {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}})
    res.append({"prompt": n, "s": round(time.time() - t, 3), "out": r["output_ids"][:8], "meta": {k: r["meta_info"].get(k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")}})
    print("generate", res[-1], flush=True)
info = json.loads(u.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=30).read())
pool = (info.get("internal_states") or [{}])[0].get("tangram_pool")
print("tangram_pool", json.dumps(pool)[:600])
json.dump({"generate": res, "tangram_pool": pool, "tangram": info.get("tangram")}, open(out, "w"), indent=1)
PY
  if [ -n "${LOAD:-}" ]; then
    set -- $LOAD
    timeout ${LOAD_S:-240} python3 .carry/sglang/p1/loadgen.py --port "$PORT" --num-prompts "$1" \
      --input-len "$2" --output-len "$3" --out "$R/$NAME.load.json" || echo "loadgen rc=$?"
  fi
else
  echo "server did not come up; log tail:"; tail -60 "$R/$NAME.server.log"
fi
kill -TERM -- -$pid 2>/dev/null
for _ in $(seq 1 20); do kill -0 -- -$pid 2>/dev/null || break; sleep 1; done
kill -KILL -- -$pid 2>/dev/null
for _ in $(seq 1 15); do
  used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
  [ "${used:-0}" -lt 2000 ] && break; sleep 1
done
grep -E "Error|Traceback|error" "$R/$NAME.server.log" | head -20
