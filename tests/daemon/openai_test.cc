// The OpenAI layer's wire format, checked byte for byte against the documented shapes.
#include <doctest/doctest.h>

#include "daemon/openai/requests.h"
#include "daemon/openai/responses.h"
#include "daemon/openai/session.h"
#include "daemon/openai/stream.h"
#include "daemon/tokenizer/tokenizer.h"

using namespace spark;
using namespace spark::openai;

namespace {
const tok::Tokenizer& fixture() {
  static const tok::Tokenizer t = *tok::Tokenizer::from_file(
      std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/tokenizer/tokenizer.json");
  return t;
}
ApiError chat_error(const std::string& body, const Limits& l = {}) {
  auto r = parse_chat_request(body, l);
  REQUIRE_FALSE(r.ok());
  return r.error;
}
const char* kMsgs = R"("messages": [{"role": "user", "content": "Hi"}])";
template <typename F>
Limits limits_with(F f) {
  Limits l;
  f(l);
  return l;
}
std::string with(const std::string& extra) {
  return std::string("{") + kMsgs + (extra.empty() ? "" : ", " + extra) + "}";
}
}  // namespace

TEST_CASE("chat request: every field parses into the internal struct") {
  auto r = parse_chat_request(R"({
    "model": "demo",
    "messages": [
      {"role": "developer", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "tool_choice": "auto", "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": 42,
    "n": 2, "max_completion_tokens": 100, "stop": "END", "logprobs": true, "top_logprobs": 5,
    "stream": true, "stream_options": {"include_usage": true}, "user": "ignored-extra"})",
                              Limits{});
  REQUIRE_MESSAGE(r.ok(), r.error.message);
  const ChatRequest& c = *r.value;
  CHECK(c.model == "demo");
  REQUIRE(c.messages.size() == 4);
  CHECK(c.messages[0].role == "system");
  CHECK(c.messages[1].content == "Hello there");
  REQUIRE(c.messages[2].tool_calls.size() == 1);
  CHECK(c.messages[2].tool_calls[0].arguments == "{\"city\": \"Paris\"}");
  CHECK(c.messages[3].tool_call_id == "call_1");
  CHECK(c.tools.size() == 1);
  CHECK(c.tool_choice.kind == ToolChoice::Kind::auto_);
  const Sampling& s = c.sampling;
  CHECK(s.temperature == 0.5);
  CHECK(s.top_p == 0.9);
  CHECK(s.top_k == 40);
  CHECK(s.min_p == 0.05);
  CHECK(s.presence_penalty == 0.5);
  CHECK(s.frequency_penalty == -0.5);
  CHECK(s.repetition_penalty == doctest::Approx(1.1));
  CHECK(s.seed == 42u);
  CHECK(s.n == 2);
  CHECK(s.max_tokens == 100);
  CHECK(s.stop == std::vector<std::string>{"END"});
  CHECK(s.logprobs);
  CHECK(s.top_logprobs == 5);
  CHECK(c.stream);
  CHECK(c.include_usage);
}

TEST_CASE("chat request: defaults, stop lists, max_tokens alias") {
  auto r = parse_chat_request(with(R"("stop": ["a", "b"], "max_tokens": 7)"), Limits{});
  REQUIRE(r.ok());
  CHECK(r.value->sampling.stop == std::vector<std::string>{"a", "b"});
  CHECK(r.value->sampling.max_tokens == 7);
  CHECK(r.value->sampling.temperature == 1.0);
  CHECK_FALSE(r.value->stream);
  CHECK(r.value->tool_choice.kind == ToolChoice::Kind::none);  // no tools
  auto d = parse_chat_request(with(""), Limits{});
  REQUIRE(d.ok());
  CHECK_FALSE(d.value->sampling.max_tokens);
}

TEST_CASE("chat request: response_format and forced tool_choice parse (structured outputs)") {
  const char* tools = R"("tools": [{"type": "function", "function": {"name": "f"}},
                                     {"type": "function", "function": {"name": "g"}}])";
  auto one = [&](const std::string& extra) {
    auto r = parse_chat_request(
        R"({"messages": [{"role": "user", "content": "x"}], )" + extra + "}", Limits{});
    REQUIRE_MESSAGE(r.ok(), r.error.message);
    return *r.value;
  };
  CHECK(one(R"("response_format": {"type": "json_object"})").response_format.kind ==
        ResponseFormat::Kind::json_object);
  auto js = one(R"("response_format": {"type": "json_schema", "json_schema": {"name": "n",
      "strict": true, "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}})");
  CHECK(js.response_format.kind == ResponseFormat::Kind::json_schema);
  CHECK(js.response_format.name == "n");
  CHECK(js.response_format.schema["properties"]["a"]["type"] == "string");
  CHECK(one(R"("response_format": {"type": "text"})").response_format.kind ==
        ResponseFormat::Kind::text);
  CHECK(one(std::string(tools) + R"(, "tool_choice": "required")").tool_choice.kind ==
        ToolChoice::Kind::required);
  auto named = one(std::string(tools) +
                   R"(, "tool_choice": {"type": "function", "function": {"name": "g"}})");
  CHECK(named.tool_choice.kind == ToolChoice::Kind::named);
  CHECK(named.tool_choice.name == "g");
}

