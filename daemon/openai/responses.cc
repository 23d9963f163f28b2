#include "daemon/openai/responses.h"

#include <fmt/format.h>

#include <random>

#include "daemon/tokenizer/tokenizer.h"
#include "daemon/tokenizer/utf8.h"

namespace spark::openai {

namespace {
Json token_entry(int32_t id, float logprob, const tok::Tokenizer& tok) {
  std::string_view bytes = tok.token_bytes(id);
  Json e = Json::object();
  e["token"] = tok::utf8_lossy(bytes);
  e["logprob"] = logprob;
  Json b = Json::array();
  for (unsigned char c : bytes) b.push_back(static_cast<int>(c));
  e["bytes"] = std::move(b);
  return e;
}

Json nullable(const std::optional<std::string>& s) {
  return s ? Json(*s) : Json(nullptr);
}
}  // namespace

std::string make_response_id(std::string_view prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{}{:012x}{:012x}", prefix, rng() & 0xFFFFFFFFFFFFull,
                     rng() & 0xFFFFFFFFFFFFull);
}

Json usage_json(const Usage& u) {
  Json j = Json::object();
  j["prompt_tokens"] = u.prompt_tokens;
  j["completion_tokens"] = u.completion_tokens;
  j["total_tokens"] = u.prompt_tokens + u.completion_tokens;
  if (u.cached_tokens >= 0) j["prompt_tokens_details"] = {{"cached_tokens", u.cached_tokens}};
  return j;
}

Json chat_logprobs_json(const std::vector<TokenLogprobs>& lp, const tok::Tokenizer& tok) {
  Json content = Json::array();
  for (const auto& t : lp) {
    Json e = token_entry(t.token, t.logprob, tok);
    Json top = Json::array();
    for (auto [id, l] : t.top) top.push_back(token_entry(id, l, tok));
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  Json j = Json::object();
  j["content"] = std::move(content);
  return j;
}

size_t utf8_chars(std::string_view bytes) {
  size_t n = 0;
  for (unsigned char c : bytes) n += (c & 0xC0) != 0x80;
  return n;
}

Json completion_logprobs_json(const std::vector<TokenLogprobs>& lp, const tok::Tokenizer& tok,
                              size_t off) {
  Json tokens = Json::array(), lps = Json::array(), tops = Json::array(), offs = Json::array();
  for (const auto& t : lp) {
    std::string_view bytes = tok.token_bytes(t.token);
    tokens.push_back(tok::utf8_lossy(bytes));
    if (t.unscored) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
    } else {
      lps.push_back(t.logprob);
      Json top = Json::object();
      for (auto [id, l] : t.top) top[tok::utf8_lossy(tok.token_bytes(id))] = l;
      tops.push_back(std::move(top));
    }
    if (t.text_offset >= 0) off = static_cast<size_t>(t.text_offset);
    offs.push_back(off);
    off += utf8_chars(bytes);
  }
  Json j = Json::object();
  j["tokens"] = std::move(tokens);
  j["token_logprobs"] = std::move(lps);
  j["top_logprobs"] = std::move(tops);
  j["text_offset"] = std::move(offs);
  return j;
}

Json tool_calls_json(const std::vector<tok::ParsedToolCall>& calls, bool delta) {
  Json arr = Json::array();
  for (const auto& c : calls) {
    Json t = Json::object();
    if (delta) t["index"] = c.index;
    if (delta && c.fragment) {  // more arguments of a call sent before
      t["function"] = Json{{"arguments", c.arguments}};
      arr.push_back(std::move(t));
      continue;
    }
    t["id"] = c.id;
    t["type"] = "function";
    Json fn = Json::object();
    fn["name"] = c.name;
    fn["arguments"] = c.arguments;
    t["function"] = std::move(fn);
    arr.push_back(std::move(t));
  }
  return arr;
}

Json chat_completion(const ResponseMeta& m, const std::vector<Choice>& choices, const Usage& u,
                     const tok::Tokenizer& tok) {
  Json j = Json::object();
  j["id"] = m.id;
  j["object"] = "chat.completion";
  j["created"] = m.created;
  j["model"] = m.model;
  Json cs = Json::array();
  for (const auto& c : choices) {
    Json msg = Json::object();
    msg["role"] = "assistant";
    // OpenAI sends null content when the answer is only tool calls.
    msg["content"] = c.text.empty() && !c.tool_calls.empty() ? Json(nullptr) : Json(c.text);
    if (!c.tool_calls.empty()) msg["tool_calls"] = tool_calls_json(c.tool_calls, false);
    // vLLM's names: reasoning_content, and reasoning in its newer servers.
    if (!c.reasoning.empty()) msg["reasoning_content"] = msg["reasoning"] = c.reasoning;
    Json cj = Json::object();
    cj["index"] = c.index;
    cj["message"] = std::move(msg);
    cj["logprobs"] = c.logprobs ? chat_logprobs_json(*c.logprobs, tok) : Json(nullptr);
    cj["finish_reason"] = c.finish_reason;
    cs.push_back(std::move(cj));
  }
  j["choices"] = std::move(cs);
  j["usage"] = usage_json(u);
  return j;
}

