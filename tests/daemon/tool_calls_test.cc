// Tool-call output parsing, whole and streamed in every split, with malformed output.
#include "daemon/tokenizer/tool_calls.h"

#include <doctest/doctest.h>

using namespace spark::tok;

namespace {
std::function<std::string()> counter_ids() {
  auto n = std::make_shared<int>(0);
  return [n] { return "call_" + std::to_string((*n)++); };
}

// Feeds `text` in pieces of `step` bytes and merges the deltas.
ToolParseDelta streamed(ChatFamily f, const std::string& text, size_t step) {
  ToolCallParser p(f, counter_ids());
  ToolParseDelta all;
  auto merge = [&](ToolParseDelta d) {
    all.content += d.content;
    for (auto& c : d.calls) all.calls.push_back(c);
  };
  for (size_t i = 0; i < text.size(); i += step) merge(p.push(text.substr(i, step)));
  merge(p.finish());
  return all;
}

// Whole-text parse, and the same result for every chunk size.
ToolParseDelta parse_all_ways(ChatFamily f, const std::string& text) {
  ToolParseDelta whole = ToolCallParser::parse(f, text, counter_ids());
  for (size_t step : {1, 2, 3, 5, 7, 13}) {
    ToolParseDelta s = streamed(f, text, step);
    CHECK(s.content == whole.content);
    REQUIRE(s.calls.size() == whole.calls.size());
    for (size_t i = 0; i < s.calls.size(); ++i) {
      CHECK(s.calls[i].name == whole.calls[i].name);
      CHECK(s.calls[i].arguments == whole.calls[i].arguments);
      CHECK(s.calls[i].index == i);
    }
  }
  return whole;
}
}  // namespace

