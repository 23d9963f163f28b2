#!/usr/bin/env node
// Hugging Face `tokenizers` side of the tokenizer benchmark (driven by spark_tokenizer_bench):
//   node bench_hf.js TOKENIZER_JSON DOCS_JSON REPS
// DOCS_JSON is an array of strings. Encodes (no special tokens) and decodes every document,
// one call at a time, REPS timed rounds after one warm-up; prints one JSON object with the
// median seconds, the token count and an FNV-1a hash of all ids (to check we agree).
'use strict';
const fs = require('fs');
const { Tokenizer } = require('tokenizers');

async function main() {
  const [file, docsFile, repsArg] = process.argv.slice(2);
  const tok = Tokenizer.fromFile(file);
  const docs = JSON.parse(fs.readFileSync(docsFile, 'utf8'));
  const reps = Number(repsArg || 3);
  let ids = [];
  const encodeOnce = async () => {
    const out = [];
    for (const d of docs) out.push((await tok.encode(d, null, { addSpecialTokens: false })).getIds());
    return out;
  };
  const decodeOnce = async (all) => { for (const x of all) await tok.decode(x, false); };
  ids = await encodeOnce();
  await decodeOnce(ids);
  const enc = [], dec = [];
  for (let r = 0; r < reps; r++) {
    let t0 = process.hrtime.bigint();
    ids = await encodeOnce();
    enc.push(Number(process.hrtime.bigint() - t0) / 1e9);
    t0 = process.hrtime.bigint();
    await decodeOnce(ids);
    dec.push(Number(process.hrtime.bigint() - t0) / 1e9);
  }
  const median = (a) => a.slice().sort((x, y) => x - y)[Math.floor(a.length / 2)];
  let h = 0xcbf29ce484222325n, tokens = 0;
  for (const x of ids) for (const id of x) {
    tokens++;
    h ^= BigInt(id);
    h = (h * 0x100000001b3n) & 0xffffffffffffffffn;
  }
  console.log(JSON.stringify({
    library: 'tokenizers (npm) ' + require('tokenizers/package.json').version,
    encode_s: median(enc), decode_s: median(dec), tokens, ids_fnv1a: h.toString(16),
  }));
}
main().catch((e) => { console.error(e); process.exit(1); });