Json text_completion(const ResponseMeta& m, const std::vector<Choice>& choices, const Usage& u,
                     const tok::Tokenizer& tok) {
  Json j = Json::object();
  j["id"] = m.id;
  j["object"] = "text_completion";
  j["created"] = m.created;
  j["model"] = m.model;
  Json cs = Json::array();
  for (const auto& c : choices) {
    Json cj = Json::object();
    cj["index"] = c.index;
    cj["text"] = c.text;
    cj["logprobs"] = c.logprobs ? completion_logprobs_json(*c.logprobs, tok, 0) : Json(nullptr);
    cj["finish_reason"] = c.finish_reason;
    cs.push_back(std::move(cj));
  }
  j["choices"] = std::move(cs);
  j["usage"] = usage_json(u);
  return j;
}

Json chat_chunk(const ResponseMeta& m, const ChatDelta& d, bool include_usage,
                const tok::Tokenizer& tok) {
  Json j = Json::object();
  j["id"] = m.id;
  j["object"] = "chat.completion.chunk";
  j["created"] = m.created;
  j["model"] = m.model;
  Json delta = Json::object();
  if (d.role) delta["role"] = "assistant";
  if (d.content) delta["content"] = *d.content;
  if (d.reasoning) delta["reasoning_content"] = delta["reasoning"] = *d.reasoning;
  if (!d.tool_calls.empty()) delta["tool_calls"] = tool_calls_json(d.tool_calls, true);
  Json c = Json::object();
  c["index"] = d.index;
  c["delta"] = std::move(delta);
  c["logprobs"] = d.logprobs ? chat_logprobs_json(*d.logprobs, tok) : Json(nullptr);
  c["finish_reason"] = nullable(d.finish_reason);
  j["choices"] = Json::array({std::move(c)});
  if (include_usage) j["usage"] = nullptr;
  return j;
}

Json completion_chunk(const ResponseMeta& m, int index, const std::string& text,
                      const std::optional<std::string>& finish_reason, bool include_usage,
                      const std::optional<std::vector<TokenLogprobs>>& logprobs, size_t off,
                      const tok::Tokenizer& tok) {
  Json j = Json::object();
  j["id"] = m.id;
  j["object"] = "text_completion";
  j["created"] = m.created;
  j["model"] = m.model;
  Json c = Json::object();
  c["index"] = index;
  c["text"] = text;
  c["logprobs"] = logprobs ? completion_logprobs_json(*logprobs, tok, off) : Json(nullptr);
  c["finish_reason"] = nullable(finish_reason);
  j["choices"] = Json::array({std::move(c)});
  if (include_usage) j["usage"] = nullptr;
  return j;
}

Json usage_chunk(const ResponseMeta& m, std::string_view object, const Usage& u) {
  Json j = Json::object();
  j["id"] = m.id;
  j["object"] = std::string(object);
  j["created"] = m.created;
  j["model"] = m.model;
  j["choices"] = Json::array();
  j["usage"] = usage_json(u);
  return j;
}

std::string sse_event(const Json& j) {
  return "data: " + j.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n\n";
}

std::string_view sse_done() {
  return "data: [DONE]\n\n";
}

Json models_list(const std::string& model, int64_t created, int max_model_len) {
  Json m = Json::object();
  m["id"] = model;
  m["object"] = "model";
  m["created"] = created;
  m["owned_by"] = "sparkctl";
  m["max_model_len"] = max_model_len;
  Json j = Json::object();
  j["object"] = "list";
  j["data"] = Json::array({std::move(m)});
  return j;
}

Json tokenize_response(const std::vector<int32_t>& ids, int max_model_len, bool token_strs,
                       const tok::Tokenizer& tok) {
  Json j = Json::object();
  j["count"] = ids.size();
  j["max_model_len"] = max_model_len;
  j["tokens"] = ids;
  if (token_strs) {
    Json s = Json::array();
    for (auto id : ids) s.push_back(tok.id_to_token(id).value_or(""));
    j["token_strs"] = std::move(s);
  }
  return j;
}

Json detokenize_response(const std::string& text) {
  Json j = Json::object();
  j["prompt"] = text;
  return j;
}

}  // namespace spark::openai
