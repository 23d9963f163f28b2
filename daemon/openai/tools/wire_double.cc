// openai_wire_double: answers ONE OpenAI API request with this project's request parser and
// response builders, the engine replaced by a test double that "generates" a fixed text
// (tokenized with a real tokenizer.json). It lets the official OpenAI client check our wire
// format end to end without a model (tests/e2e/openai_client/client_test.js --wire).
//   openai_wire_double TOKENIZER_JSON METHOD PATH < body
// Prints {"status": N, "content_type": "...", "body": "..."} on stdout.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>

#include "daemon/openai/requests.h"
#include "daemon/openai/responses.h"
#include "daemon/openai/stream.h"
#include "daemon/tokenizer/tokenizer.h"

using namespace spark;
using namespace spark::openai;

namespace {
const char* kModel = "sparkd-wire-double";
constexpr int kContext = 1024;

void reply(int status, const std::string& type, const std::string& body) {
  Json j;
  j["status"] = status;
  j["content_type"] = type;
  j["body"] = body;
  std::cout << j.dump() << "\n";
}
void reply_error(const ApiError& e) {
  reply(e.status, "application/json", error_body(e).dump());
}

// The double's "generation" for choice `i`: fixed text, cut at max_tokens.
struct Generated {
  std::vector<int32_t> ids;
  std::string finish = "stop";
};
Generated generate(const tok::Tokenizer& t, const std::string& text, int max_tokens) {
  Generated g;
  g.ids = t.encode(text, false);
  if (static_cast<int>(g.ids.size()) > max_tokens) {
    g.ids.resize(static_cast<size_t>(max_tokens));
    g.finish = "length";
  }
  return g;
}
std::vector<TokenLogprobs> fake_logprobs(const std::vector<int32_t>& ids, int top) {
  std::vector<TokenLogprobs> out;
  for (auto id : ids) {
    TokenLogprobs lp{id, -0.25f, {}};
    for (int k = 0; k < top; ++k) lp.top.push_back({k == 0 ? id : 10 + k, -0.25f - k});
    out.push_back(lp);
  }
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON METHOD PATH < body\n", argv[0]);
    return 2;
  }
  auto tok = tok::Tokenizer::from_file(argv[1]);
  if (!tok) {
    std::fprintf(stderr, "%s\n", tok.error().message.c_str());
    return 1;
  }
  std::string method = argv[2], path = argv[3];
  std::string body((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  Limits limits;
  limits.max_tokens_cap = kContext;
  ResponseMeta meta{"", 1700000000, kModel};

  if (method == "GET" && path.ends_with("/models")) {
    reply(200, "application/json", models_list(kModel, 1700000000, kContext).dump());
    return 0;
  }
  if (path.ends_with("/chat/completions")) {
    auto r = parse_chat_request(body, limits);
    if (!r.ok()) return reply_error(r.error), 0;
    ChatRequest& req = *r.value;
    if (auto e = check_model(req.model, kModel)) return reply_error(*e), 0;
    auto fmt = tok::choose_chat_format("chatml", Json::object(), "", &*tok);
    Json tools = req.tool_choice.kind == ToolChoice::Kind::none ? Json::array() : req.tools;
    auto prompt = tok::render_chat(*fmt, req.messages, tools, req.add_generation_prompt);
    if (!prompt) return reply_error(from_error(prompt.error(), "messages")), 0;
    int prompt_tokens = static_cast<int>(tok->encode(*prompt, false).size());
    auto budget = resolve_max_tokens(req.sampling, prompt_tokens, kContext, "messages");
    if (!budget.ok()) return reply_error(budget.error), 0;
    std::string text = "Hello from sparkd, a test double. 👋🏽";
    if (!tools.empty())
      text = "<tool_call>\n{\"name\": \"" + tools[0]["function"]["name"].get<std::string>() +
             "\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    meta.id = make_response_id("chatcmpl-");
    std::vector<Choice> choices;
    std::string sse;
    Usage usage{prompt_tokens, 0};
    for (int i = 0; i < req.sampling.n; ++i) {
      Generated g = generate(*tok, text, *budget.value);
      usage.completion_tokens += static_cast<int>(g.ids.size());
      ChoiceStreamOptions opt;
      opt.stop = req.sampling.stop;
      opt.parse_tool_calls = !tools.empty();
      ChoiceStream cs(*tok, opt);
      Choice c;
      c.index = i;
      std::string reason = g.finish;
      if (req.stream) {
        ChatDelta first;
        first.index = i;
        first.role = true;
        first.content = "";
        sse += sse_event(chat_chunk(meta, first, req.include_usage, *tok));
      }
      auto emit = [&](ChoiceStream::Step s, std::optional<std::vector<TokenLogprobs>> lp) {
        c.text += s.content;
        for (auto& tc : s.calls) c.tool_calls.push_back(tc);
        if (req.stream && (!s.content.empty() || !s.calls.empty() || lp)) {
          ChatDelta d;
          d.index = i;
          if (!s.content.empty()) d.content = s.content;
          d.tool_calls = s.calls;
          d.logprobs = lp;
          sse += sse_event(chat_chunk(meta, d, req.include_usage, *tok));
        }
        if (s.stopped) reason = "stop";
      };
      for (auto id : g.ids) {
        auto s = cs.push(id);
        std::optional<std::vector<TokenLogprobs>> lp;
        if (req.sampling.logprobs) lp = fake_logprobs({id}, req.sampling.top_logprobs);
        bool stopped = s.stopped;
        emit(std::move(s), lp);
        if (stopped) break;
      }
      emit(cs.finish(), std::nullopt);
      c.finish_reason = cs.finish_reason(reason);
      if (req.sampling.logprobs) c.logprobs = fake_logprobs(g.ids, req.sampling.top_logprobs);
      if (req.stream) {
        ChatDelta last;
        last.index = i;
        last.finish_reason = c.finish_reason;
        sse += sse_event(chat_chunk(meta, last, req.include_usage, *tok));
      }
      choices.push_back(std::move(c));
    }
    if (req.stream) {
      if (req.include_usage) sse += sse_event(usage_chunk(meta, "chat.completion.chunk", usage));
      sse += sse_done();
      reply(200, "text/event-stream", sse);
    } else {
      reply(200, "application/json", chat_completion(meta, choices, usage, *tok).dump());
    }
    return 0;
  }
  if (path.ends_with("/completions")) {
    auto r = parse_completion_request(body, limits);
    if (!r.ok()) return reply_error(r.error), 0;
    CompletionRequest& req = *r.value;
    if (auto e = check_model(req.model, kModel)) return reply_error(*e), 0;
    std::vector<int32_t> prompt_ids = std::holds_alternative<std::string>(req.prompt)
                                          ? tok->encode(std::get<std::string>(req.prompt), true)
                                          : std::get<std::vector<int32_t>>(req.prompt);
    auto budget =
        resolve_max_tokens(req.sampling, static_cast<int>(prompt_ids.size()), kContext, "prompt");
    if (!budget.ok()) return reply_error(budget.error), 0;
    meta.id = make_response_id("cmpl-");
    Usage usage{static_cast<int>(prompt_ids.size()), 0};
    std::vector<Choice> choices;
    std::string sse;
    for (int i = 0; i < req.sampling.n; ++i) {
      Generated g = generate(*tok, " upon a time there was a ring of GPUs.", *budget.value);
      usage.completion_tokens += static_cast<int>(g.ids.size());
      ChoiceStreamOptions opt;
      opt.stop = req.sampling.stop;
      ChoiceStream cs(*tok, opt);
      Choice c;
      c.index = i;
      std::string reason = g.finish;
      for (auto id : g.ids) {
        auto s = cs.push(id);
        c.text += s.content;
        if (req.stream && !s.content.empty())
          sse += sse_event(completion_chunk(meta, i, s.content, std::nullopt, req.include_usage,
                                            std::nullopt, 0, *tok));
        if (s.stopped) {
          reason = "stop";
          break;
        }
      }
      auto f = cs.finish();
      c.text += f.content;
      c.finish_reason = reason;
      if (req.sampling.logprobs) c.logprobs = fake_logprobs(g.ids, req.sampling.top_logprobs);
      if (req.stream)
        sse += sse_event(completion_chunk(meta, i, f.content, c.finish_reason, req.include_usage,
                                          std::nullopt, 0, *tok));
      choices.push_back(std::move(c));
    }
    if (req.stream) {
      if (req.include_usage) sse += sse_event(usage_chunk(meta, "text_completion", usage));
      sse += sse_done();
      reply(200, "text/event-stream", sse);
    } else {
      reply(200, "application/json", text_completion(meta, choices, usage, *tok).dump());
    }
    return 0;
  }
  if (path.ends_with("/tokenize")) {
    auto r = parse_tokenize_request(body, limits);
    if (!r.ok()) return reply_error(r.error), 0;
    auto ids = tok->encode(*r.value->prompt, r.value->add_special_tokens);
    reply(200, "application/json",
          tokenize_response(ids, kContext, r.value->return_token_strs, *tok).dump());
    return 0;
  }
  if (path.ends_with("/detokenize")) {
    auto r = parse_detokenize_request(body, limits);
    if (!r.ok()) return reply_error(r.error), 0;
    reply(200, "application/json", detokenize_response(tok->decode(r.value->tokens, true)).dump());
    return 0;
  }
  ApiError e;
  e.status = 404;
  e.type = "not_found_error";
  e.message = "No route " + method + " " + path;
  reply_error(e);
  return 0;
}
