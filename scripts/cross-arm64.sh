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
# two cores (a cold cross build, tests under emulation): not part of scripts/test.sh. Its
# last results are in docs/DEVELOPING.md ("Other distributions and arm64").
# A rerun is incremental: the root, its packages, the build tree and a ccache are kept, and
# the checkout is synced into the root by content (only what changed is rebuilt).
#
# Usage: scripts/cross-arm64.sh [--suite SUITE] [--fresh] [--no-binfmt]     (as root)
#   --suite      the Debian release of the root and of the arm64 libraries (default trixie,
#                closest to DGX OS = Ubuntu 24.04 in versions; bookworm = Debian 12)
#   --fresh      remake the root (and the build tree) instead of reusing them
#   --no-binfmt  do not register qemu-aarch64 with binfmt_misc (see below)
# Needs: root (debootstrap, chroot, mounts), debootstrap, a Debian mirror (HTTP), about 4 GB
#   under the cache, rsync (else every object is rebuilt from the ccache on a rerun), and
#   binfmt_misc in the kernel: the unit tests start aarch64 programs of their own
#   (spark_fault_server, sparkd fabric-rank), which the kernel can only run through qemu
#   when qemu-aarch64 is registered there. Where it is not, this script registers the
#   root's qemu-aarch64-static (flag F, so it works inside the root) for the run and
#   removes the registration at the end; --no-binfmt leaves the kernel alone, and those
#   tests then fail with "Exec format error".
# Environment: SPARK_DISTRO_MIRROR, SPARK_DISTRO_CACHE (as scripts/distro-test.sh: the
#   debootstrap tarballs, the kept root under roots/cross-SUITE-arm64, a ccache),
#   SPARK_UNIT_ARGS (doctest arguments for the unit tests, e.g. -tc='*config*'),
#   SPARK_JOBS (parallel build jobs, default nproc).
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$SRC/scripts/lib/sync-checkout.sh"
SUITE=trixie FRESH=0 TARGET=arm64 BINFMT=1
while (($#)); do
  case "$1" in
    --suite) SUITE=${2:?--suite needs a name}; shift ;;
    --fresh) FRESH=1 ;;
    --no-binfmt) BINFMT=0 ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "cross-arm64: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
