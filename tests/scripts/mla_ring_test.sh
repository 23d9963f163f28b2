#!/usr/bin/env bash
# Latent attention brought up as an operator would, on this machine's CPU (the only device
# that runs it so far): `sparkctl start` of a one-node ring serving the demo model of
# DeepSeek-V3's structure (`demo-model --arch deepseek_v3`: q LoRA, a latent KV cache, YaRN,
# the grouped sigmoid router with a shared expert and a dense first layer), READY, `sparkctl
# status` describing the latent attention (/health model_info), a chat completion, `sparkctl
# stop`.
# Usage: mla_ring_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: mla_ring_test.sh SRC_DIR BUILD_DIR}
BUILD=${2:?usage: mla_ring_test.sh SRC_DIR BUILD_DIR}
command -v python3 >/dev/null || { echo "SKIP: python3 is not installed"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"
ln -s "$BUILD/cli/sparkctl" "$tmp/bin/sparkctl"
ln -s "$BUILD/daemon/sparkd" "$tmp/bin/sparkd"
GPU_CHECK_DEVICE=cpu DEMO_ARCH=deepseek_v3 timeout 300 \
  bash "$SRC/bench/engine/sparkd_gpu_check.sh" "$tmp/bin" "$tmp/out"
grep -q "latent_attention" "$tmp/out/status-device.json" ||
  { echo "mla_ring_test: FAIL: no latent attention in status"; exit 1; }
echo "mla_ring_test: OK"
