// Native chat formats against the text the families' Hugging Face templates produce
// (expected strings written from the templates: Qwen2.5, Llama 3.1, Mistral-Nemo).
#include "daemon/tokenizer/chat.h"

#include <doctest/doctest.h>

#include <ctime>

#include "core/strings.h"
#include "daemon/tokenizer/tokenizer.h"
#include "support/tempdir.h"

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

TEST_CASE("choose_chat_format: key, then the template, then architecture, then vocabulary") {
  auto cfg_text = read_file(fixture_dir("/tokenizer_config.json"));
  REQUIRE(cfg_text);
  Json cfg = Json::parse(*cfg_text);
  auto f = choose_chat_format("auto", cfg, "LlamaForCausalLM", nullptr);
  REQUIRE(f.ok());
  CHECK(f->family == ChatFamily::chatml);  // the template beats the architecture
  CHECK(f->chat_template != nullptr);
  CHECK(f->source == "tokenizer_config.json chat_template");
  auto native = choose_chat_format("chatml", cfg, "", nullptr);
  REQUIRE(native.ok());
  CHECK(native->chat_template == nullptr);
  CHECK(native->default_system == "You are a helpful assistant.");

  Json llama_cfg = Json::parse(*read_file(fixture_dir("/llama3/tokenizer_config.json")));
  auto l = choose_chat_format("llama3", llama_cfg, "", nullptr);
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
  auto f = choose_chat_format("mistral", cfg, "MistralForCausalLM", nullptr);
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
  auto v1 = choose_chat_format("mistral", v1cfg, "", nullptr);
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

namespace {
ChatFormat template_format(const std::string& tmpl, Json cfg = Json::object()) {
  cfg["chat_template"] = tmpl;
  auto r = choose_chat_format("", cfg, "", nullptr);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.error().message));
  return *r;
}
}  // namespace

TEST_CASE("chat_template: rendered with transformers' variables; kwargs; eos stops") {
  Json cfg = Json::parse(R"({"bos_token": {"content": "<B>"}, "eos_token": "<E>"})");
  ChatFormat f = template_format(
      "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
      "{% if tools is not none %}T{{ tools | length }}{% endif %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}"
      "{% if enable_thinking is defined and enable_thinking is false %}<nothink>{% endif %}"
      "{{ eos_token }}",
      cfg);
  CHECK(f.family == ChatFamily::other);
  CHECK(f.stop_tokens() == std::vector<std::string>{"<E>"});
  std::vector<ChatMessage> m = {{"system", "s", {}, ""}, {"user", "u", {}, ""}};
  CHECK(*render_chat(f, m, Json::array(), true) == "<B><system>s<user>u<assistant><E>");
  CHECK(*render_chat(f, m, Json::array({weather_tool()}), false) == "<B><system>s<user>uT1<E>");
  Json kw = Json::parse(R"({"enable_thinking": false})");
  CHECK(*render_chat(f, m, Json::array(), true, kw) ==
        "<B><system>s<user>u<assistant><nothink><E>");
  // A template's raise_exception is a usage error (a 400 at the API).
  ChatFormat strict = template_format(
      "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok");
  auto e = render_chat(strict, m, Json::array(), true);
  REQUIRE_FALSE(e.ok());
  CHECK(e.error().code == Errc::usage);
  CHECK(e.error().message.find("user first") != std::string::npos);
}

