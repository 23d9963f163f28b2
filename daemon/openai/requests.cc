#include "daemon/openai/requests.h"

#include <fmt/format.h>

#include <cctype>
#include <climits>
#include <cmath>

namespace spark::openai {

namespace {
// Parsing stops at the first problem; Fail carries it out of the helpers.
struct Fail {
  ApiError e;
};

[[noreturn]] void fail(std::string msg, std::string param, std::string code = "") {
  throw Fail{invalid_request(std::move(msg), std::move(param), std::move(code))};
}

Json parse_body(std::string_view body, const Limits& limits) {
  if (body.size() > limits.max_body_bytes) {
    ApiError e = invalid_request(fmt::format("Request body is {} bytes; the limit is {} bytes.",
                                             body.size(), limits.max_body_bytes),
                                 "", "request_too_large");
    e.status = 413;
    throw Fail{e};
  }
  Json j;
  try {
    j = Json::parse(body);
  } catch (const std::exception& ex) {
    fail(fmt::format("Request body is not valid JSON: {}", ex.what()), "");
  }
  if (!j.is_object()) fail("Request body must be a JSON object.", "");
  return j;
}

bool present(const Json& j, const char* k) {
  return j.contains(k) && !j[k].is_null();
}

double number(const Json& j, const char* k, double lo, double hi, double def,
              bool lo_open = false) {
  if (!present(j, k)) return def;
  if (!j[k].is_number()) fail(fmt::format("'{}' must be a number.", k), k);
  double v = j[k].get<double>();
  if (!std::isfinite(v) || v < lo || v > hi || (lo_open && v == lo))
    fail(fmt::format("'{}' is {}; it must be {} {} and <= {}.", k, v, lo_open ? ">" : ">=", lo, hi),
         k);
  return v;
}

int64_t integer(const Json& j, const char* k, int64_t lo, int64_t hi, int64_t def) {
  if (!present(j, k)) return def;
  const Json& v = j[k];
  int64_t x = 0;
  if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() &&
             std::fabs(v.get<double>()) < 9e15) {
    x = static_cast<int64_t>(v.get<double>());
  } else {
    fail(fmt::format("'{}' must be an integer.", k), k);
  }
  if (x < lo || x > hi)
    fail(fmt::format("'{}' is {}; it must be between {} and {}.", k, x, lo, hi), k);
  return x;
}

bool boolean(const Json& j, const char* k, bool def) {
  if (!present(j, k)) return def;
  if (!j[k].is_boolean()) fail(fmt::format("'{}' must be a boolean.", k), k);
  return j[k].get<bool>();
}

std::string string_field(const Json& j, const char* k, const std::string& def = "") {
  if (!present(j, k)) return def;
  if (!j[k].is_string()) fail(fmt::format("'{}' must be a string.", k), k);
  return j[k].get<std::string>();
}

// Content: a string, null, or an array of {"type": "text", "text": ...} parts.
std::string content_text(const Json& c, const std::string& param) {
  if (c.is_null()) return "";
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) fail("'content' must be a string, null or an array of content parts.", param);
  std::string out;
  for (const auto& part : c) {
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      fail("each content part needs a string 'type'.", param);
    std::string type = part["type"].get<std::string>();
    if (type != "text")
      fail(fmt::format("content part type '{}' is not supported; this server takes text only.",
                       type),
           param);
    if (!part.contains("text") || !part["text"].is_string())
      fail("a text content part needs a string 'text'.", param);
    out += part["text"].get<std::string>();
  }
  return out;
}

