#!/usr/bin/env bash
# gpu-throttle-check.sh BIN_DIR OUT_DIR: preflight's gpu.throttle on this machine's GPUs with
# the real NVML and the real load (`sparkd gpu-load`), and the load alone. Run by
# scripts/gpu-run.sh (GPU_RUN_STEPS=gpu-throttle). Prints one line per GPU; fails when the
# check did not load a GPU (SKIP) or the load reached no throughput.
set -euo pipefail
bin=${1:?usage: gpu-throttle-check.sh BIN_DIR OUT_DIR}
out=${2:?usage: gpu-throttle-check.sh BIN_DIR OUT_DIR}
mkdir -p "$out"
ngpu=$(nvidia-smi -L | grep -c '^GPU ' || true)
((ngpu > 0)) || { echo "gpu-throttle-check: no GPU (nvidia-smi -L lists none)"; exit 1; }
gpus=$(seq -s, 0 $((ngpu - 1)))
cat > "$out/one-node.env" <<EOC
RING_NAME=throttle-check
STATE_DIR=$out/state
SPARKD_BIN=$bin/sparkd
NODE0_SSH=local
NODE0_FABRIC_IP=127.0.0.1
NODE0_NETDEVS=lo
NODE0_GPUS=$gpus
EOC
"$bin/sparkd" gpu-load --gpu 0 --ms 2000 | tee "$out/gpu-load.json"
python3 - "$out/gpu-load.json" <<'EOP'
import json, sys
j = json.loads(open(sys.argv[1]).read())
assert "error" not in j, j
assert j["tflops"] > 1, f"the load ran at {j['tflops']:.2f} TFLOP/s"
print(f"gpu-load: {j['iterations']} products in {j['seconds']:.2f} s, {j['tflops']:.1f} TFLOP/s")
EOP
rc=0
"$bin/sparkctl" --config "$out/one-node.env" --json preflight --local --node 0 --only gpu.throttle \
  > "$out/preflight.json" || rc=$?
# 0: pass, 15: warnings (a throttled GPU is a finding, not a failure of this step).
[[ $rc == 0 || $rc == 15 ]] || { cat "$out/preflight.json"; echo "preflight exited $rc"; exit 1; }
python3 - "$out/preflight.json" <<'EOP'
import json, sys
j = json.load(open(sys.argv[1]))
rows = [c for n in j["nodes"] for c in n["checks"] if c["id"] == "gpu.throttle"] if "nodes" in j else \
       [c for c in j["checks"] if c["id"] == "gpu.throttle"]
assert rows, "no gpu.throttle row"
for r in rows:
    print(f"{r['verdict']:4} {r.get('subject','')}: {r['message']}")
    assert r["verdict"] in ("PASS", "WARN"), "gpu.throttle did not load the GPU"
    assert "under load" in r["message"] or "reached only" in r["message"], r["message"]
EOP
