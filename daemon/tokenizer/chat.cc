#include "daemon/tokenizer/chat.h"

#include <fmt/format.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

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
    case ChatFamily::deepseek:
      return "deepseek";
    case ChatFamily::harmony:
      return "harmony";
    case ChatFamily::other:
      return "other";
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
  std::vector<std::string> out;
  switch (family) {
    case ChatFamily::llama3:
      out = {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"};
      break;
    case ChatFamily::chatml:
      out = {"<|im_end|>", "<|endoftext|>"};
      break;
    case ChatFamily::mistral:
      out = {eos_token.empty() ? "</s>" : eos_token};
      break;
    case ChatFamily::harmony:
      // <|return|> ends the answer, <|call|> a tool call; <|end|> only ends one message.
      out = {"<|return|>", "<|call|>", "<|endoftext|>"};
      break;
    case ChatFamily::deepseek:
    case ChatFamily::other:
      break;
  }
  // A template's model ends its turns with the tokenizer's eos_token (Gemma's
  // <end_of_turn>, DeepSeek's <｜end▁of▁sentence｜>).
  if (chat_template && !eos_token.empty() &&
      std::find(out.begin(), out.end(), eos_token) == out.end())
    out.push_back(eos_token);
  return out;
}

namespace {

std::optional<std::string> token_string(const Json& cfg, const char* k) {
  if (!cfg.is_object() || !cfg.contains(k)) return std::nullopt;
  const Json& v = cfg[k];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return std::nullopt;
}

// The family whose tool-call syntax and stop tokens a template's output follows.
ChatFamily template_family(const std::string& t) {
  if (t.find("<|channel|>") != std::string::npos) return ChatFamily::harmony;
  if (t.find("<｜tool▁calls▁begin｜>") != std::string::npos) return ChatFamily::deepseek;
  if (t.find("[TOOL_CALLS]") != std::string::npos) return ChatFamily::mistral;
  if (t.find("<tool_call>") != std::string::npos) return ChatFamily::chatml;
  if (t.find("<|start_header_id|>") != std::string::npos) return ChatFamily::llama3;
  if (t.find("<|im_start|>") != std::string::npos) return ChatFamily::chatml;
  if (t.find("[INST]") != std::string::npos) return ChatFamily::mistral;
  return ChatFamily::other;
}

Json template_context(const ChatTemplate& ct, const std::vector<ChatMessage>& messages,
                      const Json& tools, bool add_generation_prompt, const Json& kwargs) {
  Json ctx = Json::object();
  for (const auto& [k, v] : ct.special_tokens.items()) ctx[k] = v;
  if (kwargs.is_object())
    for (const auto& [k, v] : kwargs.items()) ctx[k] = v;
  ctx["messages"] =
      template_messages(messages, ct.object_arguments, ct.null_content, ct.reasoning_as_thinking);
  ctx["tools"] = tools.is_array() && !tools.empty() ? tools : Json();
  ctx["documents"] = Json();
  ctx["add_generation_prompt"] = add_generation_prompt;
  return ctx;
}

const jinja::Template& pick_template(const ChatTemplate& ct, const Json& tools) {
  bool has_tools = tools.is_array() && !tools.empty();
  if (has_tools && ct.tool_use_tmpl) return *ct.tool_use_tmpl;
  return ct.default_tmpl ? *ct.default_tmpl : *ct.tool_use_tmpl;
}

// Renders a conversation with one tool call both ways and keeps the form of the arguments
// (dict or text) that comes out as written; likewise whether a null content is passed
// as None or as "" (Qwen3's template fails on None, DeepSeek-V3's needs it).
Status probe_conventions(ChatTemplate& ct) {
  const std::string args_text = "{\"probe_key\": \"probe_value\"}";
  Json tools = Json::array({Json::parse(
      R"({"type": "function", "function": {"name": "probe_fn", "description": "probe",
          "parameters": {"type": "object", "properties": {"probe_key": {"type": "string"}}}}})")});
  std::optional<Error> over_budget;
  // 0: the render fails; 1: it renders; 2: it renders with the arguments as written.
  auto outcome = [&](bool object_args, bool null_content) {
    std::vector<ChatMessage> m(3);
    m[0].role = "user";
    m[0].content = "probe";
    m[1].role = "assistant";
    m[1].content_null = true;
    m[1].tool_calls.push_back({"probecall", "probe_fn", args_text});
    m[2].role = "tool";
    m[2].content = "probe result";
    m[2].tool_call_id = "probecall";
    ChatTemplate c = ct;
    c.object_arguments = object_args;
    c.null_content = null_content;
    auto out =
        pick_template(c, tools).render(template_context(c, m, tools, true, Json()), ct.limits);
    if (!out.ok()) {
      // A render past the budget is the template's own doing, not a convention.
      if (out.error().code == Errc::unsupported && !over_budget) over_budget = out.error();
      return 0;
    }
    return out->find(args_text) != std::string::npos ? 2 : 1;
  };
  bool obj = outcome(true, true) == 2 || outcome(true, false) == 2;
  bool str = outcome(false, true) == 2 || outcome(false, false) == 2;
  ct.object_arguments = obj || !str;
  // None where the template handles it (DeepSeek-V3 tests `content is none`), else "" where
  // that renders (Qwen3 fails on None; Llama 3.0's `trim` would print "None").
  ct.null_content =
      outcome(ct.object_arguments, true) == 2 || outcome(ct.object_arguments, false) == 0;
  if (over_budget)
    return make_error(Errc::config, over_budget->message +
                                        " while rendering a probe conversation at load; the "
                                        "template does more work than any request may");
  return {};
}

Result<std::shared_ptr<ChatTemplate>> compile_template(const Json& cfg,
                                                       const jinja::RenderLimits& limits) {
  auto ct = std::make_shared<ChatTemplate>();
  ct->limits = limits;
  ct->origin = cfg.value("chat_template_origin", std::string("tokenizer_config.json"));
  const Json& t = cfg["chat_template"];
  std::string where = ct->origin + " chat_template";
  if (t.is_string()) {
    auto tm = jinja::Template::parse(t.get<std::string>(), where);
    if (!tm) return tm.error();
    ct->default_tmpl = std::move(*tm);
  } else if (t.is_array()) {  // [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    for (const auto& e : t) {
      if (!e.is_object() || !e.contains("name") || !e["name"].is_string() ||
          !e.contains("template") || !e["template"].is_string())
        return make_error(Errc::config, where +
                                            ": each named template needs a string 'name' "
                                            "and 'template'");
      std::string name = e["name"].get<std::string>();
      if (name != "default" && name != "tool_use") continue;
      auto tm = jinja::Template::parse(e["template"].get<std::string>(), where + " '" + name + "'");
      if (!tm) return tm.error();
      (name == "default" ? ct->default_tmpl : ct->tool_use_tmpl) = std::move(*tm);
    }
    if (!ct->default_tmpl && !ct->tool_use_tmpl)
      return make_error(Errc::config, where + " has no template named 'default' or 'tool_use'");
  } else {
    return make_error(Errc::config, where + " is neither a string nor a list of named templates");
  }
  for (const char* k :
       {"bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"})
    if (auto v = token_string(cfg, k)) ct->special_tokens[k] = *v;
  if (cfg.contains("additional_special_tokens") && cfg["additional_special_tokens"].is_array()) {
    Json extra = Json::array();
    for (const auto& e : cfg["additional_special_tokens"])
      if (e.is_string())
        extra.push_back(e);
      else if (e.is_object() && e.contains("content") && e["content"].is_string())
        extra.push_back(e["content"]);
    ct->special_tokens["additional_special_tokens"] = extra;
  }
  ct->reasoning_as_thinking = template_text(cfg).find("message.thinking") != std::string::npos;
  SPARK_TRY(probe_conventions(*ct));
  return ct;
}

}  // namespace

