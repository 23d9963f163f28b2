#!/usr/bin/env bash
# clang-format for the C++ you touched. Without arguments: the C++ files that differ from
# the merge base with main (committed or not, new files included); with arguments: those
# files. --check only reports (clang-format --dry-run -Werror) and exits 1 on a difference.
#
# This is not a CI gate: much of the foundation predates .clang-format, and reformatting
# every file at once would collide with all work in progress. Format what you write.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
check=0
[[ "${1:-}" == "--check" ]] && { check=1; shift; }
if (($#)); then
  files=("$@")
else
  base=$(git merge-base HEAD main 2>/dev/null || git rev-list --max-parents=0 HEAD | tail -n 1)
  mapfile -t files < <({ git diff --name-only --diff-filter=AM "$base"; git ls-files --others --exclude-standard; } |
    grep -E '\.(cc|h|cu|cuh)$' | sort -u)
fi
((${#files[@]})) || { echo "format: no C++ files to format"; exit 0; }
if ((check)); then
  clang-format --dry-run -Werror "${files[@]}"
  echo "format: ${#files[@]} file(s) formatted"
else
  clang-format -i "${files[@]}"
  echo "format: formatted ${#files[@]} file(s)"
fi
