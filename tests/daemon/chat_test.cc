// Native chat formats against the text the families' Hugging Face templates produce
// (expected strings written from the templates: Qwen2.5, Llama 3.1, Mistral-Nemo).
#include "daemon/tokenizer/chat.h"

#include <doctest/doctest.h>

#include <ctime>

#include "core/strings.h"
#include "daemon/tokenizer/tokenizer.h"

using namespace spark;
using namespace spark::tok;

namespace {
Json weather_tool() {
  return Json::parse(R"({"type": "function", "function": {"name": "get_weather",
    "description": "Current weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}}, "required": ["city"]}}})");
}
ChatFormat fmt_of(ChatFamily f, const std::string& tmpl = "") {
  Json cfg = Json::object();
  if (!tmpl.empty()) cfg["chat_template"] = tmpl;
  auto r = choose_chat_format(std::string(chat_family_name(f)), cfg, "", nullptr);
  REQUIRE(r.ok());
  return *r;
}
std::string fixture_dir(const std::string& sub) {
  return std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/tokenizer" + sub;
}
}  // namespace

TEST_CASE("ChatML (Qwen2.5) system, multi-turn and generation prompt") {
  ChatFormat f =
      fmt_of(ChatFamily::chatml,
             "...You are Qwen, created by Alibaba Cloud. You are a helpful assistant....");
  std::vector<ChatMessage> m = {
      {"user", "Hi", {}, ""}, {"assistant", "Hello!", {}, ""}, {"user", "Bye", {}, ""}};
  auto p = render_chat(f, m, Json(), true);
  REQUIRE(p.ok());
  CHECK(*p ==
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_"
        "end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n");
  m.insert(m.begin(), ChatMessage{"system", "Be brief.", {}, ""});
  CHECK(render_chat(f, m, Json(), false)
            ->starts_with("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"));
}

