#!/usr/bin/env bash
# The daily commands from an installed copy, not the build tree: `cmake --install` into a
# DESTDIR (prefix /usr, as the .deb), then, with cron's environment (env -i, PATH=/usr/bin:/bin,
# HOME, LOGNAME, SHELL=/bin/sh, working directory HOME), on a one-node ring of the demo model
# (native engine on the CPU): start, status, watch --quiet (silent while healthy), kill -9 of
# the rank, watch --quiet heals it, status, stop (nothing left) — as root and as an
# unprivileged user (nobody); then a ring that the user started is found healthy by root's
# watch through the shared STATE_DIR, healed and restarted by root as the user's (its ranks
# and every file in its state), and restarted and stopped by the user after that. The
# installed sparkctl finds the installed sparkd from its own prefix (no sbin on PATH), and
# preflight's sw.sparkd passes for it.
# Without root, the user half runs as the current user and the root half is skipped (said).
# Usage: installed_ring_test.sh SRC_DIR BUILD_DIR
set -uo pipefail
SRC=${1:?usage: installed_ring_test.sh SRC_DIR BUILD_DIR}
BUILD=${2:?usage: installed_ring_test.sh SRC_DIR BUILD_DIR}
for b in cli/sparkctl daemon/sparkd; do
  [[ -x $BUILD/$b ]] || { echo "installed_ring_test: SKIP: $BUILD/$b is not built"; exit 77; }
