#!/usr/bin/env bash
# gpu-run.sh: every GPU run is ONE device call.
#
# Usage
#   scripts/gpu-run.sh stage     # here (Debian): build build-gpu/ for sm_90 and stage .device/
#   then one device call (kind nvidia-h200), from the repository root:
#       command: tar -xJf .device-pack/device.tar.xz && bash .device/run.sh
#       carry:   [".device-pack"]
#   (.device/ itself is ~100 MiB once OpenBLAS and ICU are in; the device tool carries at
#   most 64 MiB, so stage also packs it with xz into .device-pack/, which is what travels.)
#   scripts/gpu-run.sh device    # what .device/run.sh runs; also works here (GPU parts skip)
#   GPU_RUN_STEPS=stage-bench bash .device/run.sh   # bench/stage/stage_bench.sh on that machine
#
# Why staging: the GPU machine is Ubuntu 24.04 with CUDA 13, NCCL, Boost 1.83, fmt, doctest
# and libibverbs, but without PCRE2, xxhash, OpenBLAS, libssh or Gloo, and offline. So the
# binaries are built here and every shared library `ldd` names is copied next to them,
# except the ones every Ubuntu 24.04 has in a newer, compatible version (glibc's libraries,
# libstdc++, libgcc_s) and those that must match the machine (the NVIDIA driver,
# libibverbs and its providers). Binaries carry RUNPATH $ORIGIN/../lib; run.sh also sets
# LD_LIBRARY_PATH because RUNPATH does not apply to the copied libraries' own dependencies.
#
# Outputs of a device run land in $OUT (the device tool's folder; .device/out here):
# summary.txt (one line per step, '#' header), summary.json, one <step>.log per step,
# version.json, nvidia-smi.txt. The run exits non-zero when any step failed.
#
# Environment: for `stage` BUILD_DIR (build-gpu), CUDA_ARCHS (90a), JOBS (2), STAGE_DIR
# (.device), STAGE_FROM (stage an existing build instead of building), STAGE_XZ_LEVEL (the
# pack's xz level, 9: the smallest pack; the script test, whose pack never travels, uses 0), GPU_TARGETS (the
# binaries to build and stage, default all of "sparkctl sparkd spark_unit_tests
# spark_hw_tests spark_fault_server spark_kernel_tests spark_kernel_bench"; e.g.
# GPU_TARGETS="spark_kernel_tests spark_kernel_bench" for a kernels-only run, which builds
# a fraction of the tree), STAGE_FIXTURES=1 (pack tests/fixtures too, for a device tree
# without them), STAGE_NODE=1 (pack node and the official OpenAI client's JavaScript for
# the gpt-oss check of sparkd-gpu); for `device` GPU_RUN_STEPS (default
# "libraries version hw gpu-kernels unit"; also
# "sparkd-gpu" (sparkctl start of a one-node ring on this GPU, both weights placements),
# "hub-fixtures" (tools/gen_reference_hub.py's fixtures, HUB_FIXTURES; default the FP8 ones),
# "gpu-engine" (the engine's CUDA tests), "memcheck" (the GPU kernel tests under
# compute-sanitizer; MEMCHECK_TIMEOUT seconds, 300), "kernel-bench" (bench/kernels),
# "gpu-throttle" (preflight gpu.throttle under `sparkd gpu-load`), "stage-bench",
# "moe-bench" (MoE shapes of bench/engine/shapes with random weights on the GPU, beside
# their PyTorch peers; MOE_BENCH_SHAPES, MOE_BENCH_ARGS),
# "engine-trace" (batch-1 decode's kernel timeline; ENGINE_TRACE_ENV, ENGINE_TRACE_ARGS),
# "sparkctl-bench" (sparkctl bench against sparkd on the GPU), "nccl" (the hw NCCL tests),
# "tokenizer-ref" (our tokenizer against Python tokenizers on every tokenizer fixture),
# "tp-cuda" (tensor parallel on CUDA, TP=2/4 ranks sharing this GPU), "tp-bench" (the TP
# control plane's cost per step, CPU path), "nccl-ring", "multi-gpu"), OUT,
# NCCL_RING_RANKS, NCCL_TESTS_SRC, GPU_KERNELS_FILTER (doctest -tc for the gpu-kernels
# step, e.g. 'gpu prefill*'), KERNEL_BENCH_ARGS (extra arguments of spark_kernel_bench,
# e.g. "--only forms,layer"), GPU_ENGINE_FILTER, GPU_ENGINE_BOUND (the gpu-engine step).
set -euo pipefail

