// The chat template interpreter: Python Jinja2 semantics as transformers configures it
// (expected outputs are what jinja2 3.1 prints for the same templates), load-time
// rejection of what it does not implement, and render-time errors with their line.
#include "daemon/tokenizer/jinja/jinja.h"

#include <doctest/doctest.h>
#include <pthread.h>

#include <optional>

using namespace spark;
using namespace spark::tok;
using spark::tok::jinja::Template;

namespace {
std::string render(const std::string& src, const Json& ctx = Json::object()) {
  auto t = Template::parse(src, "t");
  REQUIRE_MESSAGE(t.ok(), (t.ok() ? "" : t.error().message));
  auto r = t->render(ctx);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.error().message));
  return *r;
}
Error render_error(const std::string& src, const Json& ctx = Json::object()) {
  auto t = Template::parse(src, "t");
  REQUIRE(t.ok());
  auto r = t->render(ctx);
  REQUIRE_FALSE(r.ok());
  return r.error();
}
Error load_error(const std::string& src) {
  auto t = Template::parse(src, "chat_template");
  REQUIRE_FALSE(t.ok());
  return t.error();
}
}  // namespace

TEST_CASE("jinja: trim_blocks, lstrip_blocks, '-' and comments as transformers sets them") {
  CHECK(render("{% if true %}\n  yes\n{% endif %}\n") == "  yes\n");
  CHECK(render("a\n    {% if true %}\nb\n    {% endif %}\nc") == "a\nb\nc");
  CHECK(render("a   {{- 'x' -}}   b") == "axb");
  CHECK(render("a  {%- if true -%}  b  {%- endif -%}  c") == "abc");
  CHECK(render("x {# note #}\ny") == "x y");  // a comment eats its newline too
  CHECK(render("  {# indented comment #}\nz") == "z");
  CHECK(render("{{ 'a' }}\n{{ 'b' }}\n") == "a\nb");  // one trailing newline dropped
  CHECK(render("line\n  {{ 'v' }}") == "line\n  v");  // lstrip does not touch {{
}

