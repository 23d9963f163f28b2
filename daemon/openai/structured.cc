#include "daemon/openai/structured.h"

#include <fmt/format.h>

#include <algorithm>

namespace spark::openai {

namespace {
// Markers that formats write as special tokens: the grammar may need their text.
const std::vector<std::string>& marker_texts() {
  static const std::vector<std::string> m = {
      "<tool_call>",           "</tool_call>",           "[TOOL_CALLS]",
      "<|python_tag|>",        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
      "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",         "<｜tool▁call▁end｜>"};
  return m;
}

// gpt-oss's harmony markers, as the harmony tries spell them (harmony_marker).
const std::vector<std::string>& harmony_markers() {
  static const std::vector<std::string> m = {"<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                             "<|constrain|>"};
  return m;
}

Json object_schema(Json props, std::vector<std::string> required) {
  Json s = Json::object();
  s["type"] = "object";
  s["properties"] = std::move(props);
  s["required"] = std::move(required);
  s["additionalProperties"] = false;
  return s;
}

// One alternative per tool the call may name, in the family's syntax.
ApiResult<std::vector<grammar::Grammar::Wrapped>> tool_alternatives(const ChatRequest& req,
                                                                    tok::ChatFamily family) {
  ApiResult<std::vector<grammar::Grammar::Wrapped>> r;
  std::vector<grammar::Grammar::Wrapped> alts;
  for (size_t i = 0; i < req.tools.size(); ++i) {
    const Json& fn = req.tools[i]["function"];
    const std::string name = fn["name"].get<std::string>();
    if (req.tool_choice.kind == ToolChoice::Kind::named && name != req.tool_choice.name) continue;
    const std::string where = fmt::format("tools[{}].function.parameters", i);
    Json params = fn.contains("parameters") && fn["parameters"].is_object()
                      ? fn["parameters"]
                      : Json::parse(R"({"type": "object"})");
    // The parameters alone first, so that a refusal names where they are in the request.
    if (auto alone = grammar::Grammar::from_schema(params, where); !alone) {
      r.error = invalid_request(alone.error().message + ".", "tools");
      return r;
    }
    Json props = Json::object();
    grammar::Grammar::Wrapped w;
    w.where = where;
    switch (family) {
      case tok::ChatFamily::llama3:
        props["name"] = Json{{"const", name}};
        props["parameters"] = params;
        w.schema = object_schema(std::move(props), {"name", "parameters"});
        break;
      case tok::ChatFamily::mistral:
        props["name"] = Json{{"const", name}};
        props["arguments"] = params;
        w.before = "[TOOL_CALLS][";
        w.schema = object_schema(std::move(props), {"name", "arguments"});
        w.after = "]";
        break;
      case tok::ChatFamily::deepseek:
        w.before = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>" + name +
                   "\n```json\n";
        w.schema = params;
        w.after = "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        break;
      case tok::ChatFamily::harmony:
        // A call on the commentary channel, as gpt-oss writes one; <|call|> (the trie's end)
        // closes it.
        w.before = harmony_marker("<|channel|>") + "commentary to=functions." + name + " " +
                   harmony_marker("<|constrain|>") + "json" + harmony_marker("<|message|>");
        w.schema = params;
        break;
      case tok::ChatFamily::chatml:
      case tok::ChatFamily::other:
        props["name"] = Json{{"const", name}};
        props["arguments"] = params;
        w.before = "<tool_call>\n";
        w.schema = object_schema(std::move(props), {"name", "arguments"});
        w.after = "\n</tool_call>";
        break;
    }
    alts.push_back(std::move(w));
  }
  r.value = std::move(alts);
  return r;
}
}  // namespace

std::string harmony_marker(const std::string& text) {
  return "\x1b" + text;
}

std::shared_ptr<const grammar::TokenTrie> make_token_trie(const tok::Tokenizer& tok,
                                                          const std::vector<int32_t>& end_ids,
                                                          size_t vocab_limit, bool call_markers,
                                                          bool harmony) {
  std::vector<std::string> bytes(std::min(tok.vocab_size(), vocab_limit));
  const auto& markers = marker_texts();
  const auto& hm = harmony_markers();
  for (size_t i = 0; i < bytes.size(); ++i) {
    const auto id = static_cast<tok::TokenId>(i);
    if (tok.is_special(id)) {
      auto text = tok.id_to_token(id);
      if (harmony && text && std::find(hm.begin(), hm.end(), *text) != hm.end())
        bytes[i] = harmony_marker(*text);
      else if (call_markers && text &&
               std::find(markers.begin(), markers.end(), *text) != markers.end())
        bytes[i] = *text;
      continue;
    }
    bytes[i] = std::string(tok.token_bytes(id));
    // Only the markers spell ESC in a harmony trie: a byte token of it (byte-level BPE has
    // one) cannot start a marker's spelling. Such ids stay free before a gate, and JSON
    // takes no control byte anyway.
    if (harmony && bytes[i].find('\x1b') != std::string::npos) bytes[i].clear();
  }
  return std::make_shared<const grammar::TokenTrie>(bytes, end_ids);
}

ApiResult<std::shared_ptr<const grammar::Constraint>> output_constraint(
    const ChatRequest& req, const tok::ChatFormat& fmt,
    const std::shared_ptr<const grammar::TokenTrie>& response_trie,
    const std::shared_ptr<const grammar::TokenTrie>& tool_trie,
    const std::vector<int32_t>& stop_ids) {
  ApiResult<std::shared_ptr<const grammar::Constraint>> r;
  const bool forced = req.tool_choice.kind == ToolChoice::Kind::required ||
                      req.tool_choice.kind == ToolChoice::Kind::named;
  const std::string param = forced ? "tool_choice" : "response_format";
  if (!forced && req.response_format.kind == ResponseFormat::Kind::text) {
    r.value = nullptr;  // no constraint
    return r;
  }
  const auto& trie = forced ? tool_trie : response_trie;
  if (!trie) {
    r.error = invalid_request(
        fmt::format("'{}' needs constrained decoding, which this model's tokenizer does not "
                    "support (its tokens are not byte strings).",
                    param),
        param);
    return r;
  }
  Result<std::shared_ptr<const grammar::Grammar>> g = grammar::Grammar::any_object();
  if (forced) {
    auto alts = tool_alternatives(req, fmt.family);
    if (!alts.ok()) {
      r.error = alts.error;
      return r;
    }
    g = grammar::Grammar::one_of(*alts.value);
  } else if (req.response_format.kind == ResponseFormat::Kind::json_schema) {
    g = grammar::Grammar::from_schema(req.response_format.schema,
                                      "response_format.json_schema.schema");
  }
  if (!g) {
    r.error = invalid_request(g.error().message + ".", forced ? "tools" : param);
    return r;
  }
  grammar::Constraint c{*g, trie, {}, stop_ids};
  // gpt-oss writes its analysis first, free. A response format applies to its final
  // message, from the final channel's header on. A forced call may follow an analysis
  // message (then from the next message's header on) or come first; either way it is
  // written on the commentary channel.
  if (fmt.family == tok::ChatFamily::harmony && !forced)
    c.gate = harmony_marker("<|channel|>") + "final" + harmony_marker("<|message|>");
  if (fmt.family == tok::ChatFamily::harmony && forced) {
    c.opening = harmony_marker("<|channel|>") + "analysis" + harmony_marker("<|message|>");
    c.gate = harmony_marker("<|end|>") + harmony_marker("<|start|>") + "assistant";
  }
  r.value = std::make_shared<const grammar::Constraint>(std::move(c));
  return r;
}

}  // namespace spark::openai
