// Structured outputs' grammar: JSON Schema to a byte-level pushdown automaton, the token mask
// over a vocabulary trie. Outputs drawn at random under the mask must always parse and
// validate against the schema; schemas outside the subset are refused naming the keyword.
#include <doctest/doctest.h>

#include <random>
#include <string>
#include <vector>

#include "daemon/grammar/json_grammar.h"

using namespace spark;
using namespace spark::grammar;

namespace {

// A vocabulary of every single byte, multi-byte pieces that cross JSON's structure (so the
// trie walk has to split tokens between states), and an end id.
struct Vocab {
  std::vector<std::string> bytes;
  int32_t eos = 0;
  std::shared_ptr<const TokenTrie> trie;
  Vocab() {
    for (int c = 0; c < 256; ++c) bytes.push_back(std::string(1, static_cast<char>(c)));
    for (const char* t :
         {"{\"",     "\":",     "\": ",    "\", \"", "\",\"", "},",   "}]",   "[{",
          "true",    "false",   "null",    "tr",     "ue",    "nul",  "abc",  "hello world",
          "  ",      "\n  ",    "\n",      "\\u",    "\\n",   "00",   "12",   "3.",
          ".5",      "e+",      "E-1",     "-0",     "\"}",   "\"]",  "name", "\"name",
          "\"age\"", "age",     ", ",      "é",      "\xc3",  "\xa9", "日本", "\xf0\x9f\x98",
          "\x80",    "\\ud83d", "\\ude00", "\"x\":", "{}",    "[]",   "1,",   "0}",
          "\"a",     "b\"",     "ok\"",    "\"ok\"", ", \"",  "}\n"})
      bytes.push_back(t);
    bytes.push_back("");  // a special token: never allowed
    eos = static_cast<int32_t>(bytes.size());
    bytes.push_back("");  // the end id
    trie = std::make_shared<TokenTrie>(bytes, std::vector<int32_t>{eos});
  }
};
const Vocab& vocab() {
  static Vocab v;
  return v;
}

std::shared_ptr<const Grammar> compile(const Json& schema) {
  auto g = Grammar::from_schema(schema);
  REQUIRE_MESSAGE(g.ok(), (g.ok() ? "" : g.error().message));
  return *g;
}

bool bit(const std::vector<uint32_t>& m, int32_t id) {
  return (m[static_cast<size_t>(id) >> 5] >> (id & 31)) & 1u;
}

// Draws tokens uniformly among the allowed ones until the end id (or `max` tokens).
// Returns the text, or nullopt when the length ran out.
std::optional<std::string> draw(const std::shared_ptr<const Grammar>& g, std::mt19937& rng,
                                int max = 400) {
  const Vocab& v = vocab();
  Matcher m({g, v.trie});
  std::vector<uint32_t> mask((v.bytes.size() + 31) / 32);
  std::string out;
  for (int i = 0; i < max; ++i) {
    const int n = m.fill_mask(mask.data());
    REQUIRE(n > 0);
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < static_cast<int32_t>(v.bytes.size()); ++id)
      if (bit(mask, id)) allowed.push_back(id);
    REQUIRE(static_cast<int>(allowed.size()) == n);
    // Favour the end and closing so that values finish; otherwise uniform.
    int32_t pick = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
    if (bit(mask, v.eos) && rng() % 2 == 0) pick = v.eos;
    REQUIRE(m.accept(pick));
    if (pick == v.eos) return out;
    out += v.bytes[static_cast<size_t>(pick)];
  }
  return std::nullopt;
}

