#pragma once
// Parses gpt-oss's harmony output, also incrementally while streaming. The prompt ends with
// "<|start|>assistant", so the output continues that header:
//   <|channel|>analysis<|message|>REASONING<|end|>
//   <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
// or calls a function (the recipient in the header, before or after the channel):
//   <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>
//   to=functions.NAME<|channel|>commentary json<|message|>{ARGS}<|call|>
// The analysis channel is reasoning; final and commentary messages without a recipient are
// content; a message to functions.NAME is a tool call whose arguments are its text as
// produced (trimmed; not required to be JSON; "{}" when empty). Reasoning and content come out
// as they arrive; a call as soon as its header is read (index, id, name), its arguments as
// fragments after it (ParsedToolCall::fragment). Malformed output never fails:
//  - text before any header, and text between messages, is content (whitespace alone dropped);
//  - a header without <|message|> (at the end, before an end token, or longer than 1 KiB),
//    a message to a recipient other than functions.*, or from a role other than assistant
//    comes back verbatim, special tokens included, as content;
//  - a message the output ends inside is closed there (a call keeps the arguments so far);
//  - a <|start|> or <|channel|> inside a message body ends that message first.
// The text must be decoded with special tokens kept; <|return|> and <|call|> normally end
// generation (stop tokens) and so never reach the parser.
#include <functional>
#include <string>
#include <string_view>

#include "daemon/tokenizer/tool_calls.h"

namespace spark::tok {

/// Incremental harmony parser for one response (one choice).
class HarmonyParser {
 public:
  /// `make_id` gives call ids (default: "call_" + 24 random alphanumerics).
  explicit HarmonyParser(std::function<std::string()> make_id = {});
  /// Feeds a text delta (decoded with special tokens kept).
  ToolParseDelta push(std::string_view delta);
  /// End of output: closes an open message and flushes what was held back.
  ToolParseDelta finish();
  /// Calls emitted so far.
  size_t calls() const { return calls_; }

  /// Whole-text convenience: push(text) then finish(), merged.
  static ToolParseDelta parse(std::string_view text, std::function<std::string()> make_id = {});

 private:
  enum class Mode { start, text, header, body };
  enum class Route { reasoning, content, call, raw };
  void step(ToolParseDelta& out, bool final);
  void open_message(ToolParseDelta& out);
  void close_message(ToolParseDelta& out, std::string_view end_marker);
  void emit_text(ToolParseDelta& out, std::string_view t, bool final);
  void add_arguments(ToolParseDelta& out, std::string_view t);
  void append_arguments(ToolParseDelta& out, std::string piece);

  std::function<std::string()> make_id_;
  Mode mode_ = Mode::start;
  std::string buf_;          // undecided text
  std::string header_;       // the current header, verbatim (its <|start|> included)
  std::string pending_ws_;   // whitespace between messages, dropped unless text follows
  bool stray_text_ = false;  // this stretch between messages had text other than whitespace
  Route route_ = Route::content;
  std::string name_;           // the called function
  std::string body_;           // a raw message's text so far
  bool args_started_ = false;  // the current call's arguments have a non-space character
  std::string args_ws_;        // whitespace after its arguments so far (dropped at the end)
  size_t calls_ = 0;
};

}  // namespace spark::tok
