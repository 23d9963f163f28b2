#!/usr/bin/env bash
# The main job on a fresh machine, on the embedded default ring (env/examples/local.env:
# one node, this machine): install the packages, build, check this machine and the cluster
# file, write the demo model (`sparkctl demo-model`: a small Qwen2-style checkpoint with
# RANDOM weights, so its answers are gibberish) or serve a real checkpoint, start the
# one-node ring, send one chat request and print the answer, show health and status, stop
# it gracefully. Every wait is bounded; sparkd is stopped on any exit.
#
# Environment: SPARK_BUILD_DIR (default build), SPARK_DEMO_CONFIG (default
# env/examples/local.env), SPARK_DEMO_WAIT (seconds to wait for /health, default 60; 900
# for a real checkpoint, whose weights take minutes to load), SPARKD (a sparkd binary to
# use instead of the built one), SPARK_JOBS (parallel build jobs, default ninja's).
# MODEL_PATH (default: the cluster file's): a directory holding a Hugging Face checkpoint
# (config.json with sizes, tokenizer.json, *.safetensors) is served as it is, under its
# directory's name; an empty or missing one, or an earlier demo model, gets the demo model.
# With sparkctl start/status/stop (the ring commands) steps 4-5 use them, else sparkd is
# started directly.
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$SRC"
BUILD=${SPARK_BUILD_DIR:-build}
CONFIG=${SPARK_DEMO_CONFIG:-env/examples/local.env}
WAIT=${SPARK_DEMO_WAIT:-60}
step() { printf '\n== %s\n' "$*"; }

step "1/5 packages (the build's and the demo's only: install-deps.sh --demo)"
bash scripts/install-deps.sh --demo

step "2/5 build ($BUILD)"
export CCACHE_BASEDIR="$SRC"
if [[ ! -f $BUILD/build.ninja ]]; then
  # GCC 12 is the oldest that builds the code; install-deps puts g++-12 beside an older
  # default (Ubuntu 22.04's GCC 11).
  if [[ -z ${CXX:-} ]] && (($(g++ -dumpversion | cut -d. -f1) < 12)); then
    for v in 14 13 12; do command -v "g++-$v" >/dev/null && { export CC=gcc-$v CXX=g++-$v; break; }; done
  fi
  # The tests' libraries and the benchmarks are not in the demo set: configure without them.
  cmake -S . -B "$BUILD" -G Ninja -DSPARK_TESTS=OFF -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
fi
# Only what the demo runs: the CLI and the daemon.
ninja -C "$BUILD" ${SPARK_JOBS:+-j"$SPARK_JOBS"} sparkctl sparkd
SPARKCTL=$BUILD/cli/sparkctl
SPARKD=${SPARKD:-$BUILD/daemon/sparkd}
has_cmd() { "$SPARKCTL" help | grep -qE "^  $1 "; }

step "3/5 this machine and the cluster file"
"$SPARKCTL" version
"$SPARKCTL" --config "$CONFIG" config check
if has_cmd preflight; then
  "$SPARKCTL" --config "$CONFIG" preflight || echo "(preflight reported problems; going on)"
fi

# Free ports on loopback, so the demo does not collide with anything running here. They
# reach sparkd through the environment, which overrides the cluster file.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export API_PORT=${API_PORT:-$(free_port)}
export RDZV_PORT=${RDZV_PORT:-$(free_port)}
RUN=$(mktemp -d /tmp/sparkctl-demo.XXXXXX)
LOG=$RUN/sparkd.log

