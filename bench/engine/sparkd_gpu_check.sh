#!/usr/bin/env bash
# `sparkctl start` of a one-node ring on this GPU machine, the way an operator brings one up:
# a cluster file whose only node is this machine (NODE0_SSH=local: sparkctl runs the node's
# commands here, no SSH server needed), ENGINE=native, DEVICE=cuda, the demo model. For each
# weights placement (WEIGHTS_PLACEMENT=device, then host-mapped: the GPU reads page-locked
# host memory in place, as on unified memory) it proves, in order:
#   1. `sparkctl start` exits 0 and says READY (rank 0's probe completion ran on the GPU);
#   2. `sparkctl --json status` shows rank 0 on "cuda", the GPU's name (nvidia-smi's), and
#      the placement asked for;
#   3. a chat completion comes back from the OpenAI API with tokens, and at temperature 0 the
#      same text under both placements (same kernels over the same bytes);
#   4. `sparkctl stop` exits 0, says nothing of the ring is left, and rank 0's process is gone.
# Usage: sparkd_gpu_check.sh BIN_DIR OUT_DIR (BIN_DIR holds sparkctl and sparkd, as the staged
# pack's bin/). GPU_CHECK_DEVICE=cpu runs the same path on a machine without a GPU (then the
# placements do not apply and one run is made). DEMO_ARCH=ARCHITECTURE (e.g. glm4_moe) brings
# up the demo model of that architecture (`sparkctl demo-model --arch`); for a mixture of
# experts the status's /health model_info must name the experts, the active parameters and the
# experts' split, and `sparkctl plan` must say how the experts split. DEMO_WEIGHTS=fp8 writes
# the demo's projections in FP8 with block scales (`demo-model --weights fp8`); then status
# must name that weight format. DEMO_ARCH=gpt_oss serves the gpt-oss demo model (MXFP4
# experts) with gpt-oss's harmony chat template and tokenizer (tests/fixtures/harmony), and
# after the chat the official OpenAI Node client (client_test.js --harmony-live) sends a
# conversation with reasoning_effort and a forced tool call, then the tool round with the
# earlier reasoning; where python3 has transformers, the prompt must be as long as its
# apply_chat_template renders it. Node is NODE_BIN, else the staged tools/node, else `node`;
# the openai package is found through NODE_PATH (the staged node_modules, else the source
# tree's tests/e2e/openai_client/node_modules); without node or the package the client part
# fails (GPU_CHECK_CLIENT=skip leaves it out). GPU_CHECK_KV_DTYPE=fp8 (or bf16, fp32) sets
# KV_DTYPE in the cluster file, and status's model_info must name that KV cache type. Logs,
# cluster files and JSON go to OUT_DIR.
set -euo pipefail
bin=$(cd "${1:?usage: sparkd_gpu_check.sh BIN_DIR OUT_DIR}" && pwd)
out=${2:?usage: sparkd_gpu_check.sh BIN_DIR OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
device=${GPU_CHECK_DEVICE:-cuda}
placements=${GPU_CHECK_PLACEMENTS:-device host-mapped}
[ "$device" = cuda ] || placements=device
tmp=$(mktemp -d)
started=()
cleanup() {
  local r
  for r in "${started[@]}"; do
    [ -n "$r" ] && "$bin/sparkctl" --config "$r" stop >/dev/null 2>&1 || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
say() { echo "sparkd_gpu_check: $*"; }
logs() { find "$tmp/state-$1" -name '*.log' -exec cp {} "$out/" \; 2>/dev/null || true; }
fail() { say "FAIL: $*"; exit 1; }

arch=${DEMO_ARCH:-}
weights=${DEMO_WEIGHTS:-}
kv_dtype=${GPU_CHECK_KV_DTYPE:-}
"$bin/sparkctl" demo-model "$tmp/model" ${arch:+--arch "$arch"} ${weights:+--weights "$weights"} \
  > "$out/demo-model.txt"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
harmony=""
case $arch in gpt_oss | GptOssForCausalLM) harmony=1 ;; esac
if [ -n "$harmony" ]; then
  # The staged copy (.device/engine/openai_client, .device/engine/harmony) or the source tree's.
  client_dir=$here/openai_client
  [ -f "$client_dir/client_test.js" ] || client_dir=$here/../../tests/e2e/openai_client
  fixture=$here/harmony
  [ -f "$fixture/chat_template.jinja" ] || fixture=$here/../../tests/fixtures/harmony
  for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
    cp "$fixture/$f" "$tmp/model/$f" || fail "no harmony tokenizer fixture ($fixture/$f)"
  done
  node=${NODE_BIN:-}
  if [ -z "$node" ] && [ -x "$bin/../tools/node" ]; then node=$bin/../tools/node; fi
  [ -n "$node" ] || node=$(command -v node || true)
  node_path=${NODE_PATH:-}
  [ -d "$bin/../node_modules/openai" ] && node_path=$bin/../node_modules
  [ -n "$node_path" ] || node_path=$client_dir/node_modules
  if [ "${GPU_CHECK_CLIENT:-}" != skip ]; then
    [ -n "$node" ] || fail "gpt_oss: no node to run the official OpenAI client (NODE_BIN; GPU_CHECK_CLIENT=skip leaves it out)"
    [ -d "$node_path/openai" ] || fail "gpt_oss: the openai npm package is not under $node_path (NODE_PATH)"
  fi
fi
gpu_name=""
if [ "$device" = cuda ] && command -v nvidia-smi >/dev/null; then
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null | head -n 1 || true)
fi
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

