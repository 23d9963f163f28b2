// libFuzzer target for the chat template interpreter. The first byte picks what the rest
// is: a template (parsed, then rendered with a small conversation), or the content of a
// user message rendered by a fixed ChatML-style template (what a client controls).
// Invariants: every failure is an Error with a message, of the documented kinds (config or
// unsupported at load; usage at render, or unsupported where a render passes one of its
// limits: steps, sizes, recursion, stack); nothing crashes, hangs or overflows the stack.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "daemon/tokenizer/jinja/jinja.h"

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}

bool render_failure_ok(const spark::Error& e) {
  return !e.message.empty() && (e.code == spark::Errc::usage || e.code == spark::Errc::unsupported);
}

const char* kTemplate =
    "{%- if tools %}{{ '<|im_start|>system\\n' }}{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}{% set c = m.content %}{% if '</think>' in c %}"
    "{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + c | trim + '<|im_end|>\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace spark;
  using spark::tok::Json;
  if (size == 0) return 0;
  std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  Json ctx = Json::object();
  ctx["messages"] = Json::array();
  ctx["add_generation_prompt"] = true;
  ctx["bos_token"] = "<s>";
  if (data[0] & 1) {
    Json m = Json::object();
    m["role"] = "user";
    m["content"] = rest;
    ctx["messages"].push_back(m);
    ctx["tools"] = Json::array({Json::object({{"name", rest}})});
    auto t = tok::jinja::Template::parse(kTemplate, "t");
    require(t.ok());
    auto r = t->render(ctx);
    require(r.ok() || render_failure_ok(r.error()));
    return 0;
  }
  auto t = tok::jinja::Template::parse(rest, "t");
  if (!t.ok()) {
    require(!t.error().message.empty() &&
            (t.error().code == Errc::config || t.error().code == Errc::unsupported));
    return 0;
  }
  ctx["messages"] = Json::parse(
      R"([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
           "function": {"name": "f", "arguments": {"a": [1, 2.5, "x"]}}}]},
          {"role": "tool", "tool_call_id": "c", "content": "r"}])");
  auto r = t->render(ctx);
  require(r.ok() || render_failure_ok(r.error()));
  return 0;
}