void escape_special_tokens(std::vector<ChatMessage>& messages, const Tokenizer& tok) {
  for (auto& m : messages) {
    m.content = tok.escape_special(m.content);
    if (m.reasoning_content) m.reasoning_content = tok.escape_special(*m.reasoning_content);
  }
}

Json template_messages(const std::vector<ChatMessage>& messages, bool object_arguments,
                       bool null_content, bool reasoning_as_thinking) {
  Json out = Json::array();
  for (const auto& m : messages) {
    Json j = Json::object();
    j["role"] = m.role == "ipython" ? "tool" : m.role;
    j["content"] = m.content_null && null_content ? Json() : Json(m.content);
    if (m.reasoning_content) j["reasoning_content"] = *m.reasoning_content;
    if (m.reasoning_content && reasoning_as_thinking) j["thinking"] = *m.reasoning_content;
    if (!m.tool_calls.empty()) {
      Json calls = Json::array();
      for (const auto& tc : m.tool_calls) {
        Json fn = Json::object();
        fn["name"] = tc.name;
        fn["arguments"] = object_arguments ? arguments_value(tc.arguments) : Json(tc.arguments);
        Json c = Json::object();
        c["id"] = tc.id;
        c["type"] = "function";
        c["function"] = fn;
        calls.push_back(c);
      }
      j["tool_calls"] = calls;
    }
    if (m.role == "tool" && !m.tool_call_id.empty()) j["tool_call_id"] = m.tool_call_id;
    out.push_back(j);
  }
  return out;
}

