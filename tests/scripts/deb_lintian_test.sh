#!/usr/bin/env bash
# The .deb that `cpack -G DEB` makes is clean of lintian errors: a copyright file, a
# compressed changelog and man pages, an extended description, a well-formed maintainer
# field; and lintian notes no missing hardening (fortify, stack protector, relro, bindnow),
# which needs the optimised build a package is made from: BUILD_DIR when it is one, else (with
# SPARK_LINTIAN_OPTIMISED=1; otherwise the hardening check is skipped, saying so)
# BUILD_DIR/deb-relwithdebinfo,
# configured here like BUILD_DIR but without a build type and without the tests, and built
# (incrementally on later runs). Warnings are printed, not failed on (some, like
# no-manual-page for a helper, are choices). Skips (exit 77) with the reason when lintian
# is not installed.
# Usage: deb_lintian_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: deb_lintian_test.sh SRC_DIR BUILD_DIR}
BUILD=${2:?usage: deb_lintian_test.sh SRC_DIR BUILD_DIR}
if ! command -v lintian >/dev/null; then
  echo "deb_lintian_test: SKIP: lintian is not installed (scripts/install-deps.sh installs it)"
  exit 77
fi
tmp=$(mktemp -d /tmp/sparkctl-lintian.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail=0
err() { echo "deb_lintian_test: FAIL: $*"; fail=1; }

cache_get() { sed -n "s/^$1:[A-Z]*=//p" "$2/CMakeCache.txt" | head -n 1; }
type=$(cache_get CMAKE_BUILD_TYPE "$BUILD")
check_hardening=1
if [[ $type != RelWithDebInfo && $type != Release && ${SPARK_LINTIAN_OPTIMISED:-0} != 1 ]]; then
  # A second optimised build of everything costs a cold CI run as much as the first one.
  echo "deb_lintian_test: $BUILD is a '${type:-no type}' build: packaging it as it is and not" \
    "checking hardening (SPARK_LINTIAN_OPTIMISED=1 builds and packages a RelWithDebInfo copy)"
  check_hardening=0
elif [[ $type != RelWithDebInfo && $type != Release ]]; then
  PKG=$BUILD/deb-relwithdebinfo
  echo "deb_lintian_test: $BUILD is a '${type:-no type}' build; packaging the default (RelWithDebInfo) build in $PKG"
  args=(-S "$SRC" -B "$PKG" -DSPARK_TESTS=OFF -DSPARK_WERROR=ON)
  [[ -f $BUILD/build.ninja ]] && args+=(-G Ninja)
  for k in CMAKE_C_COMPILER_LAUNCHER CMAKE_CXX_COMPILER_LAUNCHER CMAKE_CUDA_COMPILER_LAUNCHER \
    CMAKE_CUDA_ARCHITECTURES; do
    v=$(cache_get "$k" "$BUILD"); [[ -n $v ]] && args+=("-D$k=$v")
  done
  (unset CMAKE_BUILD_TYPE; cmake "${args[@]}" >"$tmp/configure.log" 2>&1) ||
    { err "configuring $PKG failed:"; tail -n 20 "$tmp/configure.log"; exit 1; }
  [[ $(cache_get CMAKE_BUILD_TYPE "$PKG") == RelWithDebInfo ]] ||
    { err "$PKG configured without a build type is '$(cache_get CMAKE_BUILD_TYPE "$PKG")', not RelWithDebInfo"; exit 1; }
  cmake --build "$PKG" >"$tmp/build.log" 2>&1 || { err "building $PKG failed:"; tail -n 30 "$tmp/build.log"; exit 1; }
  BUILD=$PKG
fi

# The compressed pages are build outputs; make sure they are current before packaging.
cmake --build "$BUILD" --target spark_compressed_docs >/dev/null
(cd "$tmp" && cpack -G DEB --config "$BUILD/CPackConfig.cmake" -B "$tmp/pkg" >"$tmp/cpack.log" 2>&1) ||
  { err "cpack failed:"; tail -n 20 "$tmp/cpack.log"; exit 1; }
deb=$(ls "$tmp"/pkg/*.deb 2>/dev/null | head -n 1)
[[ -n $deb ]] || { err "cpack made no .deb"; exit 1; }

# lintian refuses to run as root without --allow-root (CI containers run as root).
allow=()
((EUID == 0)) && allow=(--allow-root)
# Exit 1 means it found errors (counted below); anything else is lintian failing to run.
rc=0
lintian "${allow[@]}" --display-info --tag-display-limit 0 "$deb" >"$tmp/lintian.out" 2>&1 || rc=$?
((rc <= 1)) || { err "lintian exited $rc:"; cat "$tmp/lintian.out"; exit 1; }
errors=$(grep -c '^E: ' "$tmp/lintian.out" || true)
warnings=$(grep -c '^W: ' "$tmp/lintian.out" || true)
if ((errors > 0)); then
  err "lintian reports $errors error(s) on $(basename "$deb"):"
  grep '^E: ' "$tmp/lintian.out"
fi
grep '^W: ' "$tmp/lintian.out" || true
# Hardening notes (lintian gives them as information, I:): none.
if ((check_hardening)) && grep -q '^[EWI]: .*hardening-' "$tmp/lintian.out"; then
  err "lintian notes missing hardening in $(basename "$deb"):"
  grep '^[EWI]: .*hardening-' "$tmp/lintian.out"
fi

# What the package must carry, whatever lintian's version checks.
dpkg-deb -c "$deb" | awk '{print $NF}' >"$tmp/contents"
for f in ./usr/share/doc/sparkctl/copyright ./usr/share/doc/sparkctl/changelog.gz \
  ./usr/share/man/man1/sparkctl.1.gz ./usr/share/man/man8/sparkd.8.gz; do
  grep -qx "$f" "$tmp/contents" || err "$(basename "$deb") lacks $f"
done
grep -q '\.[1-8]$' "$tmp/contents" && err "uncompressed man pages: $(grep '\.[1-8]$' "$tmp/contents" | tr '\n' ' ')"
dpkg-deb -x "$deb" "$tmp/root"
cmp -s "$tmp/root/usr/share/doc/sparkctl/copyright" "$SRC/packaging/debian/copyright" ||
  err "packaged copyright differs from packaging/debian/copyright"
grep -q 'License: Apache-2.0' "$tmp/root/usr/share/doc/sparkctl/copyright" || err "copyright names no Apache-2.0 licence"
grep -q 'Apache License' "$SRC/LICENSE" && grep -q 'END OF TERMS AND CONDITIONS' "$SRC/LICENSE" ||
  err "LICENSE is not the full Apache-2.0 text"
# The changelog's newest entry is this package's version.
version=$(dpkg-deb -f "$deb" Version)
top=$(zcat "$tmp/root/usr/share/doc/sparkctl/changelog.gz" | head -n 1 | sed -n 's/^sparkctl (\([^)]*\)).*/\1/p')
[[ $top == "$version" ]] || err "changelog's newest entry is '$top', the package is '$version' (add an entry to packaging/debian/changelog)"
desc_lines=$(dpkg-deb -f "$deb" Description | wc -l)
((desc_lines > 2)) || err "the extended description is empty ($desc_lines line(s))"
maint=$(dpkg-deb -f "$deb" Maintainer)
[[ $maint =~ ^[^\<]+\ \<[^@\ ]+@[^@\ ]+\.[a-z]+\>$ ]] || err "Maintainer '$maint' is not 'Name <address>'"
[[ $maint == *localhost* ]] && err "Maintainer '$maint' is on localhost"

echo "deb_lintian_test: $(basename "$deb"): $errors lintian error(s), $warnings warning(s)"
((fail == 0)) && echo "deb_lintian_test: OK"
exit $fail
