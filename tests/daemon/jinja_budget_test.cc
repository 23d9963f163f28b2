// The chat template interpreter's budget: a template is untrusted data, so every render is
// bounded in steps, wall time, value sizes and nesting, and can be stopped from outside.
// Each template here finishes (slowly, or with a huge value) without the budget; with it,
// it is refused with the line and the limit, as a 400 on the API.
#include <doctest/doctest.h>

#include <atomic>
#include <limits>

#include "daemon/openai/requests.h"
#include "daemon/openai/session.h"
#include "daemon/tokenizer/chat.h"
#include "daemon/tokenizer/jinja/jinja.h"

using namespace spark;
using namespace spark::tok;
using spark::tok::jinja::RenderLimits;
using spark::tok::jinja::Template;

namespace {
Result<std::string> run(const std::string& src, const RenderLimits& limits) {
  auto t = Template::parse(src, "chat_template");
  REQUIRE_MESSAGE(t.ok(), (t.ok() ? "" : t.error().message));
  return t->render(Json::object(), limits);
}
// A limit passed: Errc::unsupported (a 400 on the API) naming the line and `what`.
void check_limit(const Result<std::string>& r, int line, const std::string& what) {
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::unsupported);
  INFO(r.error().message);
  CHECK(r.error().message.find("chat_template line " + std::to_string(line) + ":") !=
        std::string::npos);
  CHECK(r.error().message.find(what) != std::string::npos);
}
RenderLimits steps(uint64_t n) {
  RenderLimits l;
  l.max_steps = n;
  l.timeout = std::chrono::milliseconds(0);
  return l;
}
const tok::Tokenizer& fixture() {
  static const tok::Tokenizer t = *tok::Tokenizer::from_file(
      std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/tokenizer/tokenizer.json");
  return t;
}
}  // namespace

TEST_CASE(
    "jinja budget: nested loops and a macro that calls itself twice stop at the step budget") {
  check_limit(run("a\n{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}"
                  "{% endfor %}",
                  steps(100000)),
              2, "budget of 100000 steps (TEMPLATE_MAX_STEPS)");
  check_limit(run("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                  "{% endmacro %}\n{{ f(17) }}",
                  steps(100000)),
              1, "TEMPLATE_MAX_STEPS");
  // Under the budget the same constructs render.
  CHECK(*run("{% for i in range(10) %}{% for j in range(10) %}x{% endfor %}{% endfor %}",
             steps(100000)) == std::string(100, 'x'));
}

TEST_CASE("jinja budget: the deadline ends a render that stays under the step budget") {
  RenderLimits l = steps(std::numeric_limits<uint64_t>::max());
  l.timeout = std::chrono::milliseconds(1);
  check_limit(
      run("{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}", l), 1,
      "limit of 1 ms (TEMPLATE_TIMEOUT)");
}

TEST_CASE("jinja budget: stop() ends a render (a client gone, a daemon stopping)") {
  RenderLimits l = steps(std::numeric_limits<uint64_t>::max());
  std::atomic<int> polls{0};
  l.stop = [&] { return ++polls >= 2; };
  auto r = run("{% for i in range(1000000) %}{{ i }}{% endfor %}", l);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::busy);
  CHECK(r.error().message.find("stopped") != std::string::npos);
  CHECK(polls.load() == 2);
}

TEST_CASE("jinja budget: sizes are checked before a value grows, not after") {
  RenderLimits l = steps(std::numeric_limits<uint64_t>::max());
  // indent and center with huge widths
  check_limit(run("{{ 'a\\nb' | indent(70000000) | length }}", l), 1, "a string would pass 64 MiB");
  check_limit(run("x\n{{ 'a' | center(70000000) | length }}", l), 2, "a string would pass 64 MiB");
  // ~ and + doubling
  check_limit(run("{% set ns = namespace(s='ab') %}{% for i in range(26) %}"
                  "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
                  l),
              1, "a string would pass 64 MiB");
  check_limit(run("{% set ns = namespace(l=[1]) %}{% for i in range(21) %}"
                  "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}",
                  l),
              1, "a list would pass 1000000 items");
  // list *
  check_limit(run("{{ ([1, 2] * 600000) | length }}", l), 1, "a list would pass 1000000 items");
  // A string's characters as a list
  check_limit(run("{{ ('ab' * 600000) | list | length }}", l), 1,
              "a list would pass 1000000 items");
}

