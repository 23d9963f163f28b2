#!/usr/bin/env bash
# scripts/install-deps.sh resolves its lists against this machine's apt (--list changes
# nothing): the demo set holds the build's and the demo's packages and none of the test
# tooling, clang's fuzzing runtime is named after the clang installed here, and every
# entry that is not optional resolves to a package apt has installed or offers.
# Usage: install_deps_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: install_deps_test.sh SRC_DIR BUILD_DIR}
deps=$SRC/scripts/install-deps.sh
if ! apt-cache policy cmake 2>/dev/null | grep 'Candidate: [0-9]' >/dev/null; then
  echo "SKIP: apt has no package lists on this machine (apt-get update first)"
  exit 77
fi
demo=$(bash "$deps" --demo --list)
full=$(bash "$deps" --list)
fail=0
bad() { echo "install_deps_test: FAIL: $*"; fail=1; }

for want in cmake ninja-build g++ pkg-config libssh-dev libgloo-dev libopenblas-dev libicu-dev curl python3; do
  grep -qx "$want" <<<"$demo" || bad "the demo set lacks $want"
done
for tool in clang clang-format doctest-dev openssh-server prometheus vmtouch man-db iperf3; do
  grep -qx "$tool" <<<"$demo" && bad "the demo set holds test tooling: $tool"
  grep -qx "$tool" <<<"$full" || grep -q "^# none: $tool\b" <<<"$full" || bad "the test set lacks $tool"
done
while read -r p; do
  [[ $p == \#* ]] && continue
  grep -qx -- "$p" <<<"$full" || bad "$p is in the demo set but not in the test set"
done <<<"$demo"

# The fuzzing runtime must match the clang that is installed (libclang-rt-N-dev, or the
# older libclang-common-N-dev that held it), whatever N this release has.
if command -v clang >/dev/null; then
  n=$(clang --version | sed -n 's/.*clang version \([0-9][0-9]*\).*/\1/p' | head -n 1)
  grep -qxE "libclang-(rt|common)-$n-dev" <<<"$full" ||
    bad "clang $n is installed but the fuzzing runtime resolves to: $(grep -i 'clang-\(rt\|common\)' <<<"$full" || echo nothing)"
fi

# A command on PATH meets a cmd: alternative: Node.js from elsewhere brings its own npm, which
# Debian's npm package would conflict with, so --check must not call npm missing then.
fake=$(mktemp -d)
trap 'rm -rf "$fake"' EXIT
ln -s "$(command -v true)" "$fake/npm"
ln -s "$(command -v true)" "$fake/node"
if ! dpkg-query -W -f='${Status}' npm 2>/dev/null | grep -q 'install ok installed'; then
  listed=$(PATH="$fake:$PATH" bash "$deps" --list)
  grep -qx '# command on PATH, not from apt: npm' <<<"$listed" ||
    bad "an npm on PATH does not meet the npm entry"
  checked=$(PATH="$fake:$PATH" bash "$deps" --check || true)
  grep -q 'missing:.* npm' <<<"$checked" &&
    bad "--check calls npm missing although an npm is on PATH"
fi

# Entries apt has no name for: only the optional ones (they carry their cost).
while read -r line; do
  [[ $line == *"("*")" ]] || bad "apt here offers nothing for a required entry: ${line#\# none: }"
done < <(grep '^# none:' <<<"$full" || true)

((fail == 0)) && echo "install_deps_test: OK ($(grep -vc '^#' <<<"$demo") demo packages, $(grep -vc '^#' <<<"$full") in the test set)"
exit $fail