// The subset's validation, written from the JSON Schema rules (independent of the grammar).
bool valid(const Json& x, const Json& s, const Json& root) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) {
    std::string r = s["$ref"].get<std::string>();
    return valid(x, root.at(Json::json_pointer(r.substr(1))), root);
  }
  if (s.contains("const") && x != s["const"]) return false;
  if (s.contains("enum")) {
    bool any = false;
    for (const auto& e : s["enum"]) any = any || e == x;
    if (!any) return false;
  }
  if (s.contains("anyOf")) {
    bool any = false;
    for (const auto& a : s["anyOf"]) any = any || valid(x, a, root);
    if (!any) return false;
  }
  if (s.contains("type")) {
    std::vector<std::string> types;
    if (s["type"].is_string())
      types.push_back(s["type"].get<std::string>());
    else
      for (const auto& t : s["type"]) types.push_back(t.get<std::string>());
    bool ok = false;
    for (const auto& t : types)
      ok = ok || (t == "object" && x.is_object()) || (t == "array" && x.is_array()) ||
           (t == "string" && x.is_string()) || (t == "number" && x.is_number()) ||
           (t == "integer" && x.is_number_integer()) || (t == "boolean" && x.is_boolean()) ||
           (t == "null" && x.is_null());
    if (!ok) return false;
  }
  if (x.is_object() && s.contains("properties")) {
    for (const auto& r : s.value("required", Json::array()))
      if (!x.contains(r.get<std::string>())) return false;
    for (auto it = x.begin(); it != x.end(); ++it) {
      if (!s["properties"].contains(it.key())) {
        if (s.value("additionalProperties", Json(true)) == Json(false)) return false;
        continue;
      }
      if (!valid(it.value(), s["properties"][it.key()], root)) return false;
    }
  }
  if (x.is_array() && s.contains("items"))
    for (const auto& e : x)
      if (!valid(e, s["items"], root)) return false;
  return true;
}

// Many random outputs under `schema`: each ends, parses and validates.
void check_outputs(const Json& schema, int runs = 60) {
  auto g = compile(schema);
  std::mt19937 rng(7);
  int finished = 0;
  for (int i = 0; i < runs; ++i) {
    auto text = draw(g, rng);
    if (!text) continue;
    ++finished;
    Json x;
    INFO("schema " << schema.dump() << " output " << *text);
    REQUIRE_NOTHROW(x = Json::parse(*text));
    CHECK(valid(x, schema, schema));
  }
  CHECK(finished > runs / 2);
}

bool takes(const std::shared_ptr<const Grammar>& g, std::string_view text, bool complete = true) {
  Matcher m({g, vocab().trie});
  if (!m.accept_bytes(text)) return false;
  return !complete || m.can_end();
}

}  // namespace

