#pragma once
// Turning one choice's generated tokens into what the API sends: incremental detokenizing
// (never broken UTF-8), stop strings matched across token boundaries (text that may be the
// start of a stop string is held back; the stop string itself is not sent), and tool-call
// parsing. Pure: the HTTP layer feeds tokens and writes the returned deltas.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/tokenizer/harmony.h"
#include "daemon/tokenizer/tokenizer.h"
#include "daemon/tokenizer/tool_calls.h"

namespace spark::openai {

/// Finds stop strings in streamed text.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  struct Out {
    std::string text;      // safe to send now
    bool stopped = false;  // a stop string matched; `text` ends right before it
  };
  /// Adds a text delta. After a match every later push returns nothing.
  Out push(std::string_view delta);
  /// End of text: releases what was held back.
  std::string finish();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  size_t max_len_ = 0;
  bool stopped_ = false;
};

struct ChoiceStreamOptions {
  std::vector<std::string> stop;
  bool skip_special_tokens = true;
  bool parse_tool_calls = false;  // chat requests with tools
  /// harmony: every chat response is parsed (channels), tools or not.
  tok::ChatFamily family = tok::ChatFamily::chatml;
};

/// One choice's pipeline: tokens -> text -> stop strings -> tool calls (and, for harmony,
/// reasoning).
/// For a chat response in the harmony family, special tokens are always kept in the decoded
/// text: the parser needs the channel headers, and only output that does not follow the
/// format reaches the client with them (verbatim, as content). Stop strings match that
/// decoded text, reasoning and special tokens included.
class ChoiceStream {
 public:
  ChoiceStream(const tok::Tokenizer& tok, ChoiceStreamOptions opt);
  struct Step {
    std::string content;
    std::string reasoning;  // harmony's analysis channel
    std::vector<tok::ParsedToolCall> calls;
    bool stopped = false;  // a stop string matched: end the choice with finish_reason "stop"
  };
  /// One generated token (not the end-of-turn token that ended generation).
  Step push(int32_t token);
  /// Generation ended (EOS, max_tokens, or stop string): flush everything held.
  Step finish();
  /// "tool_calls" when calls were produced and the model stopped on its own, else `reason`.
  std::string finish_reason(const std::string& reason) const;
  size_t tool_calls() const {
    return parser_ ? parser_->calls() : harmony_ ? harmony_->calls() : 0;
  }

 private:
  Step through_parser(std::string text, bool final);
  tok::StreamDecoder dec_;
  StopMatcher stop_;
  std::unique_ptr<tok::ToolCallParser> parser_;
  std::unique_ptr<tok::HarmonyParser> harmony_;
  bool done_ = false;
};

}  // namespace spark::openai
