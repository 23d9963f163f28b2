#!/usr/bin/env bash
# The main job on a fresh machine, on the embedded default ring (env/examples/local.env:
# one node, this machine): install the packages, build, check this machine and the cluster
# file, start sparkd for the one-node ring, show its health (and status when sparkctl has
# that command), stop it gracefully. Every wait is bounded; sparkd is stopped on any exit.
#
# Environment: SPARK_BUILD_DIR (default build), SPARK_DEMO_CONFIG (default
# env/examples/local.env), SPARK_DEMO_WAIT (seconds to wait for /health, default 60),
# SPARKD (a sparkd binary to use instead of the built one).
# With sparkctl start/status/stop (the ring commands) steps 4-5 use them; a later issue adds
# a chat request.
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$SRC"
BUILD=${SPARK_BUILD_DIR:-build}
CONFIG=${SPARK_DEMO_CONFIG:-env/examples/local.env}
WAIT=${SPARK_DEMO_WAIT:-60}
step() { printf '\n== %s\n' "$*"; }

step "1/5 packages"
bash scripts/install-deps.sh

step "2/5 build ($BUILD)"
export CCACHE_BASEDIR="$SRC"
if [[ ! -f $BUILD/build.ninja ]]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
fi
ninja -C "$BUILD" sparkctl sparkd
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

if has_cmd start && has_cmd stop && has_cmd status; then
  # The ring's own lifecycle: sparkctl start launches sparkd detached (pidfile, log under
  # STATE_DIR/logs), status reads it back, stop proves nothing is left.
  step "4/5 sparkctl start (API on 127.0.0.1:$API_PORT)"
  trap '"$SPARKCTL" --config "$CONFIG" stop >/dev/null 2>&1 || true; rm -rf "$RUN"' EXIT
  # --no-wait: the demo shows the ring whatever its engine does (the native engine may not
  # be built yet); --skip-preflight: this machine is not a DGX Spark (step 3 showed why).
  "$SPARKCTL" --config "$CONFIG" start --no-wait --skip-preflight
  health=""
  deadline=$((SECONDS + WAIT))
  while ((SECONDS < deadline)); do
    if health=$(curl -sS --max-time 2 "http://127.0.0.1:$API_PORT/health" 2>/dev/null) && [[ -n $health ]]; then
      state=$(python3 -c 'import json,sys; print(json.load(sys.stdin).get("state",""))' <<<"$health" 2>/dev/null || true)
      [[ $state == ready || $state == fatal ]] && break
    fi
    sleep 0.5
  done
  if [[ -z $health ]]; then
    echo "demo: sparkd did not answer GET /health within ${WAIT}s; its log:" >&2
    "$SPARKCTL" --config "$CONFIG" logs --rank 0 -n 50 >&2 || true
    exit 1
  fi
  echo "GET /health:"
  python3 -m json.tool <<<"$health" 2>/dev/null || echo "$health"
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

health=""
deadline=$((SECONDS + WAIT))
while ((SECONDS < deadline)); do
  if ! kill -0 "$PID" 2>/dev/null; then
    echo "demo: sparkd exited before answering /health; its log:" >&2
    cat "$LOG" >&2
    exit 1
  fi
  # 200 = ready, 503 = live but not ready (the body says why); both are answers.
  if health=$(curl -sS --max-time 2 "http://127.0.0.1:$API_PORT/health" 2>/dev/null) && [[ -n $health ]]; then
    state=$(python3 -c 'import json,sys; print(json.load(sys.stdin).get("state",""))' <<<"$health" 2>/dev/null || true)
    [[ $state == ready || $state == fatal ]] && break
  fi
  sleep 0.5
done
if [[ -z $health ]]; then
  echo "demo: sparkd did not answer GET /health within ${WAIT}s; its log:" >&2
  cat "$LOG" >&2
  exit 1
fi
echo "GET /health:"
python3 -m json.tool <<<"$health" 2>/dev/null || echo "$health"
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
