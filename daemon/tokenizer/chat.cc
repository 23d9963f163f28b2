#include "daemon/tokenizer/chat.h"

#include <fmt/format.h>

#include <ctime>

#include "daemon/tokenizer/tokenizer.h"

namespace spark::tok {

namespace {
const char* kQwen25System = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
const char* kHelpfulSystem = "You are a helpful assistant.";

// Python str.strip(): Unicode whitespace (ASCII set plus the common non-ASCII spaces).
std::string py_strip(std::string_view s) {
  auto is_ws_at = [&](size_t i, size_t* len) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F)) return *len = 1, true;
    static const char* multi[] = {"\xC2\x85",     "\xC2\xA0",     "\xE1\x9A\x80", "\xE2\x80\xA8",
                                  "\xE2\x80\xA9", "\xE2\x80\xAF", "\xE2\x81\x9F", "\xE3\x80\x80"};
    for (const char* m : multi) {
      std::string_view mv(m);
      if (s.substr(i, mv.size()) == mv) return *len = mv.size(), true;
    }
    if (s.substr(i, 2) == "\xE2\x80" && i + 2 < s.size()) {  // U+2000..U+200A
      unsigned char c2 = static_cast<unsigned char>(s[i + 2]);
      if (c2 >= 0x80 && c2 <= 0x8A) return *len = 3, true;
    }
    return false;
  };
  size_t b = 0, len = 0;
  while (b < s.size() && is_ws_at(b, &len)) b += len;
  size_t e = s.size();
  while (e > b) {
    size_t start = e - 1;
    while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    if (!is_ws_at(start, &len) || start + len != e) break;
    e = start;
  }
  return std::string(s.substr(b, e - b));
}

// Tool-call arguments as a JSON value: parsed when the text is JSON (vLLM does the same
// before templating), else kept as a string.
Json arguments_value(const std::string& text) {
  try {
    return Json::parse(text);
  } catch (const std::exception&) {
    return Json(text);
  }
}

Status check_roles(const std::vector<ChatMessage>& msgs) {
  for (size_t i = 0; i < msgs.size(); ++i) {
    const auto& r = msgs[i].role;
    if (r != "system" && r != "user" && r != "assistant" && r != "tool")
      return make_error(Errc::usage, fmt::format("messages[{}].role '{}' is not one of system, "
                                                 "user, assistant, tool",
                                                 i, r));
  }
  return Status::Ok();
}

// ---- ChatML (Qwen2 / Qwen2.5 / Qwen3) ----
std::string render_chatml(const ChatFormat& f, const std::vector<ChatMessage>& m, const Json& tools,
                          bool gen) {
  std::string out;
  bool has_system = !m.empty() && m[0].role == "system";
  bool has_tools = tools.is_array() && !tools.empty();
  if (has_tools) {
    out += "<|im_start|>system\n";
    const std::string& sys = has_system ? m[0].content : f.default_system;
    if (!sys.empty()) out += sys + "\n\n";
    out +=
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
    for (const auto& t : tools) out += "\n" + py_dumps(t);
    out +=
        "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";
  } else if (has_system) {
    out += "<|im_start|>system\n" + m[0].content + "<|im_end|>\n";
  } else if (!f.default_system.empty()) {
    out += "<|im_start|>system\n" + f.default_system + "<|im_end|>\n";
  }
  // Qwen3 drops the reasoning of assistant turns before the last user message.
  size_t last_user = 0;
  for (size_t i = 0; i < m.size(); ++i)
    if (m[i].role == "user") last_user = i;
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "system" && i == 0) continue;
    if (msg.role == "user" || msg.role == "system" ||
        (msg.role == "assistant" && msg.tool_calls.empty())) {
      std::string content = msg.content;
      if (f.qwen3_thinking && msg.role == "assistant" && i < last_user) {
        if (auto p = content.rfind("</think>"); p != std::string::npos) {
          content = content.substr(p + 8);
          content.erase(0, content.find_first_not_of('\n') == std::string::npos
                               ? content.size()
                               : content.find_first_not_of('\n'));
        }
      }
      out += "<|im_start|>" + msg.role + "\n" + content + "<|im_end|>\n";
    } else if (msg.role == "assistant") {
      out += "<|im_start|>assistant";
      if (!msg.content.empty()) out += "\n" + msg.content;
      for (const auto& tc : msg.tool_calls)
        out += "\n<tool_call>\n{\"name\": \"" + tc.name +
               "\", \"arguments\": " + py_dumps(arguments_value(tc.arguments)) + "}\n</tool_call>";
      out += "<|im_end|>\n";
    } else if (msg.role == "tool") {
      if (i == 0 || m[i - 1].role != "tool") out += "<|im_start|>user";
      out += "\n<tool_response>\n" + msg.content + "\n</tool_response>";
      if (i + 1 == m.size() || m[i + 1].role != "tool") out += "<|im_end|>\n";
    }
  }
  if (gen) out += "<|im_start|>assistant\n";
  return out;
}

