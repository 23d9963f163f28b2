#!/usr/bin/env node
// Trains small byte-level BPE tokenizers (Qwen2-, Llama 3- and GPT-2-style pipelines over
// one learned vocabulary) on corpus/train.txt + corpus/code.txt, writes
// them as Hugging Face tokenizer.json fixtures, and records what the Hugging Face
// `tokenizers` library (npm, native Rust core) gives for every test string:
//   tests/fixtures/tokenizer/{tokenizer.json,tokenizer_config.json,reference.json}
//   tests/fixtures/tokenizer/{llama3,gpt2,spm,metaspace,o200k}/... (spm, metaspace:
//   SentencePiece-style BPE with byte fallback, as Mistral 7B v0.1-v0.3 ship; o200k: gpt-oss's
//   pre-tokenizer and harmony special tokens)
// Deterministic: same inputs -> byte-identical outputs. Usage: npm ci && node gen_fixtures.js
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');

const ROOT = path.resolve(__dirname, '../..');
const OUT = process.env.SPARK_TOKENIZER_OUT || path.join(ROOT, 'tests/fixtures/tokenizer');
const MERGES = 3000;

const QWEN_RE = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
// o200k (tiktoken's o200k_base, as gpt-oss's tokenizer.json spells it): case-aware words
// (CamelCase splits), contractions attached to words, digits in threes, '/' kept with
// punctuation runs.
const O200K_RE = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const LLAMA3_RE = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

// GPT-2's byte -> printable character table.
function byteChars() {
  const bs = [];
  for (let b = 0x21; b <= 0x7e; b++) bs.push(b);
  for (let b = 0xa1; b <= 0xac; b++) bs.push(b);
  for (let b = 0xae; b <= 0xff; b++) bs.push(b);
  const cs = bs.slice();
  let n = 0;
  for (let b = 0; b < 256; b++) if (!bs.includes(b)) { bs.push(b); cs.push(256 + n); n++; }
  const map = new Array(256);
  bs.forEach((b, i) => { map[b] = String.fromCodePoint(cs[i]); });
  return { order: bs, map };
}
const BC = byteChars();
const toByteLevel = (s) => Array.from(Buffer.from(s, 'utf8'), (b) => BC.map[b]).join('');

// Training-time word splitting (JS regex close to the Qwen pattern; exactness does not
// matter here, only the learned merges).
const TRAIN_RE = /'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+/gu;

function trainingText() {
  // corpus/code.txt: this project's own early core/ sources, frozen so the fixture stays
  // reproducible when the code changes.
  return fs.readFileSync(path.join(__dirname, 'corpus/train.txt'), 'utf8') +
    fs.readFileSync(path.join(__dirname, 'corpus/code.txt'), 'utf8');
}

function train(text) {
  const counts = new Map();
  for (const m of text.matchAll(TRAIN_RE)) {
    const w = toByteLevel(m[0]);
    counts.set(w, (counts.get(w) || 0) + 1);
  }
  const words = [...counts.entries()].sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))
    .map(([w, c]) => ({ syms: Array.from(w), count: c }));
  const vocab = {};
  BC.order.forEach((b, i) => { vocab[BC.map[b]] = i; });
  const merges = [];
  for (let it = 0; it < MERGES; it++) {
    const pairs = new Map();
    for (const w of words) {
      for (let i = 0; i + 1 < w.syms.length; i++) {
        const k = w.syms[i] + '\u0000' + w.syms[i + 1];
        pairs.set(k, (pairs.get(k) || 0) + w.count);
      }
    }
    let best = null, bestCount = 1;
    for (const [k, c] of pairs) {
      if (c > bestCount || (c === bestCount && best !== null && k < best)) { best = k; bestCount = c; }
    }
    if (best === null) break;
    const [a, b] = best.split('\u0000');
    const merged = a + b;
    merges.push([a, b]);
    if (!(merged in vocab)) vocab[merged] = Object.keys(vocab).length;
    for (const w of words) {
      const s = w.syms;
      const out = [];
      for (let i = 0; i < s.length; i++) {
        if (i + 1 < s.length && s[i] === a && s[i + 1] === b) { out.push(merged); i++; } else out.push(s[i]);
      }
      w.syms = out;
    }
  }
  return { vocab, merges };
}