TEST_CASE("chat request errors name the field, in OpenAI's error shape") {
  ApiError e = chat_error(with(R"("temperature": 3)"));
  CHECK(e.status == 400);
  CHECK(e.param == "temperature");
  CHECK(
      error_body(e).dump() ==
      R"({"error":{"message":"'temperature' is 3; it must be >= 0 and <= 2.","type":"invalid_request_error","param":"temperature","code":null}})");
  CHECK(chat_error("{not json").param.empty());
  CHECK(chat_error(R"({"model": "m"})").param == "messages");
  CHECK(chat_error(R"({"messages": []})").param == "messages");
  CHECK(chat_error(R"({"messages": [{"role": "wizard", "content": "x"}]})").param ==
        "messages[0].role");
  CHECK(
      chat_error(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})").param ==
      "messages[0].content");
  CHECK(chat_error(with(R"("top_logprobs": 21, "logprobs": true)")).param == "top_logprobs");
  CHECK(chat_error(with(R"("top_logprobs": 2)")).param == "top_logprobs");
  CHECK(chat_error(with(R"("n": 0)")).param == "n");
  CHECK(chat_error(with(R"("max_tokens": 0)")).param == "max_tokens");
  CHECK(chat_error(with(R"("max_tokens": 1.5)")).param == "max_tokens");
  CHECK(chat_error(with(R"("stop": [1])")).param == "stop");
  CHECK(chat_error(with(R"("stop": ["a","b","c","d","e"])"),
                   limits_with([](Limits& l) { l.max_stop = 4; }))
            .param == "stop");
  CHECK(chat_error(with(R"("stream_options": {"include_usage": true})")).param == "stream_options");
  CHECK(chat_error(with(R"("top_p": 0)")).param == "top_p");
  CHECK(chat_error(with(R"("seed": "x")")).param == "seed");
  CHECK(chat_error(with(R"("tools": [{"type": "function", "function": {"name": "bad name"}}])"))
            .param == "tools[0].function.name");
  // Forced tool calls: "required" needs tools; a named function must be one of them.
  CHECK(chat_error(with(R"("tool_choice": "required")")).param == "tool_choice");
  CHECK(chat_error(with(R"("tools": [{"type": "function", "function": {"name": "f"}}],
                           "tool_choice": {"type": "function", "function": {"name": "g"}})"))
            .param == "tool_choice");
  CHECK(chat_error(with(R"("max_tokens": 5000)"),
                   limits_with([](Limits& l) { l.max_tokens_cap = 4096; }))
            .param == "max_tokens");
  CHECK(chat_error(with(R"("response_format": {"type": "xml"})")).param == "response_format.type");
  CHECK(chat_error(with(R"("response_format": {"type": "json_schema"})")).param ==
        "response_format.json_schema");
  CHECK(chat_error(
            with(R"("response_format": {"type": "json_schema", "json_schema": {"schema": {}}})"))
            .param == "response_format.json_schema.name");
  CHECK(parse_chat_request(with(R"("response_format": {"type": "text"}, "logit_bias": {})"), {})
            .ok());
  CHECK(chat_error(with(R"("logit_bias": {"5": 10})")).param == "logit_bias");
  CHECK(chat_error(with(R"("functions": [])")).param == "functions");
  // A tool result must name the call it answers.
  CHECK(chat_error(R"({"messages": [{"role": "user", "content": "x"},
                                    {"role": "tool", "content": "sunny"}]})")
            .param == "messages[1].tool_call_id");
  CHECK(
      chat_error(R"({"messages": [{"role": "tool", "tool_call_id": "", "content": "y"}]})").param ==
      "messages[0].tool_call_id");
  CHECK(
      chat_error(R"({"messages": [{"role": "tool", "tool_call_id": 7, "content": "y"}]})").param ==
      "messages[0].tool_call_id");
  ApiError big = chat_error(with(""), limits_with([](Limits& l) { l.max_body_bytes = 10; }));
  CHECK(big.status == 413);
  CHECK(big.code == "request_too_large");
}

