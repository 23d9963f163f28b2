#!/usr/bin/env bash
# sparkd with ENGINE=native on this machine's GPU: a one-node cluster file reaches READY
# and a chat completion comes back from the GPU. Usage: sparkd_gpu_check.sh BIN_DIR OUT_DIR
# (BIN_DIR holds sparkd and sparkctl). Exit 0 when READY, /health names a CUDA device, and
# the chat returned text; logs and the JSON replies go to OUT_DIR.
set -euo pipefail
bin=$1 out=$2
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$tmp"' EXIT
"$bin/sparkctl" demo-model "$tmp/model" > "$out/demo-model.txt"
port=$((20000 + RANDOM % 20000)); rdzv=$((port + 1))
cat > "$tmp/ring.env" <<CFG
RING_NAME=gpucheck
ENGINE=native
DEVICE=cuda
MODEL_PATH=$tmp/model
MODEL=demo
API_BIND=127.0.0.1
API_PORT=$port
RDZV_PORT=$rdzv
SLOTS=4
CONTEXT_LEN=2048
MEM_FREE_MIN=256MiB
MEM_AVAILABLE_MIN=512MiB
MEM_RESERVE=2GiB
STATE_DIR=$tmp/state
NODE0_NAME=gpu
NODE0_SSH=local
NODE0_FABRIC_IP=127.0.0.1
CFG
cp "$tmp/ring.env" "$out/ring.env"
t0=$(date +%s.%N)
"$bin/sparkd" --config "$tmp/ring.env" --rank 0 --port "$port" --log-file "$out/sparkd.log" \
  > "$out/sparkd.out" 2>&1 &
pid=$!
state=""
for _ in $(seq 1 600); do
  state=$(python3 -c "import json,urllib.request as u;print(json.load(u.urlopen('http://127.0.0.1:$port/health',timeout=2))['state'])" 2>/dev/null || true)
  [ "$state" = ready ] || [ "$state" = fatal ] && break
  sleep 0.1
done
python3 -c "import json,urllib.request as u;print(json.dumps(json.load(u.urlopen('http://127.0.0.1:$port/health',timeout=2)),indent=1))" > "$out/health.json" 2>&1 || true
echo "state=$state after $(python3 -c "import time; print(round(time.time() - $t0, 2))") s"
[ "$state" = ready ] || { tail -30 "$out/sparkd.log"; exit 1; }
grep -q '"device": "sm_' "$out/health.json" || { echo "health does not name a CUDA device:"; cat "$out/health.json"; exit 1; }
python3 - "$port" > "$out/chat.json" <<'PY'
import json, sys, urllib.request as u
req = u.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions",
                data=json.dumps({"model": "demo", "max_tokens": 24,
                                 "messages": [{"role": "user", "content": "Say hello"}]}).encode(),
                headers={"Content-Type": "application/json"})
print(json.dumps(json.load(u.urlopen(req, timeout=60)), indent=1))
PY
python3 -c "import json,sys;j=json.load(open(sys.argv[1]));c=j['choices'][0];print('chat:',repr(c['message']['content'])[:80],c['finish_reason'],j['usage']);assert j['usage']['completion_tokens']>0" "$out/chat.json"
grep -o '"device": "[^"]*"' "$out/health.json" | head -2
