#!/usr/bin/env bash
# An FP8 checkpoint brought up as an operator would, on this machine's CPU: `sparkctl start` of
# a one-node ring serving the demo model with its projections in F8_E4M3 and 128x128 block
# scales (`demo-model --weights fp8`, Qwen3-MoE's structure: experts in FP8 too) and the KV
# cache in fp8 (KV_DTYPE=fp8), READY, `sparkctl status` naming the weight format and the KV
# cache type (/health model_info), a chat completion, `sparkctl stop`. The same script runs
# on the GPU machine with DEVICE=cuda.
# Usage: fp8_ring_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: fp8_ring_test.sh SRC_DIR BUILD_DIR}
BUILD=${2:?usage: fp8_ring_test.sh SRC_DIR BUILD_DIR}
command -v python3 >/dev/null || { echo "SKIP: python3 is not installed"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"
ln -s "$BUILD/cli/sparkctl" "$tmp/bin/sparkctl"
ln -s "$BUILD/daemon/sparkd" "$tmp/bin/sparkd"
GPU_CHECK_DEVICE=cpu DEMO_ARCH=qwen3_moe DEMO_WEIGHTS=fp8 GPU_CHECK_KV_DTYPE=fp8 timeout 300 \
  bash "$SRC/bench/engine/sparkd_gpu_check.sh" "$tmp/bin" "$tmp/out"
grep -q '"checkpoint_format": "fp8 e4m3' "$tmp/out/status-device.json" ||
  { echo "fp8_ring_test: FAIL: status does not name the FP8 weights"; exit 1; }
grep -q '"dtype": "fp8"' "$tmp/out/status-device.json" ||
  { echo "fp8_ring_test: FAIL: status does not name the fp8 KV cache"; exit 1; }
echo "fp8_ring_test: OK"
