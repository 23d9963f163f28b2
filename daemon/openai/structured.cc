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
      case tok::ChatFamily::chatml:
      case tok::ChatFamily::harmony:  // refused by output_constraint before this
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

std::shared_ptr<const grammar::TokenTrie> make_token_trie(const tok::Tokenizer& tok,
                                                          const std::vector<int32_t>& end_ids,
                                                          size_t vocab_limit, bool call_markers) {
  std::vector<std::string> bytes(std::min(tok.vocab_size(), vocab_limit));
  const auto& markers = marker_texts();
  for (size_t i = 0; i < bytes.size(); ++i) {
    const auto id = static_cast<tok::TokenId>(i);
    if (tok.is_special(id)) {
      auto text = tok.id_to_token(id);
      if (call_markers && text && std::find(markers.begin(), markers.end(), *text) != markers.end())
        bytes[i] = *text;
      continue;
    }
    bytes[i] = std::string(tok.token_bytes(id));
  }
  return std::make_shared<const grammar::TokenTrie>(bytes, end_ids);
}

ApiResult<std::shared_ptr<const grammar::Constraint>> output_constraint(
    const ChatRequest& req, const tok::ChatFormat& fmt,
    const std::shared_ptr<const grammar::TokenTrie>& response_trie,
    const std::shared_ptr<const grammar::TokenTrie>& tool_trie) {
  ApiResult<std::shared_ptr<const grammar::Constraint>> r;
  const bool forced = req.tool_choice.kind == ToolChoice::Kind::required ||
                      req.tool_choice.kind == ToolChoice::Kind::named;
  const std::string param = forced ? "tool_choice" : "response_format";
  if (!forced && req.response_format.kind == ResponseFormat::Kind::text) {
    r.value = nullptr;  // no constraint
    return r;
  }
  if (fmt.family == tok::ChatFamily::harmony) {
    // Harmony output opens with a channel header, which a constraint from the first token
    // would forbid.
    r.error = invalid_request(
        fmt::format("'{}' needs constrained decoding, which is not served for gpt-oss's harmony "
                    "format; use tool_choice \"auto\" and a text response_format.",
                    param),
        param);
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
  r.value = std::make_shared<const grammar::Constraint>(grammar::Constraint{*g, trie});
  return r;
}

}  // namespace spark::openai