TEST_CASE("context_length_exceeded in OpenAI's words; unset max_tokens fills the context") {
  Sampling s;
  s.max_tokens = 100;
  auto r = resolve_max_tokens(s, 4000, 4096, "messages");
  REQUIRE_FALSE(r.ok());
  CHECK(r.error.code == "context_length_exceeded");
  CHECK(r.error.param == "messages");
  CHECK(r.error.message ==
        "This model's maximum context length is 4096 tokens. However, you requested 4100 tokens "
        "(4000 in the messages, 100 in the completion). Please reduce the length of the messages "
        "or completion.");
  s.max_tokens.reset();
  CHECK(*resolve_max_tokens(s, 4000, 4096, "messages").value == 96);
  CHECK_FALSE(resolve_max_tokens(s, 4096, 4096, "prompt").ok());
  CHECK(check_model("", "demo") == std::nullopt);
  auto nf = check_model("gpt-4", "demo");
  REQUIRE(nf);
  CHECK(nf->status == 404);
  CHECK(nf->code == "model_not_found");
}

TEST_CASE("completion request: prompt forms, integer logprobs, default max_tokens 16") {
  auto r = parse_completion_request(
      R"({"model": "m", "prompt": "Once", "logprobs": 3, "echo": true})", {});
  REQUIRE(r.ok());
  CHECK(std::get<std::string>(r.value->prompt) == "Once");
  CHECK(r.value->sampling.logprobs);
  CHECK(r.value->sampling.top_logprobs == 3);
  CHECK(r.value->sampling.max_tokens == 16);
  CHECK(r.value->echo);
  auto ids = parse_completion_request(R"({"prompt": [[1, 2, 3]]})", {});
  REQUIRE(ids.ok());
  CHECK(std::get<std::vector<int32_t>>(ids.value->prompt) == std::vector<int32_t>{1, 2, 3});
  CHECK(parse_completion_request(R"({"prompt": ["a", "b"]})", {}).error.param == "prompt");
  CHECK(parse_completion_request(R"({"prompt": [-1]})", {}).error.param == "prompt");
  CHECK(parse_completion_request(R"({"model": "m"})", {}).error.param == "prompt");
  CHECK(parse_completion_request(R"({"prompt": "x", "logprobs": 21})", {}).error.param ==
        "logprobs");
}

TEST_CASE("chat.completion body, exact wire format") {
  ResponseMeta m{"chatcmpl-abc", 1700000000, "demo"};
  Choice c;
  c.text = "Hello!";
  c.finish_reason = "stop";
  CHECK(
      chat_completion(m, {c}, Usage{5, 2}, fixture()).dump() ==
      R"({"id":"chatcmpl-abc","object":"chat.completion","created":1700000000,"model":"demo",)"
      R"("choices":[{"index":0,"message":{"role":"assistant","content":"Hello!"},"logprobs":null,)"
      R"("finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}})");
  Choice t;
  t.tool_calls.push_back({0, "call_1", "get_weather", "{\"city\": \"Paris\"}"});
  t.finish_reason = "tool_calls";
  CHECK(
      chat_completion(m, {t}, Usage{1, 1}, fixture())["choices"][0].dump() ==
      R"({"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1",)"
      R"("type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},)"
      R"("logprobs":null,"finish_reason":"tool_calls"})");
}

