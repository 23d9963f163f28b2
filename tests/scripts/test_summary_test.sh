#!/usr/bin/env bash
# scripts/test.sh's summary at the end of a CI log: a ctest tier that fails repeats, at the
# very end, each failed doctest check under its test case's name, even when the passing
# cases printed thousands of lines before it (CI shows only the head and the tail of a log).
# Usage: test_summary_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: test_summary_test.sh SRC_DIR BUILD_DIR}
tmp=$(mktemp -d /tmp/spark-test-summary.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# A project of two ctest entries in one label: one passes after a long log, one fails as
# doctest reports a failed check, after a long log of its own.
mkdir -p "$tmp/proj"
cat > "$tmp/proj/pass.sh" <<'SH'
for i in $(seq 3000); do echo "../tests/e2e/x_test.cc:10: MESSAGE: line $i of a passing case"; done
SH
cat > "$tmp/proj/fail.sh" <<'SH'
echo "==============================================================================="
echo "../tests/e2e/y_test.cc:20:"
echo "TEST CASE:  y: the case that fails"
echo
for i in $(seq 2000); do echo "  logged: 2026-12-06T00:00:00 ERROR engine[0]: noise $i"; done
echo "../tests/e2e/y_test.cc:42: ERROR: CHECK( got == 128 ) is NOT correct!"
echo "  values: CHECK( 161 == 128 )"
for i in $(seq 2000); do echo "  logged: more noise $i"; done
exit 1
SH
cat > "$tmp/proj/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.25)
project(summary NONE)
enable_testing()
add_test(NAME passing COMMAND bash $tmp/proj/pass.sh)
add_test(NAME failing COMMAND bash $tmp/proj/fail.sh)
set_tests_properties(passing failing PROPERTIES LABELS e2e)
CM
cmake -S "$tmp/proj" -B "$tmp/build" > "$tmp/cmake.log" 2>&1 || { cat "$tmp/cmake.log"; fail "cmake"; }

# test.sh's own functions: the tier, then the summary that ends a run.
out=$(
  cd "$SRC"
  # shellcheck disable=SC1091
  SPARK_TEST_SH_FUNCTIONS=1 source scripts/test.sh --no-deps
  tier "$tmp/build" e2e > /dev/null
  echo "counts: $passed passed, $failed failed: ${failures[*]}"
  why_failed
)
grep -q '^counts: 1 passed, 1 failed: e2e:failing$' <<<"$out" || fail "counts: $(grep counts <<<"$out")"
grep -q '^=== why ctest-e2e failed:$' <<<"$out" || fail "no summary for the failed tier: $(head -5 <<<"$out")"
# The failed check with its test case and values, within the summary's few lines.
summary=$(sed -n '/^=== why ctest-e2e failed:$/,$p' <<<"$out")
grep -q '^TEST CASE:  y: the case that fails$' <<<"$summary" || fail "the test case is not named: $(head -5 <<<"$summary")"
grep -q 'y_test.cc:42: ERROR: CHECK( got == 128 ) is NOT correct!' <<<"$summary" || fail "the check is not repeated"
grep -q 'values: CHECK( 161 == 128 )' <<<"$summary" || fail "the values are not repeated"
(($(wc -l <<<"$summary") < 150)) || fail "the summary is $(wc -l <<<"$summary") lines: the noise came with it"
echo "PASS: a failed ctest tier's doctest checks end the log"