// SentencePiece-style BPE (Mistral 7B v0.1-v0.3, Llama 2 conversions): text with spaces as
// U+2581, no pre-tokenizer, characters plus <0xXX> byte tokens (byte fallback) and merges.
const SP = '\u2581';
function trainSpm(text) {
  const norm = SP + text.replace(/ /g, SP);
  const charCount = new Map();
  for (const c of norm) charCount.set(c, (charCount.get(c) || 0) + 1);
  const alphabet = [...charCount.entries()].filter(([c, n]) => n >= 3 && c !== '\n')
    .map(([c]) => c).sort((a, b) => a.codePointAt(0) - b.codePointAt(0));
  const vocab = { '<unk>': 0, '<s>': 1, '</s>': 2 };
  for (let b = 0; b < 256; b++) vocab['<0x' + b.toString(16).toUpperCase().padStart(2, '0') + '>'] = 3 + b;
  for (const c of alphabet) vocab[c] = Object.keys(vocab).length;
  const known = new Set(alphabet);
  const counts = new Map();
  for (const m of norm.matchAll(new RegExp(SP + '?[^' + SP + ']+|' + SP + '+', 'gu'))) {
    // Words are runs of known characters; the rest falls back to bytes at encode time.
    for (const w of m[0].split(/(?:)/u).reduce((acc, c) => {
      if (known.has(c)) acc[acc.length - 1] += c; else acc.push('');
      return acc;
    }, [''])) if (w.length > 1) counts.set(w, (counts.get(w) || 0) + 1);
  }
  const words = [...counts.entries()].sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))
    .map(([w, c]) => ({ syms: Array.from(w), count: c }));
  const merges = [];
  for (let it = 0; it < 1500; it++) {
    const pairs = new Map();
    for (const w of words) for (let i = 0; i + 1 < w.syms.length; i++) {
      const k = w.syms[i] + '\u0000' + w.syms[i + 1];
      pairs.set(k, (pairs.get(k) || 0) + w.count);
    }
    let best = null, bestCount = 1;
    for (const [k, c] of pairs) if (c > bestCount || (c === bestCount && best !== null && k < best)) { best = k; bestCount = c; }
    if (best === null) break;
    const [a, b] = best.split('\u0000');
    merges.push([a, b]);
    if (!((a + b) in vocab)) vocab[a + b] = Object.keys(vocab).length;
    for (const w of words) {
      const out = [];
      for (let i = 0; i < w.syms.length; i++) {
        if (i + 1 < w.syms.length && w.syms[i] === a && w.syms[i + 1] === b) { out.push(a + b); i++; } else out.push(w.syms[i]);
      }
      w.syms = out;
    }
  }
  return { vocab, merges };
}

function added(id, content, opts = {}) {
  return {
    id, content,
    single_word: !!opts.single_word, lstrip: !!opts.lstrip, rstrip: !!opts.rstrip,
    normalized: opts.normalized === undefined ? !opts.special : opts.normalized,
    special: !!opts.special,
  };
}

function tokenizerJson(base, v) {
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: v.added,
    normalizer: v.normalizer,
    pre_tokenizer: v.pre_tokenizer,
    post_processor: v.post_processor,
    decoder: v.decoder || { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: 'BPE', dropout: null, unk_token: v.spm ? '<unk>' : null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: !!v.spm, byte_fallback: !!v.spm,
      ignore_merges: !!v.ignore_merges, vocab: v.vocab || base.vocab,
      merges: v.string_merges ? (v.merges || base.merges).map(([a, b]) => a + ' ' + b) : (v.merges || base.merges),
    },
  };
}

const byteLevelNoRegex = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false };

