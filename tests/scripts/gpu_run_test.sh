#!/usr/bin/env bash
# scripts/gpu-run.sh: stage an existing build and run the device side here (no GPU: the GPU
# tests print SKIP). Checks the staged layout, that only non-system libraries are copied,
# that every binary resolves its libraries from the stage, and the run's summary.
# Usage: bash gpu_run_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
tmp=$(mktemp -d /tmp/spark-gpu-run-test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

for t in sparkctl sparkd spark_unit_tests spark_hw_tests; do
  [ -x "$(find "$build" -maxdepth 2 -name "$t" -type f | head -1)" ] || { echo "SKIP: $t not built in $build"; exit 0; }
done

# Usage text and exit code 2 without a mode.
rc=0; bash "$src/scripts/gpu-run.sh" > "$tmp/usage" 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "no mode: exit $rc, want 2"
grep -q 'bash .device/run.sh' "$tmp/usage" || fail "usage does not show the device command"

# The CI build is unoptimised and for two architectures: larger than a carried pack may be.
# Its pack never travels, so xz's fastest level (-9 spends minutes of CI on it).
STAGE_XZ_LEVEL=0 STAGE_MAX_MIB=1024 STAGE_FROM="$build" STAGE_DIR="$tmp/dev" bash "$src/scripts/gpu-run.sh" stage > "$tmp/stage.log" 2>&1 ||
  { cat "$tmp/stage.log"; fail "stage failed"; }
for f in run.sh gpu-run.sh MANIFEST bin/sparkctl bin/sparkd bin/spark_unit_tests bin/spark_hw_tests \
         bin/libfault_inject_libcuda.so; do
  [ -e "$tmp/dev/$f" ] || fail "stage lacks $f"
done
ls "$tmp/dev/lib"/libfmt.so.* > /dev/null 2>&1 || fail "libfmt (not on the GPU machine in this version) was not copied"
for sys in libc.so.6 libm.so.6 libstdc++.so.6 libgcc_s.so.1 ld-linux-x86-64.so.2 libcuda.so.1; do
  [ ! -e "$tmp/dev/lib/$sys" ] || fail "system library $sys was copied"
done
[ -s "$tmp/dev-pack/device.tar.xz" ] || fail "stage did not pack the tree into dev-pack/device.tar.xz"
tar -tJf "$tmp/dev-pack/device.tar.xz" > "$tmp/pack.list" || fail "the pack does not list"
grep -q '^dev/bin/sparkd$' "$tmp/pack.list" || fail "the pack lacks dev/bin/sparkd"
# The fixtures travel in the working tree, not twice.
! grep -q '^dev/fixtures/' "$tmp/pack.list" || fail "the pack carries tests/fixtures without STAGE_FIXTURES=1"
# The gpt-oss serving check's client script, conversation and harmony template are staged;
# node is not, unless STAGE_NODE=1 asks for it.
for f in engine/sparkd_gpu_check.sh engine/openai_client/client_test.js \
         engine/openai_client/harmony_live.json engine/harmony/chat_template.jinja \
         engine/harmony/tokenizer.json; do
  [ -e "$tmp/dev/$f" ] || fail "stage lacks $f"
done
! grep -q '^dev/tools/node$' "$tmp/pack.list" || fail "the pack carries node without STAGE_NODE=1"
if command -v node > /dev/null && [ -d "$src/tests/e2e/openai_client/node_modules/openai" ]; then
  STAGE_NODE=1 STAGE_XZ_LEVEL=0 STAGE_MAX_MIB=1024 STAGE_FROM="$build" STAGE_DIR="$tmp/devnode" \
    bash "$src/scripts/gpu-run.sh" stage > "$tmp/stage-node.log" 2>&1 ||
    { cat "$tmp/stage-node.log"; fail "stage with STAGE_NODE=1 failed"; }
  [ -x "$tmp/devnode/tools/node" ] || fail "STAGE_NODE=1 staged no tools/node"
  [ -f "$tmp/devnode/node_modules/openai/package.json" ] || fail "STAGE_NODE=1 staged no openai package"
  [ -z "$(find "$tmp/devnode/node_modules" -name '*.map' -o -name '*.d.ts' | head -1)" ] ||
    fail "STAGE_NODE=1 staged the package's maps or type files"
  # The staged client loads from the staged package with the staged node.
  NODE_PATH="$tmp/devnode/node_modules" "$tmp/devnode/tools/node" -e \
    "const O = require('openai'); if (typeof (O.default || O) !== 'function') process.exit(1)" ||
    fail "the staged node does not load the staged openai package"
  rm -rf "$tmp/devnode" "$tmp/devnode-pack"
else
  echo "SKIP (part): node or the openai npm package is not here: STAGE_NODE=1 not checked"
fi
grep -q "^source_dir=$src\$" "$tmp/dev/MANIFEST" || fail "MANIFEST lacks source_dir: $(cat "$tmp/dev/MANIFEST")"
# Every library the staged binaries need resolves with the stage's lib/ first.
for b in "$tmp/dev/bin"/*; do
  if LD_LIBRARY_PATH="$tmp/dev/lib" ldd "$b" | grep -q 'not found'; then fail "$b has unresolved libraries"; fi
done

# A pack level xz does not take is refused, naming the variable.
rc=0; STAGE_XZ_LEVEL=fast STAGE_MAX_MIB=1024 STAGE_FROM="$build" STAGE_DIR="$tmp/dev-bad" \
  bash "$src/scripts/gpu-run.sh" stage > "$tmp/bad-xz.log" 2>&1 || rc=$?
[ "$rc" != 0 ] || fail "STAGE_XZ_LEVEL=fast was accepted"
grep -q 'STAGE_XZ_LEVEL=fast' "$tmp/bad-xz.log" || fail "no STAGE_XZ_LEVEL message: $(tail -2 "$tmp/bad-xz.log")"

# The device side, minus the full unit run (the unit tier runs it already).
out="$tmp/out"
rc=0; OUT="$out" GPU_RUN_STEPS="libraries version hw gpu-kernels" bash "$tmp/dev/run.sh" > "$tmp/run.log" 2>&1 || rc=$?
[ "$rc" = 0 ] || { cat "$tmp/run.log"; fail "run.sh exited $rc"; }
for s in libraries version hw gpu-kernels; do
  grep -qE "^  $s +PASS" "$out/summary.txt" || fail "step $s did not pass: $(cat "$out/summary.txt")"
done
grep -q '"failed":0' "$out/summary.json" || fail "summary.json: $(cat "$out/summary.json")"
python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); assert "gpu" in j and "sparkctl" in j, j' "$out/version.json" ||
  fail "version.json is not the version report"
if ! command -v nvidia-smi > /dev/null; then
  grep -q '^SKIP: ' "$out/hw.log" || fail "without a GPU the hw tests must print SKIP"
fi
echo "PASS: gpu-run.sh stage + device"
