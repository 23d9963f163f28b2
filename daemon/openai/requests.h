#pragma once
// Parsing and validation of /v1/chat/completions, /v1/completions, /tokenize and
// /detokenize request bodies into internal structs. Unknown fields are ignored (clients
// send extras); wrong types and out-of-range values are invalid_request_error naming the
// field. Limits on body size, stop strings, n and max_tokens come from the server.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "daemon/openai/errors.h"
#include "daemon/tokenizer/chat.h"

namespace spark::openai {

using Json = tok::Json;

/// Server-side limits applied while parsing.
struct Limits {
  size_t max_body_bytes = 8u << 20;  // 413 above this
  int max_n = 16;                    // choices per request
  int max_stop = 16;                 // stop strings per request
  int max_top_logprobs = 20;
  int max_tokens_cap = 0;  // > 0: largest max_tokens accepted
};

/// Sampling and output options shared by chat and text completions.
struct Sampling {
  double temperature = 1.0;         // [0, 2]; 0 = greedy
  double top_p = 1.0;               // (0, 1]
  int top_k = -1;                   // -1 or 0 = off
  double min_p = 0.0;               // [0, 1]
  double presence_penalty = 0.0;    // [-2, 2]
  double frequency_penalty = 0.0;   // [-2, 2]
  double repetition_penalty = 1.0;  // > 0
  std::optional<uint64_t> seed;
  int n = 1;
  std::optional<int> max_tokens;  // unset: up to the context length (see resolve_max_tokens)
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool logprobs = false;
  int top_logprobs = 0;  // 0..20 (completions: the integer `logprobs`)
  /// Completions with echo and logprobs: the prompt tokens' logprobs too, with this many
  /// alternatives (the integer `logprobs`); -1: not asked for.
  int prompt_logprobs = -1;
  bool skip_special_tokens = true;
};

/// tool_choice: "none", "auto" (default), "required", or a named function.
struct ToolChoice {
  enum class Kind { none, auto_, required, named } kind = Kind::auto_;
  std::string name;
};

/// response_format: text (default), json_object (any JSON object), or json_schema (a value
/// valid under `schema`). The last two are served by constrained decoding (structured.h).
struct ResponseFormat {
  enum class Kind { text, json_object, json_schema } kind = Kind::text;
  std::string name;  // json_schema.name
  Json schema;       // json_schema.schema
};

struct ChatRequest {
  std::string model;
  std::vector<tok::ChatMessage> messages;
  Json tools = Json::array();  // OpenAI tool objects, as sent (order kept)
  ToolChoice tool_choice;
  ResponseFormat response_format;
  Sampling sampling;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool add_generation_prompt = true;
  Json chat_template_kwargs =
      Json::object();  // extra chat template variables (reasoning_effort too)
};

struct CompletionRequest {
  std::string model;
  std::variant<std::string, std::vector<int32_t>> prompt;
  Sampling sampling;
  bool stream = false;
  bool include_usage = false;
  bool echo = false;  // the prompt first (with logprobs: its tokens' too); max_tokens may be 0
};

/// /tokenize: text ("prompt") or chat ("messages").
struct TokenizeRequest {
  std::string model;
  std::optional<std::string> prompt;
  std::vector<tok::ChatMessage> messages;
  bool add_special_tokens = true;  // prompt form (chat form: false, the template has BOS)
  bool add_generation_prompt = true;
  Json chat_template_kwargs = Json::object();
  bool return_token_strs = false;
};

struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};

ApiResult<ChatRequest> parse_chat_request(std::string_view body, const Limits& limits);
ApiResult<CompletionRequest> parse_completion_request(std::string_view body, const Limits& limits);
ApiResult<TokenizeRequest> parse_tokenize_request(std::string_view body, const Limits& limits);
ApiResult<DetokenizeRequest> parse_detokenize_request(std::string_view body, const Limits& limits);

/// The `model` field names a model this server serves (empty = the default one); else a
/// 404 model_not_found error.
std::optional<ApiError> check_model(const std::string& requested, const std::string& served);

/// Completion budget after tokenization: the requested max_tokens (or what is left of the
/// context when unset), or a context_length_exceeded error in OpenAI's words.
ApiResult<int> resolve_max_tokens(const Sampling& s, int prompt_tokens, int max_context,
                                  const std::string& param);

}  // namespace spark::openai