std::vector<tok::ChatMessage> parse_messages(const Json& j) {
  if (!j.contains("messages")) fail("'messages' is required.", "messages");
  const Json& ms = j["messages"];
  if (!ms.is_array() || ms.empty()) fail("'messages' must be a non-empty array.", "messages");
  std::vector<tok::ChatMessage> out;
  for (size_t i = 0; i < ms.size(); ++i) {
    const Json& m = ms[i];
    std::string p = fmt::format("messages[{}]", i);
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      fail(fmt::format("{} must be an object with a string 'role'.", p), p + ".role");
    tok::ChatMessage msg;
    msg.role = m["role"].get<std::string>();
    if (msg.role == "developer") msg.role = "system";
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool")
      fail(fmt::format("{}.role '{}' is not one of system, developer, user, assistant, tool.", p,
                       msg.role),
           p + ".role");
    msg.content = content_text(m.value("content", Json()), p + ".content");
    msg.content_null = !present(m, "content");
    // vLLM's names for an earlier assistant turn's reasoning (templates such as Qwen3's read
    // reasoning_content).
    for (const char* k : {"reasoning_content", "reasoning"})
      if (msg.role == "assistant" && present(m, k)) {
        if (!m[k].is_string())
          fail(fmt::format("{}.{} must be a string.", p, k), fmt::format("{}.{}", p, k));
        msg.reasoning_content = m[k].get<std::string>();
      }
    if (msg.role == "assistant" && present(m, "tool_calls")) {
      const Json& tcs = m["tool_calls"];
      if (!tcs.is_array())
        fail(fmt::format("{}.tool_calls must be an array.", p), p + ".tool_calls");
      for (size_t k = 0; k < tcs.size(); ++k) {
        std::string tp = fmt::format("{}.tool_calls[{}]", p, k);
        const Json& tc = tcs[k];
        if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object())
          fail(fmt::format("{} needs a 'function' object.", tp), tp);
        const Json& fn = tc["function"];
        tok::ToolCall call;
        call.id = tc.contains("id") && tc["id"].is_string() ? tc["id"].get<std::string>() : "";
        if (!fn.contains("name") || !fn["name"].is_string())
          fail(fmt::format("{}.function.name must be a string.", tp), tp + ".function.name");
        call.name = fn["name"].get<std::string>();
        if (!present(fn, "arguments"))
          call.arguments = "{}";
        else if (fn["arguments"].is_string())
          call.arguments = fn["arguments"].get<std::string>();
        else
          call.arguments = fn["arguments"].dump();
        msg.tool_calls.push_back(std::move(call));
      }
    }
    if (msg.role == "tool") {
      // As in OpenAI's API: a tool result must say which call it answers.
      if (!present(m, "tool_call_id"))
        fail(fmt::format("{}: a 'tool' message needs 'tool_call_id', the id of the tool call "
                         "it answers.",
                         p),
             p + ".tool_call_id");
      if (!m["tool_call_id"].is_string() || m["tool_call_id"].get<std::string>().empty())
        fail(fmt::format("{}.tool_call_id must be a non-empty string.", p), p + ".tool_call_id");
      msg.tool_call_id = m["tool_call_id"].get<std::string>();
    }
    out.push_back(std::move(msg));
  }
  return out;
}

Json parse_tools(const Json& j) {
  if (!present(j, "tools")) return Json::array();
  const Json& ts = j["tools"];
  if (!ts.is_array()) fail("'tools' must be an array.", "tools");
  for (size_t i = 0; i < ts.size(); ++i) {
    std::string p = fmt::format("tools[{}]", i);
    const Json& t = ts[i];
    if (!t.is_object() || t.value("type", std::string()) != "function" || !t.contains("function") ||
        !t["function"].is_object())
      fail(fmt::format("{} must be {{\"type\": \"function\", \"function\": {{...}}}}.", p), p);
    const Json& fn = t["function"];
    if (!fn.contains("name") || !fn["name"].is_string())
      fail(fmt::format("{}.function.name must be a string.", p), p + ".function.name");
    std::string name = fn["name"].get<std::string>();
    bool ok = !name.empty() && name.size() <= 64;
    for (char c : name)
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) ok = false;
    if (!ok)
      fail(fmt::format("{}.function.name '{}' must be 1-64 characters of a-z, A-Z, 0-9, _ and -.",
                       p, name),
           p + ".function.name");
    if (present(fn, "parameters") && !fn["parameters"].is_object())
      fail(fmt::format("{}.function.parameters must be a JSON Schema object.", p),
           p + ".function.parameters");
  }
  return ts;
}

ToolChoice parse_tool_choice(const Json& j, const Json& tools) {
  ToolChoice tc;
  if (!present(j, "tool_choice")) {
    tc.kind = tools.empty() ? ToolChoice::Kind::none : ToolChoice::Kind::auto_;
    return tc;
  }
  const Json& v = j["tool_choice"];
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    if (s == "none") {
      tc.kind = ToolChoice::Kind::none;
    } else if (s == "auto") {
      tc.kind = ToolChoice::Kind::auto_;
    } else if (s == "required") {
      if (tools.empty())
        fail("tool_choice 'required' needs at least one tool in 'tools'.", "tool_choice");
      tc.kind = ToolChoice::Kind::required;
    } else {
      fail(fmt::format("tool_choice '{}' is not one of none, auto, required.", s), "tool_choice");
    }
  } else if (v.is_object() && v.value("type", std::string()) == "function" &&
             v.contains("function") && v["function"].is_object() &&
             v["function"].contains("name") && v["function"]["name"].is_string()) {
    tc.kind = ToolChoice::Kind::named;
    tc.name = v["function"]["name"].get<std::string>();
    bool known = false;
    for (const auto& t : tools) known = known || t["function"]["name"] == tc.name;
    if (!known)
      fail(fmt::format("tool_choice names the function '{}', which is not in 'tools'.", tc.name),
           "tool_choice");
  } else {
    fail(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
        "\"function\": {\"name\": ...}}.",
        "tool_choice");
  }
  if (tc.kind == ToolChoice::Kind::auto_ && tools.empty()) tc.kind = ToolChoice::Kind::none;
  return tc;
}