TEST_CASE("chat_template: named templates, chat_template.jinja, CHAT_FORMAT=template") {
  Json cfg = Json::object();
  cfg["chat_template"] = Json::parse(
      R"([{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"},
          {"name": "rag", "template": "{{ x | unknown_filter }}"}])");
  auto f = choose_chat_format("template", cfg, "", nullptr);
  REQUIRE(f.ok());
  std::vector<ChatMessage> m = {{"user", "u", {}, ""}};
  CHECK(*render_chat(*f, m, Json::array(), true) == "plain");
  CHECK(*render_chat(*f, m, Json::array({weather_tool()}), true) == "tools");

  test::TempDir dir;
  dir.write("tokenizer_config.json", R"({"chat_template": "from config", "eos_token": "</s>"})");
  auto c1 = load_tokenizer_config(dir.path());
  REQUIRE(c1.ok());
  CHECK((*c1)["chat_template"] == "from config");
  dir.write("chat_template.jinja", "from {{ 'file' }}\n");
  auto c2 = load_tokenizer_config(dir.path());
  REQUIRE(c2.ok());
  auto f2 = choose_chat_format("", *c2, "", nullptr);
  REQUIRE(f2.ok());
  CHECK(f2->source == "chat_template.jinja chat_template");
  CHECK(*render_chat(*f2, m, Json::array(), true) == "from file");
  dir.write("tokenizer_config.json", "{not json");
  auto bad = load_tokenizer_config(dir.path());
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().message.find("tokenizer_config.json") != std::string::npos);

  auto none = choose_chat_format("template", Json::object(), "Qwen3ForCausalLM", nullptr);
  REQUIRE_FALSE(none.ok());
  CHECK(none.error().code == Errc::config);
  // A built-in name still overrides a template.
  auto forced = choose_chat_format("chatml", *c2, "", nullptr);
  REQUIRE(forced.ok());
  CHECK(forced->chat_template == nullptr);
}

TEST_CASE("chat_template: an unsupported construct fails at load, naming file and line") {
  Json cfg = Json::object();
  cfg["chat_template"] = "{% for m in messages %}\n{{ m.content | wordwrap }}\n{% endfor %}";
  auto r = choose_chat_format("", cfg, "Qwen3ForCausalLM", nullptr);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::unsupported);
  CHECK(r.error().message.find("tokenizer_config.json chat_template line 2: filter 'wordwrap'") ==
        0);
}

TEST_CASE("chat_template: tool-call arguments and null contents take the form the template needs") {
  std::vector<ChatMessage> m = {{"user", "u", {}, ""},
                                {"assistant", "", {{"call1", "f", "{\"a\": 1}"}}, ""},
                                {"tool", "r", {}, "call1"}};
  m[1].content_null = true;
  // Llama 3.1 / Mistral style: tojson of the arguments needs a dict.
  ChatFormat dict = template_format(
      "{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | "
      "tojson }}{% endif %}{% endfor %}");
  CHECK(dict.chat_template->object_arguments);
  CHECK(*render_chat(dict, m, Json::array(), false) == "{\"a\": 1}");
  // DeepSeek-V3 style: string concatenation needs the text; `content is none` needs None.
  ChatFormat text = template_format(
      "{% for m in messages %}{% if m.role == 'assistant' and m.content is none %}"
      "{{ 'call:' + m.tool_calls[0].function.arguments }}{% endif %}{% endfor %}");
  CHECK_FALSE(text.chat_template->object_arguments);
  CHECK(text.chat_template->null_content);
  CHECK(*render_chat(text, m, Json::array(), false) == "call:{\"a\": 1}");
  // Qwen3 style: `'</think>' in content` fails on None, so a null content arrives as "".
  ChatFormat qwen = template_format(
      "{% for m in messages %}{% if '</think>' in m.content %}{% endif %}{% if m.tool_calls %}"
      "{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}{% endfor %}");
  CHECK_FALSE(qwen.chat_template->null_content);
  CHECK(*render_chat(qwen, m, Json::array(), false) == "{\"a\": 1}");
  Json msgs = template_messages(m, true, true);
  CHECK(msgs[0].dump() == R"({"role":"user","content":"u"})");
  CHECK(msgs[1].dump() ==
        R"({"role":"assistant","content":null,"tool_calls":[{"id":"call1","type":"function",)"
        R"("function":{"name":"f","arguments":{"a":1}}}]})");
  CHECK(msgs[2].dump() == R"({"role":"tool","content":"r","tool_call_id":"call1"})");
}
