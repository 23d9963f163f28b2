#!/usr/bin/env bash
# The arm64 tier: cross-compile the whole project for aarch64 (DGX Spark's Grace CPU) with
# Debian's cross toolchain and the arm64 libraries installed multiarch, then run the unit
# tests under qemu-user. In a Debian root of its own (debootstrap), because the arm64
# -dev packages replace some native ones (libgloo-dev is not Multi-Arch: same) and would
# upgrade this machine's packages to match:
#   1. debootstrap SUITE (native architecture), kept under the cache and reused
#   2. scripts/install-deps.sh --arch arm64   multiarch libraries, g++-aarch64-linux-gnu, qemu
#   3. cmake with cmake/aarch64-linux-gnu.cmake, -Werror: sparkctl, sparkd, the unit tests
#   4. the binaries are aarch64 ELF; sparkctl and sparkd start under qemu-aarch64-static
#   5. spark_unit_tests under qemu-aarch64-static
#   6. every other target (e2e and hw tests, benchmarks)
# CUDA: the arm64 build has CUDA only where the toolkit has NVIDIA's aarch64 cross target
# (targets/sbsa-linux); otherwise it is the CPU path (the toolchain file says which).
# It prints each step's time and ends with "N passed, N failed". It takes tens of minutes on
# two cores (a cold cross build, tests under emulation): not part of scripts/test.sh.
#
# Usage: scripts/cross-arm64.sh [--suite SUITE] [--fresh]      (as root; needs debootstrap)
#   --suite   the Debian release of the root and of the arm64 libraries (default trixie,
#             closest to DGX OS = Ubuntu 24.04 in versions; bookworm = Debian 12)
#   --fresh   remake the root instead of reusing it
# Environment: SPARK_DISTRO_MIRROR, SPARK_DISTRO_CACHE (as scripts/distro-test.sh: the
#   debootstrap tarballs, the kept root under roots/cross-SUITE-arm64, a ccache),
#   SPARK_UNIT_ARGS (doctest arguments for the unit tests, e.g. -tc='*config*').
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SUITE=trixie FRESH=0 TARGET=arm64
while (($#)); do
  case "$1" in
    --suite) SUITE=${2:?--suite needs a name}; shift ;;
    --fresh) FRESH=1 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "cross-arm64: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
