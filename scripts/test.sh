#!/usr/bin/env bash
# The whole test run, as CI does it (.ci/run calls exactly this):
#   1. install the Debian packages (scripts/install-deps.sh; skips what is there) and the
#      e2e tier's npm package (npm ci in tests/e2e/openai_client; the chat template
#      reference script test fetches its own packages into tests/e2e/chat_templates)
#   2. build with warnings as errors (build-ci/, ccache) and run every ctest tier:
#      unit, drill, e2e, script, hw (hw tests skip with a printed reason without a GPU/HCA)
#   3. one sanitizer build (build-san/: clang at -O0, ASan + UBSan + libFuzzer's coverage,
#      CUDA off, the test sources compiled a batch at a time: SPARK_UNITY_TESTS) that makes
#      both the unit tests, run under the sanitizers, and the fuzz targets, each run for a
#      bounded time on its seed corpus (tests/fuzz/corpus/<target>/), one at a time beside
#      the sanitized unit run (which keeps one core busy), JOBS at a time without it.
#      Without clang's fuzzer runtime: gcc's ASan build of the unit tests (build-asan/)
#      and the fuzz targets skipped with the reason
# It goes on after a failure and ends with "N passed, N failed"; exit status 0 only when
# nothing failed.
#
# Options: --no-asan, --no-fuzz, --no-deps.  Environment: SPARK_TEST_JOBS (default: nproc),
# SPARK_FUZZ_SECONDS (default 30 per target), CCACHE_DIR (default ~/.cache/ccache),
# SPARK_CI_CUDA_ARCHS (default 121a: the CUDA architectures of the main build when nvcc is there).
set -uo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$SRC"
JOBS=${SPARK_TEST_JOBS:-$(nproc)}
FUZZ_SECONDS=${SPARK_FUZZ_SECONDS:-30}
do_asan=1 do_fuzz=1 do_deps=1
for a in "$@"; do
  case "$a" in
    --no-asan) do_asan=0 ;;
    --no-fuzz) do_fuzz=0 ;;
    --no-deps) do_deps=0 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "test.sh: unknown option $a (try --help)" >&2; exit 2 ;;
  esac
done

export CCACHE_BASEDIR="$SRC"      # cache hits across checkouts and build directories
export CCACHE_NOHASHDIR=1
LAUNCHER=()
command -v ccache >/dev/null && LAUNCHER=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)

passed=0 failed=0 skipped=0 failures=()
t_start=$SECONDS

# stage NAME CMD...: runs CMD, counts it, logs the time; output goes to the terminal.
# A failed stage's log is kept so that the summary at the end can repeat why it failed.
STAGE_LOGS=$(mktemp -d)
trap 'rm -rf "$STAGE_LOGS"' EXIT
stage() {
  local name=$1; shift
  local t0=$SECONDS rc=0 log="$STAGE_LOGS/${#failures[@]}-${name//[^A-Za-z0-9_-]/_}.log"
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if ((rc == 0)); then
    passed=$((passed + 1))
    echo "=== $name: ok ($((SECONDS - t0)) s)"
    rm -f "$log"
    return 0
  fi
  failed=$((failed + 1)); failures+=("$name")
  fail_logs+=("$name=$log")
  echo "=== $name: FAILED ($((SECONDS - t0)) s)"
  return 1
}
fail_logs=()

# doctest_failures LOG: each failed check of a doctest run (file:line: ERROR or FATAL ERROR)
# under the name of its test case, with the values and the first lines of what it logged.
# A passing case's MESSAGE output can run to thousands of lines, so these are what the end
# of the CI log must repeat.
doctest_failures() {
  awk '/^TEST CASE:/ {tc = $0}
       /^[^ ]+:[0-9]+: (FATAL )?ERROR: / {if (tc != last) print tc; last = tc; print; n = 12; next}
       n > 0 {print; n--}' "$1" | head -n 80
}

