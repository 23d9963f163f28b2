#!/usr/bin/env node
// The official OpenAI Node client against sparkd's API.
//   node client_test.js --base-url http://127.0.0.1:8000/v1 [--model NAME] [--api-key KEY]
//       a running sparkd (the e2e tier starts one and passes its URL)
//   node client_test.js --wire BUILD_DIR/tests/openai_wire_double TOKENIZER_JSON
//       no server: every request the client makes is answered by openai_wire_double (our
//       request parser and response builders; the engine replaced by a fixed text), handed
//       to the client through its `fetch` option. Checks our wire format through the client.
//   node client_test.js --harmony --wire BUILD_DIR/tests/openai_wire_double HARMONY_TOKENIZER_JSON
//       the same with the double serving gpt-oss (tests/fixtures/harmony): reasoning,
//       content and tool calls as the client sees them, streamed and not.
//   node client_test.js --harmony-live --base-url URL [--prompt-tokens N]
//       a running sparkd serving a gpt-oss checkpoint with its harmony chat template: the
//       conversation of harmony_live.json with reasoning_effort and a forced tool call, then
//       the tool round with the earlier reasoning (harmonyLive below). N: the prompt's length
//       as transformers' apply_chat_template renders it, where the caller has transformers.
// Exits 0 when every check passed; prints one line per check ("ok" / "FAIL").
'use strict';
const { execFileSync } = require('child_process');
const OpenAI = require('openai').default || require('openai');

const args = process.argv.slice(2);
const opt = (name) => { const i = args.indexOf(name); return i >= 0 ? args[i + 1] : undefined; };
const wire = args.indexOf('--wire') >= 0;
let failures = 0;
function check(name, cond, detail) {
  if (cond) console.log(`ok   ${name}`);
  else { failures++; console.log(`FAIL ${name}${detail === undefined ? '' : ': ' + JSON.stringify(detail)}`); }
}

function wireFetch(binary, tokenizer) {
  return async (url, init = {}) => {
    const u = new URL(typeof url === 'string' ? url : url.url);
    const method = (init.method || 'GET').toUpperCase();
    const body = init.body ? String(init.body) : '';
    const out = execFileSync(binary, [tokenizer, method, u.pathname], { input: body, timeout: 20000 });
    const r = JSON.parse(out.toString('utf8'));
    return new Response(r.body, { status: r.status, headers: { 'content-type': r.content_type } });
  };
}

