#!/usr/bin/env bash
# Man page lint: every man/*.[1-8] renders without warnings (man --warnings and groff -ww),
# every key of the cluster file schema is documented in sparkctl.env(5) (the key list comes
# from `sparkctl config show --all --json`, so a key added to core/config.cc without docs
# fails here), every exit code of core/error.cc is in sparkctl(1), and every command has
# its page man/sparkctl-<command>.1.
# Usage: man_lint.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: man_lint.sh SRC_DIR BUILD_DIR}
BUILD=${2:?usage: man_lint.sh SRC_DIR BUILD_DIR}
SPARKCTL=$BUILD/cli/sparkctl
fail=0
err() { echo "man_lint: FAIL: $*"; fail=1; }

command -v man >/dev/null || { echo "man_lint: FAIL: man is not installed (man-db)"; exit 1; }
[[ -x $SPARKCTL ]] || { echo "man_lint: FAIL: $SPARKCTL not built"; exit 1; }

shopt -s nullglob
pages=("$SRC"/man/*.[1-8])
((${#pages[@]} >= 3)) || err "expected at least sparkctl.1, sparkctl-config.1, sparkctl.env.5 in man/"
for p in "${pages[@]}"; do
  out=$(LC_ALL=C.UTF-8 MANWIDTH=80 man --warnings -E UTF-8 -l "$p" 2>&1 >/dev/null || echo "man exited $?")
  [[ -z $out ]] || err "$(basename "$p"): man --warnings: $out"
  out=$(groff -ww -z -t -man "$p" 2>&1 || echo "groff exited $?")
  [[ -z $out ]] || err "$(basename "$p"): groff -ww: $out"
  head -n 20 "$p" | grep -q '^\.TH ' || err "$(basename "$p"): no .TH line"
done
echo "man_lint: rendered ${#pages[@]} page(s)"

# Every schema key in sparkctl.env(5). A minimal file; no caller environment leaks in.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'NODE0_SSH=local\n' >"$tmp/min.env"
env -i PATH="$PATH" "$SPARKCTL" --config "$tmp/min.env" --json config show --all >"$tmp/show.json"
mapfile -t keys < <(python3 -c '
import json, re, sys
s = json.load(open(sys.argv[1]))["settings"]
for k in sorted(s):
    m = re.match(r"NODE0_(.+)$", k)
    print("NODE<i>_" + m.group(1) if m else k)
' "$tmp/show.json")
((${#keys[@]} > 10)) || err "config show --all --json listed only ${#keys[@]} keys"
env5=$SRC/man/sparkctl.env.5
for k in "${keys[@]}"; do
  grep -qE "^\.B ${k}\$" "$env5" || err "key $k is not documented in man/sparkctl.env.5 (add '.TP' + '.B $k' under RING KEYS or NODE KEYS)"
done
echo "man_lint: ${#keys[@]} schema keys checked against sparkctl.env.5"

# Every exit code of exit_code() in sparkctl(1)'s EXIT STATUS.
mapfile -t codes < <(sed -n '/^int exit_code/,/^}/s/.*return \([0-9]*\);.*/\1/p' "$SRC/core/error.cc" | sort -un)
((${#codes[@]} > 5)) || err "could not read the exit codes from core/error.cc"
section=$(sed -n '/^\.SH EXIT STATUS/,/^\.SH /p' "$SRC/man/sparkctl.1")
for c in "${codes[@]}" 1; do
  grep -qx "\.B $c" <<<"$section" || err "exit code $c is not in the EXIT STATUS of man/sparkctl.1"
done
echo "man_lint: ${#codes[@]} exit codes checked against sparkctl.1"

# Every command has its page; sparkctl.1 should list it (a warning only). Commands whose
# summary starts with "(internal)" (halves of a command that sparkctl runs on other nodes)
# are documented in the page of the command that uses them.
mapfile -t cmds < <(env -i PATH="$PATH" "$SPARKCTL" help |
  sed -n '/^Commands:/,/^$/{/^  [a-z][a-z0-9-]* *(internal)/d;s/^  \([a-z][a-z0-9-]*\) .*/\1/p}')
((${#cmds[@]} >= 3)) || err "could not read the command list from sparkctl help"
for c in "${cmds[@]}"; do
  case $c in help|version) continue ;; esac
  [[ -f $SRC/man/sparkctl-$c.1 ]] || err "command $c has no man page man/sparkctl-$c.1"
  grep -q "$c" "$SRC/man/sparkctl.1" || echo "man_lint: warning: command $c is not mentioned in man/sparkctl.1"
done
echo "man_lint: ${#cmds[@]} commands checked"

# Every command's --help: "usage: sparkctl CMD ...", exit 0, none of Boost's internals
# ("-h [ --help ]", "arg (=show)"); `help help` and `help --help` answer too.
for c in "${cmds[@]}" help; do
  out=$(env -i PATH="$PATH" "$SPARKCTL" "$c" --help 2>&1) || err "sparkctl $c --help exited $?: $out"
  [[ $(head -n 1 <<<"$out") == "usage: sparkctl $c"* ]] || err "sparkctl $c --help starts '$(head -n 1 <<<"$out")'"
  grep -qE '\[ --|arg \(=|^  -h \[' <<<"$out" && err "sparkctl $c --help shows Boost's option internals: $(grep -E '\[ --|arg \(=' <<<"$out" | head -n 1)"
done
out=$(env -i PATH="$PATH" "$SPARKCTL" help help 2>&1) || err "sparkctl help help exited $?: $out"
echo "man_lint: --help of ${#cmds[@]} commands checked"

# Drift between pages and code where the code can be read: the per-rank file names that
# the node scripts use (cli/ring_nodes.cc, "sparkd-{}.log" etc.) are the only ones a page
# may name, and every code a page lists under EXIT STATUS is one that exit_code() returns
# (or 1, checks failed; or preflight's kExitWarnings, env/preflight.h).
mapfile -t rankfiles < <(grep -ho '\(sparkd\|engine\)-[a-z]*{[a-z]*}\.[a-z]*' "$SRC"/cli/ring_nodes.cc "$SRC"/cli/node_ops.cc "$SRC"/cli/cmd_ring.cc \
  "$SRC"/daemon/backend_exec.cc 2>/dev/null | sed 's/{[a-z]*}/<N>/' | sort -u)
grep -ho 'engine-rank" *+ *std::to_string([a-z_]*) *+ *"\.log"' "$SRC"/daemon/backend_exec.cc >/dev/null &&
  rankfiles+=("engine-rank<N>.log")
((${#rankfiles[@]} >= 2)) || err "could not read the per-rank file names from cli/ring_nodes.cc"
for p in "${pages[@]}"; do
  while read -r named; do
    ok=0
    for f in "${rankfiles[@]}"; do [[ $named == "$f" ]] && ok=1; done
    ((ok)) || err "$(basename "$p") names $named; the code writes: ${rankfiles[*]}"
  done < <(sed 's/\\-/-/g' "$p" | grep -o '\(sparkd\|engine\)-[a-z]*<N>\.[a-z]*' | sort -u)
done
warn_code=$(sed -n 's/.*kExitWarnings = \([0-9]*\);.*/\1/p' "$SRC/env/preflight.h")
for p in "${pages[@]}"; do
  while read -r c; do
    ok=0
    for k in "${codes[@]}" 0 1 $warn_code; do [[ $c == "$k" ]] && ok=1; done
    ((ok)) || err "$(basename "$p"): EXIT STATUS lists $c, which no Errc maps to (core/error.cc)"
  done < <(sed -n '/^\.SH EXIT STATUS/,/^\.SH /p' "$p" | sed -n 's/^\.B \([0-9][0-9]*\)$/\1/p')
done
# sparkctl(1) sends status to its page: a not-ready status is exit 10 there, so the main
# page must not say it is 1.
sed -n '/^\.SH EXIT STATUS/,/^\.SH /p' "$SRC/man/sparkctl.1" | awk '/^\.B [0-9]+$/{c=$2} /not ready/ && !/10/{print c}' |
  grep -qvx 10 && err "man/sparkctl.1 gives a not-ready status another exit code than 10 (sparkctl-status(1))"
echo "man_lint: per-rank file names (${rankfiles[*]}) and EXIT STATUS codes checked"

((fail == 0)) && echo "man_lint: OK"
exit $fail