# why_failed: for each failed stage or ctest tier, the lines of its log that say why (test
# case, file:line, sanitizer report), so that they are at the end of a long CI log.
why_failed() {
  local entry name log
  for entry in "${fail_logs[@]}"; do
    name=${entry%%=*} log=${entry#*=}
    echo "=== why $name failed:"
    if grep -qE '^[^ ]+:[0-9]+: (FATAL )?ERROR: ' "$log"; then
      doctest_failures "$log"
    fi
    grep -E -B2 -A8 'FAILED|error:|Error:|^E: |runtime error|Sanitizer|Assertion|what\(\)|^FAIL: ' "$log" |
      grep -vE '^SKIP: |^[^ ]+:[0-9]+: (FATAL )?ERROR: ' | head -n 40
  done
}

# quiet CMD...: runs CMD with its output in a log, shown only when it fails.
quiet() {
  local log rc=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=$?
  ((rc == 0)) || tail -n 60 "$log"
  rm -f "$log"
  return $rc
}

# tier BUILD LABEL: runs one ctest label; each test counts as one pass or fail. (The e2e and
# script tiers run apart: together, the script tests slowed the network-namespace entry more
# than they filled the core it leaves; docs/DEVELOPING.md.)
tier() {
  local dir=$1 label=$2 t0=$SECONDS log
  log=$(mktemp)
  echo "=== ctest -L $label ($dir)"
  ctest --test-dir "$dir" -L "^${label}\$" --output-on-failure --timeout 900 -j "$JOBS" 2>&1 | tee "$log"
  local total fail bad=0
  read -r fail total < <(sed -n 's/.*tests passed, \([0-9]*\) tests\{0,1\} failed out of \([0-9]*\).*/\1 \2/p' "$log" | tail -1)
  if [[ -z "${total:-}" ]]; then
    if grep -q "No tests were found" "$log"; then
      echo "=== ctest -L $label: no tests in this tier yet"
    else
      failed=$((failed + 1)); failures+=("ctest-$label(no result)"); bad=1
    fi
  else
    local skip
    skip=$(grep -c '(Skipped)' "$log" || true)
    passed=$((passed + total - fail - skip)); failed=$((failed + fail)); skipped=$((skipped + skip))
    ((fail > 0)) && failures+=($(grep -v "(Skipped)" "$log" | sed -n "s/^[[:space:]]*[0-9]* - \([^ ]*\) .*/${label}:\1/p")) && bad=1
  fi
  echo "=== ctest -L $label: done ($((SECONDS - t0)) s)"
  # A failed tier's log stays for why_failed at the end.
  if ((bad)); then
    mv "$log" "$STAGE_LOGS/ctest-$label.log"
    fail_logs+=("ctest-$label=$STAGE_LOGS/ctest-$label.log")
  else
    rm -f "$log"
  fi
}

# fuzz_result PREFIX: what a background run_fuzz printed (PREFIX.out) and its status
# (PREFIX.rc; missing: it never finished).
fuzz_result() {
  cat "$1.out" 2>/dev/null
  return "$(cat "$1.rc" 2>/dev/null || echo 1)"
}

# run_fuzz TARGET CORPUS_DIR: bounded libFuzzer run; prints the tail of its log.
run_fuzz() {
  local t=$1 work=$2 log rc
  log=build-san/artifacts/$t.log
  UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
  timeout $((FUZZ_SECONDS + 120)) build-san/tests/fuzz/"$t" -max_total_time="$FUZZ_SECONDS" \
    -max_len=8192 -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$SRC/build-san/artifacts/$t-" "$work" >"$log" 2>&1
  rc=$?
  grep -Ev '^(#[0-9]|"|[[:space:]]+NEW_FUNC|###### )' "$log" | tail -n 25
  return $rc
}

# SPARK_TEST_SH_FUNCTIONS=1 with `source`: only the functions above, for
# tests/scripts/test_summary_test.sh.
if [[ -n ${SPARK_TEST_SH_FUNCTIONS:-} ]]; then return 0; fi

if ((do_deps)); then stage deps bash scripts/install-deps.sh; fi
# The official OpenAI Node client the e2e tier runs against sparkd (tests/e2e/openai_client;
# its tests skip with a reason when node or the package is missing).
if ((do_deps)) && command -v npm >/dev/null; then
  stage openai-client npm ci --prefix tests/e2e/openai_client --no-audit --no-fund --loglevel=error
fi

# Main build: warnings are errors; with nvcc there, the CUDA code for one architecture,
# SPARK_CI_CUDA_ARCHS (default 121a, the GB10 of the reference ring: no CI machine has a GPU,
# and every GPU run builds sm_90a itself, scripts/gpu-run.sh stage), which keeps a cold CI
# build from compiling every kernel twice.
CUDA_ARCH_ARGS=()
command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] &&
  CUDA_ARCH_ARGS=(-DCMAKE_CUDA_ARCHITECTURES="${SPARK_CI_CUDA_ARCHS:-121a}")
# An explicit empty build type: the unoptimised flags the tests have always built with
# (a directory configured without one is RelWithDebInfo, for users).
if stage configure quiet cmake -S . -B build-ci -G Ninja -DCMAKE_BUILD_TYPE= -DSPARK_WERROR=ON -DSPARK_TESTS=ON \
     "${CUDA_ARCH_ARGS[@]}" "${LAUNCHER[@]}" &&
   stage build ninja -C build-ci -j "$JOBS"; then
  for label in unit drill e2e script hw; do tier build-ci "$label"; done
fi

# libFuzzer needs clang and its fuzzer runtime (libclang-rt-N-dev, which install-deps.sh
# installs where apt offers it): without them the tier is skipped with the reason.
fuzz_missing() {
  command -v clang++ >/dev/null || { echo "clang++ is not installed"; return 0; }
  local d rc=0
  d=$(mktemp -d)
  printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' >"$d/f.cc"
  clang++ -fsanitize=fuzzer,address,undefined "$d/f.cc" -o "$d/f" >"$d/log" 2>&1 || rc=$?
  ((rc == 0)) || echo "clang++ cannot link -fsanitize=fuzzer: $(grep -m1 -iE 'error|cannot' "$d/log")"
  rm -rf "$d"
  ((rc != 0))
}
have_fuzz=1
if ((do_asan || do_fuzz)) && fuzz_why=$(fuzz_missing); then
  have_fuzz=0
  if ((do_fuzz)); then
    echo "=== fuzz: SKIP: $fuzz_why (install the fuzzer runtime: scripts/install-deps.sh names it)"
    do_fuzz=0 skipped=$((skipped + 1))
  fi