TEST_CASE("ChatML (Qwen) tools, tool calls and grouped tool responses") {
  ChatFormat f = fmt_of(ChatFamily::chatml, "You are a helpful assistant. <tool_call>");
  Json tools = Json::array({weather_tool()});
  std::vector<ChatMessage> m = {
      {"system", "Sys.", {}, ""},
      {"user", "Weather in Berlin and Paris?", {}, ""},
      {"assistant",
       "",
       {{"call_1", "get_weather", R"({"city": "Berlin"})"},
        {"call_2", "get_weather", R"({"city":"Paris"})"}},
       ""},
      {"tool", "{\"temp\": 20}", {}, "call_1"},
      {"tool", "{\"temp\": 22}", {}, "call_2"},
  };
  auto p = render_chat(f, m, tools, true);
  REQUIRE(p.ok());
  CHECK(
      *p ==
      "<|im_start|>system\nSys.\n\n# Tools\n\nYou may call one or more functions to assist with "
      "the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
      "tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
      "\"description\": \"Current weather\", \"parameters\": {\"type\": \"object\", "
      "\"properties\": "
      "{\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each "
      "function call, return a json object with function name and arguments within "
      "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
      "<args-json-object>}\n</tool_call><|im_end|>\n"
      "<|im_start|>user\nWeather in Berlin and Paris?<|im_end|>\n"
      "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Berlin\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
      "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
      "<|im_start|>user\n<tool_response>\n{\"temp\": 20}\n</tool_response>\n<tool_response>\n"
      "{\"temp\": 22}\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
}

TEST_CASE("ChatML (Qwen3) has no default system and drops earlier reasoning") {
  ChatFormat f = fmt_of(ChatFamily::chatml, "<|im_start|>... <think> </think>");
  CHECK(f.default_system.empty());
  CHECK(f.qwen3_thinking);
  std::vector<ChatMessage> m = {{"user", "a", {}, ""},
                                {"assistant", "<think>\nhmm\n</think>\n\nA", {}, ""},
                                {"user", "b", {}, ""}};
  CHECK(*render_chat(f, m, Json(), true) ==
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n");
}

TEST_CASE("Llama 3.1: knowledge header, trimmed contents, eot") {
  ChatFormat f = fmt_of(ChatFamily::llama3, "<|start_header_id|> Cutting Knowledge Date");
  std::vector<ChatMessage> m = {{"system", " Be brief. ", {}, ""}, {"user", "Hi\n", {}, ""}};
  CHECK(*render_chat(f, m, Json(), true) ==
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
        "December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user"
        "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST_CASE("Llama 3.0: no header block; system is an ordinary turn") {
  ChatFormat f = fmt_of(ChatFamily::llama3, "{{ '<|start_header_id|>' + message['role'] }}");
  CHECK_FALSE(f.llama_knowledge_header);
  std::vector<ChatMessage> m = {{"system", "S", {}, ""}, {"user", "U", {}, ""}};
  CHECK(*render_chat(f, m, Json(), false) ==
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>");
}

TEST_CASE("Llama 3.1 tools in the first user message, JSON tool call, ipython result") {
  ChatFormat f = fmt_of(ChatFamily::llama3);
  Json tools = Json::array(
      {Json::parse(R"({"type": "function", "function": {"name": "f", "parameters": {"a": 1}}})")});
  std::vector<ChatMessage> m = {{"user", "Call f", {}, ""},
                                {"assistant", "", {{"c1", "f", R"({"a": 1})"}}, ""},
                                {"tool", "ok", {}, "c1"}};
  CHECK(
      *render_chat(f, m, tools, true) ==
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
      "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond "
      "with a JSON for a function call with its proper arguments that best answers the given "
      "prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of "
      "argument name and its value}.Do not use variables.\n\n{\n    \"type\": \"function\",\n    "
      "\"function\": {\n        \"name\": \"f\",\n        \"parameters\": {\n            \"a\": 1\n"
      "        }\n    }\n}\n\nCall f<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
      "{\"name\": \"f\", \"parameters\": {\"a\": 1}}<|eot_id|><|start_header_id|>ipython"
      "<|end_header_id|>\n\n\"ok\"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  std::vector<ChatMessage> two = {{"user", "x", {}, ""},
                                  {"assistant", "", {{"a", "f", "{}"}, {"b", "f", "{}"}}, ""}};
  auto r = render_chat(f, two, Json(), false);
  CHECK_FALSE(r.ok());
  CHECK(r.error().code == Errc::usage);
}

TEST_CASE("Mistral: system joins the last user turn; tools, tool calls, results") {
  ChatFormat f = fmt_of(ChatFamily::mistral);
  std::vector<ChatMessage> m = {{"system", "S", {}, ""},
                                {"user", "a", {}, ""},
                                {"assistant", "A", {}, ""},
                                {"user", "b", {}, ""}};
  CHECK(*render_chat(f, m, Json(), true) == "<s>[INST]a[/INST]A</s>[INST]S\n\nb[/INST]");
  Json tools = Json::array({Json::parse(
      R"({"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}})")});
  std::vector<ChatMessage> t = {{"user", "go", {}, ""},
                                {"assistant", "", {{"abcdefghi", "f", R"({"x": 1})"}}, ""},
                                {"tool", "42", {}, "abcdefghi"}};
  CHECK(*render_chat(f, t, tools, true) ==
        "<s>[AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": {\"name\": \"f\", "
        "\"description\": \"d\", \"parameters\": {\"type\": \"object\"}}}][/AVAILABLE_TOOLS]"
        "[INST]go[/INST][TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 1}, \"id\": "
        "\"abcdefghi\"}]</s>[TOOL_RESULTS]{\"content\": 42, \"call_id\": \"abcdefghi\"}"
        "[/TOOL_RESULTS]");
}

TEST_CASE("unknown roles are a usage error") {
  auto r = render_chat(fmt_of(ChatFamily::chatml), {{"robot", "x", {}, ""}}, Json(), true);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::usage);
  CHECK(r.error().message.find("robot") != std::string::npos);
}

TEST_CASE("choose_chat_format: key, then template markers, then architecture, then vocabulary") {
  auto cfg_text = read_file(fixture_dir("/tokenizer_config.json"));
  REQUIRE(cfg_text);
  Json cfg = Json::parse(*cfg_text);
  auto f = choose_chat_format("auto", cfg, "LlamaForCausalLM", nullptr);
  REQUIRE(f.ok());
  CHECK(f->family == ChatFamily::chatml);  // template markers beat the architecture
  CHECK(f->default_system == "You are a helpful assistant.");
  CHECK(f->source.find("chat_template") != std::string::npos);

  Json llama_cfg = Json::parse(*read_file(fixture_dir("/llama3/tokenizer_config.json")));
  auto l = choose_chat_format("", llama_cfg, "", nullptr);
  REQUIRE(l.ok());
  CHECK(l->family == ChatFamily::llama3);
  CHECK(l->llama_knowledge_header);
  CHECK(l->bos_token == "<|begin_of_text|>");
  CHECK(l->stop_tokens() ==
        std::vector<std::string>{"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"});

  CHECK(choose_chat_format("mistral", cfg, "", nullptr)->family == ChatFamily::mistral);
  CHECK(choose_chat_format("", Json::object(), "Qwen3ForCausalLM", nullptr)->family ==
        ChatFamily::chatml);
  CHECK(choose_chat_format("", Json::object(), "MistralForCausalLM", nullptr)->family ==
        ChatFamily::mistral);

  auto tok = Tokenizer::from_file(fixture_dir("/llama3/tokenizer.json"));
  REQUIRE(tok.ok());
  auto v = choose_chat_format("", Json::object(), "SomethingElse", &*tok);
  REQUIRE(v.ok());
  CHECK(v->family == ChatFamily::llama3);

  auto bad = choose_chat_format("vicuna", cfg, "", nullptr);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().code == Errc::config);
  auto none = choose_chat_format("", Json::object(), "GPT2LMHeadModel", nullptr);
  REQUIRE_FALSE(none.ok());
  CHECK(none.error().code == Errc::unsupported);
  CHECK(none.error().message.find("CHAT_FORMAT") != std::string::npos);
}

TEST_CASE("a rendered ChatML prompt encodes its special tokens as single ids") {
  auto tok = Tokenizer::from_file(fixture_dir("/tokenizer.json"));
  REQUIRE(tok.ok());
  auto p = render_chat(fmt_of(ChatFamily::chatml), {{"user", "Hi", {}, ""}}, Json(), true);
  auto ids = tok->encode(*p, false);
  auto im_start = *tok->token_to_id("<|im_start|>");
  CHECK(ids.front() == im_start);
  CHECK(std::count(ids.begin(), ids.end(), im_start) == 2);
  CHECK(tok->decode(ids, false) == *p);
}

TEST_CASE("Llama 3.2+ templates that call strftime_now get today's date") {
  ChatFormat old = fmt_of(ChatFamily::llama3, "<|start_header_id|> Cutting Knowledge Date");
  CHECK(old.date_string == "26 Jul 2024");
  ChatFormat now =
      fmt_of(ChatFamily::llama3,
             "Cutting Knowledge Date {%- set date_string = strftime_now(\"%d %b %Y\") %}");
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%d %b %Y", &tm);
  CHECK(now.date_string == buf);
}

TEST_CASE("Mistral v0.3 (spaced) and v0.1 styles are read from the template") {
  Json cfg = Json::parse(*read_file(fixture_dir("/spm/tokenizer_config.json")));
  auto f = choose_chat_format("", cfg, "MistralForCausalLM", nullptr);
  REQUIRE(f.ok());
  CHECK(f->family == ChatFamily::mistral);
  CHECK(f->mistral_style == ChatFormat::MistralStyle::v3);
  std::vector<ChatMessage> m = {{"system", "S", {}, ""},
                                {"user", "a", {}, ""},
                                {"assistant", " A ", {}, ""},
                                {"user", "b", {}, ""}};
  CHECK(*render_chat(*f, m, Json(), true) == "<s>[INST] a[/INST] A</s>[INST] S\n\nb[/INST]");
  Json tools = Json::array({Json::parse(R"({"type": "function", "function": {"name": "f"}})")});
  std::vector<ChatMessage> t = {{"user", "go", {}, ""},
                                {"assistant", "", {{"abcdefghi", "f", "{}"}}, ""},
                                {"tool", "1", {}, "abcdefghi"}};
  CHECK(*render_chat(*f, t, tools, true) ==
        "<s>[AVAILABLE_TOOLS] [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]"
        "[/AVAILABLE_TOOLS][INST] go[/INST][TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}, "
        "\"id\": \"abcdefghi\"}]</s>[TOOL_RESULTS] {\"content\": 1, \"call_id\": \"abcdefghi\"}"
        "[/TOOL_RESULTS]");
  Json v1cfg = Json::object();
  v1cfg["chat_template"] = "{{ '[INST] ' + message['content'] + ' [/INST]' }}";
  auto v1 = choose_chat_format("", v1cfg, "", nullptr);
  REQUIRE(v1.ok());
  CHECK(v1->mistral_style == ChatFormat::MistralStyle::v1);
  std::vector<ChatMessage> u = {
      {"user", "a", {}, ""}, {"assistant", "A", {}, ""}, {"user", "b", {}, ""}};
  CHECK(*render_chat(*v1, u, Json(), true) == "<s>[INST] a [/INST]A</s>[INST] b [/INST]");
  CHECK_FALSE(render_chat(*v1, u, tools, true).ok());
}

TEST_CASE("a rendered Mistral prompt encodes [INST] as control tokens with the spm fixture") {
  auto tok = Tokenizer::from_file(fixture_dir("/spm/tokenizer.json"));
  REQUIRE(tok.ok());
  Json cfg = Json::parse(*read_file(fixture_dir("/spm/tokenizer_config.json")));
  auto f = choose_chat_format("", cfg, "", &*tok);
  REQUIRE(f.ok());
  auto p = render_chat(*f, {{"user", "Hello world", {}, ""}}, Json(), true);
  auto ids = tok->encode(*p, false);
  CHECK(ids.front() == 1);  // <s>
  CHECK(ids[1] == *tok->token_to_id("[INST]"));
  CHECK(ids.back() == *tok->token_to_id("[/INST]"));
  // Legacy SentencePiece normalization prepends U+2581 to the segment after [INST] too.
  CHECK(tok->decode(ids, true) == " Hello world");
}
