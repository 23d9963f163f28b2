#!/usr/bin/env bash
# sparkd's chat path against Hugging Face's on real checkpoints' tokenizer files from npm
# (Qwen3, Qwen2.5, Llama 3.0 and 3.2 templates, DeepSeek-V3, Gemma 3, Mistral-Nemo):
# rendered prompts byte for byte against @huggingface/jinja, token ids against Hugging
# Face tokenizers, and tool calls parsed back from each template's own rendering
# (tests/e2e/chat_templates/reference_test.js). The npm packages (~800 MB, never
# committed) are fetched here into tests/e2e/chat_templates/node_modules. Skips (77)
# with the reason when node/npm is missing or the registry cannot be reached.
set -euo pipefail
SRC=${1:?source dir}
BUILD=${2:?build dir}
dir=$SRC/tests/e2e/chat_templates
bin=$BUILD/tests/spark_chat_render
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "SKIP: node and npm are needed for the Hugging Face reference"; exit 77
fi
if [[ ! -x $bin ]]; then echo "FAIL: $bin is not built"; exit 1; fi
cd "$dir"
if [[ ! -f node_modules/.package-lock.json || package-lock.json -nt node_modules/.package-lock.json ]]; then
  echo "fetching the reference packages (npm ci in $dir)"
  if ! timeout 600 npm ci --no-audit --no-fund --loglevel=error; then
    echo "SKIP: npm ci failed in $dir (no registry access?); the reference needs its packages"
    exit 77
  fi
fi
timeout 300 node reference_test.js "$bin"