TEST_CASE("chat.completion.chunk stream: role first, usage null, usage chunk, [DONE]") {
  ResponseMeta m{"chatcmpl-x", 1, "demo"};
  ChatDelta first;
  first.role = true;
  first.content = "";
  CHECK(sse_event(chat_chunk(m, first, true, fixture())) ==
        "data: {\"id\":\"chatcmpl-x\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":"
        "\"demo\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
        "\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n");
  ChatDelta last;
  last.finish_reason = "length";
  CHECK(chat_chunk(m, last, false, fixture()).dump() ==
        R"({"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"demo",)"
        R"("choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]})");
  ChatDelta tc;
  tc.tool_calls.push_back({1, "call_2", "f", "{}"});
  CHECK(
      chat_chunk(m, tc, false, fixture())["choices"][0]["delta"].dump() ==
      R"({"tool_calls":[{"index":1,"id":"call_2","type":"function","function":{"name":"f","arguments":"{}"}}]})");
  CHECK(
      usage_chunk(m, "chat.completion.chunk", Usage{3, 4}).dump() ==
      R"({"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"demo","choices":[],)"
      R"("usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}})");
  CHECK(sse_done() == "data: [DONE]\n\n");
  // With the prefix cache's count known: OpenAI's prompt_tokens_details.cached_tokens.
  Usage cached{30, 4};
  cached.cached_tokens = 16;
  CHECK(
      usage_json(cached).dump() ==
      R"({"prompt_tokens":30,"completion_tokens":4,"total_tokens":34,"prompt_tokens_details":{"cached_tokens":16}})");
}

TEST_CASE("text_completion body and chunk; logprobs in both shapes") {
  const tok::Tokenizer& t = fixture();
  auto ids = t.encode("Hi there", false);
  REQUIRE(ids.size() >= 2);
  std::vector<TokenLogprobs> lp = {{ids[0], -0.5f, {{ids[0], -0.5f}, {ids[1], -1.5f}}},
                                   {ids[1], -0.25f, {}}};
  ResponseMeta m{"cmpl-1", 2, "demo"};
  Choice c;
  c.text = "Hi there";
  c.finish_reason = "length";
  c.logprobs = lp;
  Json body = text_completion(m, {c}, Usage{1, 2}, t);
  CHECK(body["object"] == "text_completion");
  CHECK(body["choices"][0]["text"] == "Hi there");
  Json l = body["choices"][0]["logprobs"];
  CHECK(l["tokens"].size() == 2);
  CHECK(l["token_logprobs"][0] == -0.5);
  CHECK(l["text_offset"][0] == 0);
  CHECK(l["text_offset"][1] == std::string(t.token_bytes(ids[0])).size());
  CHECK(l["top_logprobs"][0].size() == 2);
  Json chunk = completion_chunk(m, 0, "Hi", std::nullopt, false, std::nullopt, 0, t);
  CHECK(
      chunk.dump() ==
      R"({"id":"cmpl-1","object":"text_completion","created":2,"model":"demo","choices":[{"index":0,"text":"Hi","logprobs":null,"finish_reason":null}]})");
  Json cl = chat_logprobs_json(lp, t);
  CHECK(cl["content"][0]["token"] == std::string(t.token_bytes(ids[0])));
  CHECK(cl["content"][0]["logprob"] == -0.5);
  CHECK(cl["content"][0]["bytes"].size() == t.token_bytes(ids[0]).size());
  CHECK(cl["content"][0]["top_logprobs"].size() == 2);
  CHECK(cl["content"][1]["top_logprobs"].empty());
}

TEST_CASE("StopMatcher holds back partial matches and cuts at the stop string") {
  StopMatcher s({"END", "\n\n"});
  CHECK(s.push("Hello E").text == "Hello ");
  CHECK(s.push("N").text.empty());
  auto o = s.push("Dless");
  CHECK(o.text.empty());
  CHECK(o.stopped);
  CHECK(s.push("more").text.empty());
  StopMatcher t({"END"});
  CHECK(t.push("The EN").text == "The ");
  CHECK(t.push("d").text == "ENd");
  CHECK(t.push("E").text.empty());
  CHECK(t.finish() == "E");
  StopMatcher none({});
  CHECK(none.push("abc").text == "abc");
}

