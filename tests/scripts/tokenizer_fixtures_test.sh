#!/usr/bin/env bash
# The committed tokenizer fixtures are what tools/tokenizer/gen_fixtures.js produces with
# Hugging Face tokenizers: regenerate into a temp dir and compare byte for byte. Skips (77)
# without node or the npm package (cd tools/tokenizer && npm ci).
set -euo pipefail
SRC=${1:?source dir}
dir=$SRC/tools/tokenizer
if ! command -v node >/dev/null; then echo "SKIP: node is not installed"; exit 77; fi
if [[ ! -d $dir/node_modules/tokenizers ]]; then
  echo "SKIP: the tokenizers npm package is not installed (cd $dir && npm ci)"; exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
SPARK_TOKENIZER_OUT=$out timeout 300 node "$dir/gen_fixtures.js"
diff -r "$SRC/tests/fixtures/tokenizer" "$out"
echo "fixtures match the generator"