TEST_CASE("jinja budget: values may not nest without end or hold themselves") {
  RenderLimits l = steps(std::numeric_limits<uint64_t>::max());
  check_limit(run("{% set ns = namespace(a=[]) %}{% for i in range(300) %}"
                  "{% set ns.a = [ns.a] %}{% endfor %}{{ ns.a | length }}",
                  l),
              1, "nest deeper than 256 levels");
  // A namespace that holds itself would print forever and never be freed.
  auto r = run("{% set ns = namespace(a=1) %}\n{% set ns.me = ns %}{{ ns }}", l);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message.find("line 2: cannot store a namespace or a function") !=
        std::string::npos);
}

TEST_CASE("jinja budget: a template past the budget at load fails the start, naming the limit") {
  Json cfg = Json::object();
  cfg["chat_template"] =
      "{% for m in messages %}{{ m.content }}{% endfor %}\n"
      "{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}";
  auto fmt = choose_chat_format("", cfg, "", nullptr, steps(100000));
  REQUIRE_FALSE(fmt.ok());
  CHECK(fmt.error().code == Errc::config);
  CHECK(fmt.error().message.find("line 2") != std::string::npos);
  CHECK(fmt.error().message.find("TEMPLATE_MAX_STEPS") != std::string::npos);
  CHECK(fmt.error().message.find("at load") != std::string::npos);
  // Within the default step budget it loads. No clock: an unoptimised sanitizer build on a
  // loaded machine can take longer than the default timeout for these 90,000 steps.
  auto ok = choose_chat_format("", cfg, "", nullptr, steps(RenderLimits{}.max_steps));
  CHECK_MESSAGE(ok.ok(), (ok.ok() ? std::string() : ok.error().message));
}

TEST_CASE(
    "jinja budget: on the API a render past a limit is a 400 naming the line; the "
    "rendered text is counted against the context before it is tokenized") {
  auto req = openai::parse_chat_request(R"({"messages": [{"role": "user", "content": "Hi"}]})",
                                        openai::Limits{});
  REQUIRE(req.ok());
  Json cfg = Json::object();
  cfg["chat_template"] =
      "{% for m in messages %}{{ m.content }}{% endfor %}"
      "{% if messages | length == 1 %}\n"
      "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}{% endif %}";
  // (The load's probe conversation has three messages: it renders.)
  auto fmt = choose_chat_format("", cfg, "", nullptr, steps(100000));
  REQUIRE(fmt.ok());
  auto p = openai::prepare_chat(*req.value, fixture(), *fmt, 4096);
  REQUIRE_FALSE(p.ok());
  CHECK(p.error.status == 400);
  CHECK(p.error.message.find("line 2") != std::string::npos);
  CHECK(p.error.message.find("TEMPLATE_MAX_STEPS") != std::string::npos);

  // A short conversation rendered into 2 MB of text: refused after counting about the
  // context's worth of it.
  cfg["chat_template"] = "{% for m in messages %}{{ (m.content ~ ' ') * 400000 }}{% endfor %}";
  auto big = choose_chat_format("", cfg, "", nullptr);
  REQUIRE(big.ok());
  auto q = openai::prepare_chat(*req.value, fixture(), *big, 4096);
  REQUIRE_FALSE(q.ok());
  CHECK(q.error.status == 400);
  CHECK(q.error.code == "context_length_exceeded");
  CHECK(q.error.message.find("rendered chat template") != std::string::npos);
  CHECK(q.error.message.find("counting stopped at the limit") != std::string::npos);
}
