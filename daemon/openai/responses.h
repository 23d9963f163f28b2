#pragma once
// OpenAI response bodies and server-sent-event chunks, built from plain structs: the
// object types "chat.completion", "chat.completion.chunk", "text_completion", "list",
// finish_reason "stop" | "length" | "tool_calls", usage, logprobs in both the chat and the
// legacy completions shape, /tokenize and /detokenize bodies.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/openai/requests.h"
#include "daemon/tokenizer/tool_calls.h"

namespace spark::tok {
class Tokenizer;
}

namespace spark::openai {

/// One generated token's log-probability and alternatives (token ids; texts are looked up).
struct TokenLogprobs {
  int32_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
  bool unscored = false;  // the first prompt token: logprob and top_logprobs are null
  /// Completions: the token's offset in the returned text, in characters (code points);
  /// -1: the running sum of the tokens' characters from completion_logprobs_json's start.
  int64_t text_offset = -1;
};

/// Characters (code points) in `bytes` of UTF-8: the bytes that do not continue a sequence,
/// so a character split across two tokens counts once, in the token that begins it.
size_t utf8_chars(std::string_view bytes);

struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = -1;  // prompt tokens served by the prefix cache (-1: not known)
};

/// One finished choice.
struct Choice {
  int index = 0;
  std::string text;  // content (chat) or text (completions)
  /// Chat: the model's reasoning (harmony's analysis channel), sent as the message's
  /// reasoning_content and reasoning when not empty.
  std::string reasoning;
  std::vector<tok::ParsedToolCall> tool_calls;
  std::string finish_reason = "stop";  // stop, length, tool_calls
  std::optional<std::vector<TokenLogprobs>> logprobs;
};

/// Identity of one response, shared by its chunks.
struct ResponseMeta {
  std::string id;  // "chatcmpl-..." / "cmpl-..."
  int64_t created = 0;
  std::string model;
};

/// A fresh id: prefix + 24 random hex digits.
std::string make_response_id(std::string_view prefix);

/// usage; with cached_tokens known, prompt_tokens_details.cached_tokens as OpenAI has it.
Json usage_json(const Usage& u);
/// Chat logprobs {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.
Json chat_logprobs_json(const std::vector<TokenLogprobs>& lp, const tok::Tokenizer& tok);
/// Legacy completions logprobs {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
/// text_offset counts characters (as a client indexes the returned text), from text_offset0.
Json completion_logprobs_json(const std::vector<TokenLogprobs>& lp, const tok::Tokenizer& tok,
                              size_t text_offset0);
/// OpenAI tool_calls array for a message (full) or a delta (with "index").
Json tool_calls_json(const std::vector<tok::ParsedToolCall>& calls, bool delta);

/// Non-streaming /v1/chat/completions body.
Json chat_completion(const ResponseMeta& m, const std::vector<Choice>& choices, const Usage& u,
                     const tok::Tokenizer& tok);
/// Non-streaming /v1/completions body.
Json text_completion(const ResponseMeta& m, const std::vector<Choice>& choices, const Usage& u,
                     const tok::Tokenizer& tok);

/// What one chat chunk carries for one choice.
struct ChatDelta {
  int index = 0;
  bool role = false;  // first chunk: "role": "assistant"
  std::optional<std::string> content;
  std::optional<std::string> reasoning;  // sent as reasoning_content and reasoning
  std::vector<tok::ParsedToolCall> tool_calls;
  std::optional<std::string> finish_reason;
  std::optional<std::vector<TokenLogprobs>> logprobs;
};

/// One "chat.completion.chunk"; with include_usage every chunk has "usage": null.
Json chat_chunk(const ResponseMeta& m, const ChatDelta& d, bool include_usage,
                const tok::Tokenizer& tok);
/// One streamed "text_completion" chunk.
Json completion_chunk(const ResponseMeta& m, int index, const std::string& text,
                      const std::optional<std::string>& finish_reason, bool include_usage,
                      const std::optional<std::vector<TokenLogprobs>>& logprobs,
                      size_t text_offset0, const tok::Tokenizer& tok);
/// The last chunk when stream_options.include_usage: "choices": [] and the usage.
Json usage_chunk(const ResponseMeta& m, std::string_view object, const Usage& u);

/// "data: <json>\n\n".
std::string sse_event(const Json& j);
/// "data: [DONE]\n\n".
std::string_view sse_done();

/// GET /v1/models body.
Json models_list(const std::string& model, int64_t created, int max_model_len);
/// POST /tokenize body: {"count", "max_model_len", "tokens"[, "token_strs"]}.
Json tokenize_response(const std::vector<int32_t>& ids, int max_model_len, bool token_strs,
                       const tok::Tokenizer& tok);
/// POST /detokenize body: {"prompt"}.
Json detokenize_response(const std::string& text);

}  // namespace spark::openai
