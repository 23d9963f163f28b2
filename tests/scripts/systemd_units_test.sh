#!/usr/bin/env bash
# The shipped systemd units (packaging/systemd/) pass `systemd-analyze verify` once their
# binary paths point at this build, and the timer starts the watch service. A unit with a
# typo in a directive, a wrong section or a missing binary fails here.
# Usage: systemd_units_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: systemd_units_test.sh SRC_DIR BUILD_DIR}
BUILD=${2:?usage: systemd_units_test.sh SRC_DIR BUILD_DIR}
command -v systemd-analyze >/dev/null || { echo "SKIP: systemd-analyze is not installed"; exit 77; }
units=(sparkctl-watch.service sparkctl-watch.timer sparkd@.service)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for u in "${units[@]}"; do
  [[ -f $SRC/packaging/systemd/$u ]] || { echo "FAIL: packaging/systemd/$u is missing"; exit 1; }
  sed -e "s|/usr/local/bin/sparkctl|$BUILD/cli/sparkctl|g" \
      -e "s|/usr/local/sbin/sparkd|$BUILD/daemon/sparkd|g" "$SRC/packaging/systemd/$u" >"$tmp/$u"
done
# The instance of the template that a rank uses.
cp "$tmp/sparkd@.service" "$tmp/sparkd@1.service"
fail=0
for u in sparkctl-watch.service sparkctl-watch.timer sparkd@1.service; do
  # verify prints problems on stderr; ignore only the notes about the host's own units.
  out=$(cd "$tmp" && SYSTEMD_LOG_LEVEL=warning systemd-analyze verify --man=no "$tmp/$u" 2>&1 || echo "verify exited $?")
  out=$(grep -F "$u" <<<"$out" || true)
  if [[ -n $out ]]; then echo "FAIL: $u: $out"; fail=1; else echo "ok: $u"; fi
done
grep -q '^Unit=sparkctl-watch.service$' "$tmp/sparkctl-watch.timer" || { echo "FAIL: the timer does not start sparkctl-watch.service"; fail=1; }
grep -Eq '^ExecStart=.* watch( --quiet)?$' "$tmp/sparkctl-watch.service" || { echo "FAIL: the service does not run sparkctl watch"; fail=1; }
grep -q '^Restart=no$' "$tmp/sparkd@1.service" || { echo "FAIL: sparkd@ must not restart one rank alone"; fail=1; }
exit $fail