function variants(base, spm) {
  const n = Object.keys(base.vocab).length;
  const ns = Object.keys(spm.vocab).length;
  const spmAdded = [added(0, '<unk>', { special: true }), added(1, '<s>', { special: true }),
    added(2, '</s>', { special: true }),
    ...['[INST]', '[/INST]', '[TOOL_CALLS]', '[AVAILABLE_TOOLS]', '[/AVAILABLE_TOOLS]', '[TOOL_RESULTS]',
      '[/TOOL_RESULTS]'].map((c, i) => added(ns + i, c, { special: true }))];
  const spmPost = { type: 'TemplateProcessing',
    single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
    pair: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
      { SpecialToken: { id: '<s>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
    special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } } };
  const mistralConfig = {
    bos_token: '<s>', eos_token: '</s>', unk_token: '<unk>', model_max_length: 32768,
    tokenizer_class: 'LlamaTokenizer',
    chat_template: fs.readFileSync(path.join(__dirname, 'templates/mistral_v3.jinja'), 'utf8'),
  };
  const qwenAdded = [
    added(n, '<|endoftext|>', { special: true }),
    added(n + 1, '<|im_start|>', { special: true }),
    added(n + 2, '<|im_end|>', { special: true }),
    added(n + 3, '<tool_call>', { normalized: false }),
    added(n + 4, '</tool_call>', { normalized: false }),
    added(n + 5, '<tool_response>', { normalized: false }),
    added(n + 6, '</tool_response>', { normalized: false }),
    added(n + 7, '<think>', { normalized: false }),
    added(n + 8, '</think>', { normalized: false }),
    added(n + 9, 'e\u0301te\u0301', { normalized: true }),  // matched after NFC
  ];
  const llamaNames = ['<|begin_of_text|>', '<|end_of_text|>', '<|reserved_special_token_0|>',
    '<|reserved_special_token_1|>', '<|finetune_right_pad_id|>', '<|step_id|>',
    '<|start_header_id|>', '<|end_header_id|>', '<|eom_id|>', '<|eot_id|>', '<|python_tag|>'];
  // Llama 3's vocabulary has whole-word tokens that its merges do not build; with
  // ignore_merges they win. Add a few such words so the fixture exercises that path.
  const llamaVocab = { ...base.vocab };
  for (const w of [' quick', 'Hello', ' world', ' lazy', 'Größe', ' 東京', ' Berlin', 'ing', ' the']) {
    const t = toByteLevel(w);
    if (!(t in llamaVocab)) llamaVocab[t] = Object.keys(llamaVocab).length;
  }
  const nl = Object.keys(llamaVocab).length;
  const llamaAdded = llamaNames.map((c, i) => added(nl + i, c, { special: true }));
  const gptAdded = [
    added(n, '<|endoftext|>', { special: true }),
    added(n + 1, '<s>', { special: true }),
    added(n + 2, '</s>', { special: true }),
    added(n + 3, '<mask>', { special: true, lstrip: true }),
    added(n + 4, '[SW]', { single_word: true }),
    added(n + 5, '<rs>', { rstrip: true, normalized: false }),
  ];
  const harmonyNames = ['<|startoftext|>', '<|endoftext|>', '<|return|>', '<|constrain|>',
    '<|channel|>', '<|start|>', '<|end|>', '<|message|>', '<|call|>'];
  const harmonyAdded = harmonyNames.map((c, i) => added(n + i, c, { special: true }));
  return [
    {
      dir: '', family: 'chatml',
      added: qwenAdded,
      normalizer: { type: 'NFC' },
      pre_tokenizer: { type: 'Sequence', pretokenizers: [
        { type: 'Split', pattern: { Regex: QWEN_RE }, behavior: 'Isolated', invert: false },
        byteLevelNoRegex] },
      post_processor: { type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false },
      config: {
        add_bos_token: false, bos_token: null, eos_token: '<|im_end|>', pad_token: '<|endoftext|>',
        model_max_length: 32768, tokenizer_class: 'Qwen2Tokenizer',
        chat_template: fs.readFileSync(path.join(__dirname, 'templates/chatml_qwen.jinja'), 'utf8'),
      },
    },
    {
      dir: 'llama3', family: 'llama3', ignore_merges: true, string_merges: true, vocab: llamaVocab,
      added: llamaAdded,
      normalizer: null,
      pre_tokenizer: { type: 'Sequence', pretokenizers: [
        { type: 'Split', pattern: { Regex: LLAMA3_RE }, behavior: 'Isolated', invert: false },
        byteLevelNoRegex] },
      post_processor: { type: 'Sequence', processors: [
        { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true },
        { type: 'TemplateProcessing',
          single: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
          pair: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
            { SpecialToken: { id: '<|begin_of_text|>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
          special_tokens: { '<|begin_of_text|>': { id: '<|begin_of_text|>', ids: [nl], tokens: ['<|begin_of_text|>'] } } }] },
      config: {
        bos_token: '<|begin_of_text|>', eos_token: '<|eot_id|>', model_max_length: 131072,
        tokenizer_class: 'PreTrainedTokenizerFast',
        chat_template: fs.readFileSync(path.join(__dirname, 'templates/llama3.jinja'), 'utf8'),
      },
    },
    {
      dir: 'gpt2', family: 'none',
      added: gptAdded,
      normalizer: { type: 'Sequence', normalizers: [{ type: 'NFKC' }, { type: 'Lowercase' }] },
      pre_tokenizer: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
      post_processor: { type: 'TemplateProcessing',
        single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: '</s>', type_id: 0 } }],
        pair: [{ Sequence: { id: 'A', type_id: 0 } }, { Sequence: { id: 'B', type_id: 1 } }],
        special_tokens: {
          '<s>': { id: '<s>', ids: [n + 1], tokens: ['<s>'] },
          '</s>': { id: '</s>', ids: [n + 2], tokens: ['</s>'] } } },
      config: { bos_token: '<s>', eos_token: '</s>', model_max_length: 1024, tokenizer_class: 'GPT2Tokenizer' },
    },
    {
      dir: 'spm', family: 'mistral', spm: true, vocab: spm.vocab, merges: spm.merges,
      added: spmAdded,
      normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: SP },
        { type: 'Replace', pattern: { String: ' ' }, content: SP }] },
      pre_tokenizer: null,
      post_processor: spmPost,
      decoder: { type: 'Sequence', decoders: [
        { type: 'Replace', pattern: { String: SP }, content: ' ' }, { type: 'ByteFallback' },
        { type: 'Fuse' }, { type: 'Strip', content: ' ', start: 1, stop: 0 }] },
      config: mistralConfig,
    },
    {
      dir: 'metaspace', family: 'mistral', spm: true, vocab: spm.vocab, merges: spm.merges,
      added: spmAdded,
      normalizer: null,
      pre_tokenizer: { type: 'Metaspace', replacement: SP, prepend_scheme: 'first', split: false },
      post_processor: spmPost,
      decoder: { type: 'Metaspace', replacement: SP, prepend_scheme: 'first', split: false },
      config: mistralConfig,
    },
    {
      dir: 'o200k', family: 'harmony',
      added: harmonyAdded,
      normalizer: null,
      pre_tokenizer: { type: 'Sequence', pretokenizers: [
        { type: 'Split', pattern: { Regex: O200K_RE }, behavior: 'Isolated', invert: false },
        { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }] },
      post_processor: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true },
      config: {
        bos_token: '<|startoftext|>', eos_token: '<|return|>', pad_token: '<|endoftext|>',
        model_max_length: 131072, tokenizer_class: 'PreTrainedTokenizerFast',
      },
    },
  ];
}