for p in $placements; do
  ring=$tmp/ring-$p.env
  api=$(port)
  cat > "$ring" <<CFG
RING_NAME=gpucheck-$p
ENGINE=native
DEVICE=$device
WEIGHTS_PLACEMENT=$p
MODEL_PATH=$tmp/model
MODEL=demo
API_BIND=127.0.0.1
API_PORT=$api
RDZV_PORT=$(port)
SLOTS=4
CONTEXT_LEN=2048
MEM_FREE_MIN=256MiB
MEM_AVAILABLE_MIN=512MiB
MEM_RESERVE=2GiB
START_CHECKS=port.free,sw.sparkd,model.files
READY_TIMEOUT=90s
STOP_GRACE=10s
SPARKD_BIN=$bin/sparkd
SPARKCTL_BIN=$bin/sparkctl
STATE_DIR=$tmp/state-$p
NODE0_NAME=gpu
NODE0_SSH=local
NODE0_FABRIC_IP=127.0.0.1
CFG
  [ -z "$kv_dtype" ] || echo "KV_DTYPE=$kv_dtype" >> "$ring"
  cp "$ring" "$out/ring-$p.env"
  t0=$(date +%s.%N)
  rc=0
  started+=("$ring")
  "$bin/sparkctl" --config "$ring" start > "$out/start-$p.txt" 2>&1 || rc=$?
  secs=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
  logs "$p"
  [ "$rc" = 0 ] || { cat "$out/start-$p.txt"; fail "$p: sparkctl start exited $rc"; }
  grep -q "^READY: model demo" "$out/start-$p.txt" || { cat "$out/start-$p.txt"; fail "$p: start did not say READY"; }
  say "$p: sparkctl start: READY in $secs s ($(grep '^READY' "$out/start-$p.txt"))"

  "$bin/sparkctl" --config "$ring" --json status > "$out/status-$p.json" 2>&1 ||
    { cat "$out/status-$p.json"; fail "$p: sparkctl status of a READY ring exited non-zero"; }
  python3 - "$out/status-$p.json" "$device" "$p" "$gpu_name" "$kv_dtype" <<'PY' || fail "$p: status does not show the device"
