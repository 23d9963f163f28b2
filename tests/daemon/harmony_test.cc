// gpt-oss's harmony output parsed into reasoning, content and tool calls: hand-made outputs,
// well-formed and malformed, whole and streamed split at every byte boundary.
#include "daemon/tokenizer/harmony.h"

#include <doctest/doctest.h>

#include <random>
#include <vector>

using namespace spark::tok;

namespace {
std::function<std::string()> counter_ids() {
  auto n = std::make_shared<int>(0);
  return [n] { return "call_" + std::to_string((*n)++); };
}

// Merges a delta; a call's argument fragments go to the call (sent first, with its name).
void merge(ToolParseDelta& all, ToolParseDelta d) {
  all.content += d.content;
  all.reasoning += d.reasoning;
  for (auto& c : d.calls) {
    if (c.fragment) {
      REQUIRE(!all.calls.empty());
      REQUIRE(all.calls.back().index == c.index);
      all.calls.back().arguments += c.arguments;
    } else {
      CHECK(c.index == all.calls.size());
      all.calls.push_back(std::move(c));
    }
  }
}

void same(const ToolParseDelta& a, const ToolParseDelta& b, const std::string& how) {
  INFO(how);
  CHECK(a.content == b.content);
  CHECK(a.reasoning == b.reasoning);
  REQUIRE(a.calls.size() == b.calls.size());
  for (size_t i = 0; i < a.calls.size(); ++i) {
    CHECK(a.calls[i].name == b.calls[i].name);
    CHECK(a.calls[i].arguments == b.calls[i].arguments);
    CHECK(a.calls[i].id == b.calls[i].id);
    CHECK(a.calls[i].index == i);
  }
}

// Whole-text parse; the same result split in two at every byte boundary and fed in pieces of
// every size up to 16 bytes.
ToolParseDelta parse_all_ways(const std::string& text) {
  ToolParseDelta whole = HarmonyParser::parse(text, counter_ids());
  for (const auto& c : whole.calls) CHECK_FALSE(c.fragment);  // whole text: whole calls
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    HarmonyParser p(counter_ids());
    ToolParseDelta all;
    merge(all, p.push(text.substr(0, cut)));
    merge(all, p.push(text.substr(cut)));
    merge(all, p.finish());
    same(all, whole, "cut at " + std::to_string(cut));
  }
  for (size_t step = 1; step <= 16; ++step) {
    HarmonyParser p(counter_ids());
    ToolParseDelta all;
    for (size_t i = 0; i < text.size(); i += step) merge(all, p.push(text.substr(i, step)));
    merge(all, p.finish());
    same(all, whole, "pieces of " + std::to_string(step));
  }
  return whole;
}
}  // namespace

TEST_CASE("harmony: analysis is reasoning, final is content") {
  auto r = parse_all_ways(
      "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
      "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?");
  CHECK(r.reasoning == "The user greets; answer briefly.");
  CHECK(r.content == "Hello! How can I help?");
  CHECK(r.calls.empty());
  // <|return|> (when it reaches the parser at all) ends the message and is not shown.
  auto t = parse_all_ways("<|channel|>final<|message|>Done.<|return|>");
  CHECK(t.content == "Done.");
  CHECK(t.reasoning.empty());
}

TEST_CASE("harmony: calls to functions.NAME in both header forms become tool calls") {
  auto r = parse_all_ways(
      "<|channel|>analysis<|message|>Need the weather.<|end|>"
      "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
      "<|message|>{\"city\": \"Paris\", \"unit\": \"celsius\"}<|call|>");
  CHECK(r.reasoning == "Need the weather.");
  CHECK(r.content.empty());
  REQUIRE(r.calls.size() == 1);
  CHECK(r.calls[0].name == "get_weather");
  CHECK(r.calls[0].arguments == "{\"city\": \"Paris\", \"unit\": \"celsius\"}");
  CHECK(r.calls[0].id == "call_0");
  // The recipient in the role part (as gpt-oss's template renders earlier calls), right after
  // the prompt's "<|start|>assistant"; the output ends where <|call|> stopped generation.
  auto s = parse_all_ways(
      " to=functions.search<|channel|>commentary json<|message|>{\"query\": \"sparkctl\"}");
  REQUIRE(s.calls.size() == 1);
  CHECK(s.calls[0].name == "search");
  CHECK(s.calls[0].arguments == "{\"query\": \"sparkctl\"}");
  // Two calls, a preamble to the user on commentary, and empty arguments.
  auto m = parse_all_ways(
      "<|channel|>commentary<|message|>Checking both.<|end|>"
      "<|start|>assistant<|channel|>commentary to=functions.a json<|message|>{}<|call|>"
      "<|start|>assistant<|channel|>commentary to=functions.b json<|message|>  <|call|>");
  CHECK(m.content == "Checking both.");
  REQUIRE(m.calls.size() == 2);
  CHECK(m.calls[0].name == "a");
  CHECK(m.calls[1].name == "b");
  CHECK(m.calls[1].arguments == "{}");
  CHECK(m.calls[1].index == 1);
}