fi


# fuzz_all N: every target in fuzz_targets.txt, FUZZ_SECONDS each on a copy of its seed
# corpus, N at a time (each is one process on one core); what each printed and its status
# go to $fuzz_out. A crash leaves its input in build-san/artifacts/.
fuzz_all() {
  local n=$1 i t
  mkdir -p build-san/artifacts
  for ((i = 0; i < ${#fuzz_targets[@]}; i += n)); do
    for t in "${fuzz_targets[@]:i:n}"; do
      (
        work=$(mktemp -d)
        [[ -d tests/fuzz/corpus/$t ]] && cp -r "tests/fuzz/corpus/$t/." "$work/"
        run_fuzz "$t" "$work" >"$fuzz_out/$t.out" 2>&1
        echo $? >"$fuzz_out/$t.rc"
        rm -rf "$work"
      ) &
    done
    wait
  done
}

# The unit tier under ASan+UBSan (UBSan's checks abort: a finding fails the run), with a
# 64 MiB stack: at -O0 with the sanitizers a frame of the template evaluator is several
# times its optimised size, and the cases that recurse to the evaluator's depth limits
# (256 macro calls) overflow the usual 8 MiB.
san_unit() {
  (
    ulimit -s 65536 2>/dev/null || true
    ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1} \
    UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
      "$1"/tests/spark_unit_tests
  )
}

# Sanitizers and fuzzing from ONE build where clang can (SPARK_SANITIZE + SPARK_FUZZ):
# ASan and UBSan everywhere, libFuzzer's coverage only in the libraries the fuzz targets
# link, -O0 but for the engine and the kernels' C++ twins (-O1, spark_hot_code). It
# compiles the libraries once for the unit tests and the fuzz targets: from an empty cache
# build and unit run took 955 s, against 1562 s for gcc's ASan build, its run and clang's
# fuzz build (docs/DEVELOPING.md, CI time). CUDA off; the test sources eight to a unit
# (SPARK_UNITY_TESTS): the main build above compiles each one alone, so a missing #include
# still fails there.
fuzz_targets=()
if ((have_fuzz && (do_asan || do_fuzz))); then
  san_targets=()
  if stage san-configure quiet cmake -S . -B build-san -G Ninja -DCMAKE_C_COMPILER=clang \
       -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE= -DSPARK_SANITIZE=ON -DSPARK_FUZZ=ON \
       -DSPARK_CUDA=OFF -DSPARK_TESTS=ON -DSPARK_UNITY_TESTS=ON "${LAUNCHER[@]}"; then
    mapfile -t fuzz_targets < <(grep -v '^$' build-san/tests/fuzz/fuzz_targets.txt)
    ((do_asan)) && san_targets+=(spark_unit_tests)
    ((do_fuzz)) && san_targets+=("${fuzz_targets[@]}")
    if stage san-build ninja -C build-san -j "$JOBS" "${san_targets[@]}"; then
      # The sanitized unit run keeps about one core busy (measured: 371 s of CPU in 359 s):
      # the fuzz targets run one at a time beside it, on the other, and all JOBS at a time
      # without it. Their results are reported after it, below.
      fuzz_out=$(mktemp -d)
      fuzz_pid=
      if ((do_fuzz && do_asan && JOBS > 1)); then
        fuzz_all $((JOBS - 1)) &
        fuzz_pid=$!
      fi
      ((do_asan)) && stage asan-unit san_unit build-san
      if [[ -n $fuzz_pid ]]; then
        wait "$fuzz_pid"
      elif ((do_fuzz)); then
        fuzz_all "$JOBS"
      fi
    else
      do_fuzz=0
    fi
  else
    do_fuzz=0
  fi
elif ((do_asan)); then
  # No clang fuzzer runtime: gcc's ASan build of the unit tests.
  if stage asan-configure quiet cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE= -DSPARK_SANITIZE=ON \
       -DSPARK_CUDA=OFF -DSPARK_TESTS=ON -DSPARK_UNITY_TESTS=ON "${LAUNCHER[@]}" &&
     stage asan-build ninja -C build-asan -j "$JOBS" spark_unit_tests; then
    stage asan-unit san_unit build-asan
  fi
fi

# The fuzz targets' results, each a stage of its own in the list's order.
if ((do_fuzz)); then
  for t in "${fuzz_targets[@]}"; do
    stage "fuzz:$t" fuzz_result "$fuzz_out/$t"
  done
  rm -rf "$fuzz_out"
fi

echo
echo "=== total time $((SECONDS - t_start)) s"
((failed > 0)) && { why_failed; echo "=== failed: ${failures[*]}"; }
((skipped > 0)) && echo "=== skipped (with a printed reason): $skipped"
echo "$passed passed, $failed failed"
((failed == 0))