import json, sys
st, device, placement, gpu = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], sys.argv[4]
kv = sys.argv[5]
dev = st["ranks"][0]["device"]
print(f"sparkd_gpu_check: {placement}: sparkctl status: rank 0 state {st['ranks'][0]['state']}, device: {dev}")
assert st["ranks"][0]["state"] == "ready", st["ranks"][0]
assert dev.startswith(device + " "), f"device {dev!r} is not {device}"
if device == "cuda":
    assert not gpu or gpu in dev, f"device {dev!r} does not name the GPU {gpu!r}"
    want = "weights host-mapped" if placement == "host-mapped" else "weights in device memory"
    assert want in dev, f"device {dev!r} does not say {want!r}"
info = st.get("health", {}).get("model_info", {})
print(f"sparkd_gpu_check: {placement}: model_info {json.dumps(info)}")
assert info.get("architecture"), "status shows no model_info"
cache = info.get("kv_cache", {})
print(f"sparkd_gpu_check: {placement}: KV cache {json.dumps(cache)}")
assert cache.get("blocks", 0) > 0, "model_info names no KV cache"
if kv:
    assert cache.get("dtype") == kv, f"KV cache {cache!r} is not the KV_DTYPE={kv} asked for"
PY
  if [ "$weights" = fp8 ]; then
    python3 -c "import json,sys; i=json.load(open(sys.argv[1]))['health']['model_info']; f=i.get('checkpoint_format',''); assert f.startswith('fp8 e4m3'), i; print('sparkd_gpu_check: weights', f, 'held as', i['weights'])" "$out/status-$p.json" ||
      fail "$p: status does not name the FP8 weight format"
    "$bin/sparkctl" --config "$ring" status > "$out/status-text-$p.txt" 2>&1 || true
    grep -q "weights fp8 e4m3" "$out/status-text-$p.txt" ||
      fail "$p: sparkctl status does not name the FP8 weight format"
  fi
  if [ -n "$arch" ] && grep -q '"experts"' "$out/status-$p.json"; then
    python3 - "$out/status-$p.json" <<'PY' || fail "$p: status does not describe the experts"
import json, sys
e = json.load(open(sys.argv[1]))["health"]["model_info"]
x = e["experts"]
assert x["routed"] == 8 and x["per_token"] == 2, x
assert x["split"] in ("tp", "ep") and x["split_reason"], x
assert 0 < e["active_parameters"] < e["parameters"], e
print(f"sparkd_gpu_check: experts {x['routed']} ({x['per_token']} a token, split {x['split']}: "
      f"{x['split_reason']}), {e['active_parameters']} of {e['parameters']} parameters active")
PY
    "$bin/sparkctl" --config "$ring" --json plan > "$out/plan-$p.json" 2>&1 ||
      { cat "$out/plan-$p.json"; fail "$p: sparkctl plan exited non-zero"; }
    python3 -c "import json,sys; j=json.load(open(sys.argv[1])); r=j['rows'][0]; assert j['model']['experts'] == 8, j['model']; assert r['expert_parallel'] in ('tp','ep'), r; assert r['weights_from'] == 'engine', r; print('sparkd_gpu_check: plan:', j['model']['experts'], 'experts,', r['expert_parallel'], 'at', r['ranks'], 'rank(s)')" "$out/plan-$p.json" ||
      fail "$p: sparkctl plan does not describe the experts"
  fi

  python3 - "$api" > "$out/chat-$p.json" <<'PY' || fail "$p: the chat completion failed"
import json, sys, urllib.request as u
req = u.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions",
                data=json.dumps({"model": "demo", "max_tokens": 24, "temperature": 0,
                                 "messages": [{"role": "user", "content": "Say hello"}]}).encode(),
                headers={"Content-Type": "application/json"})
print(json.dumps(json.load(u.urlopen(req, timeout=60)), indent=1))
PY
  python3 - "$out/chat-$p.json" "$p" <<'PY' || fail "$p: the chat answer is not a completion"
import json, sys
j = json.load(open(sys.argv[1]))
c = j["choices"][0]
print(f"sparkd_gpu_check: {sys.argv[2]}: chat: {c['message']['content']!r:.80} "
      f"finish {c['finish_reason']}, usage {j['usage']}")