// Deterministic PRNG (mulberry32) for the random decode cases.
function rng(seed) {
  return () => {
    seed |= 0; seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function testStrings() {
  const list = JSON.parse(fs.readFileSync(path.join(__dirname, 'corpus/test_corpus.json'), 'utf8'));
  const train = fs.readFileSync(path.join(__dirname, 'corpus/train.txt'), 'utf8');
  for (const line of train.split('\n')) list.push(line);
  list.push(train);
  // Slices at arbitrary code point boundaries (cut words, lone halves of ZWJ sequences).
  const cps = Array.from(train);
  const r = rng(7);
  for (let i = 0; i < 40; i++) {
    const a = Math.floor(r() * cps.length), len = 1 + Math.floor(r() * 60);
    list.push(cps.slice(a, a + len).join(''));
  }
  return list;
}

async function reference(tok, vocabSize, seed) {
  const cases = [];
  for (const text of testStrings()) {
    const withSpecial = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
    const plain = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    cases.push({
      text, ids: plain, ids_with_special: withSpecial,
      decoded: await tok.decode(withSpecial, false),
      decoded_skip_special: await tok.decode(withSpecial, true),
    });
  }
  const decodeCases = [];
  const r = rng(seed);
  for (let i = 0; i < 60; i++) {
    const ids = [];
    const len = 1 + Math.floor(r() * 12);
    for (let k = 0; k < len; k++) ids.push(Math.floor(r() * vocabSize));
    decodeCases.push({ ids, text: await tok.decode(ids, false), text_skip_special: await tok.decode(ids, true) });
  }
  return { cases, decode_cases: decodeCases };
}

async function main() {
  const base = train(trainingText());
  const spm = trainSpm(trainingText());
  for (const v of variants(base, spm)) {
    const dir = path.join(OUT, v.dir);
    fs.mkdirSync(dir, { recursive: true });
    const json = JSON.stringify(tokenizerJson(base, v), null, 1) + '\n';
    const tok = Tokenizer.fromString(json);  // the library must accept it as is
    fs.writeFileSync(path.join(dir, 'tokenizer.json'), json);
    fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(v.config, null, 2) + '\n');
    const vocabSize = tok.getVocabSize(true);
    const ref = await reference(tok, vocabSize, 1234 + v.dir.length);
    const out = {
      generator: 'tools/tokenizer/gen_fixtures.js with npm tokenizers ' +
        require('tokenizers/package.json').version,
      family: v.family, vocab_size: vocabSize, ...ref,
    };
    fs.writeFileSync(path.join(dir, 'reference.json'), JSON.stringify(out) + '\n');
    console.log(`${path.relative(ROOT, dir) || '.'}: vocab ${vocabSize}, ${ref.cases.length} encode cases, ${ref.decode_cases.length} decode cases`);
  }
}

main().catch((e) => { console.error(e); process.exit(1); });