// ---- Llama 3 / 3.1+ ----
Result<std::string> render_llama3(const ChatFormat& f, std::vector<ChatMessage> m,
                                  const Json& tools, bool gen) {
  bool has_tools = tools.is_array() && !tools.empty();
  std::string out = f.bos_token;
  std::optional<std::string> system;
  if (!m.empty() && m[0].role == "system") {
    system = py_strip(m[0].content);
    m.erase(m.begin());
  }
  if (f.llama_knowledge_header || has_tools) {
    out += "<|start_header_id|>system<|end_header_id|>\n\n";
    if (has_tools) out += "Environment: ipython\n";
    out += "Cutting Knowledge Date: December 2023\nToday Date: " + f.date_string + "\n\n";
    out += system.value_or("") + "<|eot_id|>";
  } else if (system) {  // Llama 3.0: the system message is an ordinary turn
    out += "<|start_header_id|>system<|end_header_id|>\n\n" + *system + "<|eot_id|>";
  }
  if (has_tools) {
    if (m.empty() || m[0].role != "user")
      return make_error(Errc::usage,
                        "Llama 3 puts tool definitions into the first user message, "
                        "but the conversation has no user message first");
    out += "<|start_header_id|>user<|end_header_id|>\n\n";
    out +=
        "Given the following functions, please respond with a JSON for a function call with "
        "its proper arguments that best answers the given prompt.\n\n"
        "Respond in the format {\"name\": function name, \"parameters\": dictionary of "
        "argument name and its value}.Do not use variables.\n\n";
    for (const auto& t : tools) out += py_dumps(t, 4) + "\n\n";
    out += py_strip(m[0].content) + "<|eot_id|>";
    m.erase(m.begin());
  }
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "tool") {
      // The Llama 3.1 template applies tojson to string contents too (strings are iterable in
      // Jinja), so a tool result arrives as a JSON string literal.
      out += "<|start_header_id|>ipython<|end_header_id|>\n\n" + py_dumps(Json(msg.content)) +
             "<|eot_id|>";
    } else if (!msg.tool_calls.empty()) {
      if (msg.tool_calls.size() != 1)
        return make_error(Errc::usage, fmt::format("messages: Llama 3 supports one tool call per "
                                                   "assistant message, got {}",
                                                   msg.tool_calls.size()));
      const ToolCall& tc = msg.tool_calls[0];
      out += "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"" + tc.name +
             "\", \"parameters\": " + py_dumps(arguments_value(tc.arguments)) + "}<|eot_id|>";
    } else {
      out += "<|start_header_id|>" + msg.role + "<|end_header_id|>\n\n" + py_strip(msg.content) +
             "<|eot_id|>";
    }
  }
  if (gen) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

