#pragma once
// Chat formats of the supported families, implemented natively (no Jinja engine): Llama 3
// (3.0 and the 3.1+ "Cutting Knowledge Date" variant with JSON tool calls), ChatML (Qwen2,
// Qwen2.5, Qwen3, with Qwen's <tools>/<tool_call>/<tool_response> format) and Mistral
// ([INST], [AVAILABLE_TOOLS], [TOOL_CALLS], [TOOL_RESULTS]; tekken/Nemo, v0.3, v0.1 styles).
// Each reproduces the family's Hugging Face chat template output byte for byte for the
// features listed in docs/dev-chat.md. How a format is chosen: choose_chat_format().
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "daemon/tokenizer/py_json.h"

namespace spark::tok {

class Tokenizer;

enum class ChatFamily { llama3, chatml, mistral };

/// Stable lower-case name ("llama3", "chatml", "mistral").
std::string_view chat_family_name(ChatFamily f);
/// Parses a CHAT_FORMAT value (a family name); nullopt when unknown.
std::optional<ChatFamily> parse_chat_family(std::string_view s);

/// One tool call of an assistant message (OpenAI shape; arguments is JSON text).
struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;
};

/// One chat message. Roles: system, user, assistant, tool ("ipython" is read as tool).
struct ChatMessage {
  std::string role;
  std::string content;
  std::vector<ToolCall> tool_calls;
  std::string tool_call_id;
};

/// The resolved format of one checkpoint, with the variant details the templates differ in.
struct ChatFormat {
  ChatFamily family = ChatFamily::chatml;
  std::string bos_token;                    // prepended by the format (Llama 3, Mistral)
  std::string eos_token;                    // ends assistant turns in the prompt (Mistral)
  std::string default_system;               // ChatML: system prompt used when none is given
  bool llama_knowledge_header = true;       // Llama 3.1+: "Cutting Knowledge Date" system block
  std::string date_string = "26 Jul 2024";  // Llama 3.1 template default
  bool qwen3_thinking = false;              // Qwen3: strip <think> from earlier assistant turns
  /// Mistral template generation: tekken (Nemo: "[INST]x[/INST]"), v3 (7B v0.3:
  /// "[INST] x[/INST]", " answer</s>", "[TOOL_CALLS] [...]"), v1 (v0.1/v0.2:
  /// "[INST] x [/INST]answer</s>", no tools).
  enum class MistralStyle { tekken, v3, v1 } mistral_style = MistralStyle::tekken;
  std::string source;  // how it was chosen, for logs and /v1/models
  /// Token strings that end a turn (the engine stops on their ids).
  std::vector<std::string> stop_tokens() const;
};

/// Picks the chat format of a checkpoint. Order: `chat_format_key` (CHAT_FORMAT; "auto" or
/// empty means detect), markers in tokenizer_config.json's chat_template, the
/// config.json architecture, then special tokens present in the vocabulary. An
/// Errc::unsupported error names what was seen and the fix (set CHAT_FORMAT).
Result<ChatFormat> choose_chat_format(std::string_view chat_format_key,
                                      const Json& tokenizer_config, std::string_view architecture,
                                      const Tokenizer* tokenizer);

/// Renders messages (and OpenAI `tools`, an array of {"type":"function","function":{...}})
/// into the prompt text; the engine encodes it with add_special_tokens = false. Errors
/// (Errc::usage) for roles or orders the family cannot express.
Result<std::string> render_chat(const ChatFormat& fmt, const std::vector<ChatMessage>& messages,
                                const Json& tools, bool add_generation_prompt);

}  // namespace spark::tok
