// Structured outputs' request side: which requests get a constraint, the 400s for what the
// grammar does not hold, and forced tool calls written in each chat family's syntax so that
// the family's tool-call parser reads every output back as one call of the named tool.
#include <doctest/doctest.h>

#include <random>

#include "daemon/openai/structured.h"
#include "daemon/tokenizer/tool_calls.h"

using namespace spark;
using namespace spark::openai;

namespace {

// Every byte, a few words, and an end id.
std::shared_ptr<const grammar::TokenTrie> byte_trie(int32_t* eos) {
  std::vector<std::string> bytes;
  for (int c = 0; c < 256; ++c) bytes.push_back(std::string(1, static_cast<char>(c)));
  for (const char* t : {"{\"", "\": ", "true", "false", "fast", "slow", "\"}", "<tool_call>"})
    bytes.push_back(t);
  *eos = static_cast<int32_t>(bytes.size());
  bytes.push_back("");
  return std::make_shared<grammar::TokenTrie>(bytes, std::vector<int32_t>{*eos});
}

ChatRequest request(const std::string& extra) {
  auto r = parse_chat_request(R"({"messages": [{"role": "user", "content": "x"}], )" + extra + "}",
                              Limits{});
  REQUIRE_MESSAGE(r.ok(), r.error.message);
  return *r.value;
}

const char* kTools = R"("tools": [
  {"type": "function", "function": {"name": "set_mode", "parameters": {"type": "object",
     "additionalProperties": false, "properties": {"mode": {"enum": ["fast", "slow"]},
     "level": {"type": "integer"}}, "required": ["mode", "level"]}}},
  {"type": "function", "function": {"name": "reset", "parameters": {"type": "object",
     "additionalProperties": false, "properties": {"hard": {"type": "boolean"}},
     "required": ["hard"]}}}])";

// Random text the constraint allows, up to its end (nullopt: still going after `max`).
std::optional<std::string> draw(const grammar::Constraint& c, int32_t eos, std::mt19937& rng,
                                int max = 500) {
  grammar::Matcher m(c);
  std::vector<uint32_t> mask((static_cast<size_t>(c.trie->vocab()) + 31) / 32);
  std::string out;
  for (int i = 0; i < max; ++i) {
    m.fill_mask(mask.data());
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < c.trie->vocab(); ++id)
      if ((mask[static_cast<size_t>(id) >> 5] >> (id & 31)) & 1u) allowed.push_back(id);
    REQUIRE_FALSE(allowed.empty());
    int32_t pick = allowed[rng() % allowed.size()];
    if (std::find(allowed.begin(), allowed.end(), eos) != allowed.end()) pick = eos;
    REQUIRE(m.accept(pick));
    if (pick == eos) return out;
    out += c.trie->bytes(pick);
  }
  return std::nullopt;
}

}  // namespace

TEST_CASE("structured outputs: which requests are constrained; unsupported keywords are a 400") {
  int32_t eos = 0;
  auto trie = byte_trie(&eos);
  tok::ChatFormat fmt;
  auto none = output_constraint(request(R"("max_tokens": 3)"), fmt, trie, trie);
  REQUIRE(none.ok());
  CHECK(*none.value == nullptr);
  auto auto_tools = output_constraint(request(std::string(kTools) + R"(, "tool_choice": "auto")"),
                                      fmt, trie, trie);
  REQUIRE(auto_tools.ok());
  CHECK(*auto_tools.value == nullptr);
  auto obj =
      output_constraint(request(R"("response_format": {"type": "json_object"})"), fmt, trie, trie);
  REQUIRE(obj.ok());
  REQUIRE(*obj.value != nullptr);
  grammar::Matcher m(**obj.value);
  CHECK(m.accept_bytes(R"({"any": [1, "x"]})"));
  CHECK(m.can_end());

  auto bad = output_constraint(
      request(R"("response_format": {"type": "json_schema", "json_schema": {"name": "p",
          "schema": {"type": "object", "properties": {"id": {"type": "string", "pattern": "x"}}}}})"),
      fmt, trie, trie);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error.status == 400);
  CHECK(bad.error.param == "response_format");
  CHECK(bad.error.message.find("'pattern' at response_format.json_schema.schema.properties.id") !=
        std::string::npos);
  // A forced call whose tool's parameters the grammar cannot hold names the tool.
  auto bad_tool = output_constraint(
      request(R"("tools": [{"type": "function", "function": {"name": "f", "parameters":
          {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}}],
          "tool_choice": "required")"),
      fmt, trie, trie);
  REQUIRE_FALSE(bad_tool.ok());
  CHECK(bad_tool.error.param == "tools");
  CHECK(bad_tool.error.message.find("'minimum' at tools[0].function.parameters.properties.n") !=
        std::string::npos);
  // A tokenizer whose tokens are not bytes (no trie) cannot be constrained: said, not ignored.
  auto no_trie = output_constraint(request(R"("response_format": {"type": "json_object"})"), fmt,
                                   nullptr, nullptr);
  REQUIRE_FALSE(no_trie.ok());
  CHECK(no_trie.error.param == "response_format");
}

TEST_CASE("structured outputs: forced calls in each family's syntax parse back as that call") {
  int32_t eos = 0;
  auto trie = byte_trie(&eos);
  std::mt19937 rng(17);
  for (auto family : {tok::ChatFamily::chatml, tok::ChatFamily::llama3, tok::ChatFamily::mistral,
                      tok::ChatFamily::deepseek, tok::ChatFamily::other}) {
    CAPTURE(tok::chat_family_name(family));
    tok::ChatFormat fmt;
    fmt.family = family;
    for (const char* choice :
         {R"("tool_choice": {"type": "function", "function": {"name": "reset"}})",
          R"("tool_choice": "required")"}) {
      CAPTURE(choice);
      auto c = output_constraint(request(std::string(kTools) + ", " + choice), fmt, trie, trie);
      REQUIRE(c.ok());
      REQUIRE(*c.value != nullptr);
      int parsed = 0;
      for (int run = 0; run < 12; ++run) {
        auto text = draw(**c.value, eos, rng);
        if (!text) continue;
        INFO(*text);
        auto d = tok::ToolCallParser::parse(family, *text);
        REQUIRE(d.calls.size() == 1);
        CHECK(d.content.empty());
        const auto& call = d.calls[0];
        auto args = tok::Json::parse(call.arguments);
        if (call.name == "reset") {
          CHECK(args["hard"].is_boolean());
        } else {
          CHECK(std::string(choice).find("required") != std::string::npos);
          CHECK(call.name == "set_mode");
          CHECK((args["mode"] == "fast" || args["mode"] == "slow"));
          CHECK(args["level"].is_number_integer());
        }
        ++parsed;
      }
      CHECK(parsed >= 6);
    }
  }
}