std::vector<std::string> parse_stop(const Json& j, const Limits& limits) {
  std::vector<std::string> out;
  if (!present(j, "stop")) return out;
  const Json& s = j["stop"];
  if (s.is_string()) {
    out.push_back(s.get<std::string>());
  } else if (s.is_array()) {
    for (const auto& x : s) {
      if (!x.is_string()) fail("'stop' must be a string or an array of strings.", "stop");
      out.push_back(x.get<std::string>());
    }
  } else {
    fail("'stop' must be a string or an array of strings.", "stop");
  }
  if (static_cast<int>(out.size()) > limits.max_stop)
    fail(fmt::format("'stop' has {} entries; at most {} are allowed.", out.size(), limits.max_stop),
         "stop");
  for (const auto& x : out)
    if (x.empty()) fail("'stop' entries must not be empty.", "stop");
  return out;
}

Sampling parse_sampling(const Json& j, const Limits& limits, bool chat) {
  Sampling s;
  s.temperature = number(j, "temperature", 0, 2, 1.0);
  s.top_p = number(j, "top_p", 0, 1, 1.0, true);
  s.top_k = static_cast<int>(integer(j, "top_k", -1, 1 << 30, -1));
  s.min_p = number(j, "min_p", 0, 1, 0.0);
  s.presence_penalty = number(j, "presence_penalty", -2, 2, 0.0);
  s.frequency_penalty = number(j, "frequency_penalty", -2, 2, 0.0);
  s.repetition_penalty = number(j, "repetition_penalty", 0, 2, 1.0, true);
  if (present(j, "seed"))
    s.seed = static_cast<uint64_t>(integer(j, "seed", INT64_MIN, INT64_MAX, 0));
  s.n = static_cast<int>(integer(j, "n", 1, limits.max_n, 1));
  int64_t cap = limits.max_tokens_cap > 0 ? limits.max_tokens_cap : (1 << 30);
  const char* mt_key =
      chat && present(j, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  // Completions take max_tokens 0 with echo (checked there): the prompt and its logprobs.
  if (present(j, mt_key))
    s.max_tokens = static_cast<int>(integer(j, mt_key, chat ? 1 : 0, cap, 16));
  if (!chat && !s.max_tokens) s.max_tokens = 16;  // OpenAI's default for /v1/completions
  s.stop = parse_stop(j, limits);
  if (present(j, "stop_token_ids")) {
    if (!j["stop_token_ids"].is_array())
      fail("'stop_token_ids' must be an array.", "stop_token_ids");
    for (const auto& x : j["stop_token_ids"]) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX)
        fail("'stop_token_ids' must hold non-negative integers.", "stop_token_ids");
      s.stop_token_ids.push_back(x.get<int32_t>());
    }
  }
  s.ignore_eos = boolean(j, "ignore_eos", false);
  s.skip_special_tokens = boolean(j, "skip_special_tokens", true);
  if (chat) {
    s.logprobs = boolean(j, "logprobs", false);
    s.top_logprobs = static_cast<int>(integer(j, "top_logprobs", 0, limits.max_top_logprobs, 0));
    if (s.top_logprobs > 0 && !s.logprobs)
      fail("'top_logprobs' needs 'logprobs': true.", "top_logprobs");
  } else if (present(j, "logprobs")) {
    s.top_logprobs = static_cast<int>(integer(j, "logprobs", 0, limits.max_top_logprobs, 0));
    s.logprobs = true;
  }
  return s;
}

// Fields whose meaning we cannot honour are refused rather than silently ignored.
// chat_template_kwargs: extra template variables (enable_thinking, ...), as vLLM takes them.
// The names the server itself passes cannot be overridden.
Json parse_template_kwargs(const Json& j) {
  Json out = Json::object();
  if (present(j, "chat_template_kwargs")) {
    const Json& k = j["chat_template_kwargs"];
    if (!k.is_object()) fail("'chat_template_kwargs' must be an object.", "chat_template_kwargs");
    for (const char* reserved : {"messages", "tools", "documents", "add_generation_prompt"})
      if (k.contains(reserved))
        fail(
            fmt::format("'chat_template_kwargs' cannot set '{}'; use the request field.", reserved),
            "chat_template_kwargs");
    out = k;
  }
  // reasoning_effort reaches the template as a variable of that name (gpt-oss's template
  // writes "Reasoning: <effort>" into its system message), as vLLM passes it; the request
  // field wins over a chat_template_kwargs entry.
  if (present(j, "reasoning_effort")) {
    const Json& e = j["reasoning_effort"];
    if (!e.is_string() || (e != "low" && e != "medium" && e != "high"))
      fail("'reasoning_effort' must be one of \"low\", \"medium\", \"high\".", "reasoning_effort");
    out["reasoning_effort"] = e;
  }
  return out;
}