die() { echo "gpu-run.sh: $*" >&2; exit 1; }

# Libraries never copied (see above). Matched against the soname.
SYSTEM_LIBS='^(linux-vdso|ld-linux.*|libc|libm|libdl|librt|libpthread|libresolv|libutil|libanl|libnsl|libmvec|libstdc\+\+|libgcc_s|libcuda|libnvidia-.*|libibverbs|librdmacm|libmlx4|libmlx5|libefa|libnl-3|libnl-route-3)\.so'
# The device tool carries at most 64 MiB; STAGE_MAX_MIB raises the check for a stage that
# is never carried (the script test stages the unoptimised two-architecture CI build).
MAX_STAGE_MIB=${STAGE_MAX_MIB:-60}
# target name -> path in the build tree
declare -A BINARY_PATH=([sparkctl]=cli/sparkctl [sparkd]=daemon/sparkd
  [spark_unit_tests]=tests/spark_unit_tests [spark_hw_tests]=tests/spark_hw_tests
  [spark_kernel_tests]=tests/spark_kernel_tests
  [spark_fault_server]=tests/spark_fault_server [spark_kernel_bench]=bench/kernels/spark_kernel_bench
  [spark-engine]=daemon/engine/spark-engine [spark_kernel_trace]=bench/libspark_kernel_trace.so)
DEFAULT_TARGETS="sparkctl sparkd spark-engine spark_unit_tests spark_hw_tests spark_fault_server spark_kernel_tests spark_kernel_bench"
EXTRA_FILES=(tests/libfault_inject_libcuda.so tests/libfault_inject_libnccl.so tests/libfault_inject_libnvidia_ml.so)
# Tools the stage benchmark needs that the GPU machine lacks (copied with their libraries).
TOOLS=(ip iperf3 nc vmtouch)

