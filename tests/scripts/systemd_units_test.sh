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
# sparkd tells systemd when it is ready (sd_notify), and runs as the package's user, sandboxed
# without losing the GPUs and RDMA devices (no device list) or locked memory.
for want in 'Type=notify' 'NotifyAccess=main' 'User=sparkctl' 'ProtectSystem=strict' \
  'ReadWritePaths=/var/lib/sparkctl' 'NoNewPrivileges=yes' 'PrivateTmp=yes' 'LimitMEMLOCK=infinity'; do
  grep -qx "$want" "$tmp/sparkd@1.service" || { echo "FAIL: sparkd@ lacks $want"; fail=1; }
done
for u in sparkd@1.service sparkctl-watch.service; do
  for bad in PrivateDevices DeviceAllow ProtectClock MemoryDenyWriteExecute SystemCallFilter; do
    grep -q "^$bad=" "$tmp/$u" && { echo "FAIL: $u sets $bad= (it would cut the GPUs off)"; fail=1; }
  done
  grep -qx 'NoNewPrivileges=yes' "$tmp/$u" || { echo "FAIL: $u is not sandboxed (NoNewPrivileges)"; fail=1; }
done
# The exposure systemd-analyze gives the units (offline: systemd 250 and later): no worse than
# the figures the units' comments state.
if systemd-analyze security --help 2>/dev/null | grep -q -- '--offline'; then
  for pair in 'sparkd@1.service 3.8' 'sparkctl-watch.service 6.7'; do
    set -- $pair
    score=$(cd "$tmp" && SYSTEMD_LOG_LEVEL=err systemd-analyze security --offline=true --no-pager "$tmp/$1" 2>&1 |
      sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
    if [[ -z $score ]]; then echo "FAIL: systemd-analyze security gave no figure for $1"; fail=1
    elif awk -v s="$score" -v m="$2" 'BEGIN{exit !(s > m)}'; then echo "FAIL: $1 exposure $score, above $2"; fail=1
    else echo "ok: $1 exposure $score (at most $2)"; fi
  done
else
  echo "note: systemd-analyze security has no --offline here; exposure not measured"
fi
exit $fail