Result<Json> load_tokenizer_config(const std::string& dir) {
  namespace fs = std::filesystem;
  auto slurp = [](const std::string& path, std::string* out) {
    std::ifstream f(path, std::ios::binary);
    if (!f) return false;
    std::ostringstream ss;
    ss << f.rdbuf();
    *out = ss.str();
    return !f.bad();
  };
  Json cfg = Json::object();
  std::error_code ec;
  std::string path = dir + "/tokenizer_config.json";
  if (fs::is_regular_file(path, ec)) {
    std::string text;
    if (!slurp(path, &text)) return make_error(Errc::io, "cannot read " + path);
    cfg = Json::parse(text, nullptr, false);
    if (cfg.is_discarded() || !cfg.is_object())
      return make_error(Errc::config, path + " is not a valid JSON object");
  }
  std::string jinja_path = dir + "/chat_template.jinja";
  if (fs::is_regular_file(jinja_path, ec)) {
    std::string text;
    if (!slurp(jinja_path, &text)) return make_error(Errc::io, "cannot read " + jinja_path);
    cfg["chat_template"] = text;
    cfg["chat_template_origin"] = "chat_template.jinja";
  }
  return cfg;
}

Result<ChatFormat> choose_chat_format(std::string_view key, const Json& cfg, std::string_view arch,
                                      const Tokenizer* tok, const jinja::RenderLimits& limits) {
  std::string tmpl = template_text(cfg);
  auto finish = [&](ChatFamily fam, std::string source) {
    ChatFormat f = defaults(fam);
    refine(f, tmpl, cfg);
    f.source = std::move(source);
    return f;
  };
  if (!key.empty() && key != "auto" && key != "template") {
    auto fam = parse_chat_family(key);
    if (!fam)
      return make_error(Errc::config, fmt::format("CHAT_FORMAT={} is not one of auto, template, "
                                                  "llama3, chatml, mistral",
                                                  key));
    return finish(*fam, "CHAT_FORMAT");
  }
  bool has_template =
      cfg.is_object() && cfg.contains("chat_template") && !cfg["chat_template"].is_null();
  if (has_template) {
    auto ct = compile_template(cfg, limits);
    if (!ct) return ct.error();
    ChatFormat f;
    f.family = arch == "GptOssForCausalLM" ? ChatFamily::harmony : template_family(tmpl);
    f.bos_token = token_string(cfg, "bos_token").value_or("");
    f.eos_token = token_string(cfg, "eos_token").value_or("");
    f.chat_template = *ct;
    f.source = (*ct)->origin + " chat_template";
    return f;
  }
  if (key == "template")
    return make_error(Errc::config,
                      "CHAT_FORMAT=template but the checkpoint has no chat_template (neither in "
                      "tokenizer_config.json nor a chat_template.jinja); set CHAT_FORMAT=auto or "
                      "a built-in format (llama3, chatml, mistral)");
  if (arch == "GptOssForCausalLM" || (tok && tok->token_to_id("<|channel|>")))
    return make_error(Errc::unsupported,
                      fmt::format("gpt-oss's harmony chat format ({}) has no built-in renderer: "
                                  "the checkpoint needs its chat_template (chat_template.jinja or "
                                  "tokenizer_config.json)",
                                  arch == "GptOssForCausalLM" ? "architecture GptOssForCausalLM"
                                                              : "vocabulary has <|channel|>"));
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
      fmt::format("cannot tell the chat format: no chat_template in tokenizer_config.json or "
                  "chat_template.jinja, architecture '{}', no <|start_header_id|>/<|im_start|>/"
                  "[INST] token; set CHAT_FORMAT=llama3|chatml|mistral",
                  arch));
}

Result<std::string> render_chat(const ChatFormat& f, const std::vector<ChatMessage>& messages,
                                const Json& tools, bool add_generation_prompt,
                                const Json& template_kwargs, const std::function<bool()>& stop) {
  if (f.chat_template) {
    const ChatTemplate& ct = *f.chat_template;
    jinja::RenderLimits limits = ct.limits;
    limits.stop = stop;
    return pick_template(ct, tools).render(
        template_context(ct, messages, tools, add_generation_prompt, template_kwargs), limits);
  }
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
    case ChatFamily::deepseek:
    case ChatFamily::harmony:
    case ChatFamily::other:
      break;
  }
  return make_error(Errc::unsupported,
                    fmt::format("the '{}' family has no built-in chat format; it needs the "
                                "checkpoint's chat_template",
                                chat_family_name(f.family)));
}

}  // namespace spark::tok
