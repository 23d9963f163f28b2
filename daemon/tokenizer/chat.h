#pragma once
// Chat prompt rendering. A checkpoint's own Jinja chat_template (tokenizer_config.json or
// chat_template.jinja) is run by our interpreter (daemon/tokenizer/jinja/) with the
// variables transformers passes it. Built-in formats, written natively, cover checkpoints
// without a template and the CHAT_FORMAT override: Llama 3 (3.0 and the 3.1+ "Cutting
// Knowledge Date" variant with JSON tool calls), ChatML (Qwen2, Qwen2.5, Qwen3, with Qwen's
// <tools>/<tool_call>/<tool_response> format) and Mistral ([INST], [AVAILABLE_TOOLS],
// [TOOL_CALLS], [TOOL_RESULTS]; tekken/Nemo, v0.3, v0.1 styles). gpt-oss's harmony format
// (channels, <|call|>) is rendered by the checkpoint's own template only. How a format is
// chosen: choose_chat_format().
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "daemon/tokenizer/jinja/jinja.h"
#include "daemon/tokenizer/py_json.h"

namespace spark::tok {

class Tokenizer;

/// A family's prompt and tool-call conventions. llama3, chatml and mistral have built-in
/// formats; deepseek (DeepSeek-V3's <｜tool▁calls▁begin｜> calls), harmony (gpt-oss: analysis
/// and final channels, calls to functions.NAME; see harmony.h) and other (no tool-call syntax
/// we parse, e.g. Gemma 3) exist only with the checkpoint's own template.
enum class ChatFamily { llama3, chatml, mistral, deepseek, harmony, other };

/// Stable lower-case name ("llama3", "chatml", "mistral", "deepseek", "harmony", "other").
std::string_view chat_family_name(ChatFamily f);
/// Parses a CHAT_FORMAT built-in format name; nullopt when unknown.
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
  bool content_null = false;  // "content": null or absent (templates see None)
  std::optional<std::string> reasoning_content =
      std::nullopt;  // an assistant turn's reasoning, when sent
};

/// A checkpoint's compiled chat template and what transformers renders it with.
struct ChatTemplate {
  std::optional<jinja::Template> default_tmpl;   // used without tools (and with, if alone)
  std::optional<jinja::Template> tool_use_tmpl;  // the named "tool_use" template, if any
  Json special_tokens = Json::object();          // bos_token, eos_token, ... as strings
  /// Tool-call arguments reach the template as a dict (Llama 3.1, Mistral apply tojson to
  /// them) or as the JSON text the client sent (DeepSeek-V3 concatenates them); probed
  /// once at load.
  bool object_arguments = true;
  /// A null content reaches the template as None (else as ""), probed likewise.
  bool null_content = true;
  /// An assistant turn's reasoning also reaches the template as `thinking` (gpt-oss's
  /// template reads message.thinking; set when the template text does).
  bool reasoning_as_thinking = false;
  std::string origin;  // "tokenizer_config.json" or "chat_template.jinja"
  /// The budget of every render (TEMPLATE_MAX_STEPS, TEMPLATE_TIMEOUT), the load's probes
  /// included.
  jinja::RenderLimits limits;
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
  /// Set when the checkpoint's own chat template renders prompts (family then only picks
  /// the tool-call parser and stop tokens).
  std::shared_ptr<const ChatTemplate> chat_template;
  /// Token strings that end a turn (the engine stops on their ids).
  std::vector<std::string> stop_tokens() const;
};

/// Reads MODEL_DIR/tokenizer_config.json (an empty object when absent) and puts
/// MODEL_DIR/chat_template.jinja, when present, in its "chat_template" (the file wins, as
/// in transformers). Errors name the file.
Result<Json> load_tokenizer_config(const std::string& model_dir);

/// Picks the chat format of a checkpoint. `chat_format_key` (CHAT_FORMAT): "auto" or empty
/// runs the checkpoint's chat_template when it has one, else detects a built-in format
/// from the config.json architecture and the vocabulary's special tokens; "template"
/// requires the template; a built-in name forces that format. A template that does not
/// parse or uses what the interpreter lacks is an error naming the line. An
/// Errc::unsupported error names what was seen and the fix (set CHAT_FORMAT). `limits`
/// budget every render of the template, the probes at load included: a template whose
/// probe passes them fails the load (Errc::config naming the line and the limit).
Result<ChatFormat> choose_chat_format(std::string_view chat_format_key,
                                      const Json& tokenizer_config, std::string_view architecture,
                                      const Tokenizer* tokenizer,
                                      const jinja::RenderLimits& limits = {});

/// Renders messages (and OpenAI `tools`, an array of {"type":"function","function":{...}})
/// into the prompt text; the engine encodes it with add_special_tokens = false.
/// `template_kwargs` (a request's chat_template_kwargs, e.g. enable_thinking) become
/// template variables; built-in formats ignore them. Errors (Errc::usage) for roles or
/// orders the format cannot express and for a template's raise_exception(); a template
/// render past its limits is Errc::unsupported naming the line and the limit; `stop`
/// (polled during a template render) ends it with Errc::busy.
Result<std::string> render_chat(const ChatFormat& fmt, const std::vector<ChatMessage>& messages,
                                const Json& tools, bool add_generation_prompt,
                                const Json& template_kwargs = Json::object(),
                                const std::function<bool()>& stop = {});

/// Escapes special-token spellings (Tokenizer::escape_special) in what clients write into
/// the prompt: every message's content and an assistant turn's reasoning_content, so that a
/// typed "<|start|>" or "<|channel|>" cannot open a turn or a channel.
void escape_special_tokens(std::vector<ChatMessage>& messages, const Tokenizer& tok);

/// The messages as a chat template sees them (OpenAI shape; tool-call arguments as a dict
/// or as text per `object_arguments`, a null content as None or "" per `null_content`;
/// tool_calls, tool_call_id and reasoning_content (also as `thinking` with
/// `reasoning_as_thinking`) only where the request had them).
Json template_messages(const std::vector<ChatMessage>& messages, bool object_arguments,
                       bool null_content, bool reasoning_as_thinking = false);

}  // namespace spark::tok
