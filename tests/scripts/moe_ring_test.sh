#!/usr/bin/env bash
# A mixture of experts brought up as an operator would, on this machine's CPU: `sparkctl start`
# of a one-node ring serving the demo model of GLM-4.5's structure (`demo-model --arch
# glm4_moe`: groups, correction bias, a shared expert, a dense first layer, partial rotary),
# READY, `sparkctl status` describing the experts (/health model_info), `sparkctl plan` saying
# how they split, a chat completion, `sparkctl stop`. The same script runs on the GPU machine
# with DEVICE=cuda (scripts/gpu-run.sh, step sparkd-gpu).
# Usage: moe_ring_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: moe_ring_test.sh SRC_DIR BUILD_DIR}
BUILD=${2:?usage: moe_ring_test.sh SRC_DIR BUILD_DIR}
command -v python3 >/dev/null || { echo "SKIP: python3 is not installed"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"
ln -s "$BUILD/cli/sparkctl" "$tmp/bin/sparkctl"
ln -s "$BUILD/daemon/sparkd" "$tmp/bin/sparkd"
GPU_CHECK_DEVICE=cpu DEMO_ARCH=glm4_moe timeout 300 \
  bash "$SRC/bench/engine/sparkd_gpu_check.sh" "$tmp/bin" "$tmp/out"
grep -q "split" "$tmp/out/status-device.json" || { echo "moe_ring_test: FAIL: no experts in status"; exit 1; }
echo "moe_ring_test: OK"