TEST_CASE("jinja: loops with loop.*, else, filters, unpacking, break and continue") {
  Json ctx = Json::parse(R"({"xs": ["a", "b", "c"], "d": {"k1": 1, "k2": 2}, "empty": []})");
  CHECK(render("{% for x in xs %}{{ loop.index }}{{ x }}{{ loop.length }}"
               "{% if loop.first %}F{% endif %}{% if loop.last %}L{% endif %}"
               "{{ loop.revindex0 }},{% endfor %}",
               ctx) == "1a3F2,2b31,3c3L0,");
  CHECK(render("{% for x in empty %}x{% else %}none{% endfor %}", ctx) == "none");
  CHECK(render("{% for x in xs if x != 'b' %}{{ loop.index }}{{ x }}{% endfor %}", ctx) == "1a2c");
  CHECK(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", ctx) == "k1=1;k2=2;");
  CHECK(render("{% for k in d %}{{ k }}{% endfor %}", ctx) == "k1k2");
  CHECK(render("{% for x in xs %}{% if x == 'b' %}{% continue %}{% endif %}{{ x }}"
               "{% if x == 'c' %}{% break %}{% endif %}{% endfor %}",
               ctx) == "ac");
  CHECK(render("{% for x in xs %}{{ loop.previtem | default('-') }}{{ loop.cycle('o', 'e') }}"
               "{% endfor %}",
               ctx) == "-oaebo");
  // `set` inside a loop does not leave it (nor the iteration); namespace() does.
  CHECK(render("{% set y = 0 %}{% for x in xs %}{% set y = y + 1 %}{% endfor %}{{ y }}", ctx) ==
        "0");
  CHECK(render("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + 1 %}"
               "{% endfor %}{{ ns.n }}",
               ctx) == "3");
  CHECK(render("{% for i in range(3) %}{% if i == 0 %}{% set z = 'set' %}{% endif %}"
               "{{ z is defined }}{% endfor %}") == "TrueFalseFalse");
}

TEST_CASE("jinja: expressions as Python evaluates them") {
  CHECK(render("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }}") ==
        "3 -4 1 2 3.5 1024");
  CHECK(render("{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 'ab' * 2 }} {{ [1] + [2] }}") ==
        "7 9 abab [1, 2]");
  CHECK(render("{{ 'a' ~ 1 ~ none }} {{ 'n' ~ 2 * 3 }}") == "a1None n6");
  CHECK(render("{{ 0 or 'x' }} {{ 'y' and 0 }} {{ not '' }} {{ 1 if 0 else 2 }}") == "x 0 True 2");
  CHECK(render("{{ 'ell' in 'hello' }} {{ 2 not in [1, 2] }} {{ 'k' in {'k': 1} }}") ==
        "True False True");
  CHECK(render("{{ 1 < 2 < 3 }} {{ 'b' > 'a' }} {{ 1 == 1.0 }} {{ true == 1 }}") ==
        "True True True True");
  CHECK(render("{{ none }} {{ true }} {{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ [1, 'a', none] }}") ==
        "None True 1.0 0.30000000000000004 1e+20 [1, 'a', None]");
  CHECK(render("{{ {'a': 1, 'b': \"it's\"} }}") == "{'a': 1, 'b': \"it's\"}");
  CHECK(render("{{ 'a' 'b' }} {{ \"tab\\there\" }} {{ '\\u00e9' }}") == "ab tab\there é");
  Json ctx = Json::parse(R"({"m": [{"role": "user", "content": "x"}], "s": "héllo wörld"})");
  CHECK(render("{{ m[0].role }} {{ m[0]['content'] }} {{ m[-1].role }} {{ m[5] is defined }}",
               ctx) == "user x user False");
  CHECK(render("{{ s[1] }} {{ s[1:4] }} {{ s[::-1] }} {{ s[-5:] }} {{ s | length }}", ctx) ==
        "é éll dlröw olléh wörld 11");
  CHECK(render("{{ m[1:] | length }} {{ [1, 2, 3][::-1] }} {{ [1, 2, 3, 4][1::2] }}", ctx) ==
        "0 [3, 2, 1] [2, 4]");
}

TEST_CASE("jinja: set, block set, macros, call blocks, filter blocks") {
  CHECK(render("{% set a, b = 1, 2 %}{{ a + b }}") == "3");
  CHECK(render("{% set x %}in {{ 'side' }}{% endset %}[{{ x }}]") == "[in side]");
  CHECK(render("{% macro tag(name, cls='c') %}<{{ name }} {{ cls }}>{% endmacro %}"
               "{{ tag('a') }}{{ tag('b', cls='d') }}") == "<a c><b d>");
  CHECK(render("{% macro wrap() %}[{{ caller() }}]{% endmacro %}"
               "{% call wrap() %}body{% endcall %}") == "[body]");
  CHECK(render("{% filter upper %}shout{% endfilter %}") == "SHOUT");
  CHECK(render("{% generation %}kept{% endgeneration %}") == "kept");
}

TEST_CASE("jinja: filters") {
  Json ctx = Json::parse(R"({"tools": [{"name": "f", "d": "é \"q\"", "n": [1, 2.5, true, null]}],
    "ms": [{"role": "user", "c": "a"}, {"role": "tool", "c": "b"}, {"role": "user"}],
    "obj": {"b": 2, "a": 1}})");
  CHECK(render("{{ tools[0] | tojson }}", ctx) ==
        R"({"name": "f", "d": "é \"q\"", "n": [1, 2.5, true, null]})");
  CHECK(render("{{ obj | tojson(indent=2) }}", ctx) == "{\n  \"b\": 2,\n  \"a\": 1\n}");
  CHECK(render("{{ obj | tojson(sort_keys=true) }} {{ obj | tojson(separators=(',', ':')) }}",
               ctx) == R"({"a": 1, "b": 2} {"b":2,"a":1})");
  CHECK(render("{{ '  x  ' | trim }}|{{ 'xxaxx' | trim('x') }}|{{ none | trim }}") == "x|a|None");
  CHECK(render("{{ 'hello world' | title }} {{ 'hELLO' | capitalize }} {{ 'straße' | upper }}") ==
        "Hello World Hello STRASSE");
  CHECK(render("{{ 'aaa' | replace('a', 'b', 2) }} {{ undef | default('d') }} "
               "{{ '' | default('e', true) }} {{ '' | default('f') }}|") == "bba d e |");
  CHECK(render("{{ ms | map(attribute='role') | join(',') }}", ctx) == "user,tool,user");
  CHECK(render("{{ ms | selectattr('role', 'equalto', 'user') | list | length }} "
               "{{ ms | rejectattr('role', 'equalto', 'user') | map(attribute='c') | first }} "
               "{{ ms | selectattr('c', 'undefined') | list | length }} "
               "{{ ms | selectattr('c') | map(attribute='c') | last }}",
               ctx) == "2 b 1 b");
  CHECK(render("{% for k, v in obj | dictsort %}{{ k }}{{ v }}{% endfor %} "
               "{% for k, v in obj | items %}{{ k }}{% endfor %}",
               ctx) == "a1b2 ba");
  CHECK(render("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}") ==
        "a\n  b\n\n  c|  a\n  b");
  CHECK(render("{{ '42' | int + 1 }} {{ 'x' | int }} {{ '2.5' | float }} {{ 3 | float }}") ==
        "43 0 2.5 3.0");
  CHECK(render("{{ [3, 1, 2, 1] | unique | list }} {{ [3, 1, 2] | sort }} "
               "{{ [3, 1, 2] | sort(reverse=true) | first }} {{ 'abc' | reverse }} "
               "{{ [1, 2] | reverse | list }}") == "[3, 1, 2] [1, 2, 3] 3 cba [2, 1]");
  CHECK(render("{{ ms | length }} {{ 'añb' | length }} {{ obj | length }} {{ undef | length }} "
               "{{ [1, 'x'] | string }} {{ 1 | string }}",
               ctx) == "3 3 2 0 [1, 'x'] 1");
}