TEST_CASE("harmony: text before any header is content") {
  auto r = parse_all_ways("Plain words, no channel.");
  CHECK(r.content == "Plain words, no channel.");
  CHECK(r.reasoning.empty());
  auto s = parse_all_ways("Hi <|start|>assistant<|channel|>final<|message|>there");
  CHECK(s.content == "Hi there");
  // A lone '<' and a marker's prefix are text too.
  CHECK(parse_all_ways("a < b, <|chan").content == "a < b, <|chan");
  CHECK(parse_all_ways("").content.empty());
  // Whitespace between messages is dropped.
  auto w = parse_all_ways(
      "<|channel|>analysis<|message|>x<|end|>\n\n<|start|>assistant<|channel|>final<|message|>y");
  CHECK(w.reasoning == "x");
  CHECK(w.content == "y");
}

TEST_CASE("harmony: an unterminated channel keeps what it produced") {
  // Generation stopped (max_tokens) inside the analysis: reasoning only.
  auto r = parse_all_ways("<|channel|>analysis<|message|>Let me think about");
  CHECK(r.reasoning == "Let me think about");
  CHECK(r.content.empty());
  // A header that never reaches <|message|> is returned verbatim as content.
  auto h = parse_all_ways("<|channel|>analysis");
  CHECK(h.content == "<|channel|>analysis");
  auto e = parse_all_ways("<|channel|>final<|end|>ok");
  CHECK(e.content == "<|channel|>final<|end|>ok");
  // A header longer than 1 KiB is text, not held forever.
  std::string junk(1100, 'x');
  auto l = parse_all_ways("<|channel|>" + junk + "<|message|>tail");
  CHECK(l.content == "<|channel|>" + junk + "<|message|>tail");
  // A call cut off keeps the arguments produced so far.
  auto c = parse_all_ways("<|channel|>commentary to=functions.f json<|message|>{\"a\": ");
  REQUIRE(c.calls.size() == 1);
  CHECK(c.calls[0].arguments == "{\"a\":");
  // A new header inside a message body ends that message first.
  auto n = parse_all_ways(
      "<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>answer");
  CHECK(n.reasoning == "think");
  CHECK(n.content == "answer");
  auto k = parse_all_ways("<|channel|>analysis<|message|>think<|channel|>final<|message|>answer");
  CHECK(k.reasoning == "think");
  CHECK(k.content == "answer");
}

TEST_CASE("harmony: bad JSON arguments stay the call's arguments as produced") {
  auto r = parse_all_ways(
      "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
      "{city: Paris,}<|call|>");
  REQUIRE(r.calls.size() == 1);
  CHECK(r.calls[0].name == "get_weather");
  CHECK(r.calls[0].arguments == "{city: Paris,}");
  CHECK(r.content.empty());
}

TEST_CASE("harmony: unknown recipients and foreign roles come back verbatim as content") {
  auto r = parse_all_ways(
      "<|channel|>analysis<|message|>Search it.<|end|>"
      "<|start|>assistant<|channel|>commentary to=browser.search <|constrain|>json"
      "<|message|>{\"query\": \"x\"}<|call|>");
  CHECK(r.reasoning == "Search it.");
  CHECK(r.calls.empty());
  CHECK(r.content ==
        "<|start|>assistant<|channel|>commentary to=browser.search <|constrain|>json"
        "<|message|>{\"query\": \"x\"}<|call|>");
  // "functions." without a name is no function either.
  auto f = parse_all_ways("<|channel|>commentary to=functions. json<|message|>{}<|end|>");
  CHECK(f.calls.empty());
  CHECK(f.content == "<|channel|>commentary to=functions. json<|message|>{}<|end|>");
  // The model writing a tool's answer or a user turn itself.
  auto t = parse_all_ways(
      "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"21\"<|end|>");
  CHECK(t.calls.empty());
  CHECK(t.content ==
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"21\"<|end|>");
  // An unknown channel without a recipient is content.
  CHECK(parse_all_ways("<|channel|>notes<|message|>n").content == "n");
}

TEST_CASE("harmony: any mix of markers and text parses the same however it is split") {
  // Fixed-seed sequences of harmony's markers, header words and text pieces, well-formed or
  // not: no exception, and streaming equals the whole-text parse at every cut.
  const std::vector<std::string> pieces = {
      "<|start|>",     "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
      "<|constrain|>", "assistant",   "analysis",    "final",   "commentary", " to=functions.f",
      "to=browser.x",  " json",       "{\"a\": 1}",  "{bad",    " ",          "\n",
      "text",          "<|",          "<|sta",       "é",       "functions.", "user"};
  std::mt19937 rng(20261205);
  for (int n = 0; n < 300; ++n) {
    std::string text;
    const size_t len = 1 + rng() % 14;
    for (size_t i = 0; i < len; ++i) text += pieces[rng() % pieces.size()];
    INFO(text);
    parse_all_ways(text);
  }
}

TEST_CASE("harmony: a call cut off after a marker's first bytes keeps them as arguments") {
  auto r = parse_all_ways("<|channel|>commentary to=functions.f json<|message|>{\"a\": 1}<|");
  REQUIRE(r.calls.size() == 1);
  CHECK(r.calls[0].arguments == "{\"a\": 1}<|");
}