ResponseFormat parse_response_format(const Json& j) {
  ResponseFormat f;
  if (!present(j, "response_format")) return f;
  const Json& rf = j["response_format"];
  if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
    fail("'response_format' must be an object with a string 'type'.", "response_format");
  const std::string type = rf["type"].get<std::string>();
  if (type == "text") return f;
  if (type == "json_object") {
    f.kind = ResponseFormat::Kind::json_object;
    return f;
  }
  if (type != "json_schema")
    fail(fmt::format("response_format type '{}' is not one of text, json_object, json_schema.",
                     type),
         "response_format.type");
  if (!rf.contains("json_schema") || !rf["json_schema"].is_object())
    fail("response_format json_schema needs a 'json_schema' object.",
         "response_format.json_schema");
  const Json& js = rf["json_schema"];
  if (!js.contains("name") || !js["name"].is_string())
    fail("response_format.json_schema.name must be a string.", "response_format.json_schema.name");
  f.name = js["name"].get<std::string>();
  if (!present(js, "schema")) {
    f.schema = Json::object();  // any value, as OpenAI takes a missing schema
  } else {
    if (!js["schema"].is_object())
      fail("response_format.json_schema.schema must be a JSON Schema object.",
           "response_format.json_schema.schema");
    f.schema = js["schema"];
  }
  f.kind = ResponseFormat::Kind::json_schema;
  return f;
}

void refuse_unsupported(const Json& j, bool chat) {
  if (!chat && present(j, "response_format")) {
    const Json& rf = j["response_format"];
    if (!rf.is_object() || rf.value("type", std::string()) != "text")
      fail(
          "'response_format' other than {\"type\": \"text\"} is served on /v1/chat/completions "
          "only.",
          "response_format");
  }
  if (present(j, "logit_bias") && !(j["logit_bias"].is_object() && j["logit_bias"].empty()))
    fail("'logit_bias' is not supported.", "logit_bias");
  if (present(j, "functions") || present(j, "function_call"))
    fail("'functions' and 'function_call' are deprecated; send 'tools' instead.",
         present(j, "functions") ? "functions" : "function_call");
}

void parse_stream(const Json& j, bool* stream, bool* include_usage) {
  *stream = boolean(j, "stream", false);
  *include_usage = false;
  if (present(j, "stream_options")) {
    const Json& so = j["stream_options"];
    if (!so.is_object()) fail("'stream_options' must be an object.", "stream_options");
    if (!*stream) fail("'stream_options' is only allowed with 'stream': true.", "stream_options");
    *include_usage = boolean(so, "include_usage", false);
  }
}

template <typename T, typename F>
ApiResult<T> guarded(F&& f) {
  ApiResult<T> r;
  try {
    r.value = f();
  } catch (const Fail& e) {
    r.error = e.e;
  } catch (const std::exception& e) {  // a JSON access we did not foresee: still a 400
    r.error = invalid_request(fmt::format("Malformed request: {}", e.what()), "");
  }
  return r;
}
}  // namespace

ApiResult<ChatRequest> parse_chat_request(std::string_view body, const Limits& limits) {
  return guarded<ChatRequest>([&] {
    Json j = parse_body(body, limits);
    ChatRequest r;
    r.model = string_field(j, "model");
    r.messages = parse_messages(j);
    r.tools = parse_tools(j);
    r.tool_choice = parse_tool_choice(j, r.tools);
    r.sampling = parse_sampling(j, limits, true);
    refuse_unsupported(j, true);
    r.response_format = parse_response_format(j);
    parse_stream(j, &r.stream, &r.include_usage);
    r.add_generation_prompt = boolean(j, "add_generation_prompt", true);
    r.chat_template_kwargs = parse_template_kwargs(j);
    return r;
  });
}

