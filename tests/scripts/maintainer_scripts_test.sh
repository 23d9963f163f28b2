#!/usr/bin/env bash
# The package's maintainer scripts (packaging/debian/postinst, postrm) reload systemd when it
# runs (daemon-reload after install, upgrade and removal) and not when it does not, and
# postinst creates the group and the system user sparkd@.service runs as only when missing.
# They run in a user and mount namespace whose /run is a fresh tmpfs (so /run/systemd/system
# is there or not as the case needs), with recording stand-ins for systemctl and the account
# tools first on PATH (test doubles: nothing on the host is changed).
# Usage: maintainer_scripts_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: maintainer_scripts_test.sh SRC_DIR BUILD_DIR}
if ! unshare --user --map-root-user --mount true 2>/dev/null; then
  echo "maintainer_scripts_test: SKIP: user namespaces are not available here"
  exit 77
fi
tmp=$(mktemp -d /tmp/sparkctl-maint.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail=0
err() { echo "maintainer_scripts_test: FAIL: $*"; fail=1; }

# Recording test doubles: each appends its name and arguments to $CALLS. getent knows the
# groups and users listed in $KNOWN ("group:NAME passwd:NAME").
mkdir -p "$tmp/doubles"
for t in systemctl groupadd useradd usermod chgrp chmod; do
  printf '#!/bin/sh\necho "%s $*" >>"$CALLS"\n' "$t" >"$tmp/doubles/$t"
done
cat >"$tmp/doubles/getent" <<'SH'
#!/bin/sh
case " $KNOWN " in *" $1:$2 "*) echo "$2:x:1:"; exit 0 ;; esac
exit 2
SH
chmod +x "$tmp/doubles/"*

# run SCRIPT ARG SYSTEMD(yes|no) KNOWN: the calls it made, one a line.
run() {
  local calls="$tmp/calls.$RANDOM"
  : >"$calls"
  CALLS=$calls KNOWN=$4 PATH="$tmp/doubles:$PATH" unshare --user --map-root-user --mount sh -c '
    mount -t tmpfs none /run
    [ "$1" = yes ] && mkdir -p /run/systemd/system
    sh "$2" "$3"' run "$3" "$SRC/packaging/debian/$1" "$2" || { err "$1 $2 exited $?"; }
  cat "$calls"
}

out=$(run postinst configure yes "")
grep -qx 'systemctl --system daemon-reload' <<<"$out" || err "postinst configure does not reload systemd: $out"
grep -qx 'groupadd --system sparkctl' <<<"$out" || err "postinst does not create group sparkctl: $out"
grep -q '^useradd --system --gid sparkctl .* sparkctl$' <<<"$out" || err "postinst does not create user sparkctl: $out"
grep -q '^usermod' <<<"$out" && err "postinst adds sparkctl to groups that do not exist: $out"
grep -qx 'chmod 2775 /var/lib/sparkctl' <<<"$out" || err "postinst does not set /var/lib/sparkctl 2775: $out"

out=$(run postinst configure yes "group:sparkctl passwd:sparkctl group:video group:render")
grep -q '^groupadd\|^useradd' <<<"$out" && err "postinst recreates an existing group or user: $out"
grep -qx 'usermod --append --groups video sparkctl' <<<"$out" || err "postinst does not add sparkctl to video: $out"
grep -qx 'usermod --append --groups render sparkctl' <<<"$out" || err "postinst does not add sparkctl to render: $out"

out=$(run postinst configure no "group:sparkctl passwd:sparkctl")
grep -q '^systemctl' <<<"$out" && err "postinst calls systemctl on a host without systemd: $out"

for arg in remove purge; do
  out=$(run postrm "$arg" yes "")
  grep -qx 'systemctl --system daemon-reload' <<<"$out" || err "postrm $arg does not reload systemd: $out"
  out=$(run postrm "$arg" no "")
  grep -q '^systemctl' <<<"$out" && err "postrm $arg calls systemctl on a host without systemd: $out"
done
((fail == 0)) && echo "maintainer_scripts_test: ok"
exit $fail
