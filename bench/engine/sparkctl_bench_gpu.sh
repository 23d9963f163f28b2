#!/usr/bin/env bash
# sparkctl bench against sparkd (ENGINE=native) on this machine's GPU, serving the demo
# model: every section and gate runs through the CUDA engine. Usage:
# sparkctl_bench_gpu.sh BIN_DIR OUT_DIR (BIN_DIR holds sparkd and sparkctl). Exit 0 when
# sparkd was READY on a CUDA device, the bench exited 0 or 13 (a gate failed: random
# weights answer nothing right) and C1, C8, TTFT and the first prefill size have figures.
# OUT_DIR gets bench.json, bench.txt, the sparkd log and health.json.
set -euo pipefail
bin=$1 out=$2
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$tmp"' EXIT
"$bin/sparkctl" demo-model "$tmp/model" > "$out/demo-model.txt"
port=$((20000 + RANDOM % 20000)); rdzv=$((port + 1))
cat > "$tmp/ring.env" <<CFG
RING_NAME=gpubench
ENGINE=native
DEVICE=cuda
MODEL_PATH=$tmp/model
MODEL=demo
API_BIND=127.0.0.1
API_PORT=$port
RDZV_PORT=$rdzv
SLOTS=8
CONTEXT_LEN=2048
MEM_FREE_MIN=256MiB
MEM_AVAILABLE_MIN=512MiB
MEM_RESERVE=2GiB
STATE_DIR=$tmp/state
NODE0_NAME=gpu
NODE0_SSH=local
NODE0_FABRIC_IP=127.0.0.1
CFG
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
[ "$state" = ready ] || { echo "sparkd state=$state"; tail -30 "$out/sparkd.log"; exit 1; }
grep -q '"device": "cuda ' "$out/health.json" || { echo "health does not name a CUDA device:"; cat "$out/health.json"; exit 1; }
rc=0
"$bin/sparkctl" --config "$tmp/ring.env" bench --out "$out" --label "sparkd demo (GPU)" \
  --runs 3 --max-tokens 128 --prefill-sizes 512,1k,2k --prefix-tokens 2048 --long-tokens 3000 \
  --thinking-max-tokens 256 --mem-interval 1s || rc=$?
cat "$out/bench.txt"
[ "$rc" = 0 ] || [ "$rc" = 13 ] || { echo "sparkctl bench exited $rc"; exit 1; }
python3 - "$out/bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s = r["sections"]
figures = {
    "c1": s["c1"]["tokens_per_s"]["median"],
    "c8": s["c8"]["aggregate_tokens_per_s"]["median"],
    "ttft_p50": s["ttft"]["p50_s"],
    "prefill_512": s["prefill"]["sizes"][0]["tokens_per_s"]["median"],
}
print("figures:", json.dumps(figures))
assert all(v > 0 for v in figures.values()), figures
PY
