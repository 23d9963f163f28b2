#!/usr/bin/env bash
# The fresh-machine tier: a new Debian root made with debootstrap (default: Debian 13
# "trixie", minbase), and in it what a new user runs, from this checkout:
#   1. scripts/install-deps.sh --demo       the demo set only
#   2. scripts/demo.sh                      build sparkctl + sparkd, run the one-node demo
#   3. scripts/install-deps.sh              the test set on top
#   4. the unit tests                       same build dir with SPARK_TESTS=ON
# It prints each step's time and ends with "N passed, N failed". It takes minutes (a cold
# build with the release's compiler), so it is not part of scripts/test.sh.
#
# Usage: scripts/distro-test.sh [--suite SUITE] [--keep]    (as root; needs debootstrap)
#   --suite   a Debian suite debootstrap knows (trixie, bookworm, sid; default trixie)
#   --keep    leave the root in place afterwards (its path is printed)
# Environment: SPARK_DISTRO_MIRROR (default http://deb.debian.org/debian),
#   SPARK_DISTRO_CACHE (default /var/cache/sparkctl/distro-test): the debootstrap tarball
#   per suite (made once, reused) and a ccache per suite, so a rerun is quicker.
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SUITE=trixie KEEP=0
while (($#)); do
  case "$1" in
    --suite) SUITE=${2:?--suite needs a name}; shift ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "distro-test: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
MIRROR=${SPARK_DISTRO_MIRROR:-http://deb.debian.org/debian}
CACHE=${SPARK_DISTRO_CACHE:-/var/cache/sparkctl/distro-test}
ARCH=$(dpkg --print-architecture)

((EUID == 0)) || { echo "distro-test: needs root (debootstrap, chroot, mounts)" >&2; exit 1; }
command -v debootstrap >/dev/null ||
  { echo "distro-test: debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

mkdir -p "$CACHE/roots" "$CACHE/ccache-$SUITE"
TARBALL=$CACHE/$SUITE-$ARCH-minbase.tgz
ROOT=$(mktemp -d "$CACHE/roots/$SUITE.XXXXXX")
mounted=()

cleanup() {
  local m
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
  if ((KEEP)); then
    echo "distro-test: root kept at $ROOT (chroot $ROOT bash)"
    return
  fi
  # Never delete through a mount that is still there (the bind of /dev above all).
  if m=$(findmnt -rn -o TARGET | grep -F "$ROOT/"); then
    echo "distro-test: still mounted under $ROOT, not removing it: $m" >&2
    return
  fi
  rm -rf --one-file-system "$ROOT"
}
trap cleanup EXIT

declare -a names=() secs=() results=()
# step NAME CMD...: runs CMD, records its time and result.
step() {
  local name=$1 t0=$SECONDS rc=0
  shift
  echo
  echo "=== distro-test $SUITE: $name"
  "$@" || rc=$?
  names+=("$name"); secs+=($((SECONDS - t0))); results+=("$rc")
  echo "=== distro-test $SUITE: $name: $( ((rc == 0)) && echo ok || echo "FAILED (exit $rc)") ($((SECONDS - t0)) s)"
  return $rc
}

make_root() {
  if [[ ! -s $TARBALL ]]; then
    echo "distro-test: downloading $SUITE ($ARCH, minbase) from $MIRROR into $TARBALL"
    local tmp
    tmp=$(mktemp -d "$CACHE/roots/tarball.XXXXXX")
    debootstrap --variant=minbase --make-tarball="$TARBALL.part" "$SUITE" "$tmp" "$MIRROR"
    rm -rf --one-file-system "$tmp"
    mv "$TARBALL.part" "$TARBALL"
  fi
  debootstrap --variant=minbase --unpack-tarball="$TARBALL" "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 ||
    { tail -n 30 "$ROOT.log"; rm -f "$ROOT.log"; return 1; }
  rm -f "$ROOT.log"
  # No service starts inside the root (openssh-server, prometheus): they would listen on
  # this machine's network.
  printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
  chmod 755 "$ROOT/usr/sbin/policy-rc.d"
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
  echo "root: $ROOT ($(. "$ROOT/etc/os-release" && echo "$PRETTY_NAME"))"
}

mount_root() {
  local m
  mount -t proc proc "$ROOT/proc" && mounted+=("$ROOT/proc")
  mount -t sysfs sysfs "$ROOT/sys" && mounted+=("$ROOT/sys")
  for m in /dev /dev/pts; do
    mkdir -p "$ROOT$m"
    mount --bind "$m" "$ROOT$m" && mounted+=("$ROOT$m")
  done
  mkdir -p "$ROOT/root/.cache/ccache"
  mount --bind "$CACHE/ccache-$SUITE" "$ROOT/root/.cache/ccache" && mounted+=("$ROOT/root/.cache/ccache")
}

# The checkout's files as git sees them (tracked and new, not ignored): no build trees.
copy_source() {
  mkdir -p "$ROOT/src/sparkctl"
  if git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1; then
    (cd "$SRC" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$ROOT/src/sparkctl"
  else
    tar -C "$SRC" --exclude='./build*' -cf - . | tar -xf - -C "$ROOT/src/sparkctl"
  fi
}

# in_root CMD: runs a bash command line in the root, in the source tree, as a login would.
in_root() {
  chroot "$ROOT" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 bash -c "cd /src/sparkctl && $1"
}

t_start=$SECONDS
step "debootstrap $SUITE" make_root
mount_root
copy_source
# The demo waits longer than its default: a cold start on a loaded machine.
step "install-deps --demo" in_root 'bash scripts/install-deps.sh --demo' &&
  step "demo.sh" in_root 'SPARK_DEMO_WAIT=180 bash scripts/demo.sh' &&
  step "install-deps (test set)" in_root 'bash scripts/install-deps.sh' &&
  step "build unit tests" in_root 'cmake -S . -B build -DSPARK_TESTS=ON >/dev/null && ninja -C build spark_unit_tests' &&
  step "unit tests" in_root 'build/tests/spark_unit_tests' || true

echo
echo "=== distro-test $SUITE ($ARCH): $(. "$ROOT/etc/os-release" && echo "$PRETTY_NAME")"
passed=0 failed=0
for i in "${!names[@]}"; do
  printf '  %-28s %6s s  %s\n' "${names[$i]}" "${secs[$i]}" "$( ((results[i] == 0)) && echo ok || echo FAILED)"
  ((results[i] == 0)) && passed=$((passed + 1)) || failed=$((failed + 1))
done
echo "=== total $((SECONDS - t_start)) s"
((passed + failed == 6)) || failed=$((failed + 6 - passed - failed))
echo "$passed passed, $failed failed"
((failed == 0))