TEST_CASE("jinja: tests") {
  Json ctx =
      Json::parse(R"({"s": "x", "n": 1, "f": 1.5, "o": {}, "a": [], "z": null, "b": false})");
  CHECK(render("{{ s is string }}{{ n is number }}{{ f is number }}{{ o is mapping }}"
               "{{ a is iterable }}{{ s is iterable }}{{ n is iterable }}{{ a is sequence }}",
               ctx) == "TrueTrueTrueTrueTrueTrueFalseTrue");
  CHECK(render("{{ z is none }}{{ z is not none }}{{ q is defined }}{{ q is undefined }}"
               "{{ b is false }}{{ b is true }}{{ n is integer }}{{ f is float }}",
               ctx) == "TrueFalseFalseTrueTrueFalseTrueTrue");
  CHECK(render("{{ n is equalto 1 }}{{ n is eq(2) }}{{ 3 is odd }}{{ 4 is divisibleby 2 }}"
               "{{ s is in ['x'] }}{{ 'ab' is lower }}",
               ctx) == "TrueFalseTrueTrueTrueTrue");
}

TEST_CASE("jinja: string and dict methods") {
  Json ctx = Json::parse(R"({"c": "<think>\nr\n</think>\n\nanswer", "d": {"k": "v"}})");
  CHECK(render("{{ c.split('</think>')[-1].lstrip('\\n') }}|"
               "{{ c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}",
               ctx) == "answer|r");
  CHECK(render("{{ ' a  b '.split() }} {{ 'a,b,c'.split(',', 1) }} {{ 'a,b,c'.rsplit(',', 1) }}") ==
        "['a', 'b'] ['a', 'b,c'] ['a,b', 'c']");
  CHECK(render("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} "
               "{{ 'abcb'.find('b') }} {{ 'abcb'.rfind('b') }} {{ 'abcb'.count('b') }} "
               "{{ 'x'.find('y') }}") == "True True 1 3 2 -1");
  CHECK(render("{{ '{} and {name}'.format(1, name='n') }} {{ '-'.join(['a', 'b']) }} "
               "{{ 'Ab'.upper() }}{{ 'Ab'.lower() }} {{ 'xyx'.strip('x') }} {{ 'a b'.title() }} "
               "{{ '12'.isdigit() }} {{ 'ab'.replace('a', 'z') }}") ==
        "1 and n a-b ABab y A B True zb");
  CHECK(render("{{ d.get('k') }} {{ d.get('x', 'def') }} {{ d.get('x') }} {{ d.keys() | list }} "
               "{{ d.values() | list }} {{ d.items() | list | length }}",
               ctx) == "v def None ['k'] ['v'] 1");
}

TEST_CASE("jinja: globals - raise_exception, strftime_now, range, dict, namespace") {
  Error e = render_error("line one\n{{ raise_exception('Conversation roles must alternate') }}");
  CHECK(e.code == Errc::usage);
  CHECK(e.message == "t line 2: Conversation roles must alternate");
  CHECK(render("{{ strftime_now('%Y') | length }}") == "4");
  CHECK(render("{{ range(3) | list }} {{ range(1, 7, 2) | list }} {{ dict(a=1).a }}") ==
        "[0, 1, 2] [1, 3, 5] 1");
  CHECK(render("{% set ns = namespace({'x': 1}, y=2) %}{{ ns.x + ns.y }}") == "3");
  CHECK(render_error("{{ range(10000000) | length }}").message.find("range()") !=
        std::string::npos);
}

TEST_CASE("jinja: undefined values behave as in Python Jinja's default Undefined") {
  Json ctx = Json::parse(R"({"m": {"role": "user"}})");
  CHECK(render("[{{ nothing }}]{{ m.content is defined }}{{ m.content | default('-') }}", ctx) ==
        "[]False-");
  Error attr = render_error("\n{{ nothing.attr }}", ctx);
  CHECK(attr.message == "t line 2: 'nothing' is undefined");
  Error add = render_error("{{ 'a' + m.content }}", ctx);
  CHECK(add.message.find("'content' is undefined") != std::string::npos);
  Error type = render_error("{{ 'a' + 1 }}", ctx);
  CHECK(type.message.find("unsupported operand") != std::string::npos);
  Error assign = render_error("{% set x = 1 %}{% set x.y = 2 %}", ctx);
  CHECK(assign.message.find("non-namespace") != std::string::npos);
}

