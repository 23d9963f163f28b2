#!/usr/bin/env bash
# Bash completion (packaging/completion/sparkctl) against the built sparkctl: commands
# (internal ones hidden), each command's options, check IDs and groups after --only/--skip
# (also inside a comma-separated list), node names and ranks from the cluster file given
# with --config, subcommands of config and help.
# Usage: completion_test.sh SRC_DIR BUILD_DIR
set -uo pipefail
SRC=${1:?usage: completion_test.sh SRC_DIR BUILD_DIR}
BUILD=${2:?usage: completion_test.sh SRC_DIR BUILD_DIR}
bin=$BUILD/cli/sparkctl
[[ -x $bin ]] || { echo "completion_test: SKIP: $bin is not built (ninja sparkctl)"; exit 77; }
# shellcheck source=/dev/null
source "$SRC/packaging/completion/sparkctl"
fail=0
ring=$SRC/env/examples/two-sparks.env

# Completes the words of a command line (the last one is the word under the cursor) and
# prints the candidates one per line, sorted.
complete_line() {
  COMP_WORDS=("$bin" "$@")
  COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
  COMP_LINE="${COMP_WORDS[*]}"
  COMP_POINT=${#COMP_LINE}
  COMPREPLY=()
  _sparkctl "$bin" "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD - 1]}"
  printf '%s\n' "${COMPREPLY[@]}" | sort
}

# expect "WHAT" "candidates, space-separated" words...
expect() {
  local what=$1 want=$2
  shift 2
  local got
  got=$(complete_line "$@" | tr '\n' ' ' | sed 's/ $//')
  if [[ $got != "$want" ]]; then
    echo "completion_test: FAIL: $what: 'sparkctl $*' completes to '$got', want '$want'"
    fail=1
  fi
}
# has "WHAT" "candidate" words...: the candidate is among those offered.
has() {
  local what=$1 want=$2
  shift 2
  if ! complete_line "$@" | grep -qx -- "$want"; then
    echo "completion_test: FAIL: $what: 'sparkctl $*' does not offer '$want' (got: $(complete_line "$@" | tr '\n' ' '))"
    fail=1
  fi
}

expect "commands" "stage-weights start status stop" st
expect "internal commands hidden" "" stage-r
has "global options" "--config" --con
expect "help's argument is a command" "watch" help wat
expect "config subcommands" "check" config ch
has "a command's options" "--quiet" watch --
has "a command's options" "--skip-preflight" start --
has "short options too" "-f" logs -
expect "check IDs" "rdma rdma.devices rdma.gid rdma.netdev rdma.port" preflight --only rd
expect "check groups" "sw sw.known_bad sw.parity sw.sparkd" preflight --skip sw
expect "the last element of a list" "mem,sw.known_bad mem,sw.parity mem,sw.sparkd" preflight --only mem,sw.
expect "node names from the cluster file" "spark-a spark-b" --config "$ring" stage-weights --from spark-
expect "ranks from the cluster file" "0 1" --config "$ring" logs --rank ""
expect "an option's value is not an option" "" --config "$ring" logs --lines ""

if ((fail == 0)); then echo "completion_test: OK"; fi
exit $fail
