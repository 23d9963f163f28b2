// openai_wire_double: answers ONE OpenAI API request with this project's request parser,
// prepare_* and CompletionWriter, the engine replaced by a test double that "generates" a fixed
// text (tokenized with a real tokenizer.json, fake logprobs). It lets the official OpenAI
// client check our wire format end to end without a model
// (tests/e2e/openai_client/client_test.js --wire).
//   openai_wire_double TOKENIZER_JSON METHOD PATH < body
// When TOKENIZER_JSON's directory holds a chat_template.jinja (the gpt-oss-like fixture
// tests/fixtures/harmony), the double serves a gpt-oss model instead: the chat
// format is chosen as for GptOssForCausalLM and the fixed text is harmony output (an analysis
// message, then a final answer ended by <|return|> or a function call ended by <|call|>).
// Prints {"status": N, "content_type": "...", "body": "..."} on stdout.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <string>

#include "daemon/openai/requests.h"
#include "daemon/openai/responses.h"
#include "daemon/openai/session.h"
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
int reply_error(const ApiError& e) {
  reply(e.status, "application/json", error_body(e).dump());
  return 0;
}

// The engine double: the same fixed continuation for every choice, cut at max_tokens, then
// the end-of-turn token.
std::string run_double(CompletionWriter& r, const tok::Tokenizer& t, const std::string& text, int n,
                       int max_tokens, int top_logprobs, int32_t eot) {
  std::string out = r.start();
  auto ids = t.encode(text, false);
  for (int c = 0; c < n; ++c) {
    int produced = 0;
    for (auto id : ids) {
      if (produced == max_tokens || r.finished(c)) break;
      TokenLogprobs lp{id, -0.25f, {}};
      for (int k = 0; k < top_logprobs; ++k) lp.top.push_back({k == 0 ? id : 10 + k, -0.25f - k});
      out += r.token(c, id, lp);
      ++produced;
    }
    if (r.finished(c)) continue;
    if (produced == max_tokens)
      out += r.finish(c, "length");
    else
      out += r.token(c, eot);
  }
  return out + r.done();
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
  const std::string dir = std::filesystem::path(argv[1]).parent_path().string();
  const bool harmony = std::filesystem::exists(dir + "/chat_template.jinja");
  Json tcfg = Json::object();
  if (harmony) {
    auto c = tok::load_tokenizer_config(dir);
    if (!c) {
      std::fprintf(stderr, "%s\n", c.error().message.c_str());
      return 1;
    }
    tcfg = *c;
  }
  auto fmt =
      tok::choose_chat_format("", tcfg, harmony ? "GptOssForCausalLM" : "Qwen2ForCausalLM", &*tok);
  if (!fmt) {
    std::fprintf(stderr, "%s\n", fmt.error().message.c_str());
    return 1;
  }
  int32_t eot = *tok->token_to_id(harmony ? "<|return|>" : "<|im_end|>");

  if (method == "GET" && path.ends_with("/models")) {
    reply(200, "application/json", models_list(kModel, 1700000000, kContext).dump());
    return 0;
  }
  if (path.ends_with("/chat/completions")) {
    auto r = parse_chat_request(body, limits);
    if (!r.ok()) return reply_error(r.error);
    const ChatRequest& req = *r.value;
    if (auto e = check_model(req.model, kModel)) return reply_error(*e);
    auto p = prepare_chat(req, *tok, *fmt, kContext);
    if (!p.ok()) return reply_error(p.error);
    bool tools = req.tool_choice.kind != ToolChoice::Kind::none && !req.tools.empty();
    std::string text = "Hello from sparkd, a test double. 👋🏽";
    std::set<int32_t> stops = {eot};
    int32_t end = eot;
    if (harmony) {
      for (const auto& s : fmt->stop_tokens())
        if (auto id = tok->token_to_id(s)) stops.insert(*id);
      text = "<|channel|>analysis<|message|>A greeting; answer in kind.<|end|><|start|>assistant";
      if (tools) {
        text += "<|channel|>commentary to=functions." +
                req.tools[0]["function"]["name"].get<std::string>() +
                " <|constrain|>json<|message|>{\"city\": \"Paris\"}";
        end = *tok->token_to_id("<|call|>");
      } else {
        text += "<|channel|>final<|message|>Hello from sparkd, a test double. 👋🏽";
      }
    } else if (tools) {
      text = "<tool_call>\n{\"name\": \"" + req.tools[0]["function"]["name"].get<std::string>() +
             "\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    }
    CompletionWriter resp(req, *tok, *fmt, kModel, static_cast<int>(p.value->ids.size()), stops);
    std::string out = run_double(resp, *tok, text, req.sampling.n, p.value->max_tokens,
                                 req.sampling.top_logprobs, end);
    reply(200, resp.content_type(), out);
    return 0;
  }
  if (path.ends_with("/completions")) {
    auto r = parse_completion_request(body, limits);
    if (!r.ok()) return reply_error(r.error);
    const CompletionRequest& req = *r.value;
    if (auto e = check_model(req.model, kModel)) return reply_error(*e);
    auto p = prepare_completion(req, *tok, kContext);
    if (!p.ok()) return reply_error(p.error);
    CompletionWriter resp(req, *tok, kModel, static_cast<int>(p.value->ids.size()), {eot},
                          p.value->text);
    std::string out =
        run_double(resp, *tok, " upon a time there was a ring of GPUs.", req.sampling.n,
                   p.value->max_tokens, req.sampling.top_logprobs, eot);
    reply(200, resp.content_type(), out);
    return 0;
  }
  if (path.ends_with("/tokenize")) {
    auto r = parse_tokenize_request(body, limits);
    if (!r.ok()) return reply_error(r.error);
    std::vector<int32_t> ids;
    if (r.value->prompt) {
      ids = tok->encode(*r.value->prompt, r.value->add_special_tokens);
    } else {
      auto text =
          tok::render_chat(*fmt, r.value->messages, Json::array(), r.value->add_generation_prompt);
      if (!text) return reply_error(from_error(text.error(), "messages"));
      ids = tok->encode(*text, r.value->add_special_tokens);
    }
    reply(200, "application/json",
          tokenize_response(ids, kContext, r.value->return_token_strs, *tok).dump());
    return 0;
  }
  if (path.ends_with("/detokenize")) {
    auto r = parse_detokenize_request(body, limits);
    if (!r.ok()) return reply_error(r.error);
    reply(200, "application/json", detokenize_response(tok->decode(r.value->tokens, true)).dump());
    return 0;
  }
  ApiError e;
  e.status = 404;
  e.type = "not_found_error";
  e.message = "No route " + method + " " + path;
  return reply_error(e);
}