done
t0=$SECONDS
tmp=$(mktemp -d /tmp/sparkctl-installed.XXXXXX)
chmod 755 "$tmp"
ring=$tmp/ring.env
state=$tmp/state-root/none
cleanup() {
  # Whatever a failed step left running: stop it as its owner would.
  for who in root nobody "$(id -un)"; do
    [[ -f $tmp/started-by-$who ]] && as "$who" sparkctl --config "$ring" stop --lock-wait 5s >/dev/null 2>&1
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail=0
err() { echo "installed_ring_test: FAIL: $*"; fail=1; }

DESTDIR=$tmp/root cmake --install "$BUILD" --prefix /usr >"$tmp/install.log" 2>&1 ||
  { err "cmake --install failed: $(tail -n 5 "$tmp/install.log")"; exit 1; }
bindir=$tmp/root/usr/bin
[[ -x $tmp/root/usr/sbin/sparkd ]] || { err "sparkd not installed to sbin"; exit 1; }
# Shared state, as /var/lib/sparkctl of a system install (writable by root and the ring's
# users: the package's group sparkctl; here sticky and world-writable, standing in for it).
mkdir -p "$tmp/state-root" "$tmp/home-nobody"
chmod 1777 "$tmp/state-root"
chmod 777 "$tmp/home-nobody"

# as WHO CMD ARGS...: CMD from the installed bin/ with cron's environment, as WHO.
me=$(id -un)
as() {
  local who=$1 cmd=$2 home
  shift 2
  if [[ $who == root ]]; then home=/root; else home=$tmp/home-nobody; fi
  [[ $who == "$me" || $(id -u) != 0 ]] && home=${HOME:-/tmp}
  # STATE_DIR per part (the environment overrides the cluster file): a ring healed by
  # root holds root's files, which another user's later start could not replace.
  local -a run=(env -i PATH=/usr/bin:/bin HOME="$home" LOGNAME="$who" USER="$who" SHELL=/bin/sh
    STATE_DIR="$state")
  if [[ $who != "$me" && $(id -u) == 0 ]]; then
    run=(setpriv --reuid="$who" --regid="$(id -g "$who")" --clear-groups "${run[@]}")
  fi
  (cd "$home" 2>/dev/null || cd /; timeout 180 "${run[@]}" "$bindir/$cmd" "$@")
}

as "$me" sparkctl demo-model "$tmp/model" >"$tmp/demo.log" 2>&1 || { err "demo-model: $(cat "$tmp/demo.log")"; exit 1; }
chmod -R a+rX "$tmp/model"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cat >"$ring" <<CFG
RING_NAME=installed
MODEL_PATH=$tmp/model
MODEL=demo
API_BIND=127.0.0.1
API_PORT=$(port)
RDZV_PORT=$(port)
SLOTS=2
CONTEXT_LEN=256
MEM_FREE_MIN=1MiB
MEM_AVAILABLE_MIN=1MiB
MEM_RESERVE=0
MEM_GUARD_WAIT=0
MEM_GUARD_CANCEL=0
START_CHECKS=port.free,sw.sparkd,model.files
READY_TIMEOUT=120s
STOP_GRACE=10s
WATCH_GRACE=0s
WATCH_FAILURES=1
WATCH_BACKOFF=0s
PROBE_PROMPT=a
NODE0_NAME=local
NODE0_SSH=local
NODE0_FABRIC_IP=127.0.0.1
CFG
chmod 644 "$ring"

# One user's day: start, status, a silent watch, a killed rank healed by watch, stop.
day() {
  local who=$1 out
  state=$tmp/state-root/$who
  out=$(as "$who" sparkctl --config "$ring" start 2>&1) || { err "$who: start: $out"; return; }
  touch "$tmp/started-by-$who"
  grep -q "READY: model demo" <<<"$out" || err "$who: start did not say READY: $out"
  grep -q "^sw.sparkd\|sw.sparkd" <<<"$(as "$who" sparkctl --config "$ring" preflight --only sw.sparkd 2>&1)" ||
    err "$who: preflight sw.sparkd did not run"
  out=$(as "$who" sparkctl --config "$ring" status 2>&1) || err "$who: status of a READY ring exited $?: $out"
  out=$(as "$who" sparkctl --config "$ring" watch --quiet 2>&1)
  rc=$?
  ((rc == 0)) || err "$who: watch --quiet on a healthy ring exited $rc: $out"
  [[ -z $out ]] || err "$who: watch --quiet printed on a healthy ring: $out"
  pid=$(cat "$state/run/sparkd-0.pid" 2>/dev/null)
  [[ -n $pid ]] || { err "$who: no pidfile for rank 0"; return; }
  [[ $(stat -c %U "/proc/$pid") == "$who" || $(id -u) != 0 ]] || err "$who: rank 0 (pid $pid) runs as $(stat -c %U "/proc/$pid")"
  kill -9 "$pid"
  out=$(as "$who" sparkctl --config "$ring" watch --quiet 2>&1)
  grep -qi "restart" <<<"$out" || err "$who: watch --quiet after kill -9 of rank 0 did not restart it: $out"
  out=$(as "$who" sparkctl --config "$ring" status 2>&1) || err "$who: status after the heal exited $?: $out"
  # The first healthy check after the heal is news (the heal held); the next is silent.
  out=$(as "$who" sparkctl --config "$ring" watch --quiet 2>&1)
  grep -q "watch: healthy" <<<"$out" || err "$who: watch --quiet after the heal did not confirm it: $out"
  out=$(as "$who" sparkctl --config "$ring" watch --quiet 2>&1)
  [[ -z $out ]] || err "$who: watch --quiet printed twice after the heal: $out"
  newpid=$(cat "$state/run/sparkd-0.pid" 2>/dev/null)
  [[ -n $newpid && $newpid != "$pid" ]] && kill -0 "$newpid" 2>/dev/null ||
    err "$who: no new rank 0 after the heal (old pid $pid, now '$newpid')"
  out=$(as "$who" sparkctl --config "$ring" stop 2>&1) || err "$who: stop: $out"
  grep -q "nothing of the ring is left on any node" <<<"$out" || err "$who: stop left something: $out"
  rm -f "$tmp/started-by-$who"
  # (A zombie waiting for a reaping init is not running.)
  [[ -e /proc/$newpid && $(awk '{print $3}' "/proc/$newpid/stat" 2>/dev/null) != Z ]] &&
    err "$who: sparkd pid $newpid still runs after stop"
  echo "installed_ring_test: $who: start, status, watch (healthy, heal), stop: ok"
}

if [[ $(id -u) == 0 ]]; then
  day root
  day nobody
  # The ring a user started, seen by root's timer through the shared state directory.
  state=$tmp/state-root/shared
  out=$(as nobody sparkctl --config "$ring" start 2>&1) || err "nobody: start: $out"
  touch "$tmp/started-by-nobody"
  out=$(as root sparkctl --config "$ring" watch --quiet 2>&1)
  rc=$?
  ((rc == 0)) && [[ -z $out ]] || err "root's watch --quiet of nobody's ring (rc $rc): $out"
  out=$(as root sparkctl --config "$ring" --json watch 2>&1)
  grep -q '"verdict": "healthy"' <<<"$out" || err "root's watch does not find nobody's ring healthy: $out"
  # Root's timer heals the user's ring, then root restarts it: the ranks it starts are the
  # user's, and so is everything in the state directory, so the user can restart and stop it.
  rank_user() { stat -c %U "/proc/$(cat "$state/run/sparkd-0.pid" 2>/dev/null)" 2>/dev/null; }
  not_theirs() { find "$state" ! -user nobody -printf '%P ' 2>/dev/null; }
  pid=$(cat "$state/run/sparkd-0.pid" 2>/dev/null)
  [[ -n $pid ]] && kill -9 "$pid"
  out=$(as root sparkctl --config "$ring" watch --quiet 2>&1)
  grep -qi "restart" <<<"$out" || err "root's watch did not heal nobody's ring: $out"
  [[ $(rank_user) == nobody ]] || err "root's heal started rank 0 as '$(rank_user)', not nobody"
  [[ -z $(not_theirs) ]] || err "after root's heal, not nobody's: $(not_theirs)"
  out=$(as root sparkctl --config "$ring" restart 2>&1) || err "root: restart of nobody's ring: $out"
  [[ $(rank_user) == nobody ]] || err "root's restart started rank 0 as '$(rank_user)', not nobody"
  [[ -z $(not_theirs) ]] || err "after root's restart, not nobody's: $(not_theirs)"
  out=$(as nobody sparkctl --config "$ring" restart 2>&1) || err "nobody: restart after root's: $out"
  out=$(as nobody sparkctl --config "$ring" stop 2>&1) || err "nobody: stop of the shared ring: $out"
  grep -q "nothing of the ring is left on any node" <<<"$out" || err "nobody: stop left something: $out"
  rm -f "$tmp/started-by-nobody"
  echo "installed_ring_test: nobody's ring healed and restarted by root stays nobody's: ok"
else
  echo "installed_ring_test: not root: the root half and the user switch are skipped; the day runs as $me"
  day "$me"
fi
echo "installed_ring_test: $((SECONDS - t0)) s"
((fail == 0)) && echo "installed_ring_test: OK"
exit $fail
