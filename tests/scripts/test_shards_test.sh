#!/usr/bin/env bash
# The e2e tier is split into several ctest entries (doctest filters in tests/CMakeLists.txt)
# that run side by side: every test case of the binary must be in exactly one entry, so that a filter that drops or repeats cases fails here.
# Usage: test_shards_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
BUILD=${2:?usage: test_shards_test.sh SRC_DIR BUILD_DIR}
command -v python3 >/dev/null || { echo "SKIP: python3 is not installed"; exit 77; }
ctest --test-dir "$BUILD" --show-only=json-v1 > "$BUILD/test_shards.json"
python3 - "$BUILD/test_shards.json" <<'PY'
import collections, json, subprocess, sys
tests = json.load(open(sys.argv[1]))["tests"]
def cases(argv):
    out = subprocess.run(argv + ["-ltc"], capture_output=True, text=True, check=True).stdout
    return [l for l in out.splitlines() if l and not l.startswith(("[doctest]", "==="))]
bad = 0
for label in ("e2e",):
    entries = [t for t in tests
               if any(p["name"] == "LABELS" and label in p["value"] for p in t.get("properties", []))]
    if len(entries) < 2:
        print(f"test_shards: FAIL: the {label} tier has {len(entries)} entries, expected several"); bad = 1; continue
    binary = entries[0]["command"][0]
    whole = cases([binary])
    seen = collections.Counter()
    for e in entries:
        got = cases(e["command"])
        print(f"test_shards: {label}: {e['name']}: {len(got)} cases")
        seen.update(got)
    missing = [c for c in whole if c not in seen]
    twice = [c for c, n in seen.items() if n > 1]
    if missing or twice or sum(seen.values()) != len(whole):
        print(f"test_shards: FAIL: {label}: {len(whole)} cases in the binary, {sum(seen.values())} in the entries; "
              f"missing {missing[:5]}, in two entries {twice[:5]}"); bad = 1
    else:
        print(f"test_shards: {label}: all {len(whole)} cases, each in one entry")
sys.exit(bad)
PY