stage() {
  local src; src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  cd "$src"
  local build=${BUILD_DIR:-build-gpu} archs=${CUDA_ARCHS:-90a} jobs=${JOBS:-2}
  local want_targets; read -r -a want_targets <<< "${GPU_TARGETS:-$DEFAULT_TARGETS}"
  local t BINARIES=()
  for t in "${want_targets[@]}"; do
    [ -n "${BINARY_PATH[$t]:-}" ] || die "GPU_TARGETS: unknown target '$t' (known: ${!BINARY_PATH[*]})"
    BINARIES+=("${BINARY_PATH[$t]}")
  done
  if [ -n "${STAGE_FROM:-}" ]; then
    build=$STAGE_FROM  # an existing build (the script test uses this); no configure/build
    archs=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null || true)
  else
    local launcher=()
    command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
    [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null || die "nvcc not found: the GPU build needs the CUDA toolkit (/usr/local/cuda)"
    # No -Werror here: GCC 12 at -O3 raises false -Wmaybe-uninitialized/-Wrestrict on
    # std::optional and std::string; CI's build keeps warnings as errors.
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARK_WERROR=OFF \
      -DCMAKE_CUDA_ARCHITECTURES="$archs" -DSPARK_CUDA=ON "${launcher[@]}" \
      '-DCMAKE_BUILD_RPATH=$ORIGIN/../lib' >/dev/null
    ninja -C "$build" -j"$jobs" "${want_targets[@]}" fault_inject_libcuda fault_inject_libnccl fault_inject_libnvidia_ml
    build="$src/$build"
  fi

  local dev=${STAGE_DIR:-$src/.device}
  rm -rf "$dev"
  mkdir -p "$dev/bin" "$dev/lib"
  local f
  for f in "${BINARIES[@]}" "${EXTRA_FILES[@]}"; do
    if [ ! -f "$build/$f" ]; then
      # An existing build (STAGE_FROM) may lack the kernel binaries (no CUDA): skip them.
      if [ -n "${STAGE_FROM:-}" ]; then
        case $f in "${BINARY_PATH[spark_kernel_bench]}"|"${BINARY_PATH[spark_kernel_tests]}") continue ;; esac
      fi
      die "$build/$f was not built"
    fi
    cp "$build/$f" "$dev/bin/"
  done
  strip --strip-unneeded "$dev"/bin/* 2>/dev/null || true
  mkdir -p "$dev/tools"
  local t
  for t in "${TOOLS[@]}"; do
    if command -v "$t" >/dev/null; then cp -L "$(command -v "$t")" "$dev/tools/$t"; fi
  done
  cp "$src/bench/stage/stage_bench.sh" "$dev/stage_bench.sh"
  cp "$src/scripts/nccl-ring.sh" "$dev/nccl-ring.sh"
  cp "$src/scripts/multi-gpu.sh" "$dev/multi-gpu.sh"
  cp "$src/scripts/gpu-throttle-check.sh" "$dev/gpu-throttle-check.sh"
  # The engine's GPU checks and benchmark: scripts and the PyTorch peer. The reference
  # fixtures travel in the working tree (the tests read them under the source path, which
  # device() links to the tree); STAGE_FIXTURES=1 packs a copy for a tree without them.
  mkdir -p "$dev/engine"
  if [ "${STAGE_FIXTURES:-0}" = 1 ]; then
    mkdir -p "$dev/fixtures"
    cp -r "$src/tests/fixtures/models" "$src/tests/fixtures/tokenizer" "$dev/fixtures/"
  fi
  cp "$src"/bench/engine/*.py "$src"/bench/engine/*.sh "$src/tools/bf16_bound.py" \
    "$src/tools/gen_reference.py" "$src/tools/gen_reference_hub.py" "$dev/engine/"
  cp -r "$src/bench/engine/shapes" "$dev/engine/"
  # The gpt-oss serving check (sparkd_gpu_check.sh with DEMO_ARCH=gpt_oss): the official
  # OpenAI client's script and conversation, the harmony tokenizer and template. With
  # STAGE_NODE=1 also node itself (tools/node) and the client's runtime JavaScript
  # (node_modules/openai without its sources, maps and type files): the GPU machine has
  # neither, and they add about 25 MiB to the pack.
  mkdir -p "$dev/engine/openai_client" "$dev/engine/harmony"
  cp "$src/tests/e2e/openai_client/client_test.js" "$src/tests/e2e/openai_client/harmony_live.json" \
    "$dev/engine/openai_client/"
  cp "$src/tests/fixtures/harmony/tokenizer.json" "$src/tests/fixtures/harmony/tokenizer_config.json" \
    "$src/tests/fixtures/harmony/chat_template.jinja" "$dev/engine/harmony/"
  if [ "${STAGE_NODE:-0}" = 1 ]; then
    local client_pkg=$src/tests/e2e/openai_client/node_modules/openai
    command -v node >/dev/null || die "STAGE_NODE=1: node is not installed here"
    [ -d "$client_pkg" ] || die "STAGE_NODE=1: $client_pkg is missing (npm ci --prefix tests/e2e/openai_client)"
    cp -L "$(command -v node)" "$dev/tools/node"
    mkdir -p "$dev/node_modules"
    cp -r "$client_pkg" "$dev/node_modules/"
    rm -rf "$dev/node_modules/openai/src"
    find "$dev/node_modules/openai" \( -name '*.map' -o -name '*.d.ts' -o -name '*.d.mts' \
      -o -name '*.d.cts' -o -name '*.mjs' -o -name '*.md' \) -delete
  fi
  # sparkctl bench's known-answer set, where bin/sparkctl looks for it (bin/../share).
  mkdir -p "$dev/share/sparkctl/bench"
  cp "$src/packaging/bench/known-answers.jsonl" "$dev/share/sparkctl/bench/"

  # Every non-system library the binaries need, under its soname.
  local name path copied=()
  while read -r name path; do
    [[ "$name" =~ $SYSTEM_LIBS ]] && continue
    [ -e "$path" ] || die "ldd names $name => $path, which does not exist here"
    cp -L "$path" "$dev/lib/$name"
    copied+=("$name")
  done < <(for f in "$dev"/bin/* "$dev"/tools/*; do ldd "$f"; done |
             awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | sort -u)
  strip --strip-unneeded "$dev"/lib/* 2>/dev/null || true
  if for f in "$dev"/bin/* "$dev"/tools/*; do LD_LIBRARY_PATH="$dev/lib" ldd "$f"; done | grep -q 'not found'; then
    die "a staged binary has unresolved libraries: $(for f in "$dev"/bin/*; do ldd "$f"; done | grep 'not found' | sort -u | tr '\n' ' ')"
  fi

  cp "$src/scripts/gpu-run.sh" "$dev/gpu-run.sh"
  cat > "$dev/run.sh" <<'EOF'
#!/usr/bin/env bash
# Generated by scripts/gpu-run.sh stage. On the GPU machine: bash .device/run.sh
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu-run.sh" device "$@"
EOF
  chmod +x "$dev/run.sh" "$dev/gpu-run.sh"
  {
    echo "commit=$(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$src" diff --quiet 2>/dev/null || echo -dirty)"
    echo "staged=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "source_dir=$src"
    echo "build_dir=$build"
    echo "cuda_architectures=$archs"
    echo "libraries=${copied[*]}"
  } > "$dev/MANIFEST"

  # What travels is the xz-packed tree (the device tool carries at most 64 MiB).
  local pack="${dev}-pack"
  [[ ${STAGE_XZ_LEVEL:-9} =~ ^[0-9]$ ]] || die "STAGE_XZ_LEVEL=${STAGE_XZ_LEVEL}: want an xz level, 0 to 9"
  rm -rf "$pack"
  mkdir -p "$pack"
  tar -C "$(dirname "$dev")" -cf - "$(basename "$dev")" | xz -T2 "-${STAGE_XZ_LEVEL:-9}" > "$pack/device.tar.xz"
  # The working tree travels beside it and counts against the same limit (its tracked files
  # that are there: one moved aside for a call does not travel).
  local mib tree_mib
  mib=$(( $(du -sb "$pack" | cut -f1) / 1048576 ))
  tree_mib=$(( $(git -C "$src" ls-files -z 2>/dev/null | (cd "$src" && xargs -0 stat -c %s 2>/dev/null || true) | awk '{s+=$1} END {print s+0}') / 1048576 ))
  [ $(( mib + tree_mib )) -lt "$MAX_STAGE_MIB" ] ||
    die "$pack is ${mib} MiB packed and the tree ${tree_mib} MiB, over the ${MAX_STAGE_MIB} MiB limit together (du -a $dev | sort -n | tail)"
  echo "# staged $(basename "$dev") ($(( $(du -sb "$dev" | cut -f1) / 1048576 )) MiB, ${mib} MiB packed): $(ls "$dev/bin" | tr '\n' ' ')"
  echo "# libraries: ${copied[*]}"
  echo "# device call: command 'tar -xJf .device-pack/device.tar.xz && bash .device/run.sh', carry [\".device-pack\"], kind nvidia-h200"
}

# ---- on the GPU machine -------------------------------------------------------------------
device() {
  local dev; dev=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  local repo; repo=$(dirname "$dev")
  local out=${OUT:-$dev/out}
  mkdir -p "$out"
  export LD_LIBRARY_PATH="$dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export NCCL_NVLS_ENABLE=0
  export SPARK_LOG_LEVEL=${SPARK_LOG_LEVEL:-info}

  # Tests compiled in another checkout look for fixtures under its path: point it here.
  local src_dir; src_dir=$(sed -n 's/^source_dir=//p' "$dev/MANIFEST" 2>/dev/null || true)
  if [ -n "$src_dir" ] && [ ! -e "$src_dir" ]; then
    mkdir -p "$(dirname "$src_dir")" 2>/dev/null && ln -s "$repo" "$src_dir" 2>/dev/null ||
      echo "# note: cannot link $src_dir -> $repo; fixture-reading tests may fail" >&2
  fi

  local summary="$out/summary.txt" failed=0 steps_json=()
  printf '# %-14s %-6s %-8s %s\n' step status seconds detail > "$summary"
  # step NAME TIMEOUT_S CMD...: runs with a deadline, logs to $out/NAME.log, records status.
  step() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS rc=0 status
    echo "=== $name: $*" | tee "$out/$name.log"
    timeout --kill-after=10 "$limit" "$@" >> "$out/$name.log" 2>&1 || rc=$?
    tail -n 40 "$out/$name.log"
    case $rc in
      0) status=PASS ;;
      124|137) status=TIMEOUT; failed=1 ;;
      *) status=FAIL; failed=1 ;;
    esac
    local detail="rc=$rc"
    local skips; skips=$(grep -c '^SKIP:' "$out/$name.log" || true)
    [ "$skips" -gt 0 ] && detail="$detail skips=$skips"
    printf '  %-14s %-6s %-8s %s\n' "$name" "$status" "$((SECONDS - t0))" "$detail" | tee -a "$summary"
    steps_json+=("{\"step\":\"$name\",\"status\":\"$status\",\"rc\":$rc,\"seconds\":$((SECONDS - t0)),\"skips\":$skips}")
  }

  local gpu=0
  if command -v nvidia-smi >/dev/null && nvidia-smi -L > "$out/nvidia-smi-L.txt" 2>&1 && grep -q '^GPU ' "$out/nvidia-smi-L.txt"; then
    gpu=1
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
    cat "$out/nvidia-smi.txt"
    # With a GPU present, a "no CUDA device" skip is a failure, not a pass.
    export SPARK_REQUIRE_GPU=1
  else
    echo "# no GPU here (nvidia-smi missing or lists none): GPU tests will print SKIP" | tee "$out/nvidia-smi.txt"
  fi

  local want=" ${GPU_RUN_STEPS:-libraries version hw gpu-kernels unit} "
  [[ $want == *" libraries "* ]] &&
    step libraries 30 bash -c 'for f in "$0"/bin/*; do ldd "$f"; done | grep "not found" && exit 1 || exit 0' "$dev"
  if [[ $want == *" version "* ]]; then
    step version 60 "$dev/bin/sparkctl" -v version
    timeout 60 "$dev/bin/sparkctl" version --json > "$out/version.json" 2>> "$out/version.log" || true
  fi
  [[ $want == *" hw "* ]] && step hw 240 "$dev/bin/spark_hw_tests"
  # The kernel tests: the small binary when staged, else the same tests in the unit binary.
  local ktests="$dev/bin/spark_kernel_tests"
  [ -x "$ktests" ] || ktests="$dev/bin/spark_unit_tests"
  # The engine on the GPU: the CUDA device against transformers' fixtures (and the CPU
  # reference tests for contrast), transformers' own bf16-vs-fp32 spread, sparkd serving a
  # chat from the GPU, and the decode/prefill/READY benchmark with its PyTorch peer.
  if [[ $want == *" gpu-engine "* ]]; then
    mkdir -p "$repo/tests/fixtures"
    local kind
    for kind in models tokenizer; do
      [ -e "$repo/tests/fixtures/$kind" ] && continue
      [ -e "$dev/fixtures/$kind" ] || die "no tests/fixtures/$kind in the tree and none staged (STAGE_FIXTURES=1)"
      cp -r "$dev/fixtures/$kind" "$repo/tests/fixtures/"
    done
    # GPU_ENGINE_FILTER narrows the tests (doctest -tc); GPU_ENGINE_BOUND=0 skips the
    # transformers bf16-vs-fp32 step (minutes of CPU and GPU time, needed only when the
    # bound itself is in question).
    step gpu-engine 240 "$dev/bin/spark_unit_tests" -tc="${GPU_ENGINE_FILTER:-cuda engine*,reference:*,engine:*,native backend:*}"
    [ "${GPU_ENGINE_BOUND:-1}" = 0 ] ||
      step bf16-bound 180 python3 "$dev/engine/bf16_bound.py" "$repo/tests/fixtures/models" --json-out "$out/bf16_bound.json"
  fi
  # Reference fixtures written as publishers store them (tools/gen_reference_hub.py, CPU
  # float32 transformers), into $OUT/fixtures to be committed under tests/fixtures/models;
  # HUB_FIXTURES names them (default the FP8 ones and DeepSeek-V3's). The gpu-engine step
  # after it in the same run tests the engine against them on the GPU and the CPU.
  if [[ $want == *" hub-fixtures "* ]]; then
    # The generator's manifest keeps the fixtures of earlier runs: start from the tree's.
    mkdir -p "$out/fixtures"
    cp "$repo/tests/fixtures/models/manifest-hub.json" "$out/fixtures/" 2>/dev/null || true
    step hub-fixtures 420 python3 "$dev/engine/gen_reference_hub.py" --out "$out/fixtures" \
      --only "${HUB_FIXTURES:-qwen3_fp8,qwen3_moe_fp8,deepseek_v3,deepseek_v3_qdirect,deepseek_v3_fp8}"
    mkdir -p "$repo/tests/fixtures/models"
    cp -r "$out/fixtures/." "$repo/tests/fixtures/models/" 2>/dev/null || true
  fi
  # Our tokenizer against the Python `tokenizers` library (the machine has it; npm's binding
  # of the same Rust core wrote the committed references): every fixture under
  # tests/fixtures/tokenizer, the o200k one (gpt-oss's pre-tokenizer) among them.
  if [[ $want == *" tokenizer-ref "* ]]; then
    local tdirs=() t
    for t in "$repo"/tests/fixtures/tokenizer/*/ "$repo"/tests/fixtures/tokenizer/; do
      local tname; tname=$(basename "$t")
      [ "$t" = "$repo/tests/fixtures/tokenizer/" ] && tname=chatml
      python3 "$repo/tools/tokenizer/gen_reference.py" "$t/tokenizer.json" "$out/tokenizer-py/$tname" \
        >> "$out/tokenizer-py.log" 2>&1 && tdirs+=("$out/tokenizer-py/$tname")
    done
    step tokenizer-ref 120 env SPARK_TOKENIZER_REF_DIRS="$(IFS=:; echo "${tdirs[*]}")" \
      "$dev/bin/spark_unit_tests" -tc='*external references*'
  fi
  # `sparkctl start` of a one-node ring on this machine (NODE0_SSH=local: no sshd needed)
  # with DEVICE=cuda, weights in device memory and then host-mapped: READY, status naming
  # cuda and the GPU, a chat, stop leaving nothing.
  [[ $want == *" sparkd-gpu "* ]] &&
    step sparkd-gpu 120 bash "$dev/engine/sparkd_gpu_check.sh" "$dev/bin" "$out/sparkd"
  # The same with a mixture of experts (the demo model of GLM-4.5's structure).
  [[ $want == *" sparkd-gpu "* ]] &&
    step sparkd-gpu-moe 150 env DEMO_ARCH=glm4_moe bash "$dev/engine/sparkd_gpu_check.sh" \
      "$dev/bin" "$out/sparkd-moe"
  # gpt-oss (MXFP4 experts, the harmony template) through the official OpenAI client, which
  # needs the node that STAGE_NODE=1 stages; without it the serving is checked, not the client.
  if [[ $want == *" sparkd-gpu "* ]]; then
    if [ -x "$dev/tools/node" ]; then
      step sparkd-gpu-oss 200 env DEMO_ARCH=gpt_oss bash "$dev/engine/sparkd_gpu_check.sh" \
        "$dev/bin" "$out/sparkd-oss"
    else
      echo "sparkd-gpu-oss: node was not staged (STAGE_NODE=1): the OpenAI client part is left out"
      step sparkd-gpu-oss 200 env DEMO_ARCH=gpt_oss GPU_CHECK_CLIENT=skip bash \
        "$dev/engine/sparkd_gpu_check.sh" "$dev/bin" "$out/sparkd-oss"
    fi
  fi
  # And an FP8 checkpoint (Qwen3-MoE's structure, projections and experts in e4m3) with the
  # KV cache in fp8 (KV_DTYPE=fp8).
  [[ $want == *" sparkd-gpu "* ]] &&
    step sparkd-gpu-fp8 150 env DEMO_ARCH=qwen3_moe DEMO_WEIGHTS=fp8 GPU_CHECK_KV_DTYPE=fp8 bash \
      "$dev/engine/sparkd_gpu_check.sh" "$dev/bin" "$out/sparkd-fp8"
  # sparkctl bench (every section and gate) against sparkd on the GPU; not in the default list.
  [[ $want == *" sparkctl-bench "* ]] &&
    step sparkctl-bench 300 bash "$dev/engine/sparkctl_bench_gpu.sh" "$dev/bin" "$out/sparkctl-bench"
  if [[ $want == *" engine-bench "* ]]; then
    local ck=${ENGINE_BENCH_DIR:-/tmp/llama3-8b-random}
    step bench-ckpt 240 python3 "$dev/engine/make_checkpoint.py" "$ck" --layers "${ENGINE_BENCH_LAYERS:-32}"
    step engine-bench 420 "$dev/bin/spark-engine" gpubench --model "$ck" --json-out "$out/engine_bench.json"
    step torch-peer 240 python3 "$dev/engine/torch_peer.py" --layers "${ENGINE_BENCH_LAYERS:-32}" --json-out "$out/torch_peer.json"
  fi
  # Mixture-of-experts decode and prefill on real model shapes with random weights made on
  # the GPU (gpubench --synthetic: no checkpoint on disk), each beside its PyTorch peer of the
  # same shape. MOE_BENCH_SHAPES: names under bench/engine/shapes (default all).
  if [[ $want == *" moe-bench "* ]]; then
    local shape name
    for shape in ${MOE_BENCH_SHAPES:-$(cd "$dev/engine/shapes" && ls *.json)}; do
      name=${shape%.json}
      # shellcheck disable=SC2086
      step "moe-$name" 420 "$dev/bin/spark-engine" gpubench --model "$dev/engine/shapes/$shape" \
        --synthetic 1 --context 9216 --b1-runs 3 ${MOE_BENCH_ARGS:-} --json-out "$out/moe_bench_$name.json"
      step "peer-$name" 300 python3 "$dev/engine/torch_moe_peer.py" "$dev/engine/shapes/$shape" \
        --json-out "$out/torch_moe_peer_$name.json"
    done
  fi
  # The kernel timeline of batch-1 decode (needs spark_kernel_trace staged): gpubench's
  # decode rows under the CUPTI injection library, then trace_summary.py's table per decode
  # graph (step period, GPU idle between steps, what each kernel adds). ENGINE_TRACE_ENV:
  # assignments for the traced run (e.g. "SPARK_CUDA_NORM_IN_PRODUCT=0").
  # ENGINE_TRACE_SHAPE: a name under bench/engine/shapes, traced with random weights made on
  # the GPU, instead of the dense checkpoint.
  if [[ $want == *" engine-trace "* ]]; then
    local ck=${ENGINE_BENCH_DIR:-/tmp/llama3-8b-random} synth=()
    if [ -n "${ENGINE_TRACE_SHAPE:-}" ]; then
      ck="$dev/engine/shapes/${ENGINE_TRACE_SHAPE%.json}.json"
      [ -f "$ck" ] || die "ENGINE_TRACE_SHAPE: no $ck"
      synth=(--synthetic 1 --context 4096)
    elif [ ! -f "$ck/config.json" ]; then
      step bench-ckpt 240 python3 "$dev/engine/make_checkpoint.py" "$ck" --layers "${ENGINE_BENCH_LAYERS:-32}"
    fi
    # shellcheck disable=SC2086
    step engine-trace 240 env ${ENGINE_TRACE_ENV:-} CUDA_INJECTION64_PATH="$dev/bin/libspark_kernel_trace.so" \
      SPARK_TRACE_OUT="$out/engine-trace.csv" "$dev/bin/spark-engine" gpubench --model "$ck" "${synth[@]}" \
      --decode-only 1 --b1-runs 1 ${ENGINE_TRACE_ARGS:-} --json-out "$out/engine_trace_bench.json"
    step trace-summary 120 python3 "$dev/engine/trace_summary.py" "$out/engine-trace.csv" \
      --json "$out/engine_trace.json"
    xz -T0 -1 "$out/engine-trace.csv" || true
  fi
  [[ $want == *" gpu-kernels "* ]] &&
    step gpu-kernels 480 "$ktests" -tc="${GPU_KERNELS_FILTER:-*rmsnorm*,*swiglu*,*bf16*,*CUDA*,gpu *,philox*,sample_*,twins*,rope*,paged*,decode split*,moe *}"
  # KERNEL_BENCH_ARGS: e.g. "--only sampler" for the sampler's rows alone.
  # shellcheck disable=SC2086
  [[ $want == *" kernel-bench "* ]] &&
    step kernel-bench 300 "$dev/bin/spark_kernel_bench" --json "$out/kernel_bench.json" ${KERNEL_BENCH_ARGS:-}
  # The same tests under compute-sanitizer's memcheck (out-of-bounds and misaligned
  # accesses, leaks); the 32k-token cases are left out there (SPARK_TEST_NO_LARGE).
  if [[ $want == *" memcheck "* ]]; then
    local cs; cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    step memcheck "${MEMCHECK_TIMEOUT:-300}" env SPARK_TEST_NO_LARGE=1 "$cs" --tool memcheck --leak-check full --error-exitcode 9 \
      "$ktests" -tc='gpu *'
  fi
  [[ $want == *" unit "* ]] && step unit 240 "$dev/bin/spark_unit_tests"
  # preflight's gpu.throttle with the real NVML and `sparkd gpu-load` (not in the default list).
  [[ $want == *" gpu-throttle "* ]] &&
    step gpu-throttle 180 bash "$dev/gpu-throttle-check.sh" "$dev/bin" "$out/gpu-throttle"
  # NCCL on this machine's GPUs: the one-GPU NCCL path and its faults, and the logic tests.
  [[ $want == *" nccl "* ]] &&
    step nccl 240 "$dev/bin/spark_hw_tests" -tc="hw nccl*" -s
  # Tensor parallel on CUDA with one GPU: TP=2 and TP=4 ranks share it, over Gloo staged
  # through host memory (NCCL refuses two ranks on one device), against TP=1 on CUDA and the
  # CPU reference: logits at every position in one process, greedy tokens and logprobs of
  # the spark-engine binary as processes. The same recipe and device calls NCCL serves.
  [[ $want == *" tp-cuda "* ]] &&
    step tp-cuda 120 "$dev/bin/spark_hw_tests" -tc='hw tp-cuda*'
  # What the TP control plane (step plan, heartbeats) costs a decode step, on the CPU path of
  # this machine's quiet cores: the engine against the same steps in lock-step with no plan.
  if [[ $want == *" tp-bench "* ]]; then
    step tp-bench 120 "$dev/bin/spark-engine" tpbench --tokens 64 --rounds 3 --threads 1
    grep '^{' "$out/tp-bench.log" | tail -n 1 > "$out/tp_bench.json" || true
  fi
  # A one-host ring over NCCL with the real binaries (all GPUs, one rank each).
  [[ $want == *" nccl-ring "* ]] &&
    step nccl-ring 300 bash "$dev/nccl-ring.sh" "$dev/bin" "$out/nccl-ring" ${NCCL_RING_RANKS:-}
  # Machines with several GPUs: TP=2/4 vs TP=1, busbw vs nccl-tests (NCCL_TESTS_SRC: a
  # checkout carried in, never committed), topology, a rank killed. Not in the default list.
  [[ $want == *" multi-gpu "* ]] &&
    step multi-gpu 580 bash "$dev/multi-gpu.sh" "$dev/bin" "$out/multi-gpu" ${NCCL_TESTS_SRC:-}
  # Not in the default list: GPU_RUN_STEPS="stage-bench" (root; namespaces, zram, page cache).
  [[ $want == *" stage-bench "* ]] &&
    step stage-bench 540 env PATH="$dev/tools:$PATH" SPARKCTL="$dev/bin/sparkctl" \
      bash "$dev/stage_bench.sh" "$dev" --size-gib 4 --targets 3 --json "$out/stage_bench.json"

  cat "$summary"
  local joined; joined=$(IFS=,; echo "${steps_json[*]}")
  echo "{\"gpu\":$gpu,\"failed\":$failed,\"steps\":[${joined}]}" > "$out/summary.json"
  return $failed
}

case "${1:-}" in
  stage) stage ;;
  device) device ;;
  *) sed -n '2,25p' "${BASH_SOURCE[0]}"; exit 2 ;;
esac
