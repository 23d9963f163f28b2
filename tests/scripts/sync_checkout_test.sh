#!/usr/bin/env bash
# scripts/lib/sync-checkout.sh (how distro-test.sh and cross-arm64.sh copy the checkout into
# their kept roots): an edited file whose mtime is older than an object built from the last
# copy still comes out newer than that object, so make rebuilds it; an unchanged file keeps
# its mtime (no needless rebuild); deleted and ignored files are not there; the root's own
# build tree stays. Both with rsync and without.
# Usage: sync_checkout_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: sync_checkout_test.sh SRC_DIR BUILD_DIR}
. "$SRC/scripts/lib/sync-checkout.sh"
command -v git >/dev/null || { echo "sync_checkout_test: SKIP: no git"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
bad() { echo "sync_checkout_test: FAIL ($mode): $*"; fail=1; }

run() {
  mode=$1
  local co=$tmp/$mode/checkout dest=$tmp/$mode/root/src
  mkdir -p "$co" "$tmp/$mode/root"
  git -C "$co" init -q
  printf 'int f(int);\n' >"$co/api.h"
  printf 'int f(int a) { return a; }\n' >"$co/api.cc"
  printf 'gone\n' >"$co/old.cc"
  printf 'build*/\n*.log\n' >"$co/.gitignore"
  git -C "$co" add -A
  touch -d '2020-01-01 00:00:00' "$co/api.h" "$co/api.cc" "$co/old.cc"
  sync_checkout "$co" "$dest" "$tmp/$mode/root" >/dev/null
  # That copy was made long ago, and a build in the root after it: its objects are newer
  # than every source there.
  find "$dest" -type f -exec touch -d '2020-01-01 00:00:00' {} +
  mkdir -p "$dest/build"
  printf 'obj\n' >"$dest/build/api.o"
  touch -d '2021-01-01 00:00:00' "$dest/build/api.o"
  # In the checkout: api.h changes, stamped before that build (an edit made while an
  # earlier copy built, a branch switch); old.cc goes; an untracked file and an ignored one.
  printf 'int f(int, int);\n' >"$co/api.h"
  touch -d '2020-06-01 00:00:00' "$co/api.h"
  rm "$co/old.cc"
  printf 'new\n' >"$co/new.cc"
  printf 'noise\n' >"$co/run.log"
  sync_checkout "$co" "$dest" "$tmp/$mode/root" >/dev/null

  [[ $(cat "$dest/api.h") == 'int f(int, int);' ]] || bad "api.h has the old content"
  [[ $dest/api.h -nt $dest/build/api.o ]] ||
    bad "the edited api.h ($(stat -c %y "$dest/api.h")) is not newer than the object built before it ($(stat -c %y "$dest/build/api.o")): the object would count as up to date"
  [[ -e $dest/old.cc ]] && bad "old.cc, deleted in the checkout, is still there"
  [[ -e $dest/new.cc ]] || bad "new.cc (untracked, not ignored) was not copied"
  [[ -e $dest/run.log ]] && bad "run.log (ignored) was copied"
  [[ -e $dest/build/api.o ]] || bad "the root's build tree was removed"
  ls "$tmp/$mode/root" | grep -q '^sync\.' && bad "the staging copy was left behind"
  if [[ $mode == rsync ]]; then
    [[ $(stat -c %Y "$dest/api.cc") == $(date -d '2020-01-01 00:00:00' +%s) ]] ||
      bad "api.cc did not change but its mtime did ($(stat -c %y "$dest/api.cc")): it would be rebuilt"
  fi
  return 0
}

if command -v rsync >/dev/null; then
  run rsync
else
  echo "sync_checkout_test: no rsync here: only the fallback is checked"
fi
SPARK_SYNC_NO_RSYNC=1 run no-rsync
((fail == 0)) && echo "sync_checkout_test: ok"
exit $fail
