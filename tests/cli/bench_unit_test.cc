// sparkctl bench's pure parts: the SSE splitter, the prefill inversion check, the base URL,
// result loading, the comparison table's best marks and the SVG chart.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "cli/bench.h"
#include "core/sse_client.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::cli;
using nlohmann::json;

TEST_CASE("SseParser: events across reads, CRLF, comments, multi-line data, [DONE]") {
  SseParser p;
  std::vector<std::string> got;
  bool done = false;
  uint64_t n = 0;
  auto h = [&](std::string_view d) {
    got.emplace_back(d);
    return true;
  };
  std::string text =
      ": keep-alive\r\n\r\ndata: {\"a\":1}\r\n\r\nevent: x\ndata: line1\ndata: line2\n\n"
      "data:nospace\n\ndata: [DONE]\n\n";
  // One byte at a time: no event may depend on how the reads split the stream.
  for (char c : text) REQUIRE(p.feed(std::string_view(&c, 1), h, &done, &n));
  CHECK(got == std::vector<std::string>{"{\"a\":1}", "line1\nline2", "nospace"});
  CHECK(n == 3);
  CHECK(done);
  // The handler stops the stream.
  SseParser q;
  int seen = 0;
  CHECK_FALSE(q.feed(
      "data: 1\n\ndata: 2\n\n", [&](std::string_view) { return ++seen < 1; }, &done, &n));
  CHECK(seen == 1);
}

TEST_CASE("bench: a longer prompt that prefills faster is noise, not a figure") {
  auto size = [](int t, double med) {
    return json{{"target_tokens", t}, {"tokens_per_s", {{"median", med}}}};
  };
  json s = json::array({size(1024, 5000), size(8192, 4000), size(32768, 4500),
                        json{{"target_tokens", 65536}, {"skipped", "over max_model_len"}},
                        size(131072, 3000)});
  bench::check_inversion(s);
  CHECK(s[0]["tokens_per_s"]["median"] == 5000);
  CHECK(s[1]["tokens_per_s"]["median"] == 4000);
  // 4500 > 4000 at 8k: noise; the next size is judged against 8k's figure.
  CHECK(s[2]["tokens_per_s"].is_null());
  CHECK(s[2]["noise"].get<std::string>().find("8192") != std::string::npos);
  CHECK(s[2]["discarded_tokens_per_s"]["median"] == 4500);
  CHECK(s[4]["tokens_per_s"]["median"] == 3000);
  CHECK_FALSE(s[4].contains("noise"));
}

TEST_CASE("bench: base URLs") {
  auto e = bench::parse_base("http://10.0.0.1:8000");
  REQUIRE(e.ok());
  CHECK(e->host == "10.0.0.1");
  CHECK(e->port == 8000);
  CHECK(e->prefix == "/v1");
  CHECK(bench::parse_base("http://h:9/openai/v1/")->prefix == "/openai/v1");
  CHECK(bench::parse_base("https://h/v1").error().code == Errc::unsupported);
  CHECK(bench::parse_base("h:80").error().code == Errc::config);
}

TEST_CASE("bench compare: one column per arm, the best marked, an SVG of the main figures") {
  auto arm = [](const char* label, double c1, double ttft) {
    return json{{"schema", "sparkctl-bench/1"},
                {"label", label},
                {"sections",
                 {{"c1", {{"tokens_per_s", {{"median", c1}}}}},
                  {"ttft", {{"p50_s", ttft}, {"p95_s", ttft}, {"max_s", ttft}}}}},
                {"gates", {{"count", {{"pass", c1 > 10}}}}}};
  };
  std::vector<json> rs = {arm("ours", 12.5, 0.2), arm("vllm <b>", 9.0, 0.1)};
  std::string t = bench::format_compare(rs);
  INFO(t);
  CHECK(t.find("# arm A: ours") != std::string::npos);
  CHECK(t.find("12.5*") != std::string::npos);  // higher is better
  CHECK(t.find(" 9.0 ") != std::string::npos);
  CHECK(t.find("0.100*") != std::string::npos);  // times: lower is better
  CHECK(t.find("pass") != std::string::npos);
  CHECK(t.find("FAIL") != std::string::npos);
  std::string svg = bench::compare_svg(rs);
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(svg.find("vllm &lt;b&gt;") != std::string::npos);  // labels escaped
  CHECK(svg.find("C1 decode") != std::string::npos);
  CHECK(svg.find("gate count") == std::string::npos);  // gates are in the table only

  test::TempDir d("bench-unit");
  CHECK(bench::load_result(d / "missing.json").error().code == Errc::not_found);
  CHECK(bench::load_result(d.write("x.json", "{\"a\":1}")).error().code == Errc::config);
  d.write("run/bench.json", rs[0].dump());
  auto r = bench::load_result(d / "run");
  REQUIRE(r.ok());
  CHECK((*r)["label"] == "ours");
}

TEST_CASE("bench report: rows name the real concurrency, --runs 1 warns, values sit above bars") {
  auto arm = [](const char* label, int streams, int runs) {
    return json{
        {"schema", "sparkctl-bench/1"},
        {"label", label},
        {"protocol", {{"runs", runs}, {"temperature", 0.0}, {"thinking", false}}},
        {"sections",
         {{"c1", {{"tokens_per_s", {{"median", 10.0}, {"min", 9.0}, {"max", 11.0}}}}},
          {"c8",
           {{"streams", streams},
            {"aggregate_tokens_per_s", {{"median", 40.0}, {"min", 40.0}, {"max", 40.0}}},
            {"per_stream_tokens_per_s", {{"median", 10.0}, {"min", 10.0}, {"max", 10.0}}}}}}}};
  };
  std::string one = bench::format_table(arm("ours", 4, 1));
  INFO(one);
  CHECK(one.find("C4 aggregate") != std::string::npos);
  CHECK(one.find("C4 per stream") != std::string::npos);
  CHECK(one.find("C8") == std::string::npos);
  CHECK(one.find("# warning: --runs 1: one sample per figure") != std::string::npos);
  CHECK(bench::format_table(arm("ours", 4, 3)).find("warning: --runs 1") == std::string::npos);
  std::vector<json> rs = {arm("a", 4, 3), arm("b", 16, 3)};
  CHECK(bench::format_compare(rs).find("C4/C16 aggregate") != std::string::npos);
  // Every rotated value label reads upward from its anchor above the bar: anchored at its
  // start, never centred (which put half of it over the bar).
  std::string svg = bench::compare_svg(rs);
  size_t rotated = 0;
  for (size_t p = svg.find("rotate(-90"); p != std::string::npos;
       p = svg.find("rotate(-90", p + 1)) {
    size_t open = svg.rfind("<text", p);
    REQUIRE(open != std::string::npos);
    CHECK(svg.substr(open, p - open).find("text-anchor=\"start\"") != std::string::npos);
    ++rotated;
  }
  CHECK(rotated == 6);  // 3 charted figures x 2 arms
}