TEST_CASE("jinja: what the interpreter lacks fails at load with the construct and its line") {
  Error f = load_error("{{ 'a' }}\n\n{{ x | wordwrap(10) }}");
  CHECK(f.code == Errc::unsupported);
  CHECK(f.message.find("chat_template line 3: filter 'wordwrap'") == 0);
  CHECK(f.message.find("CHAT_FORMAT") != std::string::npos);
  Error t = load_error("{% if x is prime %}{% endif %}");
  CHECK(t.code == Errc::unsupported);
  CHECK(t.message.find("line 1: test 'prime'") != std::string::npos);
  Error m = load_error("{% set x = [] %}\n{% set _ = x.append(1) %}");
  CHECK(m.message.find("line 2: method 'append()'") != std::string::npos);
  Error fn = load_error("{{ lipsum(2) }}");
  CHECK(fn.message.find("function 'lipsum()'") != std::string::npos);
  Error in_map = load_error("{{ xs | map('wordwrap') | list }}");
  CHECK(in_map.message.find("filter 'wordwrap' (named in map)") != std::string::npos);
  // Only names a render could reach count: these are fine.
  CHECK(Template::parse("{% macro m() %}{% endmacro %}{{ m() }}{{ x.strip() }}", "t").ok());

  Error syn = load_error("ok\n{% if x %}\nno end");
  CHECK(syn.code == Errc::config);
  CHECK(syn.message.find("chat_template line 3") != std::string::npos);
  CHECK(syn.message.find("endif") != std::string::npos);
  CHECK(load_error("{{ 'never closed }}").code == Errc::config);
  CHECK(load_error("{% frobnicate %}").message.find("unknown statement") != std::string::npos);
  CHECK(load_error("{{ a b }}").code == Errc::config);
}

TEST_CASE("jinja: hostile nesting and runaway output fail cleanly, not by a crash") {
  CHECK(load_error("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}")
            .message.find("nested deeper") != std::string::npos);
  std::string ifs;
  for (int i = 0; i < 1000; ++i) ifs += "{% if true %}";
  CHECK(load_error(ifs).message.find("nested deeper") != std::string::npos);
  Json ctx = Json::object();
  ctx["tools"] = Json::parse(std::string(600, '[') + std::string(600, ']'));
  Error e = render_error("{{ tools | length }}", ctx);
  CHECK(e.code == Errc::usage);
  CHECK(e.message.find("512") != std::string::npos);
  CHECK(render_error("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}").message.find("recursed") !=
        std::string::npos);
  CHECK(render_error("{% set s = 'x' * 100000 %}{% for i in range(700) %}{{ s }}{% endfor %}")
            .message.find("MiB") != std::string::npos);
}

TEST_CASE("jinja: recursion on a small stack ends in a limit error before the stack does") {
  // 250 levels of a macro whose call sits inside nested expressions take megabytes of stack
  // in any build; the thread below has 512 KiB. Without the stack check this overflows.
  const std::string src =
      "{% macro f(n) %}{% if n > 0 %}{{ ((((f(n - 1) ~ '') ~ '') ~ '') ~ '') }}{% endif %}"
      "{% endmacro %}{{ f(250) }}";
  auto t = Template::parse(src, "t");
  REQUIRE(t.ok());
  struct Job {
    const Template* t;
    std::optional<Result<std::string>> r;
  } job{&*t, std::nullopt};
  pthread_attr_t attr;
  REQUIRE(pthread_attr_init(&attr) == 0);
  REQUIRE(pthread_attr_setstacksize(&attr, size_t{512} << 10) == 0);
  pthread_t th;
  REQUIRE(pthread_create(
              &th, &attr,
              [](void* p) -> void* {
                auto* j = static_cast<Job*>(p);
                j->r.emplace(j->t->render(Json::object()));
                return nullptr;
              },
              &job) == 0);
  pthread_join(th, nullptr);
  pthread_attr_destroy(&attr);
  REQUIRE(job.r.has_value());
  REQUIRE_FALSE(job.r->ok());
  CHECK(job.r->error().code == Errc::unsupported);  // a limit, as the step budget
  CHECK(job.r->error().message.find("too deep for the render's stack") != std::string::npos);
  CHECK(job.r->error().message.find("line 1") != std::string::npos);
  // The same template renders on this thread's (ordinary) stack at a depth that fits.
  CHECK(render("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) ~ 'x' }}{% endif %}{% endmacro %}"
               "{{ f(3) }}") == "xxx");
}