ApiResult<CompletionRequest> parse_completion_request(std::string_view body, const Limits& limits) {
  return guarded<CompletionRequest>([&] {
    Json j = parse_body(body, limits);
    CompletionRequest r;
    r.model = string_field(j, "model");
    if (!j.contains("prompt")) fail("'prompt' is required.", "prompt");
    const Json& p = j["prompt"];
    const Json* one = &p;
    if (p.is_array() && !p.empty() && (p[0].is_string() || p[0].is_array())) {
      if (p.size() != 1)
        fail("'prompt' with several prompts is not supported; send one request per prompt.",
             "prompt");
      one = &p[0];
    }
    if (one->is_string()) {
      r.prompt = one->get<std::string>();
    } else if (one->is_array()) {
      std::vector<int32_t> ids;
      for (const auto& x : *one) {
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX)
          fail("'prompt' as tokens must be an array of non-negative integers.", "prompt");
        ids.push_back(x.get<int32_t>());
      }
      if (ids.empty()) fail("'prompt' must not be empty.", "prompt");
      r.prompt = std::move(ids);
    } else {
      fail("'prompt' must be a string or an array of token ids.", "prompt");
    }
    if (present(j, "suffix")) fail("'suffix' is not supported.", "suffix");
    if (present(j, "best_of") && integer(j, "best_of", 1, 1, 1) != 1)
      fail("'best_of' is not supported.", "best_of");
    r.sampling = parse_sampling(j, limits, false);
    refuse_unsupported(j, false);
    parse_stream(j, &r.stream, &r.include_usage);
    r.echo = boolean(j, "echo", false);
    if (r.sampling.max_tokens == 0 && !r.echo)
      fail("'max_tokens' 0 is only accepted with 'echo': true (the prompt and its logprobs).",
           "max_tokens");
    if (r.echo && r.sampling.logprobs) r.sampling.prompt_logprobs = r.sampling.top_logprobs;
    return r;
  });
}

ApiResult<TokenizeRequest> parse_tokenize_request(std::string_view body, const Limits& limits) {
  return guarded<TokenizeRequest>([&] {
    Json j = parse_body(body, limits);
    TokenizeRequest r;
    r.model = string_field(j, "model");
    if (present(j, "prompt")) {
      r.prompt = string_field(j, "prompt");
      r.add_special_tokens = boolean(j, "add_special_tokens", true);
    } else if (present(j, "messages")) {
      r.messages = parse_messages(j);
      r.add_special_tokens = boolean(j, "add_special_tokens", false);
      r.add_generation_prompt = boolean(j, "add_generation_prompt", true);
      r.chat_template_kwargs = parse_template_kwargs(j);
    } else {
      fail("either 'prompt' or 'messages' is required.", "prompt");
    }
    r.return_token_strs = boolean(j, "return_token_strs", false);
    return r;
  });
}

ApiResult<DetokenizeRequest> parse_detokenize_request(std::string_view body, const Limits& limits) {
  return guarded<DetokenizeRequest>([&] {
    Json j = parse_body(body, limits);
    DetokenizeRequest r;
    r.model = string_field(j, "model");
    if (!j.contains("tokens") || !j["tokens"].is_array())
      fail("'tokens' must be an array of token ids.", "tokens");
    for (const auto& x : j["tokens"]) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX)
        fail("'tokens' must hold non-negative integers.", "tokens");
      r.tokens.push_back(x.get<int32_t>());
    }
    return r;
  });
}

std::optional<ApiError> check_model(const std::string& requested, const std::string& served) {
  if (requested.empty() || requested == served) return std::nullopt;
  ApiError e;
  e.status = 404;
  e.type = "invalid_request_error";
  e.param = "model";
  e.code = "model_not_found";
  e.message =
      fmt::format("The model '{}' does not exist; this server serves '{}'.", requested, served);
  return e;
}

ApiResult<int> resolve_max_tokens(const Sampling& s, int prompt_tokens, int max_context,
                                  const std::string& param) {
  ApiResult<int> r;
  int want = s.max_tokens.value_or(max_context - prompt_tokens);
  // An explicit 0 (completions with echo) asks for the prompt alone, which still must fit.
  const bool prompt_only = s.max_tokens && *s.max_tokens == 0;
  if (prompt_tokens + (s.max_tokens && !prompt_only ? want : 1) > max_context ||
      (want < 1 && !prompt_only)) {
    int shown = s.max_tokens ? want : 1;
    r.error = invalid_request(
        fmt::format("This model's maximum context length is {} tokens. However, you requested {} "
                    "tokens ({} in the {}, {} in the completion). Please reduce the length of the "
                    "{} or completion.",
                    max_context, prompt_tokens + shown, prompt_tokens, param, shown, param),
        param, "context_length_exceeded");
    return r;
  }
  r.value = want;
  return r;
}

}  // namespace spark::openai