TEST_CASE("Qwen <tool_call> blocks become calls; text around them stays content") {
  auto r = parse_all_ways(ChatFamily::chatml,
                          "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                          "{\"city\": \"Berlin\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", "
                          "\"arguments\": {}}\n</tool_call>\n");
  CHECK(r.content == "Let me check.\n");
  REQUIRE(r.calls.size() == 2);
  CHECK(r.calls[0].name == "get_weather");
  CHECK(r.calls[0].arguments == "{\"city\": \"Berlin\"}");
  CHECK(r.calls[0].id == "call_0");
  CHECK(r.calls[1].name == "f");
  CHECK(r.calls[1].arguments == "{}");
}

TEST_CASE("Qwen plain answers pass through, including a lone '<'") {
  auto r = parse_all_ways(ChatFamily::chatml, "a < b and <tool_ is not a call; x<tool_call");
  CHECK(r.content == "a < b and <tool_ is not a call; x<tool_call");
  CHECK(r.calls.empty());
}

TEST_CASE("Qwen streaming holds back a possible <tool_call> start, then releases it") {
  ToolCallParser p(ChatFamily::chatml, counter_ids());
  CHECK(p.push("Hello <tool").content == "Hello ");
  CHECK(p.push("bar").content == "<toolbar");
  CHECK(p.push("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}").empty());
  auto d = p.push("</tool_call>");
  REQUIRE(d.calls.size() == 1);
  CHECK(d.calls[0].arguments == "{\"a\": 1}");
  CHECK(p.finish().empty());
}

TEST_CASE("malformed Qwen tool calls come back as text, never an error") {
  auto bad_json = parse_all_ways(ChatFamily::chatml, "<tool_call>{\"name\": f}</tool_call> rest");
  CHECK(bad_json.calls.empty());
  CHECK(bad_json.content == "<tool_call>{\"name\": f}</tool_call> rest");
  auto no_name = parse_all_ways(ChatFamily::chatml, "<tool_call>{\"arguments\": {}}</tool_call>");
  CHECK(no_name.calls.empty());
  CHECK(no_name.content == "<tool_call>{\"arguments\": {}}</tool_call>");
  auto cut = parse_all_ways(ChatFamily::chatml, "x <tool_call>{\"name\": \"f\", \"argu");
  CHECK(cut.calls.empty());
  CHECK(cut.content == "x <tool_call>{\"name\": \"f\", \"argu");
  // A complete body without the closing tag (generation stopped at EOS) is accepted.
  auto unclosed =
      parse_all_ways(ChatFamily::chatml, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n");
  CHECK(unclosed.calls.size() == 1);
  CHECK(unclosed.content.empty());
}

TEST_CASE("Llama 3 JSON tool calls, with python_tag and ';'-separated calls") {
  auto r = parse_all_ways(ChatFamily::llama3,
                          "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}");
  REQUIRE(r.calls.size() == 1);
  CHECK(r.calls[0].name == "get_weather");
  CHECK(r.calls[0].arguments == "{\"city\": \"Paris\"}");
  CHECK(r.content.empty());
  auto two =
      parse_all_ways(ChatFamily::llama3,
                     " <|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", "
                     "\"arguments\": {\"x\": \"}\"}}");
  REQUIRE(two.calls.size() == 2);
  CHECK(two.calls[1].name == "b");
  CHECK(two.calls[1].arguments == "{\"x\": \"}\"}");
}

TEST_CASE("Llama 3 answers that are not calls stay content") {
  CHECK(parse_all_ways(ChatFamily::llama3, "Paris is the capital.").content ==
        "Paris is the capital.");
  auto json_answer = parse_all_ways(ChatFamily::llama3, "{\"name\": \"Bob\", \"age\": 3}");
  CHECK(json_answer.calls.empty());
  CHECK(json_answer.content == "{\"name\": \"Bob\", \"age\": 3}");
  auto broken = parse_all_ways(ChatFamily::llama3, "{\"name\": \"f\", \"parameters\": {");
  CHECK(broken.calls.empty());
  CHECK(broken.content == "{\"name\": \"f\", \"parameters\": {");
  auto after =
      parse_all_ways(ChatFamily::llama3, "{\"name\": \"f\", \"parameters\": {}} and then text");
  CHECK(after.calls.size() == 1);
  CHECK(after.content == " and then text");
}

TEST_CASE("Mistral [TOOL_CALLS] arrays keep the model's ids") {
  auto r = parse_all_ways(ChatFamily::mistral,
                          "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}, \"id\": "
                          "\"abcdefghi\"}, {\"name\": \"g\", \"arguments\": {}}]");
  REQUIRE(r.calls.size() == 2);
  CHECK(r.calls[0].id == "abcdefghi");
  CHECK(r.calls[1].id == "call_0");
  CHECK(r.content.empty());
  auto junk = parse_all_ways(ChatFamily::mistral, "[TOOL_CALLS] oops");
  CHECK(junk.calls.empty());
  CHECK(junk.content == "[TOOL_CALLS] oops");
  auto text = parse_all_ways(ChatFamily::mistral, "Just [TOOL text");
  CHECK(text.content == "Just [TOOL text");
}

TEST_CASE("default ids look like OpenAI's and Mistral's") {
  auto q = ToolCallParser::parse(ChatFamily::chatml, "<tool_call>{\"name\": \"f\"}</tool_call>");
  REQUIRE(q.calls.size() == 1);
  CHECK(q.calls[0].id.size() == 29);
  CHECK(q.calls[0].id.rfind("call_", 0) == 0);
  auto m = ToolCallParser::parse(ChatFamily::mistral,
                                 "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]");
  REQUIRE(m.calls.size() == 1);
  CHECK(m.calls[0].id.size() == 9);
}

TEST_CASE("whitespace after a call is dropped only when no text follows (any chunking)") {
  auto r = parse_all_ways(ChatFamily::chatml, "<tool_call>{\"name\": \"f\"}</tool_call>\n tail\n");
  CHECK(r.calls.size() == 1);
  CHECK(r.content == "\n tail\n");
  auto m = parse_all_ways(ChatFamily::mistral,
                          "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}] x \n\n");
  CHECK(m.content == " x \n\n");
  auto only = parse_all_ways(ChatFamily::chatml, "<tool_call>{\"name\": \"f\"}</tool_call>\n\n");
  CHECK(only.content.empty());
}

TEST_CASE("DeepSeek-V3 tool-call blocks (V3 fenced and V3.1 forms), streamed in every split") {
  const std::string v3 =
      "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
      "```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function"
      "<｜tool▁sep｜>search\n```json\n{\"query\": \"a ``` b\"}\n```<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>";
  ToolParseDelta d = parse_all_ways(ChatFamily::deepseek, v3);
  CHECK(d.content == "Let me check.");
  REQUIRE(d.calls.size() == 2);
  CHECK(d.calls[0].name == "get_weather");
  CHECK(d.calls[0].arguments == "{\"city\": \"Paris\"}");
  CHECK(d.calls[1].name == "search");
  CHECK(d.calls[1].arguments == "{\"query\": \"a ``` b\"}");

  // V3.1: name before the separator, bare JSON after it; the end marker may be missing
  // when generation stops on the end-of-sentence token.
  ToolParseDelta v31 = parse_all_ways(
      ChatFamily::deepseek,
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"tz\": \"UTC\"}"
      "<｜tool▁call▁end｜>");
  CHECK(v31.content.empty());
  REQUIRE(v31.calls.size() == 1);
  CHECK(v31.calls[0].name == "get_time");
  CHECK(v31.calls[0].arguments == "{\"tz\": \"UTC\"}");

  ToolParseDelta plain = parse_all_ways(ChatFamily::deepseek, "No tools needed: 2 < 3.");
  CHECK(plain.content == "No tools needed: 2 < 3.");
  CHECK(plain.calls.empty());
  // Bad JSON inside the block: the whole block comes back as text.
  const std::string bad =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{oops\n```"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  ToolParseDelta b = parse_all_ways(ChatFamily::deepseek, bad);
  CHECK(b.calls.empty());
  CHECK(b.content == bad);
}