assert c["message"]["role"] == "assistant"
assert isinstance(c["message"]["content"], str)
assert c["finish_reason"] in ("stop", "length"), c["finish_reason"]
assert 0 < j["usage"]["completion_tokens"] <= 24, j["usage"]
PY

  if [ -n "$harmony" ] && [ "${GPU_CHECK_CLIENT:-}" != skip ]; then
    grep -rq "chat format harmony" "$tmp/state-$p" ||
      fail "$p: sparkd did not choose the harmony chat format for the gpt-oss checkpoint"
    python3 -c "import json,sys; i=json.load(open(sys.argv[1]))['health']['model_info']; f=i['checkpoint_format']; assert f.startswith('mxfp4') and i['weights'].startswith('mxfp4+'), i; print('sparkd_gpu_check: weights', f, 'held as', i['weights'])" "$out/status-$p.json" ||
      fail "$p: status does not name the MXFP4 experts"
    # The prompt as transformers renders it with the checkpoint's template (where it is here).
    want=$(python3 - "$tmp/model" "$client_dir/harmony_live.json" <<'PY' 2>"$out/hf-render-$p.txt" || true
import json, sys
from transformers import AutoTokenizer
conv = json.load(open(sys.argv[2]))
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok.apply_chat_template(conv["messages"], tools=conv["tools"], add_generation_prompt=True,
                              reasoning_effort=conv["reasoning_effort"], tokenize=True)
ids = ids["input_ids"] if hasattr(ids, "keys") else ids
print(len(ids))
PY
)
    if [ -n "$want" ]; then
      say "$p: transformers renders the client's conversation in $want tokens"
    else
      say "$p: no transformers here ($(tail -n 1 "$out/hf-render-$p.txt")): the prompt's length is not compared"
    fi
    NODE_PATH=$node_path timeout 300 "$node" "$client_dir/client_test.js" --harmony-live \
      --base-url "http://127.0.0.1:$api/v1" ${want:+--prompt-tokens "$want"} > "$out/client-$p.txt" 2>&1 ||
      { cat "$out/client-$p.txt"; fail "$p: the official OpenAI client's gpt-oss checks failed"; }
    grep '^#   the call' "$out/client-$p.txt" | sed "s/^#  /sparkd_gpu_check: $p: client:/"
    say "$p: official OpenAI client: $(grep -c '^ok ' "$out/client-$p.txt") checks passed (forced tool call, streamed, tool round with reasoning)"
  fi

  pid=$(cat "$tmp/state-$p/run/sparkd-0.pid" 2>/dev/null || true)
  "$bin/sparkctl" --config "$ring" stop > "$out/stop-$p.txt" 2>&1 || { cat "$out/stop-$p.txt"; fail "$p: sparkctl stop exited non-zero"; }
  started=("${started[@]/$ring}")
  grep -q "nothing of the ring is left on any node" "$out/stop-$p.txt" ||
    { cat "$out/stop-$p.txt"; fail "$p: stop left something"; }
  if [ -n "$pid" ] && [ -e "/proc/$pid" ] && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]; then
    fail "$p: sparkd pid $pid still runs after stop"
  fi
  say "$p: sparkctl stop: nothing left (rank 0 was pid ${pid:-?})"
done

# Same kernels over the same bytes: the greedy answer does not depend on where the weights are.
set -- $placements
if [ $# -ge 2 ]; then
  a=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['choices'][0]['message']['content'])" "$out/chat-$1.json")
  b=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['choices'][0]['message']['content'])" "$out/chat-$2.json")
  [ "$a" = "$b" ] || fail "greedy answers differ: $1 ${a@Q} vs $2 ${b@Q}"
  say "the greedy answer is the same under $1 and $2 weights"
fi
say "OK: sparkctl start -> READY on $device${gpu_name:+ ($gpu_name)}, status, chat, stop, for: $placements"