async function main() {
  let client, model;
  if (wire) {
    const i = args.indexOf('--wire');
    const [binary, tokenizer] = [args[i + 1], args[i + 2]];
    client = new OpenAI({ apiKey: 'test', baseURL: 'http://wire.invalid/v1', fetch: wireFetch(binary, tokenizer), maxRetries: 0 });
  } else {
    client = new OpenAI({ apiKey: opt('--api-key') || 'none', baseURL: opt('--base-url'), maxRetries: 0, timeout: 120000 });
  }
  const models = await client.models.list();
  const ids = [];
  for await (const m of models) ids.push(m.id);
  check('models.list returns the served model', ids.length >= 1, ids);
  model = opt('--model') || ids[0];
  if (args.indexOf('--harmony') >= 0) return harmony(client, model);
  if (args.indexOf('--harmony-live') >= 0) return harmonyLive(client, model);

  const messages = [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Say hello.' }];
  const chat = await client.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0, seed: 7 });
  check('chat.completion object', chat.object === 'chat.completion', chat.object);
  check('chat id prefix', typeof chat.id === 'string' && chat.id.startsWith('chatcmpl-'), chat.id);
  check('chat message role', chat.choices[0].message.role === 'assistant');
  check('chat finish_reason', ['stop', 'length'].includes(chat.choices[0].finish_reason), chat.choices[0].finish_reason);
  check('chat usage adds up', chat.usage.total_tokens === chat.usage.prompt_tokens + chat.usage.completion_tokens, chat.usage);

  const stream = await client.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0, seed: 7, stream: true, stream_options: { include_usage: true } });
  let text = '', chunks = 0, usage = null, finish = null, role = null, objectsOk = true;
  for await (const c of stream) {
    chunks++;
    if (c.object !== 'chat.completion.chunk') objectsOk = false;
    if (c.usage) usage = c.usage;
    for (const ch of c.choices) {
      if (ch.delta.role) role = ch.delta.role;
      if (ch.delta.content) text += ch.delta.content;
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  check('stream chunks are chat.completion.chunk', objectsOk && chunks > 2, chunks);
  check('stream first delta has the role', role === 'assistant');
  check('stream text equals the non-streamed text (greedy, same seed)', text === (chat.choices[0].message.content || ''), [text, chat.choices[0].message.content]);
  check('stream finish_reason', finish === chat.choices[0].finish_reason, finish);
  check('stream usage in the last chunk', usage && usage.completion_tokens === chat.usage.completion_tokens, usage);

  const n2 = await client.chat.completions.create({ model, messages, max_tokens: 4, n: 2, logprobs: true, top_logprobs: 3 });
  check('n=2 gives two choices', n2.choices.length === 2 && n2.choices[1].index === 1);
  const lp = n2.choices[0].logprobs && n2.choices[0].logprobs.content;
  check('logprobs with 3 alternatives', Array.isArray(lp) && lp.length > 0 && lp[0].top_logprobs.length === 3 && Array.isArray(lp[0].bytes), lp && lp[0]);

  const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather for a city', parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
  const tc = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'Weather in Paris?' }], tools, max_tokens: 64 });
  const calls = tc.choices[0].message.tool_calls || [];
  check('tools request accepted', ['stop', 'length', 'tool_calls'].includes(tc.choices[0].finish_reason), tc.choices[0]);
  if (wire) {
    check('tool call parsed into tool_calls', calls.length === 1 && calls[0].function.name === 'get_weather' && JSON.parse(calls[0].function.arguments).city === 'Paris', calls);
    check('tool call finish_reason', tc.choices[0].finish_reason === 'tool_calls');
    const ts = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'Weather?' }], tools, max_tokens: 64, stream: true });
    const acc = {};
    for await (const c of ts) for (const ch of c.choices) for (const d of ch.delta.tool_calls || []) {
      acc[d.index] = acc[d.index] || { name: '', args: '' };
      if (d.function && d.function.name) acc[d.index].name += d.function.name;
      if (d.function && d.function.arguments) acc[d.index].args += d.function.arguments;
    }
    check('streamed tool call deltas', acc[0] && acc[0].name === 'get_weather' && JSON.parse(acc[0].args).city === 'Paris', acc);
  }

  const comp = await client.completions.create({ model, prompt: 'Once', max_tokens: 8, temperature: 0 });
  check('text_completion object', comp.object === 'text_completion' && typeof comp.choices[0].text === 'string', comp);
  const cs = await client.completions.create({ model, prompt: 'Once', max_tokens: 8, temperature: 0, stream: true });
  let ctext = '';
  for await (const c of cs) for (const ch of c.choices) ctext += ch.text;
  check('streamed completion text equals non-streamed', ctext === comp.choices[0].text, [ctext, comp.choices[0].text]);

  const st = await client.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0, seed: 7 });
  const full = st.choices[0].message.content || '';
  if (full.length > 4) {
    const stopAt = full.slice(2, 4);
    const cut = await client.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0, seed: 7, stop: [stopAt] });
    check('stop string cuts the text before it', cut.choices[0].message.content === full.slice(0, full.indexOf(stopAt)) && cut.choices[0].finish_reason === 'stop', [full, stopAt, cut.choices[0].message.content]);
  }
  const echo = await client.completions.create({ model, prompt: 'Once', max_tokens: 3, echo: true });
  check('echo prepends the prompt', echo.choices[0].text.startsWith('Once'), echo.choices[0].text);

  // /tokenize and /detokenize are not in the client: plain HTTP through the same transport.
  const post = async (p, body) => {
    const url = wire ? 'http://wire.invalid' + p : new URL(p, opt('--base-url')).toString();
    const f = wire ? wireFetch(args[args.indexOf('--wire') + 1], args[args.indexOf('--wire') + 2]) : fetch;
    const r = await f(url, { method: 'POST', body: JSON.stringify(body), headers: { 'content-type': 'application/json' } });
    return { status: r.status, json: await r.json() };
  };
  const tk = await post('/tokenize', { model, prompt: 'Hello 👋 world', add_special_tokens: false });
  check('/tokenize counts tokens', tk.status === 200 && tk.json.count === tk.json.tokens.length && tk.json.count > 0, tk);
  const dt = await post('/detokenize', { model, tokens: tk.json.tokens });
  check('/detokenize inverts /tokenize', dt.status === 200 && dt.json.prompt === 'Hello 👋 world', dt);

  try {
    await client.chat.completions.create({ model, messages, temperature: 5 });
    check('temperature 5 rejected', false);
  } catch (e) {
    check('temperature 5 -> 400 invalid_request_error, param temperature', e.status === 400 && e.type === 'invalid_request_error' && e.param === 'temperature', { status: e.status, type: e.type, param: e.param });
  }
  try {
    await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'x'.repeat(20000) }], max_tokens: 4 });
    check('over-long prompt rejected', !wire);  // live: depends on the server's context length
  } catch (e) {
    check('over-long prompt -> context_length_exceeded', e.status === 400 && e.code === 'context_length_exceeded', { status: e.status, code: e.code });
  }
  try {
    await client.chat.completions.create({ model: 'no-such-model', messages });
    check('unknown model rejected', false);
  } catch (e) {
    check('unknown model -> 404 model_not_found', e.status === 404 && e.code === 'model_not_found', { status: e.status, code: e.code });
  }
  if (!wire) await structuredOutputs(client, model);  // needs the engine: live only
  console.log(failures ? `# ${failures} check(s) failed` : '# all checks passed');
  process.exit(failures ? 1 : 0);
}