MIRROR=${SPARK_DISTRO_MIRROR:-http://deb.debian.org/debian}
CACHE=${SPARK_DISTRO_CACHE:-/var/cache/sparkctl/distro-test}
JOBS=${SPARK_JOBS:-$(nproc)}
ARCH=$(dpkg --print-architecture)
[[ $ARCH != "$TARGET" ]] || { echo "cross-arm64: this machine is $TARGET already: build natively" >&2; exit 1; }

((EUID == 0)) || { echo "cross-arm64: needs root (debootstrap, chroot, mounts): run it with sudo" >&2; exit 1; }
command -v debootstrap >/dev/null ||
  { echo "cross-arm64: debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

mkdir -p "$CACHE/roots" "$CACHE/ccache-cross-$SUITE-$TARGET"
TARBALL=$CACHE/$SUITE-$ARCH-minbase.tgz
ROOT=$CACHE/roots/cross-$SUITE-$TARGET
mounted=()

BINFMT_DIR=/proc/sys/fs/binfmt_misc
binfmt_registered=0 binfmt_mounted=0

cleanup() {
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
  # Leave the kernel as it was found.
  if ((binfmt_registered)); then
    echo -1 >"$BINFMT_DIR/qemu-aarch64" 2>/dev/null || true
    echo "cross-arm64: removed the qemu-aarch64 binfmt_misc registration made for this run"
  fi
  ((binfmt_mounted)) && umount "$BINFMT_DIR" 2>/dev/null || true
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
  # A machine's / is 0755: other users (the tests' nobody) must be able to resolve paths.
  mkdir -p "$ROOT" && chmod 0755 "$ROOT"
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
  # The CUDA toolkit, where it can build for aarch64 (NVIDIA's sbsa-linux cross target): the
  # toolchain file looks for it at /usr/local/cuda inside the root.
  if [[ -d /usr/local/cuda/targets/sbsa-linux ]]; then
    mkdir -p "$ROOT/usr/local/cuda"
    mount --bind -o ro /usr/local/cuda "$ROOT/usr/local/cuda" && mounted+=("$ROOT/usr/local/cuda")
    echo "CUDA: $(readlink -f /usr/local/cuda) with targets/sbsa-linux: the arm64 build has the CUDA kernels"
  else
    echo "CUDA: no /usr/local/cuda/targets/sbsa-linux on this machine (NVIDIA's aarch64 cross" \
      "target, the cuda-cross-sbsa packages): the arm64 build is the CPU path"
  fi
}

# The checkout, synced into the kept root by content (scripts/lib/sync-checkout.sh says why
# the build tree under /build needs that).
copy_source() {
  # A source tree from before the content sync cannot be trusted, nor objects built from it.
  if [[ ! -f $ROOT/src/.sparkctl-synced ]]; then
    rm -rf --one-file-system "$ROOT/src/sparkctl" "$ROOT/build/$TARGET"
  fi
  sync_checkout "$SRC" "$ROOT/src/sparkctl" "$CACHE/roots"
  touch "$ROOT/src/.sparkctl-synced"
}

# ensure_binfmt: the kernel runs aarch64 ELF files through qemu (what the unit tests need to
# start their own aarch64 children). Registers the root's qemu-aarch64-static when nothing
# handles aarch64 yet; F opens it now, so the path need not resolve inside the root.
ensure_binfmt() {
  local qemu=$ROOT/usr/bin/qemu-aarch64-static
  if ! ((BINFMT)); then
    echo "binfmt_misc: left alone (--no-binfmt): tests that start aarch64 children fail"
    return 0
  fi
  if ! grep -q binfmt_misc /proc/filesystems; then
    echo "cross-arm64: this kernel has no binfmt_misc: the unit tests that start aarch64" \
      "programs will fail with 'Exec format error'" >&2
    return 0
  fi
  if [[ ! -e $BINFMT_DIR/register ]]; then
    mount -t binfmt_misc binfmt_misc "$BINFMT_DIR" ||
      { echo "cross-arm64: cannot mount binfmt_misc on $BINFMT_DIR" >&2; return 1; }
    binfmt_mounted=1
  fi
  local f
  for f in "$BINFMT_DIR"/*; do
    [[ -f $f && $f != */register && $f != */status ]] || continue
    if grep -qx enabled "$f" && grep -q '^magic 7f454c460201010000000000000000000200b700' "$f"; then
      echo "binfmt_misc: aarch64 ELF runs through $(sed -n 's/^interpreter //p' "$f") ($(basename "$f"))"
      return 0
    fi
  done
  [[ -x $qemu ]] || { echo "cross-arm64: $qemu is missing (install-deps --arch $TARGET installs qemu-user-static)" >&2; return 1; }
  # The magic and mask of an aarch64 ELF executable (little-endian, 64-bit, e_machine 183).
  printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:'"$qemu"':F' \
    >"$BINFMT_DIR/register" ||
    { echo "cross-arm64: registering $qemu with binfmt_misc failed" >&2; return 1; }
  binfmt_registered=1
  echo "binfmt_misc: registered $qemu for aarch64 ELF for this run (removed at the end)"
}

in_root() {
  chroot "$ROOT" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 CCACHE_BASEDIR=/src/sparkctl SPARK_UNIT_ARGS="${SPARK_UNIT_ARGS:-}" \
    bash -c "cd /src/sparkctl && $1"
}

B=/build/$TARGET
run_unit_tests() { ensure_binfmt && in_root "qemu-aarch64-static $B/tests/spark_unit_tests \$SPARK_UNIT_ARGS"; }
t_start=$SECONDS
step "debootstrap $SUITE" make_root
mount_root
copy_source
CONFIGURE="cmake -S . -B $B -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DSPARK_WERROR=ON \
  -DSPARK_TESTS=ON -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
# The binaries and the unit tests first (their result comes sooner), then everything else;
# -k 0 reports every file that does not build, not only the first.
step "install-deps --arch $TARGET" in_root "bash scripts/install-deps.sh --arch $TARGET" &&
  step "cross build: sparkctl sparkd unit tests" in_root "$CONFIGURE && ninja -C $B -k 0 -j$JOBS sparkctl sparkd spark_unit_tests" &&
  step "aarch64 binaries start" in_root "set -e
      for b in $B/cli/sparkctl $B/daemon/sparkd $B/tests/spark_unit_tests; do
        echo \"\$b: \$(readelf -h \$b | sed -n 's/^ *Machine: *//p')\"
        readelf -h \$b | grep -q 'Machine: *AArch64'
      done
      qemu-aarch64-static $B/cli/sparkctl version
      qemu-aarch64-static $B/daemon/sparkd --help >/dev/null" &&
  step "unit tests (qemu-aarch64-static)" run_unit_tests || true   # set -e: the summary still comes
step "cross build: every other target" in_root "$CONFIGURE >/dev/null && ninja -C $B -k 0 -j$JOBS" || true

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
