#!/usr/bin/env bash
# multi-gpu.sh: the checks that need one host with two or more GPUs, in one device call.
#   1. topology: `nvidia-smi topo -m` (NVLink or PCIe), and the transport NCCL chose between
#      the GPUs as the fabric self-test read it (P2P, SHM, NET) -- NVLink multicast stays off
#   2. TP=2 (and TP=4 with four GPUs) against TP=1 on the same random-weight model: the same
#      greedy tokens, and logprobs within BF16_LOGPROB_BOUND (default 0.05)
#   3. the self-test's bus bandwidth against NVIDIA's nccl-tests (all_reduce_perf,
#      all_gather_perf built here from a copy carried in, never committed), same sizes:
#      goal within 5% at 64 MB and above; the latency at the decode size (8-16 KB) for both
#   4. a rank killed during generation: rank 0 fatal within HEARTBEAT_TIMEOUT naming it, the
#      request in flight fails with an error (scripts/nccl-ring.sh, step 3)
#
# Usage: scripts/multi-gpu.sh BIN_DIR OUT_DIR [NCCL_TESTS_SRC]
#   BIN_DIR: sparkctl and sparkd (a staged .device/bin); NCCL_TESTS_SRC: a checkout of
#   github.com/NVIDIA/nccl-tests (fetched on the head and carried; without it step 3 is
#   skipped with a reason). MODEL_DIRS="dir ..." adds random-weight checkpoints (Llama, Qwen,
#   Mistral shapes) to step 2; the demo model is always there. gpu-run.sh runs it as the
#   multi-gpu step. Writes summary.txt, summary.json and one directory per ring to OUT_DIR;
#   exits non-zero when a check fails, 77 when the machine has fewer than two GPUs.
set -uo pipefail

bin=${1:?usage: multi-gpu.sh BIN_DIR OUT_DIR [NCCL_TESTS_SRC]}
out=${2:?usage: multi-gpu.sh BIN_DIR OUT_DIR [NCCL_TESTS_SRC]}
nccl_tests=${3:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ring=$here/nccl-ring.sh
bound=${BF16_LOGPROB_BOUND:-0.05}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "${gpus:-0}" -ge 2 ] || { echo "SKIP: $gpus GPU(s); multi-gpu.sh needs two or more"; exit 77; }
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
fail=0
summary=$out/summary.txt
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
check() { if eval "$2"; then note "PASS $1"; else note "FAIL $1"; fail=1; fi; }

# 1. Topology.
nvidia-smi topo -m > "$out/topo.txt" 2>&1
cat "$out/topo.txt"

sizes=(1 2)
[ "$gpus" -ge 4 ] && sizes+=(4)

# 2 and 4: one ring per size and model; nccl-ring.sh checks READY, the kill and the request.
models=("demo")
for m in ${MODEL_DIRS:-}; do models+=("$m"); done
for m in "${models[@]}"; do
  tag=$(basename "$m")
  for n in "${sizes[@]}"; do
    d=$out/ring-$tag-tp$n
    if [ "$m" = demo ]; then
      bash "$ring" "$bin" "$d" "$n" > "$d.log" 2>&1; rc=$?
    else
      MODEL_DIR=$m bash "$ring" "$bin" "$d" "$n" > "$d.log" 2>&1; rc=$?
    fi
    grep -E '^(PASS|FAIL)' "$d.log" | sed "s/^/[$tag tp$n] /" | tee -a "$summary"
    [ $rc = 0 ] || fail=1
  done
  for n in "${sizes[@]:1}"; do
    check "[$tag] TP=$n greedy tokens equal TP=1, logprobs within $bound" \
      "python3 - '$out/ring-$tag-tp1' '$out/ring-$tag-tp$n' '$bound' <<'PY'
import glob, json, os, sys
a, b, bound = sys.argv[1], sys.argv[2], float(sys.argv[3])
worst, ok = 0.0, True
for fa in sorted(glob.glob(os.path.join(a, 'greedy-*.json'))):
    ja = json.load(open(fa)); jb = json.load(open(os.path.join(b, os.path.basename(fa))))
    ca, cb = ja['choices'][0], jb['choices'][0]
    if ca['text'] != cb['text']:
        print('tokens differ:', repr(ca['text']), repr(cb['text'])); ok = False
    la = (ca.get('logprobs') or {}).get('token_logprobs') or []
    lb = (cb.get('logprobs') or {}).get('token_logprobs') or []
    for x, y in zip(la, lb):
        worst = max(worst, abs(x - y))