// ---- Mistral (tekken / Nemo style) ----
Result<std::string> render_mistral(const ChatFormat& f, std::vector<ChatMessage> m,
                                   const Json& tools) {
  std::optional<std::string> system;
  if (!m.empty() && m[0].role == "system") {
    system = m[0].content;
    m.erase(m.begin());
  }
  size_t last_user = m.size();
  for (size_t i = 0; i < m.size(); ++i)
    if (m[i].role == "user") last_user = i;
  bool has_tools = tools.is_array() && !tools.empty();
  bool v3 = f.mistral_style == ChatFormat::MistralStyle::v3;
  bool v1 = f.mistral_style == ChatFormat::MistralStyle::v1;
  std::string inst = v1 || v3 ? "[INST] " : "[INST]", close = v1 ? " [/INST]" : "[/INST]";
  if (v1 && has_tools)
    return make_error(Errc::usage, "this Mistral chat template (v0.1/v0.2) defines no tool format");
  std::string out = f.bos_token;
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "user") {
      if (has_tools && i == last_user) {
        out += v3 ? "[AVAILABLE_TOOLS] [" : "[AVAILABLE_TOOLS][";
        for (size_t k = 0; k < tools.size(); ++k) {
          const Json& fn = tools[k].contains("function") ? tools[k]["function"] : tools[k];
          out += "{\"type\": \"function\", \"function\": {";
          bool first = true;
          for (const auto& [key, val] : fn.items()) {
            if (key == "return") continue;
            if (!first) out += ", ";
            first = false;
            if (val.is_string())
              out += "\"" + key + "\": \"" + val.get<std::string>() + "\"";
            else
              out += "\"" + key + "\": " + py_dumps(val);
          }
          out += "}}";
          out += k + 1 < tools.size() ? ", " : "]";
        }
        out += "[/AVAILABLE_TOOLS]";
      }
      if (i + 1 == m.size() && system)
        out += inst + *system + "\n\n" + msg.content + close;
      else
        out += inst + msg.content + close;
    } else if (msg.role == "assistant" && !msg.tool_calls.empty()) {
      out += v3 ? "[TOOL_CALLS] [" : "[TOOL_CALLS][";
      for (size_t k = 0; k < msg.tool_calls.size(); ++k) {
        const ToolCall& tc = msg.tool_calls[k];
        Json fn = Json::object();
        fn["name"] = tc.name;
        fn["arguments"] = arguments_value(tc.arguments);
        std::string s = py_dumps(fn);
        s.pop_back();
        out += s + ", \"id\": \"" + tc.id + "\"}";
        out += k + 1 < msg.tool_calls.size() ? ", " : "]" + f.eos_token;
      }
    } else if (msg.role == "assistant") {
      out += (v3 ? " " + py_strip(msg.content) : msg.content) + f.eos_token;
    } else if (msg.role == "tool") {
      out += std::string(v3 ? "[TOOL_RESULTS] {" : "[TOOL_RESULTS]{") +
             "\"content\": " + msg.content + ", \"call_id\": \"" + msg.tool_call_id +
             "\"}[/TOOL_RESULTS]";
    } else {
      return make_error(Errc::usage, "Mistral formats allow one system message, first");
    }
  }
  return out;
}

ChatFormat defaults(ChatFamily fam) {
  ChatFormat f;
  f.family = fam;
  if (fam == ChatFamily::llama3) f.bos_token = "<|begin_of_text|>";
  if (fam == ChatFamily::mistral) f.bos_token = "<s>", f.eos_token = "</s>";
  return f;
}

std::string template_text(const Json& cfg) {
  if (!cfg.is_object() || !cfg.contains("chat_template")) return {};
  const Json& t = cfg["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array()) {  // [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
    std::string all;
    for (const auto& e : t)
      if (e.is_object() && e.contains("template") && e["template"].is_string())
        all += e["template"].get<std::string>();
    return all;
  }
  return {};
}

// Fills variant details from the template text and tokenizer_config.json.
void refine(ChatFormat& f, const std::string& tmpl, const Json& cfg) {
  auto token_field = [&](const char* k) -> std::optional<std::string> {
    if (!cfg.is_object() || !cfg.contains(k)) return std::nullopt;
    const Json& v = cfg[k];
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string())
      return v["content"].get<std::string>();
    return std::nullopt;
  };
  if (f.family == ChatFamily::llama3) {
    if (auto b = token_field("bos_token")) f.bos_token = *b;
    f.llama_knowledge_header =
        tmpl.empty() || tmpl.find("Cutting Knowledge Date") != std::string::npos;
    // Llama 3.2+ templates take today's date from transformers' strftime_now("%d %b %Y").
    if (tmpl.find("strftime_now") != std::string::npos) {
      std::time_t now = std::time(nullptr);
      std::tm tm{};
      gmtime_r(&now, &tm);
      char buf[32];
      std::strftime(buf, sizeof buf, "%d %b %Y", &tm);
      f.date_string = buf;
    }
  } else if (f.family == ChatFamily::chatml) {
    if (tmpl.find(kQwen25System) != std::string::npos)
      f.default_system = kQwen25System;
    else if (tmpl.find(kHelpfulSystem) != std::string::npos)
      f.default_system = kHelpfulSystem;
    f.qwen3_thinking = tmpl.find("</think>") != std::string::npos;
  } else {
    if (auto b = token_field("bos_token")) f.bos_token = *b;
    if (auto e = token_field("eos_token")) f.eos_token = *e;
    if (tmpl.find("' [/INST]'") != std::string::npos ||
        tmpl.find("\" [/INST]\"") != std::string::npos)
      f.mistral_style = ChatFormat::MistralStyle::v1;
    else if (tmpl.find("[INST] ") != std::string::npos)
      f.mistral_style = ChatFormat::MistralStyle::v3;
  }
}
}  // namespace

