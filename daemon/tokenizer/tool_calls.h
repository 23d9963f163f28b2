#pragma once
// Parses model output into OpenAI tool calls, also incrementally while streaming: Qwen's
// <tool_call>{json}</tool_call> blocks (ChatML), Llama 3's bare JSON object
// {"name": ..., "parameters": {...}} (optionally after <|python_tag|>, several separated by
// ';'), Mistral's [TOOL_CALLS][{...}, ...], DeepSeek-V3's <｜tool▁calls▁begin｜> blocks. Text that
// may still become a tool call is held back; anything malformed is returned as plain content, never
// as an error.
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/tokenizer/chat.h"

namespace spark::tok {

/// One parsed call; arguments is JSON text (what OpenAI's function.arguments holds). A
/// streaming parser (HarmonyParser) may send a call in parts: first its index, id and name
/// with the arguments so far, then fragments (fragment = true: only index and more
/// arguments), as OpenAI's stream deltas carry them.
struct ParsedToolCall {
  size_t index = 0;  // position among this response's calls
  std::string id;
  std::string name;
  std::string arguments;
  bool fragment = false;
};

/// What one push()/finish() makes final: content text, reasoning text (harmony's analysis
/// channel, see harmony.h) and completed calls.
struct ToolParseDelta {
  std::string content;
  std::string reasoning;
  std::vector<ParsedToolCall> calls;
  bool empty() const { return content.empty() && reasoning.empty() && calls.empty(); }
};

/// Incremental parser for one response (one choice).
class ToolCallParser {
 public:
  /// `make_id` gives ids for calls the model did not name (default: "call_" + 24 random
  /// alphanumerics; 9 alphanumerics for Mistral).
  explicit ToolCallParser(ChatFamily family, std::function<std::string()> make_id = {});
  /// Feeds a text delta (decoded with special tokens kept for Mistral's [TOOL_CALLS]).
  ToolParseDelta push(std::string_view delta);
  /// End of output: flushes what was held back.
  ToolParseDelta finish();
  /// Calls emitted so far.
  size_t calls() const { return calls_; }

  /// Whole-text convenience: finish(push(text)).
  static ToolParseDelta parse(ChatFamily family, std::string_view text,
                              std::function<std::string()> make_id = {});

 private:
  enum class Mode { start, text, block, json, done_text };
  void step(ToolParseDelta& out, bool final);
  void emit_text(ToolParseDelta& out, std::string_view t);
  bool add_call(ToolParseDelta& out, const std::string& json_text, bool array);
  bool add_deepseek_calls(ToolParseDelta& out, std::string_view body);

  ChatFamily family_;
  std::function<std::string()> make_id_;
  Mode mode_ = Mode::start;
  std::string buf_;          // undecided text
  std::string pending_ws_;   // whitespace after a call, dropped if only whitespace follows
  bool after_call_ = false;  // no text sent since the last call
  std::string json_raw_;     // what the json mode consumed, returned as text if it fails
  size_t calls_ = 0;
};

/// End of the JSON object or array that starts at s[pos] ('{' or '['): the index one past
/// its closing bracket, or npos while it is incomplete (strings and escapes respected).
size_t json_value_end(std::string_view s, size_t pos);

}  // namespace spark::tok