print('max |logprob difference|', worst)
sys.exit(0 if ok and worst <= bound else 1)
PY"
  done
done

# 1 (continued). The transport between the GPUs, as NCCL told the self-test.
for n in "${sizes[@]:1}"; do
  f=$out/ring-demo-tp$n/preflight-fabric.json
  [ -f "$f" ] && python3 -c "
import json, sys
j = json.load(open('$f'))
for r in j['ranks']:
    print('tp$n rank', r['rank'], 'peers', [(p['peer'], p['detail']) for p in r['nccl']['peers']])
" | tee -a "$summary"
done

# 3. Against nccl-tests, same sizes, same machine.
if [ -z "$nccl_tests" ] || [ ! -f "$nccl_tests/Makefile" ]; then
  note "SKIP nccl-tests: no NCCL_TESTS_SRC given (carry a checkout of NVIDIA/nccl-tests)"
else
  make -C "$nccl_tests" -j8 MPI=0 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
    NCCL_HOME=${NCCL_HOME:-/usr} > "$out/nccl-tests-build.log" 2>&1 ||
    { note "FAIL nccl-tests build (see nccl-tests-build.log)"; fail=1; }
  n=${sizes[-1]}
  for op in all_reduce all_gather; do
    "$nccl_tests/build/${op}_perf" -b 8K -e 256M -f 2 -g "$n" -w 5 -n 20 \
      > "$out/nccl-tests-$op.txt" 2>&1 || { note "FAIL ${op}_perf"; fail=1; }
  done
  check "self-test busbw within 5% of nccl-tests at >= 64 MB (TP=$n)" \
    "python3 - '$out' '$n' <<'PY'
import json, sys
out, n = sys.argv[1], sys.argv[2]
ours = json.load(open(f'{out}/ring-demo-tp{n}/preflight-fabric.json'))['ranks'][0]['points']
ok = True
print(f\"{'op':>10} {'size':>10} {'ours GB/s':>10} {'nccl-tests':>10} {'ratio':>6} {'ours us':>8} {'theirs us':>9}\")
for op in ('all_reduce', 'all_gather'):
    theirs = {}
    for line in open(f'{out}/nccl-tests-{op}.txt'):
        f = line.split()
        if len(f) > 8 and f[0].isdigit():
            # size count type [redop] root time algbw busbw #wrong (out-of-place first)
            k = 5 if op == 'all_reduce' else 4
            theirs[int(f[0])] = (float(f[k]), float(f[k + 2]))
    for p in ours:
        if p['op'] != op or p['bytes'] not in theirs: continue
        t_us, t_bw = theirs[p['bytes']]
        r = p['busbw_gbs'] / t_bw if t_bw else 0
        print(f\"{op:>10} {p['bytes']:>10} {p['busbw_gbs']:>10.2f} {t_bw:>10.2f} {r:>6.3f} {p['time_us']:>8.2f} {t_us:>9.2f}\")
        if p['bytes'] >= 64 << 20 and r < 0.95: ok = False
sys.exit(0 if ok else 1)
PY" | tee "$out/busbw-vs-nccl-tests.txt"
fi

# 2 (engine level). The engine's tensor parallel over NCCL, one GPU per rank: logits of TP=2
# (and TP=4) at every position against TP=1 and the CPU, and the spark-engine binary as
# processes with decode graphs replayed on every rank (tests/hw/tp_cuda_test.cc).
if [ -x "$bin/spark_hw_tests" ]; then
  TP_CUDA_COLLECTIVE=nccl "$bin/spark_hw_tests" -tc='hw tp-cuda*' > "$out/tp-cuda-nccl.log" 2>&1
  rc=$?
  grep '^tp-cuda' "$out/tp-cuda-nccl.log" | tee -a "$summary"
  check "engine TP over NCCL matches TP=1 and the CPU within the bf16 bound" "[ $rc = 0 ]"
fi

# Batch-1 decode of a Llama-3-8B-shaped model at TP=2 against TP=1 needs the GPU engine's
# benchmark (spark-engine bench on CUDA); it is run by the engine's own script when present.
if [ -x "$bin/spark-engine" ]; then
  for n in "${sizes[@]}"; do
    "$bin/spark-engine" bench --demo --json > "$out/decode-tp$n.json" 2>&1 || true
  done
  note "NOTE decode benchmarks in decode-tp*.json"
fi

echo "{\"gpus\":$gpus,\"failed\":$fail}" > "$out/summary.json"
cat "$summary"
exit $fail