std::string_view chat_family_name(ChatFamily f) {
  switch (f) {
    case ChatFamily::llama3:
      return "llama3";
    case ChatFamily::chatml:
      return "chatml";
    case ChatFamily::mistral:
      return "mistral";
  }
  return "?";
}

std::optional<ChatFamily> parse_chat_family(std::string_view s) {
  if (s == "llama3") return ChatFamily::llama3;
  if (s == "chatml") return ChatFamily::chatml;
  if (s == "mistral") return ChatFamily::mistral;
  return std::nullopt;
}

std::vector<std::string> ChatFormat::stop_tokens() const {
  switch (family) {
    case ChatFamily::llama3:
      return {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"};
    case ChatFamily::chatml:
      return {"<|im_end|>", "<|endoftext|>"};
    case ChatFamily::mistral:
      return {eos_token.empty() ? "</s>" : eos_token};
  }
  return {};
}

Result<ChatFormat> choose_chat_format(std::string_view key, const Json& cfg, std::string_view arch,
                                      const Tokenizer* tok) {
  std::string tmpl = template_text(cfg);
  auto finish = [&](ChatFamily fam, std::string source) {
    ChatFormat f = defaults(fam);
    refine(f, tmpl, cfg);
    f.source = std::move(source);
    return f;
  };
  if (!key.empty() && key != "auto") {
    auto fam = parse_chat_family(key);
    if (!fam)
      return make_error(Errc::config, fmt::format("CHAT_FORMAT={} is not one of auto, llama3, "
                                                  "chatml, mistral",
                                                  key));
    return finish(*fam, "CHAT_FORMAT");
  }
  if (!tmpl.empty()) {
    if (tmpl.find("<|start_header_id|>") != std::string::npos)
      return finish(ChatFamily::llama3, "chat_template markers (<|start_header_id|>)");
    if (tmpl.find("<|im_start|>") != std::string::npos)
      return finish(ChatFamily::chatml, "chat_template markers (<|im_start|>)");
    if (tmpl.find("[INST]") != std::string::npos)
      return finish(ChatFamily::mistral, "chat_template markers ([INST])");
  }
  if (arch == "Qwen2ForCausalLM" || arch == "Qwen3ForCausalLM")
    return finish(ChatFamily::chatml, fmt::format("architecture {}", arch));
  if (arch == "MistralForCausalLM")
    return finish(ChatFamily::mistral, fmt::format("architecture {}", arch));
  if (arch == "LlamaForCausalLM" && tok && tok->token_to_id("<|start_header_id|>"))
    return finish(ChatFamily::llama3, fmt::format("architecture {}", arch));
  if (tok) {
    if (tok->token_to_id("<|start_header_id|>"))
      return finish(ChatFamily::llama3, "vocabulary has <|start_header_id|>");
    if (tok->token_to_id("<|im_start|>"))
      return finish(ChatFamily::chatml, "vocabulary has <|im_start|>");
    if (tok->token_to_id("[INST]")) return finish(ChatFamily::mistral, "vocabulary has [INST]");
  }
  return make_error(
      Errc::unsupported,
      fmt::format("cannot tell the chat format: tokenizer_config.json has {}, "
                  "architecture '{}', no <|start_header_id|>/<|im_start|>/[INST] "
                  "token; set CHAT_FORMAT=llama3|chatml|mistral",
                  tmpl.empty() ? "no chat_template" : "an unrecognized chat_template", arch));
}

Result<std::string> render_chat(const ChatFormat& f, const std::vector<ChatMessage>& messages,
                                const Json& tools, bool add_generation_prompt) {
  std::vector<ChatMessage> m = messages;
  for (auto& msg : m)
    if (msg.role == "ipython") msg.role = "tool";
  SPARK_TRY(check_roles(m));
  switch (f.family) {
    case ChatFamily::chatml:
      return render_chatml(f, m, tools, add_generation_prompt);
    case ChatFamily::llama3:
      return render_llama3(f, std::move(m), tools, add_generation_prompt);
    case ChatFamily::mistral:
      return render_mistral(f, std::move(m), tools);
  }
  return make_error(Errc::internal, "unknown chat family");
}

}  // namespace spark::tok