MIRROR=${SPARK_DISTRO_MIRROR:-http://deb.debian.org/debian}
CACHE=${SPARK_DISTRO_CACHE:-/var/cache/sparkctl/distro-test}
ARCH=$(dpkg --print-architecture)
[[ $ARCH != "$TARGET" ]] || { echo "cross-arm64: this machine is $TARGET already: build natively" >&2; exit 1; }

((EUID == 0)) || { echo "cross-arm64: needs root (debootstrap, chroot, mounts)" >&2; exit 1; }
command -v debootstrap >/dev/null ||
  { echo "cross-arm64: debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

mkdir -p "$CACHE/roots" "$CACHE/ccache-cross-$SUITE-$TARGET"
TARBALL=$CACHE/$SUITE-$ARCH-minbase.tgz
ROOT=$CACHE/roots/cross-$SUITE-$TARGET
mounted=()

cleanup() {
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT

declare -a names=() secs=() results=()
# step NAME CMD...: runs CMD, records its time and result.
step() {
  local name=$1 t0=$SECONDS rc=0
  shift
  echo
  echo "=== cross-arm64: $name"
  "$@" || rc=$?
  names+=("$name"); secs+=($((SECONDS - t0))); results+=("$rc")
  echo "=== cross-arm64: $name: $( ((rc == 0)) && echo ok || echo "FAILED (exit $rc)") ($((SECONDS - t0)) s)"
  return $rc
}

make_root() {
  if ((FRESH)) && [[ -d $ROOT ]]; then
    if findmnt -rn -o TARGET | grep -qF "$ROOT/"; then
      echo "cross-arm64: something is still mounted under $ROOT; not removing it" >&2
      return 1
    fi
    rm -rf --one-file-system "$ROOT"
  fi
  if [[ -f $ROOT/.sparkctl-root-ok ]]; then
    echo "root: $ROOT (kept from an earlier run; --fresh remakes it)"
    return 0
  fi
  rm -rf --one-file-system "$ROOT"
  if [[ ! -s $TARBALL ]]; then
    echo "cross-arm64: downloading $SUITE ($ARCH, minbase) from $MIRROR into $TARBALL"
    local tmp
    tmp=$(mktemp -d "$CACHE/roots/tarball.XXXXXX")
    debootstrap --variant=minbase --make-tarball="$TARBALL.part" "$SUITE" "$tmp" "$MIRROR"
    rm -rf --one-file-system "$tmp"
    mv "$TARBALL.part" "$TARBALL"
  fi
  debootstrap --variant=minbase --unpack-tarball="$TARBALL" "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 ||
    { tail -n 30 "$ROOT.log"; rm -f "$ROOT.log"; return 1; }
  rm -f "$ROOT.log"
  printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"   # no services start in it
  chmod 755 "$ROOT/usr/sbin/policy-rc.d"
  touch "$ROOT/.sparkctl-root-ok"
  echo "root: $ROOT ($(. "$ROOT/etc/os-release" && echo "$PRETTY_NAME"))"
}

mount_root() {
  local m
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
  mount -t proc proc "$ROOT/proc" && mounted+=("$ROOT/proc")
  mount -t sysfs sysfs "$ROOT/sys" && mounted+=("$ROOT/sys")
  for m in /dev /dev/pts; do
    mkdir -p "$ROOT$m"
    mount --bind "$m" "$ROOT$m" && mounted+=("$ROOT$m")
  done
  mkdir -p "$ROOT/root/.cache/ccache"
  mount --bind "$CACHE/ccache-cross-$SUITE-$TARGET" "$ROOT/root/.cache/ccache" && mounted+=("$ROOT/root/.cache/ccache")
}

# The checkout's files as git sees them (tracked and new, not ignored), fresh each run.
copy_source() {
  rm -rf --one-file-system "$ROOT/src/sparkctl"
  mkdir -p "$ROOT/src/sparkctl"
  if git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1; then
    (cd "$SRC" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$ROOT/src/sparkctl"
  else
    tar -C "$SRC" --exclude='./build*' -cf - . | tar -xf - -C "$ROOT/src/sparkctl"
  fi
}

in_root() {
  chroot "$ROOT" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 CCACHE_BASEDIR=/src/sparkctl SPARK_UNIT_ARGS="${SPARK_UNIT_ARGS:-}" \
    bash -c "cd /src/sparkctl && $1"
}

B=/build/$TARGET
t_start=$SECONDS
step "debootstrap $SUITE" make_root
mount_root
copy_source
CONFIGURE="cmake -S . -B $B -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DSPARK_WERROR=ON \
  -DSPARK_TESTS=ON -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
# The binaries and the unit tests first (their result comes sooner), then everything else;
# -k 0 reports every file that does not build, not only the first.
step "install-deps --arch $TARGET" in_root "bash scripts/install-deps.sh --arch $TARGET" &&
  step "cross build: sparkctl sparkd unit tests" in_root "$CONFIGURE && ninja -C $B -k 0 -j$(nproc) sparkctl sparkd spark_unit_tests" &&
  step "aarch64 binaries start" in_root "set -e
      for b in $B/cli/sparkctl $B/daemon/sparkd $B/tests/spark_unit_tests; do
        echo \"\$b: \$(readelf -h \$b | sed -n 's/^ *Machine: *//p')\"
        readelf -h \$b | grep -q 'Machine: *AArch64'
      done
      qemu-aarch64-static $B/cli/sparkctl version
      qemu-aarch64-static $B/daemon/sparkd --help >/dev/null" &&
  step "unit tests (qemu-aarch64-static)" in_root "qemu-aarch64-static $B/tests/spark_unit_tests \$SPARK_UNIT_ARGS"
step "cross build: every other target" in_root "$CONFIGURE >/dev/null && ninja -C $B -k 0 -j$(nproc)" || true

echo
echo "=== cross-arm64: $TARGET on $(. "$ROOT/etc/os-release" && echo "$PRETTY_NAME") ($ARCH)"
passed=0 failed=0
for i in "${!names[@]}"; do
  printf '  %-34s %6s s  %s\n' "${names[$i]}" "${secs[$i]}" "$( ((results[i] == 0)) && echo ok || echo FAILED)"
  ((results[i] == 0)) && passed=$((passed + 1)) || failed=$((failed + 1))
done
echo "=== total $((SECONDS - t_start)) s"
((passed + failed == 6)) || failed=$((failed + 6 - passed - failed))
echo "$passed passed, $failed failed"
((failed == 0))