# The model the ring serves: the environment's MODEL_PATH, else the cluster file's. A real
# checkpoint there is served as it is; otherwise the demo model is written there.
MODEL_DIR=${MODEL_PATH:-$(sed -n 's/^MODEL_PATH=//p' "$CONFIG" | tail -n 1)}
[[ -n $MODEL_DIR ]] || { echo "demo: $CONFIG sets no MODEL_PATH" >&2; exit 1; }
REAL=0
if [[ -f $MODEL_DIR/config.json ]] && ! grep -q '"sparkctl_demo"' "$MODEL_DIR/config.json"; then
  REAL=1
  echo "serving the checkpoint in $MODEL_DIR"
  # The served name is the directory's; the context 4096 tokens, or the model's maximum
  # when that is less, unless the environment says otherwise.
  export MODEL=${MODEL:-$(basename "$MODEL_DIR")}
  export CONTEXT_LEN=${CONTEXT_LEN:-$(python3 -c '
import json, sys
c = json.load(open(sys.argv[1]))
m = c.get("max_position_embeddings") or c.get("text_config", {}).get("max_position_embeddings") or 4096
print(min(4096, int(m)))' "$MODEL_DIR/config.json" 2>/dev/null || echo 2048)}
  [[ -n ${SPARK_DEMO_WAIT:-} ]] || WAIT=900
  # Can the engine serve it (architecture, weight types, tokenizer)? Said before start.
  "$SPARKCTL" --config "$CONFIG" preflight --only model.files,model.engine || {
    echo "demo: the native engine cannot serve $MODEL_DIR (above: why, and what to do)" >&2
    exit 1
  }
else
  echo "writing the demo model to $MODEL_DIR (random weights: expect gibberish answers)"
  "$SPARKCTL" demo-model "$MODEL_DIR"
fi
export MODEL_PATH=$MODEL_DIR

# wait_ready: polls /health until ready or fatal (bounded by SPARK_DEMO_WAIT); sets $health.
wait_ready() {
  health=""
  local deadline=$((SECONDS + WAIT)) state=""
  while ((SECONDS < deadline)); do
    if [[ -n ${PID:-} ]] && ! kill -0 "$PID" 2>/dev/null; then
      echo "demo: sparkd exited before it was ready; its log:" >&2
      cat "$LOG" >&2
      return 1
    fi
    # 200 = ready, 503 = live but not ready (the body says why); both are answers.
    if health=$(curl -sS --max-time 2 "http://127.0.0.1:$API_PORT/health" 2>/dev/null) && [[ -n $health ]]; then
      state=$(python3 -c 'import json,sys; print(json.load(sys.stdin).get("state",""))' <<<"$health" 2>/dev/null || true)
      [[ $state == ready || $state == fatal ]] && break
    fi
    sleep 0.5
  done
  if [[ -z $health ]]; then
    echo "demo: sparkd did not answer GET /health within ${WAIT}s" >&2
    return 1
  fi
  echo "GET /health:"
  python3 -m json.tool <<<"$health" 2>/dev/null || echo "$health"
  if [[ $state != ready ]]; then
    echo "demo: the ring is not ready (state '$state') after ${WAIT}s" >&2
    return 1
  fi
}

# chat: one OpenAI chat completion; prints the answer.
chat() {
  local body='{"model":"","messages":[{"role":"user","content":"Hello! Who are you?"}],"max_tokens":24,"temperature":0}'
  echo "POST /v1/chat/completions: $body"
  local reply
  reply=$(curl -sS --max-time 60 -H 'Content-Type: application/json' -d "$body" \
    "http://127.0.0.1:$API_PORT/v1/chat/completions")
  python3 -c '
import json, sys
j = json.loads(sys.argv[1])
if "error" in j:
    sys.exit("demo: the chat request failed: " + json.dumps(j["error"]))
c = j["choices"][0]
print(("answer: %r" if sys.argv[2] == "1" else "answer (random weights, so gibberish): %r") % c["message"]["content"])
print("finish_reason %s, usage %s" % (c["finish_reason"], json.dumps(j["usage"])))
' "$reply" "$REAL"
}

if has_cmd start && has_cmd stop && has_cmd status; then
  # The ring's own lifecycle: sparkctl start launches sparkd detached (pidfile, log under
  # STATE_DIR/logs), status reads it back, stop proves nothing is left.
  step "4/5 sparkctl start (API on 127.0.0.1:$API_PORT)"
  trap '"$SPARKCTL" --config "$CONFIG" stop >/dev/null 2>&1 || true; rm -rf "$RUN"' EXIT
  # --no-wait: the demo shows the ring whatever its engine does (the native engine may not
  # be built yet); --skip-preflight: this machine is not a DGX Spark (step 3 showed why).
  "$SPARKCTL" --config "$CONFIG" start --no-wait --skip-preflight
  if ! wait_ready; then
    "$SPARKCTL" --config "$CONFIG" logs --rank 0 -n 50 >&2 || true
    exit 1
  fi
  chat
  "$SPARKCTL" --config "$CONFIG" status || true

  step "5/5 sparkctl stop"
  rc=0
  "$SPARKCTL" --config "$CONFIG" stop || rc=$?
  "$SPARKCTL" --config "$CONFIG" logs --rank 0 -n 5 || true
  echo "sparkd stopped, exit status $rc"
  exit "$rc"
fi

step "4/5 start sparkd, rank 0 of the one-node ring (API on 127.0.0.1:$API_PORT)"
"$SPARKD" --config "$CONFIG" --rank 0 >"$LOG" 2>&1 &
PID=$!
cleanup() {
  if kill -0 "$PID" 2>/dev/null; then kill -TERM "$PID" 2>/dev/null || true; sleep 1; kill -KILL "$PID" 2>/dev/null || true; fi
  rm -rf "$RUN"
}
trap cleanup EXIT
echo "sparkd pid $PID, log $LOG"

wait_ready
chat
if has_cmd status; then "$SPARKCTL" --config "$CONFIG" status || true; fi

step "5/5 stop (SIGTERM)"
kill -TERM "$PID"
for _ in $(seq 1 60); do kill -0 "$PID" 2>/dev/null || break; sleep 0.25; done
if kill -0 "$PID" 2>/dev/null; then
  echo "demo: sparkd did not stop within 15 s of SIGTERM; killing it" >&2
  exit 1
fi
rc=0; wait "$PID" || rc=$?
echo "sparkd stopped, exit status $rc"
tail -n 5 "$LOG"
exit "$rc"