TEST_CASE("ChoiceStream: tokens to text with a stop string across token boundaries") {
  const tok::Tokenizer& t = fixture();
  auto ids = t.encode("The answer is 42.\n\nUser: next question", false);
  ChoiceStreamOptions opt;
  opt.stop = {"\n\nUser:"};
  ChoiceStream cs(t, opt);
  std::string out;
  bool stopped = false;
  for (auto id : ids) {
    auto s = cs.push(id);
    out += s.content;
    if (s.stopped) {
      stopped = true;
      break;
    }
  }
  CHECK(stopped);
  CHECK(out == "The answer is 42.");
  CHECK(cs.finish_reason("stop") == "stop");
}

TEST_CASE("ChoiceStream: Qwen tool call streamed token by token becomes one tool_calls delta") {
  const tok::Tokenizer& t = fixture();
  auto ids = t.encode(
      "Checking.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"東京\"}}\n</tool_call>",
      false);
  ChoiceStreamOptions opt;
  opt.parse_tool_calls = true;
  opt.family = tok::ChatFamily::chatml;
  ChoiceStream cs(t, opt);
  std::string content;
  std::vector<tok::ParsedToolCall> calls;
  for (auto id : ids) {
    auto s = cs.push(id);
    content += s.content;
    for (auto& c : s.calls) calls.push_back(c);
  }
  auto f = cs.finish();
  content += f.content;
  for (auto& c : f.calls) calls.push_back(c);
  CHECK(content == "Checking.");
  REQUIRE(calls.size() == 1);
  CHECK(calls[0].name == "get_weather");
  CHECK(calls[0].arguments == "{\"city\": \"東京\"}");
  CHECK(cs.finish_reason("stop") == "tool_calls");
  CHECK(cs.finish_reason("length") == "length");
}

TEST_CASE("/tokenize and /detokenize bodies") {
  auto r =
      parse_tokenize_request(R"({"model": "demo", "prompt": "Hi", "return_token_strs": true})", {});
  REQUIRE(r.ok());
  CHECK(r.value->prompt == "Hi");
  CHECK(r.value->add_special_tokens);
  auto chat = parse_tokenize_request(R"({"messages": [{"role": "user", "content": "x"}]})", {});
  REQUIRE(chat.ok());
  CHECK(chat.value->messages.size() == 1);
  CHECK_FALSE(chat.value->add_special_tokens);
  CHECK(parse_tokenize_request(R"({"model": "demo"})", {}).error.param == "prompt");
  const tok::Tokenizer& t = fixture();
  auto ids = t.encode("Hi", false);
  Json body = tokenize_response(ids, 4096, true, t);
  CHECK(body["count"] == ids.size());
  CHECK(body["max_model_len"] == 4096);
  CHECK(body["tokens"].get<std::vector<int32_t>>() == ids);
  CHECK(body["token_strs"].size() == ids.size());
  auto d = parse_detokenize_request(R"({"tokens": [1, 2, 3]})", {});
  REQUIRE(d.ok());
  CHECK(d.value->tokens == std::vector<int32_t>{1, 2, 3});
  CHECK(parse_detokenize_request(R"({"tokens": "abc"})", {}).error.param == "tokens");
  CHECK(detokenize_response("Hi").dump() == R"({"prompt":"Hi"})");
  CHECK(
      models_list("demo", 5, 4096).dump() ==
      R"({"object":"list","data":[{"id":"demo","object":"model","created":5,"owned_by":"sparkctl","max_model_len":4096}]})");
  CHECK(make_response_id("chatcmpl-").size() == 9 + 24);
}

namespace {
ChatRequest chat_req(const std::string& extra) {
  auto r = parse_chat_request(with(extra), Limits{});
  REQUIRE_MESSAGE(r.ok(), r.error.message);
  return *r.value;
}
tok::ChatFormat chatml() {
  return *tok::choose_chat_format("chatml", Json::object(), "", nullptr);
}
// Splits an SSE body into its JSON events (and "[DONE]").
std::vector<std::string> events(const std::string& sse) {
  std::vector<std::string> out;
  size_t pos = 0;
  while ((pos = sse.find("data: ", pos)) != std::string::npos) {
    size_t end = sse.find("\n\n", pos);
    out.push_back(sse.substr(pos + 6, end - pos - 6));
    pos = end + 2;
  }
  return out;
}
}  // namespace

