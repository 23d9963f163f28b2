#!/usr/bin/env bash
# The official OpenAI Node client parses what our API layer writes: every request it makes
# is answered by openai_wire_double (real request parser and response builders, the engine
# replaced by a fixed text; a second run serves gpt-oss's harmony output). Skips (77) when
# node or the client package is not installed (cd tests/e2e/openai_client && npm ci).
set -euo pipefail
SRC=${1:?source dir}
BUILD=${2:?build dir}
dir=$SRC/tests/e2e/openai_client
double=$BUILD/tests/openai_wire_double
if ! command -v node >/dev/null; then echo "SKIP: node is not installed"; exit 77; fi
if [[ ! -d $dir/node_modules/openai ]]; then
  echo "SKIP: the openai npm package is not installed (cd $dir && npm ci)"; exit 77
fi
if [[ ! -x $double ]]; then echo "FAIL: $double is not built"; exit 1; fi
cd "$dir"
timeout 300 node client_test.js --wire "$double" "$SRC/tests/fixtures/tokenizer/tokenizer.json"
# gpt-oss: harmony reasoning, content and tool calls.
timeout 300 node client_test.js --harmony --wire "$double" "$SRC/tests/fixtures/harmony/tokenizer.json"
