#!/usr/bin/env bash
# Install and package: `cmake --install` into a DESTDIR puts the binaries, man pages and
# example cluster files where they belong and the installed sparkctl works; `cpack -G DEB`
# makes a .deb whose contents list the same files. Both ship the systemd units, pointed at
# the installed binaries, and the packaged units pass `systemd-analyze verify`.
# Usage: install_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: install_test.sh SRC_DIR BUILD_DIR}
BUILD=${2:?usage: install_test.sh SRC_DIR BUILD_DIR}
tmp=$(mktemp -d /tmp/sparkctl-install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail=0
err() { echo "install_test: FAIL: $*"; fail=1; }

# 1. cmake --install into a DESTDIR, prefix /usr as the package uses.
DESTDIR=$tmp/root cmake --install "$BUILD" --prefix /usr >"$tmp/install.log"
root=$tmp/root/usr
expect=(
  bin/sparkctl sbin/sparkd
  share/man/man1/sparkctl.1.gz share/man/man1/sparkctl-config.1.gz share/man/man5/sparkctl.env.5.gz
  share/doc/sparkctl/copyright share/doc/sparkctl/changelog.gz
  share/sparkctl/prometheus/sparkctl-alerts.yml share/sparkctl/prometheus/scrape-open.yml
  share/sparkctl/prometheus/scrape-auth.yml share/sparkctl/examples/sparkctl.cron
  share/sparkctl/examples/local.env share/sparkctl/examples/two-sparks.env
  share/sparkctl/examples/three-sparks.env share/sparkctl/examples/four-sparks.env
  share/sparkctl/bench/known-answers.jsonl
  lib/systemd/system/sparkctl-watch.service lib/systemd/system/sparkctl-watch.timer
  lib/systemd/system/sparkd@.service
  share/bash-completion/completions/sparkctl
)
for f in "${expect[@]}"; do [[ -f $root/$f ]] || err "cmake --install did not install $f"; done
for p in "$SRC"/man/*.[1-8]; do
  n=$(basename "$p"); [[ -f $root/share/man/man${n##*.}/$n.gz ]] || err "man page $n.gz not installed"
done
[[ -x $root/bin/sparkctl ]] || err "bin/sparkctl is not executable"
# The installed sparkctl finds its known-answer set (bin/../share/sparkctl/bench): with
# nothing listening it fails connecting (6), not for want of the set (4).
rc=0
env -i PATH=/usr/bin:/bin "$root/bin/sparkctl" bench --base http://127.0.0.1:9/v1 --no-memory \
  --sections known_answers >"$tmp/bench.txt" 2>&1 || rc=$?
((rc == 6)) || err "installed sparkctl bench exited $rc, not 6 (connection refused): $(cat "$tmp/bench.txt")"
# Installed units run the binaries of this prefix, not the sources' /usr/local default.
units=$root/lib/systemd/system
grep -qx 'ExecStart=/usr/bin/sparkctl watch --quiet' "$units/sparkctl-watch.service" 2>/dev/null ||
  err "installed sparkctl-watch.service does not run /usr/bin/sparkctl: $(grep ExecStart "$units/sparkctl-watch.service" 2>&1)"
grep -q '^ExecStart=/usr/sbin/sparkd ' "$units/sparkd@.service" 2>/dev/null ||
  err "installed sparkd@.service does not run /usr/sbin/sparkd: $(grep ExecStart "$units/sparkd@.service" 2>&1)"
# A system install's shared state root (the default STATE_DIR is /var/lib/sparkctl/RING_NAME):
# root's, and no other local user may create a ring's state directory there.
[[ $(stat -c %a "$tmp/root/var/lib/sparkctl" 2>/dev/null) == 755 ]] ||
  err "cmake --install --prefix /usr did not make /var/lib/sparkctl mode 0755 ($(stat -c %a "$tmp/root/var/lib/sparkctl" 2>&1))"
# The commented cluster file example (a conffile in the .deb) and the cron example.
[[ -f $tmp/root/etc/sparkctl/ring.env ]] || err "cmake --install --prefix /usr did not install /etc/sparkctl/ring.env"
grep -qv '^#' "$tmp/root/etc/sparkctl/ring.env" 2>/dev/null && err "/etc/sparkctl/ring.env is not all comments (it must describe no live ring)"
grep -q 'watch --quiet' "$root/share/sparkctl/examples/sparkctl.cron" 2>/dev/null || err "the cron example does not run watch --quiet"
grep -q '^Environment=SPARK_CONFIG=/etc/sparkctl/ring.env' "$units/sparkctl-watch.service" || err "the watch unit does not name /etc/sparkctl/ring.env"
# With cron's PATH (no sbin), the installed sparkctl finds the installed sparkd from its own
# prefix: preflight reports that sparkd's version.
if [[ -x $root/bin/sparkctl ]]; then
  env -i PATH=/usr/bin:/bin timeout 120 "$root/bin/sparkctl" --config "$root/share/sparkctl/examples/local.env" \
    --json preflight >"$tmp/preflight.json" 2>"$tmp/preflight.err" || true
  grep -q '"sparkd_version": "sparkd ' "$tmp/preflight.json" ||
    err "installed sparkctl (PATH=/usr/bin:/bin) did not find the installed sparkd: $(grep -o '"sparkd_version": "[^"]*"' "$tmp/preflight.json" | head -n 1) $(tail -n 3 "$tmp/preflight.err")"
fi
# The installed binary runs and validates the installed examples.
if [[ -x $root/bin/sparkctl ]]; then
  env -i PATH="$PATH" "$root/bin/sparkctl" --version >/dev/null || err "installed sparkctl --version failed"
  # Examples whose head (a `local` node) names an API key file: config check reads that
  # file as start would, so this machine gets one of its own (the environment overrides
  # the file's API_KEY_FILE); without one, config check must refuse, naming the file.
  printf 'k%.0s' {1..32} >"$tmp/api-key" && chmod 600 "$tmp/api-key"
  for e in "$root"/share/sparkctl/examples/*.env; do
    key=()
    grep -q '^API_KEY_FILE=' "$e" && key=(API_KEY_FILE="$tmp/api-key")
    env -i PATH="$PATH" "${key[@]}" "$root/bin/sparkctl" --config "$e" config check >/dev/null 2>"$tmp/err" ||
      err "installed sparkctl config check $(basename "$e"): $(cat "$tmp/err")"
    if ((${#key[@]})); then
      env -i PATH="$PATH" API_KEY_FILE="$tmp/no-such-key" "$root/bin/sparkctl" --config "$e" config check >/dev/null 2>"$tmp/err" &&
        grep -q '^NODE0_SSH=local' "$e" &&
        err "installed sparkctl config check $(basename "$e") accepted a missing API key file"
      grep -q "no-such-key" "$tmp/err" || ! grep -q '^NODE0_SSH=local' "$e" ||
        err "config check $(basename "$e") with a missing key file did not name it: $(cat "$tmp/err")"
    fi
  done
fi
# The installed completion completes against the installed sparkctl.
if [[ -x $root/bin/sparkctl ]]; then
  got=$(PATH=$root/bin:$PATH bash -c 'source "$1"; COMP_WORDS=(sparkctl wat); COMP_CWORD=1
    _sparkctl sparkctl wat sparkctl; echo "${COMPREPLY[*]}"' _ "$root/share/bash-completion/completions/sparkctl" 2>&1)
  [[ $got == watch ]] || err "the installed bash completion completes 'sparkctl wat' to '$got', not 'watch'"
fi
echo "install_test: cmake --install checked (${#expect[@]} files)"

# 2. cpack -G DEB, in its own directory so the build tree stays clean; under a umask of 002
# (Ubuntu's for users), which must not reach the control files' modes.
(umask 002 && cd "$tmp" && cpack -G DEB --config "$BUILD/CPackConfig.cmake" -B "$tmp/pkg" >"$tmp/cpack.log" 2>&1) ||
  { err "cpack failed:"; tail -n 20 "$tmp/cpack.log"; exit 1; }
deb=$(ls "$tmp"/pkg/*.deb 2>/dev/null | head -n 1)
[[ -n $deb ]] || { err "cpack made no .deb"; exit 1; }
dpkg-deb -c "$deb" | awk '{print $NF}' >"$tmp/contents"
for f in "${expect[@]}"; do grep -qx "./usr/$f" "$tmp/contents" || err "$(basename "$deb") lacks /usr/$f"; done
dpkg-deb -c "$deb" | grep -q '^drwxr-xr-x root/root .* \./var/lib/sparkctl/$' ||
  err "$(basename "$deb") lacks /var/lib/sparkctl/ mode 0755 root/root: $(dpkg-deb -c "$deb" | grep 'var/lib/sparkctl/$')"
# The control files' modes are dpkg's, whatever the checkout's or the umask: conffiles 0644,
# the maintainer scripts 0755.
dpkg-deb --ctrl-tarfile "$deb" | tar -tvf - >"$tmp/control"
for f in conffiles:-rw-r--r-- md5sums:-rw-r--r-- control:-rw-r--r-- postinst:-rwxr-xr-x postrm:-rwxr-xr-x; do
  grep -q "^${f#*:} .* \./${f%%:*}$" "$tmp/control" ||
    err "control file ${f%%:*} is not ${f#*:}: $(grep "\./${f%%:*}$" "$tmp/control" || echo missing)"
done
# postinst gives the state root to the group sparkctl (2775); the package reloads systemd on
# install and removal.
dpkg-deb -I "$deb" postinst 2>/dev/null | grep -q 'groupadd --system sparkctl' || err "postinst does not make the group sparkctl"
dpkg-deb -I "$deb" postinst 2>/dev/null | grep -q 'chmod 2775 /var/lib/sparkctl' || err "postinst does not set /var/lib/sparkctl 2775"
for sc in postinst postrm; do
  dpkg-deb -I "$deb" $sc 2>/dev/null | grep -q 'systemctl --system daemon-reload' || err "$sc does not reload systemd"
done
grep -qx './etc/sparkctl/ring.env' "$tmp/contents" || err "$(basename "$deb") lacks /etc/sparkctl/ring.env"
dpkg-deb -I "$deb" conffiles 2>/dev/null | grep -qx '/etc/sparkctl/ring.env' || err "/etc/sparkctl/ring.env is not a conffile of the .deb"
# The packaged units verify once unpacked, with their paths pointing into the unpacked tree.
if command -v systemd-analyze >/dev/null; then
  dpkg-deb -x "$deb" "$tmp/deb"
  mkdir -p "$tmp/verify"
  for u in sparkctl-watch.service sparkctl-watch.timer sparkd@.service; do
    [[ -f $tmp/deb/usr/lib/systemd/system/$u ]] || continue
    sed -e "s|/usr/bin/|$tmp/deb/usr/bin/|g" -e "s|/usr/sbin/|$tmp/deb/usr/sbin/|g" \
      "$tmp/deb/usr/lib/systemd/system/$u" >"$tmp/verify/$u"
  done
  cp "$tmp/verify/sparkd@.service" "$tmp/verify/sparkd@1.service" 2>/dev/null || true
  for u in sparkctl-watch.service sparkctl-watch.timer sparkd@1.service; do
    [[ -f $tmp/verify/$u ]] || continue
    out=$(cd "$tmp/verify" && SYSTEMD_LOG_LEVEL=warning systemd-analyze verify --man=no "$tmp/verify/$u" 2>&1 || echo "verify exited $?")
    out=$(grep -F "$u" <<<"$out" || true)
    [[ -z $out ]] || err "packaged unit $u does not verify: $out"
  done
  echo "install_test: packaged systemd units verified"
else
  echo "install_test: systemd-analyze is not installed; packaged units not verified"
fi
[[ $(dpkg-deb -f "$deb" Package) == sparkctl ]] || err "package name is not sparkctl"
depends=$(dpkg-deb -f "$deb" Depends)
grep -q "libc6" <<<"$depends" || err "Depends was not filled in by dpkg-shlibdeps: '$depends'"
grep -q "passwd" <<<"$depends" || err "Depends lacks passwd (postinst's groupadd): '$depends'"
echo "install_test: $(basename "$deb"): $(wc -l <"$tmp/contents") entries, Depends: $depends"

((fail == 0)) && echo "install_test: OK"
exit $fail