TEST_CASE("prepare_chat renders, encodes and budgets; context overflow is an API error") {
  const tok::Tokenizer& t = fixture();
  auto p = prepare_chat(chat_req(R"("max_tokens": 5)"), t, chatml(), 4096);
  REQUIRE(p.ok());
  CHECK(p.value->text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  CHECK(p.value->ids == t.encode(p.value->text, false));
  CHECK(p.value->max_tokens == 5);
  auto over = prepare_chat(chat_req(R"("max_tokens": 5)"), t, chatml(), 8);
  REQUIRE_FALSE(over.ok());
  CHECK(over.error.code == "context_length_exceeded");
  auto cr = parse_completion_request(R"({"prompt": [1, 999999]})", {});
  REQUIRE(cr.ok());
  CHECK(prepare_completion(*cr.value, t, 4096).error.param == "prompt");
}

TEST_CASE("CompletionWriter streaming: role, content, finish on the stop token, usage, [DONE]") {
  const tok::Tokenizer& t = fixture();
  ChatRequest req = chat_req(R"("stream": true, "stream_options": {"include_usage": true})");
  int32_t eot = *t.token_to_id("<|im_end|>");
  CompletionWriter r(req, t, chatml(), "demo", 9, {eot});
  CHECK(std::string(r.content_type()) == "text/event-stream");
  std::string sse = r.start();
  for (auto id : t.encode("Hi 👋", false)) sse += r.token(0, id);
  sse += r.token(0, eot);
  CHECK(r.finished(0));
  CHECK(r.token(0, 42).empty());  // after the end nothing more is sent
  sse += r.done();
  auto ev = events(sse);
  REQUIRE(ev.size() >= 4);
  CHECK(Json::parse(ev.front())["choices"][0]["delta"]["role"] == "assistant");
  std::string text;
  for (size_t i = 1; i + 2 < ev.size(); ++i)
    text += Json::parse(ev[i])["choices"][0]["delta"].value("content", "");
  CHECK(text == "Hi 👋");
  Json fin = Json::parse(ev[ev.size() - 3]);
  CHECK(fin["choices"][0]["finish_reason"] == "stop");
  Json usage = Json::parse(ev[ev.size() - 2]);
  CHECK(usage["choices"].empty());
  CHECK(usage["usage"]["prompt_tokens"] == 9);
  CHECK(usage["usage"]["completion_tokens"] == t.encode("Hi 👋", false).size() + 1);
  CHECK(ev.back() == "[DONE]");
}

TEST_CASE("CompletionWriter non-streaming: n choices, stop string, length, logprobs") {
  const tok::Tokenizer& t = fixture();
  ChatRequest req = chat_req(R"("n": 2, "stop": ["world"], "logprobs": true, "top_logprobs": 1)");
  CompletionWriter r(req, t, chatml(), "demo", 3, {});
  CHECK(r.start().empty());
  for (auto id : t.encode("Hello world and more", false)) {
    CHECK(r.token(0, id, TokenLogprobs{id, -1.0f, {{id, -1.0f}}}).empty());
    if (r.finished(0)) break;
  }
  CHECK(r.finished(0));
  for (auto id : t.encode("Hello", false)) r.token(1, id, TokenLogprobs{id, -1.0f, {}});
  CHECK(r.finish(1, "length").empty());
  Json body = Json::parse(r.done());
  CHECK(body["object"] == "chat.completion");
  CHECK(body["choices"][0]["message"]["content"] == "Hello ");
  CHECK(body["choices"][0]["finish_reason"] == "stop");
  CHECK(body["choices"][1]["message"]["content"] == "Hello");
  CHECK(body["choices"][1]["finish_reason"] == "length");
  CHECK(body["choices"][0]["logprobs"]["content"].size() >= 1);
}

TEST_CASE("CompletionWriter completions with echo") {
  const tok::Tokenizer& t = fixture();
  auto req = parse_completion_request(R"({"prompt": "Once", "echo": true, "max_tokens": 3})", {});
  REQUIRE(req.ok());
  CompletionWriter r(*req.value, t, "demo", 1, {}, "Once");
  for (auto id : t.encode(" upon", false)) r.token(0, id);
  r.finish(0, "length");
  Json body = Json::parse(r.done());
  CHECK(body["object"] == "text_completion");
  CHECK(body["choices"][0]["text"] == "Once upon");
  CHECK(body["choices"][0]["finish_reason"] == "length");
}

TEST_CASE(
    "completion request: echo with logprobs asks for prompt logprobs; max_tokens 0 needs echo") {
  auto r = parse_completion_request(
      R"({"prompt": "Once", "echo": true, "logprobs": 2, "max_tokens": 0})", {});
  REQUIRE(r.ok());
  CHECK(r.value->sampling.prompt_logprobs == 2);
  CHECK(*r.value->sampling.max_tokens == 0);
  CHECK(*resolve_max_tokens(r.value->sampling, 5, 16, "prompt").value == 0);
  CHECK_FALSE(resolve_max_tokens(r.value->sampling, 16, 16, "prompt").ok());  // no room at all
  auto plain = parse_completion_request(R"({"prompt": "Once", "echo": true})", {});
  REQUIRE(plain.ok());
  CHECK(plain.value->sampling.prompt_logprobs == -1);  // echo alone computes no prompt logits
  auto lp = parse_completion_request(R"({"prompt": "Once", "logprobs": 1})", {});
  REQUIRE(lp.ok());
  CHECK(lp.value->sampling.prompt_logprobs == -1);
  CHECK(parse_completion_request(R"({"prompt": "x", "max_tokens": 0})", {}).error.param ==
        "max_tokens");
  CHECK(chat_error(with(R"("max_tokens": 0)")).param == "max_tokens");
}

TEST_CASE("CompletionWriter echo with logprobs: prompt tokens first, first null, text offsets") {
  const tok::Tokenizer& t = fixture();
  const int32_t bos = *t.token_to_id("<|endoftext|>");  // a special token the text does not spell
  const std::string prompt = "caf\xc3\xa9 au lait";     // 'é': two bytes, one character
  std::vector<int32_t> ids = {bos};
  for (auto id : t.encode(prompt, false)) ids.push_back(id);
  const std::vector<int32_t> gen = t.encode(" ok", false);
  std::vector<TokenLogprobs> scored;
  for (size_t i = 1; i < ids.size(); ++i)
    scored.push_back({ids[i], -0.5f * static_cast<float>(i), {{ids[i], -0.1f}}});
  for (bool stream : {false, true}) {
    CAPTURE(stream);
    auto req = parse_completion_request(
        std::string(R"({"prompt": "x", "echo": true, "logprobs": 1, "max_tokens": 4, "stream": )") +
            (stream ? "true" : "false") + "}",
        {});
    REQUIRE(req.ok());
    CompletionWriter r(*req.value, t, "demo", static_cast<int>(ids.size()), {}, prompt);
    CHECK(r.start().empty());  // the echo waits for its logprobs
    std::string out = r.prompt_logprobs(0, ids, scored);
    for (auto id : gen) out += r.token(0, id, TokenLogprobs{id, -1.0f, {}});
    out += r.finish(0, "length");
    out += r.done();
    Json lp;
    std::string text;
    if (stream) {
      // The first chunk is the echoed prompt with its logprobs; then one chunk per token.
      auto first = Json::parse(out.substr(6, out.find("\n\n") - 6));
      CHECK(first["choices"][0]["text"] == prompt);
      CHECK(first["choices"][0]["logprobs"]["tokens"].size() == ids.size());
      lp = first["choices"][0]["logprobs"];
      text = prompt;
    } else {
      Json body = Json::parse(out);
      text = body["choices"][0]["text"];
      CHECK(text == prompt + " ok");
      lp = body["choices"][0]["logprobs"];
      REQUIRE(lp["tokens"].size() == ids.size() + gen.size());
    }
    CHECK(lp["token_logprobs"][0].is_null());
    CHECK(lp["top_logprobs"][0].is_null());
    CHECK(lp["token_logprobs"][1] == -0.5);
    CHECK(lp["top_logprobs"][1].size() == 1);
    // Offsets count characters of the returned text: the special token takes no room, 'é'
    // one character.
    CHECK(lp["text_offset"][0] == 0);
    CHECK(lp["text_offset"][1] == 0);
    size_t chars = 0;
    for (size_t i = 1; i < ids.size(); ++i) {
      CHECK(lp["text_offset"][i] == chars);
      chars += utf8_chars(t.token_bytes(ids[i]));
    }
    CHECK(chars == 12);  // "café au lait"
    if (!stream) CHECK(lp["text_offset"][ids.size()] == 12);
  }
}

TEST_CASE("toolkit errors map to OpenAI statuses and types") {
  CHECK(from_error(make_error(Errc::usage, "x")).status == 400);
  auto nf = from_error(make_error(Errc::not_found, "gone"), "model");
  CHECK(nf.status == 404);
  CHECK(nf.type == "not_found_error");
  CHECK(nf.param == "model");
  CHECK(from_error(make_error(Errc::resource, "full")).status == 429);
  CHECK(from_error(make_error(Errc::busy, "b")).status == 503);
  CHECK(from_error(make_error(Errc::timeout, "t")).status == 504);
  auto internal = from_error(make_error(Errc::internal, "bug"));
  CHECK(internal.status == 500);
  CHECK(internal.type == "server_error");
  // Invalid UTF-8 in generated text never breaks the JSON of an SSE event.
  Json j;
  j["text"] = std::string("ok\xFF");
  CHECK(sse_event(j) == "data: {\"text\":\"ok\xEF\xBF\xBD\"}\n\n");
}

TEST_CASE(
    "chat request: chat_template_kwargs, reasoning_content, null content reach the template") {
  auto r = parse_chat_request(
      R"({"messages": [{"role": "user", "content": "Hi"},
          {"role": "assistant", "content": null, "reasoning_content": "hmm",
           "tool_calls": [{"id": "c1", "type": "function",
                           "function": {"name": "f", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "ok"},
          {"role": "assistant", "reasoning": "r2", "content": "done"}],
          "chat_template_kwargs": {"enable_thinking": false, "custom": [1]}})",
      {});
  REQUIRE(r.ok());
  CHECK(r.value->chat_template_kwargs.dump() == R"({"enable_thinking":false,"custom":[1]})");
  CHECK_FALSE(r.value->messages[0].content_null);
  CHECK(r.value->messages[1].content_null);
  CHECK(r.value->messages[1].reasoning_content == "hmm");
  CHECK(r.value->messages[3].reasoning_content == "r2");
  CHECK(chat_error(with(R"("chat_template_kwargs": [1])")).param == "chat_template_kwargs");
  ApiError reserved = chat_error(with(R"("chat_template_kwargs": {"messages": []})"));
  CHECK(reserved.param == "chat_template_kwargs");
  CHECK(reserved.message.find("'messages'") != std::string::npos);
  CHECK(
      chat_error(R"({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 5}]})")
          .param == "messages[0].reasoning_content");

  // Through prepare_chat into a template that shows what it was given.
  tok::Json cfg = tok::Json::object();
  cfg["chat_template"] =
      "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.reasoning_content }}|"
      "{% endfor %}{{ enable_thinking }}";
  auto fmt = tok::choose_chat_format("", cfg, "", nullptr);
  REQUIRE(fmt.ok());
  auto p = prepare_chat(*r.value, fixture(), *fmt, 4096);
  REQUIRE(p.ok());
  // (The template never shows tool calls, so a null content reaches it as "".)
  CHECK(p.value->text == "user:Hi||assistant:|hmm|tool:ok||assistant:done|r2|False");
  // A template's raise_exception becomes a 400 naming messages.
  cfg["chat_template"] = "{{ raise_exception('Only user and assistant roles are supported!') }}";
  auto strict = tok::choose_chat_format("", cfg, "", nullptr);
  REQUIRE(strict.ok());
  auto bad = prepare_chat(*r.value, fixture(), *strict, 4096);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error.status == 400);
  CHECK(bad.error.param == "messages");
  CHECK(bad.error.message.find("Only user and assistant roles are supported!") !=
        std::string::npos);
}
