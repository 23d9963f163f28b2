#!/usr/bin/env bash
# The fresh-machine tier: a new Debian root made with debootstrap (default: Debian 13
# "trixie", minbase), and in it what a new user runs, from this checkout:
#   1. scripts/install-deps.sh --demo       the demo set only
#   2. scripts/demo.sh                      build sparkctl + sparkd, run the one-node demo
#   3. scripts/install-deps.sh              the test set on top
#   4. the unit tests                       same build dir with SPARK_TESTS=ON
# It prints each step's time and ends with "N passed, N failed". It takes tens of minutes
# cold (a build with the release's compiler on a small machine), so it is not part of
# scripts/test.sh. Its last results are in docs/DEVELOPING.md ("Other distributions and
# arm64").
#
# Usage: scripts/distro-test.sh [--suite SUITE] [--resume] [--keep]   (as root)
#   --suite   a Debian suite debootstrap knows (trixie, bookworm, sid; default trixie)
#   --resume  go on in the root an earlier run left (a failed run keeps it): the package
#             steps that passed with the same install-deps.sh are not repeated; the demo,
#             the build (incremental) and the tests run again on the checkout as it is now
#   --keep    leave the root in place after a run that passed, too (its path is printed)
# Needs: root (debootstrap, chroot, mounts), debootstrap, a Debian mirror (HTTP), about
#   3 GB under the cache; rsync for an incremental rebuild on --resume.
# Environment: SPARK_DISTRO_MIRROR (default http://deb.debian.org/debian),
#   SPARK_DISTRO_CACHE (default /var/cache/sparkctl/distro-test): per suite the debootstrap
#   tarball (made once), the .debs apt downloaded and a ccache, so a rerun downloads and
#   compiles little; the root itself under roots/distro-SUITE.
#   SPARK_JOBS: parallel build jobs (default: ninja's).
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$SRC/scripts/lib/sync-checkout.sh"
SUITE=trixie KEEP=0 RESUME=0
while (($#)); do
  case "$1" in
    --suite) SUITE=${2:?--suite needs a name}; shift ;;
    --keep) KEEP=1 ;;
    --resume) RESUME=1 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "distro-test: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
MIRROR=${SPARK_DISTRO_MIRROR:-http://deb.debian.org/debian}
CACHE=${SPARK_DISTRO_CACHE:-/var/cache/sparkctl/distro-test}
ARCH=$(dpkg --print-architecture)

((EUID == 0)) || { echo "distro-test: needs root (debootstrap, chroot, mounts): run it with sudo" >&2; exit 1; }
command -v debootstrap >/dev/null ||
  { echo "distro-test: debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

mkdir -p "$CACHE/roots" "$CACHE/ccache-$SUITE" "$CACHE/apt-$SUITE/partial"
TARBALL=$CACHE/$SUITE-$ARCH-minbase.tgz
ROOT=$CACHE/roots/distro-$SUITE
mounted=()
passed_all=0

# still_mounted: what is mounted under the root (nothing may be deleted through a mount,
# the bind of /dev above all).
still_mounted() { findmnt -rn -o TARGET | grep -F "$ROOT/"; }

cleanup() {
  local m
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
  if ((KEEP)) || ! ((passed_all)); then
    echo "distro-test: root kept at $ROOT (chroot $ROOT bash;" \
      "$(basename "$0") --resume goes on from there)"
    return
  fi
  if m=$(still_mounted); then
    echo "distro-test: still mounted under $ROOT, not removing it: $m" >&2
    return
  fi
  rm -rf --one-file-system "$ROOT"
}
trap cleanup EXIT

if [[ -e $ROOT ]] && m=$(still_mounted); then
  echo "distro-test: $ROOT is in use (mounted: $m): another run of this suite?" \
    "Unmount it (umount -l) if not" >&2
  trap - EXIT
  exit 1
fi
if ((RESUME)) && [[ ! -f $ROOT/.sparkctl-root-ok ]]; then
  echo "distro-test: nothing to resume under $ROOT: starting fresh"
  RESUME=0
fi
if ! ((RESUME)); then
  rm -rf --one-file-system "$ROOT"
fi

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

# once STAMP CMD...: CMD unless it passed in this root before with the same install-deps.sh
# (what the package steps depend on); --resume relies on it.
once() {
  local stamp=$ROOT/.sparkctl-done-$1 key
  shift
  key=$(sha256sum "$SRC/scripts/install-deps.sh" | cut -d' ' -f1)
  if [[ -f $stamp && $(cat "$stamp") == "$key" ]]; then
    echo "(passed in this root before, with this install-deps.sh: not repeated)"
    return 0
  fi
  rm -f "$stamp"
  "$@" && echo "$key" >"$stamp"
}

make_root() {
  if [[ -f $ROOT/.sparkctl-root-ok ]]; then
    echo "root: $ROOT (left by an earlier run: --resume)"
    return 0
  fi
  rm -rf --one-file-system "$ROOT"
  mkdir -p "$ROOT"
  # A machine's / is 0755. A 0700 root (mktemp -d makes one) lets no other user resolve any
  # path: the tests that drop to the user nobody then see nothing at all.
  chmod 0755 "$ROOT"
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
  mount --bind "$CACHE/ccache-$SUITE" "$ROOT/root/.cache/ccache" && mounted+=("$ROOT/root/.cache/ccache")
  # apt keeps what it downloads: the next fresh root installs from here.
  mount --bind "$CACHE/apt-$SUITE" "$ROOT/var/cache/apt/archives" && mounted+=("$ROOT/var/cache/apt/archives")
}

# The checkout, synced into the root by content (a resumed root's build trees rebuild what
# changed and only that: scripts/lib/sync-checkout.sh).
copy_source() { sync_checkout "$SRC" "$ROOT/src/sparkctl" "$CACHE/roots"; }

# in_root CMD: runs a bash command line in the root, in the source tree, as a login would.
in_root() {
  chroot "$ROOT" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 SPARK_JOBS="${SPARK_JOBS:-}" bash -c "cd /src/sparkctl && $1"
}

t_start=$SECONDS
step "debootstrap $SUITE" make_root
mount_root
copy_source
# The demo waits longer than its default: a cold start on a loaded machine.
step "install-deps --demo" once demo in_root 'bash scripts/install-deps.sh --demo' &&
  step "demo.sh" in_root 'SPARK_DEMO_WAIT=180 bash scripts/demo.sh' &&
  step "install-deps (test set)" once test in_root 'bash scripts/install-deps.sh' &&
  step "build unit tests" in_root 'cmake -S . -B build -DSPARK_TESTS=ON >/dev/null &&
    ninja -C build ${SPARK_JOBS:+-j$SPARK_JOBS} spark_unit_tests' &&
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
((failed == 0)) && passed_all=1
((failed == 0))