TEST_CASE("grammar: random outputs under every supported keyword parse and validate") {
  check_outputs(Json::parse(R"({"type": "string"})"));
  check_outputs(Json::parse(R"({"type": "number"})"));
  check_outputs(Json::parse(R"({"type": "integer"})"));
  check_outputs(Json::parse(R"({"type": "boolean"})"));
  check_outputs(Json::parse(R"({"type": "null"})"));
  check_outputs(Json::parse(R"({"enum": ["red", "green", 3, null, {"a": [1]}]})"));
  check_outputs(Json::parse(R"({"const": "fixed"})"));
  check_outputs(Json::parse(R"({"type": ["string", "null"]})"));
  check_outputs(Json::parse(R"({"type": "array", "items": {"type": "integer"}})"));
  check_outputs(Json::parse(R"({"anyOf": [{"type": "integer"}, {"type": "string"},
      {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
       "additionalProperties": false}]})"));
  check_outputs(Json::parse(R"({
    "type": "object", "additionalProperties": false,
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
                   "nick": {"type": ["string", "null"]}},
    "required": ["name", "age"]})"));
  // Nested $defs and a recursive $ref.
  check_outputs(Json::parse(R"({
    "$defs": {"node": {"type": "object", "additionalProperties": false,
                       "properties": {"v": {"type": "integer"},
                                      "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                       "required": ["v", "kids"]}},
    "$ref": "#/$defs/node"})"));
  // Any JSON object (response_format json_object) and free-form maps.
  {
    auto g = Grammar::any_object();
    std::mt19937 rng(3);
    int finished = 0;
    for (int i = 0; i < 60; ++i) {
      auto text = draw(g, rng);
      if (!text) continue;
      ++finished;
      INFO(*text);
      Json x;
      REQUIRE_NOTHROW(x = Json::parse(*text));
      CHECK(x.is_object());
    }
    CHECK(finished > 30);
  }
  check_outputs(Json::parse(R"({"type": "object", "additionalProperties": {"type": "number"}})"));
}

TEST_CASE(
    "grammar: object properties come in the schema's order; required ones are never left out") {
  auto g = compile(Json::parse(R"({"type": "object", "additionalProperties": false,
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
      "required": ["a", "c"]})"));
  CHECK(takes(g, R"({"a": 1, "b": 2, "c": 3})"));
  CHECK(takes(g, R"({"a":1,"c":3})"));
  CHECK_FALSE(takes(g, R"({"a": 1})"));                  // c is required
  CHECK_FALSE(takes(g, R"({"c": 3, "a": 1})", false));   // out of order
  CHECK_FALSE(takes(g, R"({"a": 1, "d": 4})", false));   // not a property
  CHECK_FALSE(takes(g, R"({"a": 1, "a": 1})", false));   // twice
  CHECK_FALSE(takes(g, R"( {"a": 1, "c": 3})", false));  // no whitespace before the value
  auto empty = compile(
      Json::parse(R"({"type": "object", "properties": {}, "additionalProperties": false})"));
  CHECK(takes(empty, "{}"));
  CHECK(takes(empty, "{ }"));
  CHECK_FALSE(takes(empty, "{\"x\":1}", false));
}

TEST_CASE("grammar: strings take UTF-8 and escapes; \\u surrogates must pair") {
  auto g = compile(Json::parse(R"({"type": "string"})"));
  CHECK(takes(g, R"("plain")"));
  CHECK(takes(g, "\"caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x98\x80\""));
  CHECK(takes(g, R"("\" \\ \/ \b \f \n \r \t")"));
  CHECK(takes(g, R"("\u00e9\u0041\uFFFF")"));
  CHECK(takes(g, R"("\ud83d\ude00")"));  // a surrogate pair
  CHECK(takes(g, R"("\uD83D\uDE00")"));
  CHECK_FALSE(takes(g, R"("\ude00")", false));        // a low surrogate alone
  CHECK_FALSE(takes(g, R"("\ud83dx")", false));       // a high surrogate alone
  CHECK_FALSE(takes(g, R"("\ud83d\u0041")", false));  // a high one, then no low one
  CHECK_FALSE(takes(g, R"("\x")", false));
  CHECK_FALSE(takes(g, R"("\u00g0")", false));
  CHECK_FALSE(takes(g, "\"a\nb\"", false));              // a raw control character
  CHECK_FALSE(takes(g, "\"\xc3(\"", false));             // a lead byte without its continuation
  CHECK_FALSE(takes(g, "\"\xc0\xaf\"", false));          // an overlong form
  CHECK_FALSE(takes(g, "\"\xed\xa0\x80\"", false));      // a surrogate in UTF-8
  CHECK_FALSE(takes(g, "\"\xf4\x90\x80\x80\"", false));  // past U+10FFFF
  CHECK_FALSE(takes(g, R"("open)"));                     // not complete
  // Every random string with escapes parses to what the escapes say.
  std::mt19937 rng(11);
  for (int i = 0; i < 100; ++i) {
    auto text = draw(g, rng);
    if (!text) continue;
    INFO(*text);
    Json x;
    REQUIRE_NOTHROW(x = Json::parse(*text));
    CHECK(x.is_string());
  }
}

TEST_CASE("grammar: numbers follow JSON's grammar; integers take no fraction or exponent") {
  auto num = compile(Json::parse(R"({"type": "number"})"));
  auto integer = compile(Json::parse(R"({"type": "integer"})"));
  for (const char* ok : {"0", "-0", "12", "-3.25", "1e5", "1E+5", "2.5e-3", "0.0", "1e99"})
    CHECK_MESSAGE(takes(num, ok), ok);
  for (const char* bad :
       {"01", "1.", ".5", "-", "1e", "1e+", "+1", "--1", "1.2.3", "0x1", "NaN", "1e100"})
    CHECK_MESSAGE(!takes(num, bad), bad);
  CHECK(takes(integer, "-42"));
  CHECK_FALSE(takes(integer, "1.0", false));
  CHECK_FALSE(takes(integer, "1e5", false));
  // Digits per part are bounded, so a number cannot run on forever.
  CHECK(takes(num, std::string(kMaxDigits, '7')));
  CHECK_FALSE(takes(num, std::string(kMaxDigits + 1, '7'), false));
  // A complete number may still go on: the end and more digits are both allowed.
  Matcher m({num, vocab().trie});
  REQUIRE(m.accept_bytes("12"));
  std::vector<uint32_t> mask((vocab().bytes.size() + 31) / 32);
  m.fill_mask(mask.data());
  CHECK(bit(mask, vocab().eos));
  CHECK(bit(mask, '3'));
  CHECK_FALSE(m.must_end());
}

TEST_CASE("grammar: the trie mask is exactly the tokens whose bytes the automaton takes") {
  const Vocab& v = vocab();
  auto g = compile(Json::parse(R"({"type": "object", "additionalProperties": false,
      "properties": {"name": {"type": "string"}, "n": {"type": "number"},
                     "ok": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
      "required": ["name", "n", "ok"]})"));
  std::mt19937 rng(5);
  int checked = 0;
  for (int run = 0; run < 12; ++run) {
    Matcher m({g, v.trie});
    std::string prefix;
    std::vector<uint32_t> mask((v.bytes.size() + 31) / 32);
    for (int step = 0; step < 60; ++step) {
      m.fill_mask(mask.data());
      // The reference: every token tried on its own from the same prefix (vocab x length).
      for (int32_t id = 0; id < static_cast<int32_t>(v.bytes.size()); ++id) {
        Matcher ref({g, v.trie});
        REQUIRE(ref.accept_bytes(prefix));
        const bool ok = id == v.eos ? ref.can_end() : ref.accept(id);
        if (bit(mask, id) != ok) {
          FAIL_CHECK("prefix " << prefix << " token " << id << " mask " << bit(mask, id));
          break;
        }
        ++checked;
      }
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < static_cast<int32_t>(v.bytes.size()); ++id)
        if (bit(mask, id)) allowed.push_back(id);
      const int32_t pick = allowed[rng() % allowed.size()];
      if (pick == v.eos) break;
      REQUIRE(m.accept(pick));
      prefix += v.bytes[static_cast<size_t>(pick)];
    }
  }
  CHECK(checked > 1000);
  // Once the value is complete and nothing may follow, only the end id is allowed.
  Matcher done({g, v.trie});
  REQUIRE(done.accept_bytes(R"({"name": "x", "n": 1.5, "ok": null})"));
  CHECK(done.must_end());
  std::vector<uint32_t> mask((v.bytes.size() + 31) / 32);
  CHECK(done.fill_mask(mask.data()) == 1);
  CHECK(bit(mask, v.eos));
  // The special token (no bytes) is never allowed; the end id not before the end.
  Matcher start({g, v.trie});
  start.fill_mask(mask.data());
  CHECK_FALSE(bit(mask, v.eos - 1));
  CHECK_FALSE(bit(mask, v.eos));
  CHECK(bit(mask, '{'));
  CHECK_FALSE(bit(mask, '['));
  CHECK_FALSE(start.accept(v.eos));
}

TEST_CASE("grammar: schemas outside the subset are refused naming the keyword and where") {
  auto refused = [](const char* schema, const char* words) {
    auto g = Grammar::from_schema(Json::parse(schema), "response_format.json_schema.schema");
    REQUIRE_FALSE(g.ok());
    CHECK(g.error().code == Errc::usage);
    CHECK_MESSAGE(g.error().message.find(words) != std::string::npos, g.error().message);
  };
  refused(R"({"type": "string", "pattern": "^a$"})",
          "'pattern' at response_format.json_schema.schema");
  refused(R"({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}})",
          "'format' at response_format.json_schema.schema.properties.d");
  refused(R"({"oneOf": [{"type": "string"}]})", "'oneOf'");
  refused(R"({"allOf": [{"type": "string"}]})", "'allOf'");
  refused(R"({"type": "string", "minLength": 2})", "'minLength'");
  refused(R"({"type": "object", "properties": {"a": true}, "additionalProperties": true})",
          "'additionalProperties' other than false");
  refused(R"({"type": "object", "properties": {"a": {}}, "required": ["b"]})",
          "names 'b', which is not in 'properties'");
  refused(R"({"$ref": "#/$defs/missing"})", "does not resolve");
  refused(R"({"$ref": "https://example.com/s.json"})", "only references inside the schema");
  refused(R"({"type": "array", "items": [{"type": "string"}]})", "'items' at");
  refused(R"({"type": "text"})", "'text'");
  refused(R"({"enum": []})", "'enum'");
  refused(R"(false)", "no value is valid");
  // Annotations are not constraints: accepted.
  CHECK(Grammar::from_schema(
            Json::parse(R"({"title": "T", "description": "d", "type": "string", "default": "x"})"))
            .ok());
}

TEST_CASE("grammar: wrapped alternatives (tool-call formats) keep their markers") {
  std::vector<Grammar::Wrapped> alts;
  alts.push_back({"<tool_call>\n", Json::parse(R"({"type": "object", "additionalProperties": false,
                      "properties": {"name": {"const": "get_weather"},
                                     "arguments": {"type": "object", "additionalProperties": false,
                                       "properties": {"city": {"type": "string"}},
                                       "required": ["city"]}},
                      "required": ["name", "arguments"]})"),
                  "\n</tool_call>", "tools[0]"});
  alts.push_back({"<tool_call>\n", Json::parse(R"({"type": "object", "additionalProperties": false,
                      "properties": {"name": {"const": "now"}, "arguments": {"type": "object"}},
                      "required": ["name", "arguments"]})"),
                  "\n</tool_call>", "tools[1]"});
  auto g = Grammar::one_of(alts);
  REQUIRE(g.ok());
  CHECK(takes(*g,
              "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
              "\"Oslo\"}}\n</tool_call>"));
  CHECK(takes(*g, "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"));
  CHECK_FALSE(takes(*g, "{\"name\": \"now\", \"arguments\": {}}", false));
  CHECK_FALSE(takes(*g, "<tool_call>\n{\"name\": \"other\"", false));
  std::mt19937 rng(9);
  int finished = 0;
  for (int i = 0; i < 40; ++i) {
    auto text = draw(*g, rng, 600);
    if (!text) continue;
    ++finished;
    INFO(*text);
    REQUIRE(text->rfind("<tool_call>\n", 0) == 0);
    REQUIRE(text->size() > 26);
    const std::string body = text->substr(12, text->size() - 12 - 13);
    CHECK(text->substr(text->size() - 13) == "\n</tool_call>");
    Json x;
    REQUIRE_NOTHROW(x = Json::parse(body));
    CHECK((x["name"] == "get_weather" || x["name"] == "now"));
    CHECK(x["arguments"].is_object());
  }
  CHECK(finished > 20);
  auto bad = Grammar::one_of({{"", Json::parse(R"({"type": "string", "maxLength": 3})"), "",
                               "tools[2].function.parameters"}});
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().message.find("'maxLength' at tools[2].function.parameters") !=
        std::string::npos);
}
