#!/usr/bin/env bash
# nccl-ring.sh: a one-host ring over NCCL on this machine's GPUs, end to end with the real
# binaries: `sparkctl preflight --fabric` (table and JSON), then one sparkd per rank started
# with exactly the environment `sparkctl env --rank N --export` prints, READY with the fabric
# self-test's figures in /health, a completion, and (with 2+ ranks) the last rank killed:
# rank 0 must turn fatal naming it within HEARTBEAT_TIMEOUT (plus the watchdog's second).
#
# Usage: scripts/nccl-ring.sh BIN_DIR OUT_DIR [RANKS]
#   BIN_DIR holds sparkctl and sparkd; RANKS defaults to the number of GPUs (one per rank).
# Writes to OUT_DIR: preflight-fabric.txt/.json, health-ready.json, completion.json,
# greedy-*.json (greedy tokens with logprobs), kill.json and inflight.json (RANKS > 1),
# logs/. MODEL_DIR=... serves that model instead of a fresh demo model. Exits non-zero when a check fails. Needs NCCL and a GPU.
set -uo pipefail

bin=${1:?usage: nccl-ring.sh BIN_DIR OUT_DIR [RANKS]}
out=${2:?usage: nccl-ring.sh BIN_DIR OUT_DIR [RANKS]}
n=${3:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
[ "${n:-0}" -ge 1 ] || { echo "SKIP: no GPU (nvidia-smi lists none)"; exit 77; }
mkdir -p "$out/logs"
work=$(mktemp -d /tmp/nccl-ring.XXXXXX)
mkdir -p "$work/logs"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  sleep 2
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  cp "$work"/logs/* "$out/logs/" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fail=0
check() { if eval "$2"; then echo "PASS $1"; else echo "FAIL $1"; fail=1; fi; }

gpus=$(seq -s, 0 $((n - 1)))
api=$((18000 + RANDOM % 1000))
model=${MODEL_DIR:-$work/model}
if [ -z "${MODEL_DIR:-}" ]; then
  "$bin/sparkctl" demo-model "$model" > "$out/logs/demo-model.txt" 2>&1 || { echo "FAIL demo-model"; exit 1; }
fi
cat > "$work/ring.env" <<CFG
RING_NAME=nccl-check
MODEL_PATH=$model
NODE0_NAME=$(hostname -s)
NODE0_SSH=local
NODE0_FABRIC_IP=127.0.0.1
NODE0_GPUS=$gpus
COLLECTIVE=nccl
STATE_DIR=$work/state
LOG_DIR=$work/logs
API_PORT=$api
RDZV_PORT=$((api + 1000))
HEARTBEAT_TIMEOUT=5s
CFG
ctl() { "$bin/sparkctl" --config "$work/ring.env" "$@"; }

# 1. The fabric before any engine starts.
ctl preflight --fabric > "$out/preflight-fabric.txt" 2>&1; pf=$?
ctl --json preflight --fabric > "$out/preflight-fabric.json" 2>&1
cat "$out/preflight-fabric.txt"
check "preflight --fabric passes on $n rank(s)" '[ $pf = 0 ]'

# 2. The ring, each rank with exactly what `sparkctl env --rank N` prints.
for r in $(seq 0 $((n - 1))); do
  ctl env --rank "$r" --export > "$work/rank$r.env" 2>"$work/logs/env-$r.err" || { echo "FAIL env --rank $r"; cat "$work/logs/env-$r.err"; exit 1; }
  ( set -a; . "$work/rank$r.env"; exec "$bin/sparkd" --config "$work/ring.env" --rank "$r" \
      --log-file "$work/logs/sparkd-$r.log" ) > "$work/logs/sparkd-$r.out" 2>&1 &
  pids+=($!)
done
health() { curl -s -m 5 "http://127.0.0.1:$api/health"; }
state=""
for _ in $(seq 1 240); do
  state=$(health | sed -n 's/.*"state":"\([a-z]*\)".*/\1/p' | head -1)
  [ "$state" = ready ] || [ "$state" = fatal ] && break
  sleep 0.5
done
health > "$out/health-ready.json"
check "rank 0 READY (state $state)" '[ "$state" = ready ]'
check "/health carries the fabric self-test, passed" 'grep -q "\"fabric\":{" "$out/health-ready.json" && grep -q "\"passed\":true" "$out/health-ready.json"'
grep -h "NCCL environment\|fabric self-test" "$work"/logs/sparkd-*.log | head -20
curl -s -m 60 "http://127.0.0.1:$api/v1/completions" -H 'content-type: application/json' \
  -d '{"prompt":"The capital of France is","max_tokens":8,"temperature":0}' > "$out/completion.json"
check "a completion through every rank" 'grep -q "\"choices\"" "$out/completion.json"'
# Greedy tokens with their logprobs, for comparing rings of different sizes (multi-gpu.sh).
i=0
for prompt in "The capital of France is" "def fibonacci(n):" "1, 2, 3, 5, 8,"; do
  curl -s -m 60 "http://127.0.0.1:$api/v1/completions" -H 'content-type: application/json' \
    -d "{\"prompt\":\"$prompt\",\"max_tokens\":16,\"temperature\":0,\"logprobs\":1}" \
    > "$out/greedy-$i.json"
  i=$((i + 1))
done

# 3. A rank killed: rank 0 fatal within HEARTBEAT_TIMEOUT, naming it.
if [ "$n" -gt 1 ]; then
  last=$((n - 1))
  # A long request in flight when the rank dies: it must fail with a clear error, not hang.
  curl -s -m 60 "http://127.0.0.1:$api/v1/completions" -H 'content-type: application/json' \
    -d '{"prompt":"Once upon a time","max_tokens":4000,"temperature":0,"ignore_eos":true}' \
    > "$out/inflight.json" 2>&1 &
  inflight=$!
  sleep 1
  t0=$(date +%s.%N)
  kill -KILL "${pids[$last]}"
  for _ in $(seq 1 60); do
    state=$(health | sed -n 's/.*"state":"\([a-z]*\)".*/\1/p' | head -1)
    [ "$state" = fatal ] && break
    sleep 0.25
  done
  t1=$(date +%s.%N)
  health > "$out/health-killed.json"
  secs=$(echo "$t1 - $t0" | bc)
  echo "{\"killed_rank\":$last,\"state\":\"$state\",\"seconds\":$secs}" > "$out/kill.json"
  check "rank 0 fatal after rank $last was killed (${secs}s)" '[ "$state" = fatal ]'
  check "within HEARTBEAT_TIMEOUT + 2 s" '[ "$(echo "$secs < 7" | bc)" = 1 ]'
  check "the reason names rank $last" 'grep -q "rank $last" "$out/health-killed.json"'
  wait "$inflight"
  check "the request in flight failed with an error" 'grep -q "\"error\"" "$out/inflight.json"'
fi
exit $fail