// gpt-oss (harmony) through the client: the double's analysis message comes back as
// reasoning_content (and reasoning), its final message as content, its call to the first tool
// as tool_calls; streamed deltas add up to the same.
async function harmony(client, model) {
  const messages = [{ role: 'user', content: 'Say hello.' }];
  const want = { reasoning: 'A greeting; answer in kind.', content: 'Hello from sparkd, a test double. 👋🏽' };
  const chat = await client.chat.completions.create({ model, messages, reasoning_effort: 'low' });
  const m = chat.choices[0].message;
  check('harmony: final channel is content', m.content === want.content, m);
  check('harmony: analysis channel is reasoning_content and reasoning', m.reasoning_content === want.reasoning && m.reasoning === want.reasoning, m);
  check('harmony: finish_reason stop on <|return|>', chat.choices[0].finish_reason === 'stop', chat.choices[0]);
  const stream = await client.chat.completions.create({ model, messages, stream: true });
  let content = '', reasoning = '', finish = null, reasoningFirst = true;
  for await (const c of stream) for (const ch of c.choices) {
    if (ch.delta.reasoning_content) { if (content) reasoningFirst = false; reasoning += ch.delta.reasoning_content; }
    if (ch.delta.content) content += ch.delta.content;
    if (ch.finish_reason) finish = ch.finish_reason;
  }
  check('harmony: streamed content and reasoning equal the non-streamed ones', content === want.content && reasoning === want.reasoning && reasoningFirst, [content, reasoning]);
  check('harmony: streamed finish_reason', finish === 'stop', finish);

  const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather for a city', parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
  const tc = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'Weather in Paris?' }], tools });
  const tm = tc.choices[0].message;
  check('harmony: a call to functions.get_weather is a tool call', (tm.tool_calls || []).length === 1 && tm.tool_calls[0].function.name === 'get_weather' && JSON.parse(tm.tool_calls[0].function.arguments).city === 'Paris', tm);
  check('harmony: tool call finish_reason, null content, reasoning kept', tc.choices[0].finish_reason === 'tool_calls' && tm.content === null && tm.reasoning_content === want.reasoning, tc.choices[0]);
  const ts = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'Weather?' }], tools, stream: true });
  const acc = [];
  let tfinish = null;
  for await (const c of ts) for (const ch of c.choices) {
    for (const d of ch.delta.tool_calls || []) {
      acc[d.index] = acc[d.index] || { name: '', args: '' };
      if (d.function && d.function.name) acc[d.index].name += d.function.name;
      if (d.function && d.function.arguments) acc[d.index].args += d.function.arguments;
    }
    if (ch.finish_reason) tfinish = ch.finish_reason;
  }
  check('harmony: streamed tool call deltas', acc.length === 1 && acc[0].name === 'get_weather' && JSON.parse(acc[0].args).city === 'Paris' && tfinish === 'tool_calls', [acc, tfinish]);
  // The tool round goes back in: the earlier reasoning and call, then the result.
  const prior = tm.tool_calls && tm.tool_calls.length ? tm.tool_calls
    : [{ id: 'call_0', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris"}' } }];
  const round = await client.chat.completions.create({ model, tools, reasoning_effort: 'high', messages: [
    { role: 'user', content: 'Weather in Paris?' },
    { role: 'assistant', content: null, reasoning_content: want.reasoning, tool_calls: prior },
    { role: 'tool', tool_call_id: prior[0].id, content: '{"temperature": 21}' }] });
  check('harmony: a tool round with reasoning is accepted', round.choices[0].message.role === 'assistant', round.choices[0]);
  try {
    await client.chat.completions.create({ model, messages, reasoning_effort: 'max' });
    check('harmony: reasoning_effort max rejected', false);
  } catch (e) {
    check('harmony: reasoning_effort max -> 400, param reasoning_effort', e.status === 400 && e.param === 'reasoning_effort', { status: e.status, param: e.param });
  }
  console.log(failures ? `# ${failures} check(s) failed` : '# all checks passed');
  process.exit(failures ? 1 : 0);
}

// gpt-oss (harmony) served by the engine itself. Its weights are random, so the words are
// whatever they are; what holds for any weights is checked: the forced call (tool_choice
// naming get_weather: the grammar writes the commentary channel's call, after an analysis
// message or not) comes back through the client as one tool call whose arguments parse and
// keep to the tool's schema, with finish_reason tool_calls and no content; streamed, the
// same call, delta by delta; the tool round (the earlier reasoning, the call and its result
// go back in) is served; an unknown reasoning_effort is a 400 naming it.
async function harmonyLive(client, model) {
  const conv = JSON.parse(require('fs').readFileSync(require('path').join(__dirname, 'harmony_live.json'), 'utf8'));
  const tool = conv.tools[0].function;
  const req = { model, messages: conv.messages, tools: conv.tools, reasoning_effort: conv.reasoning_effort,
    tool_choice: { type: 'function', function: { name: tool.name } }, temperature: 0, max_tokens: 400 };
  const tc = await client.chat.completions.create(req);
  const c = tc.choices[0], m = c.message, calls = m.tool_calls || [];
  let args = null;
  try { args = JSON.parse(calls.length ? calls[0].function.arguments : 'null'); } catch (e) { args = e.message; }
  const enumCities = tool.parameters.properties.city.enum;
  console.log(`#   the call: ${JSON.stringify(calls.map((x) => x.function))}; reasoning ${JSON.stringify(m.reasoning_content || '')}; usage ${JSON.stringify(tc.usage)}`);
  check('harmony live: the forced call is one tool call to get_weather', calls.length === 1 && calls[0].type === 'function' && calls[0].function.name === tool.name && /^call_/.test(calls[0].id), m);
  check('harmony live: its arguments are JSON that keeps to the schema', args && typeof args === 'object' && enumCities.includes(args.city) && Object.keys(args).length === 1, args);
  check('harmony live: finish_reason tool_calls, content null', c.finish_reason === 'tool_calls' && m.content === null, c);
  check('harmony live: reasoning, where the model wrote an analysis, is a string', m.reasoning_content === undefined || m.reasoning_content === null || typeof m.reasoning_content === 'string', m);
  const want = opt('--prompt-tokens');
  if (want !== undefined)
    check(`harmony live: the prompt is as long as transformers renders it (${want} tokens)`, tc.usage.prompt_tokens === Number(want), tc.usage);
  check('harmony live: usage adds up', tc.usage.total_tokens === tc.usage.prompt_tokens + tc.usage.completion_tokens && tc.usage.completion_tokens > 0, tc.usage);

  const ts = await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
  const acc = [];
  let finish = null, reasoning = '', content = '', usage = null;
  for await (const k of ts) {
    if (k.usage) usage = k.usage;
    for (const ch of k.choices) {
      for (const d of ch.delta.tool_calls || []) {
        acc[d.index] = acc[d.index] || { id: '', name: '', args: '' };
        if (d.id) acc[d.index].id += d.id;
        if (d.function && d.function.name) acc[d.index].name += d.function.name;
        if (d.function && d.function.arguments) acc[d.index].args += d.function.arguments;
      }
      if (ch.delta.reasoning_content) reasoning += ch.delta.reasoning_content;
      if (ch.delta.content) content += ch.delta.content;
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  check('harmony live: streamed, the same call (greedy)', acc.length === 1 && calls.length === 1 && acc[0].name === calls[0].function.name && acc[0].args === calls[0].function.arguments && /^call_/.test(acc[0].id), [acc, calls]);
  check('harmony live: streamed finish_reason tool_calls, no content, the same reasoning', finish === 'tool_calls' && content === '' && reasoning === (m.reasoning_content || ''), [finish, content, reasoning]);
  check('harmony live: streamed usage equals the non-streamed', usage && usage.completion_tokens === tc.usage.completion_tokens && usage.prompt_tokens === tc.usage.prompt_tokens, usage);

  const prior = calls.length ? calls : [{ id: 'call_0', type: 'function', function: { name: tool.name, arguments: '{"city": "Paris"}' } }];
  const round = await client.chat.completions.create({ model, tools: conv.tools, reasoning_effort: 'low', temperature: 0, max_tokens: 16,
    messages: [...conv.messages,
      { role: 'assistant', content: null, reasoning_content: conv.earlier_reasoning, tool_calls: prior },
      { role: 'tool', tool_call_id: prior[0].id, content: conv.tool_result }] });
  const rc = round.choices[0];
  console.log(`#   the tool round: finish ${rc.finish_reason}, usage ${JSON.stringify(round.usage)}`);
  check('harmony live: the tool round with the earlier reasoning is served', rc.message.role === 'assistant' && ['stop', 'length', 'tool_calls'].includes(rc.finish_reason), rc);
  check('harmony live: the tool round\'s prompt holds the call and its result', round.usage.prompt_tokens > tc.usage.prompt_tokens + 10, [round.usage, tc.usage]);
  try {
    await client.chat.completions.create({ model, messages: conv.messages, reasoning_effort: 'max', max_tokens: 4 });
    check('harmony live: reasoning_effort max rejected', false);
  } catch (e) {
    check('harmony live: reasoning_effort max -> 400, param reasoning_effort', e.status === 400 && e.param === 'reasoning_effort', { status: e.status, param: e.param });
  }
  console.log(failures ? `# ${failures} check(s) failed` : '# all checks passed');
  process.exit(failures ? 1 : 0);
}

// Structured outputs through the client's own helpers: chat.completions.parse with a
// json_schema response_format (it JSON.parses the content; a finish_reason of length throws)
// and strict tools with tool_choice named and required (it JSON.parses the arguments). The
// demo model's random weights would write anything: only the server's grammar makes these
// outputs parse and fit the schema. The schemas hold no free strings, so that a random model
// ends well within max_tokens.
async function structuredOutputs(client, model) {
  const schema = {
    type: 'object', additionalProperties: false,
    properties: {
      unit: { enum: ['C', 'F'] }, days: { type: 'integer' }, rain: { type: 'boolean' },
      hours: { type: 'array', items: { type: 'integer' } }, note: { anyOf: [{ type: 'null' }, { type: 'number' }] },
    },
    required: ['unit', 'days', 'rain', 'hours', 'note'],
  };
  const fits = (x) => x && typeof x === 'object' && ['C', 'F'].includes(x.unit) && Number.isInteger(x.days) &&
    typeof x.rain === 'boolean' && Array.isArray(x.hours) && x.hours.every(Number.isInteger) &&
    (x.note === null || typeof x.note === 'number') && Object.keys(x).length === 5;
  let parsedOk = 0, ended = 0;
  for (const seed of [1, 2, 3, 4]) {
    try {
      const r = await client.chat.completions.parse({
        model, messages: [{ role: 'user', content: 'Forecast as JSON.' }], max_tokens: 400, seed,
        response_format: { type: 'json_schema', json_schema: { name: 'forecast', strict: true, schema } },
      });
      ended++;
      if (fits(r.choices[0].message.parsed) && r.choices[0].finish_reason === 'stop') parsedOk++;
      else check('json_schema output fits the schema', false, r.choices[0].message);
    } catch (e) {
      if (e.constructor.name !== 'LengthFinishReasonError') check('json_schema parse', false, String(e));
    }
  }
  check('json_schema: chat.completions.parse gives values that fit the schema', ended >= 2 && parsedOk === ended, { ended, parsedOk });

  const obj = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'JSON please.' }], max_tokens: 300, seed: 5, response_format: { type: 'json_object' } });
  if (obj.choices[0].finish_reason === 'stop') {
    let o = null;
    try { o = JSON.parse(obj.choices[0].message.content); } catch (e) { o = e.message; }
    check('json_object: the content is a JSON object', o !== null && typeof o === 'object' && !Array.isArray(o), obj.choices[0].message.content);
  }

  const tools = [
    { type: 'function', function: { name: 'set_mode', strict: true, parameters: { type: 'object', additionalProperties: false, properties: { mode: { enum: ['fast', 'slow'] }, level: { type: 'integer' } }, required: ['mode', 'level'] } } },
    { type: 'function', function: { name: 'reset', strict: true, parameters: { type: 'object', additionalProperties: false, properties: { hard: { type: 'boolean' } }, required: ['hard'] } } },
  ];
  const choices = [{ type: 'function', function: { name: 'set_mode' } }, 'required'];
  for (const tool_choice of choices) {
    const label = typeof tool_choice === 'string' ? tool_choice : 'named';
    let got = null;
    for (const seed of [1, 2, 3]) {
      try {
        got = await client.chat.completions.parse({ model, messages: [{ role: 'user', content: 'Go.' }], tools, tool_choice, max_tokens: 300, seed });
        break;
      } catch (e) {
        if (e.constructor.name !== 'LengthFinishReasonError') { check(`tool_choice ${label}`, false, String(e)); break; }
      }
    }
    const calls = got ? got.choices[0].message.tool_calls || [] : [];
    const c = calls[0];
    const okCall = c && (label === 'named' ? c.function.name === 'set_mode' : ['set_mode', 'reset'].includes(c.function.name)) &&
      (c.function.name === 'set_mode'
        ? ['fast', 'slow'].includes(c.function.parsed_arguments.mode) && Number.isInteger(c.function.parsed_arguments.level)
        : typeof c.function.parsed_arguments.hard === 'boolean');
    check(`tool_choice ${label}: one call whose parsed arguments fit the tool's parameters`, calls.length === 1 && okCall && got.choices[0].finish_reason === 'tool_calls', got && got.choices[0]);
  }

  try {
    await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'x' }], response_format: { type: 'json_schema', json_schema: { name: 'p', schema: { type: 'string', pattern: '^a+$' } } } });
    check('unsupported schema keyword rejected', false);
  } catch (e) {
    check('unsupported schema keyword -> 400 naming it', e.status === 400 && e.param === 'response_format' && /'pattern'/.test(e.message), { status: e.status, param: e.param, message: e.message });
  }
}

main().catch((e) => { console.error('FAIL', e); process.exit(1); });
