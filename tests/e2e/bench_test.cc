// sparkctl bench end to end: against a live sparkd on the demo model (every section yields
// numbers, every gate runs; verdicts on random weights are not asserted), against the
// fault_inject_openai double (each gate fails when it should, every bad reply gives a clear
// error within a bounded run), the memory guard, and bench compare with its SVG chart.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/http_client.h"
#include "support/spawn.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int exit_of(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool wait_http(int port, const std::string& target) {
  auto end = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < end) {
    HttpCall c;
    c.port = static_cast<uint16_t>(port);
    c.target = target;
    c.timeout = 2000ms;
    auto r = http_call(c);
    if (r.ok() && r->status == 200 &&
        (target != "/health" || json::parse(r->body, nullptr, false).value("state", "") == "ready"))
      return true;
    std::this_thread::sleep_for(100ms);
  }
  return false;
}

std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string w; in >> w;) v.push_back(w);
  return v;
}

// A run of sparkctl bench: exit code, output, the result document from --out.
struct BenchRun {
  int code = -1;
  std::string out;
  json result;
  std::string dir;  // --out
};

BenchRun bench(const test::TempDir& dir, std::vector<std::string> args,
               const std::map<std::string, std::string>& env = {},
               std::chrono::milliseconds limit = 120s) {
  static int n = 0;
  std::string out = dir / ("out" + std::to_string(++n));
  std::vector<std::string> argv = {SPARKCTL_BIN, "bench", "--out", out};
  argv.insert(argv.end(), args.begin(), args.end());
  auto [st, text] = test::run_capture(argv, env, limit);
  BenchRun r;
  r.code = exit_of(st);
  r.out = text;
  r.dir = out;
  r.result = json::parse(slurp(out + "/bench.json"), nullptr, false);
  return r;
}

// The fault double on a free port.
struct Fault {
  int port = test::free_port();
  std::unique_ptr<test::Child> child;
  Fault(const test::TempDir& dir, const std::string& mode, int prefill_us_per_byte = 2) {
    child = std::make_unique<test::Child>(
        std::vector<std::string>{test::find_fixture_binary(FAULT_OPENAI_BIN), "--port",
                                 std::to_string(port), "--mode", mode, "--prefill-us-per-byte",
                                 std::to_string(prefill_us_per_byte)},
        std::map<std::string, std::string>{}, dir / ("fault-" + mode + ".txt"));
    REQUIRE_MESSAGE(wait_http(port, "/v1/models"), "fault_inject_openai did not start");
  }
  ~Fault() {
    child->signal(SIGTERM);
    if (!child->wait_for(5s)) child->signal(SIGKILL);
  }
  std::string base() const { return "http://127.0.0.1:" + std::to_string(port) + "/v1"; }
};

// Small sizes for the fault double (and fast deadlines: a fault must not take minutes).
std::vector<std::string> small(const std::string& base, const std::string& sections,
                               const std::string& known) {
  auto v = words(
      "--runs 1 --max-tokens 24 --concurrency 2 --ttft-samples 2 --prefill-sizes 64,128 "
      "--prefix-tokens 64 --long-tokens 128 --tool-calls 4 --count-to 12 "
      "--thinking-max-tokens 32 --stall 1s --timeout 5s --request-timeout 3s --no-memory");
  for (const auto& x : {std::string("--base"), base, std::string("--sections"), sections,
                        std::string("--known-answers"), known})
    v.insert(v.end() - 1, x);
  return v;
}

const json& gate(const BenchRun& r, const char* g) {
  static const json none;
  if (!r.result.is_object() || !r.result.contains("gates") || !r.result["gates"].contains(g))
    return none;
  return r.result["gates"][g];
}

}  // namespace

TEST_CASE("bench: a live sparkd on the demo model: every section yields numbers, every gate runs") {
  test::TempDir dir("bench-e2e");
  auto [st, out] =
      test::run_capture({SPARKCTL_BIN, "demo-model", dir / "model"}, {}, std::chrono::seconds(60));
  REQUIRE_MESSAGE(st == 0, out);
  int port = test::free_port();
  std::map<std::string, std::string> env = {{"MODEL_PATH", dir / "model"},
                                            {"STATE_DIR", dir / "state"},
                                            {"API_PORT", std::to_string(port)},
                                            {"RDZV_PORT", std::to_string(test::free_port())},
                                            {"SLOTS", "4"},
                                            {"CONTEXT_LEN", "1024"},
                                            {"PROBE_PROMPT", "a"}};
  std::string cfg = std::string(SPARK_SOURCE_DIR) + "/env/examples/local.env";
  test::Child sparkd({SPARKD_BIN, "--config", cfg, "--rank", "0", "--port", std::to_string(port),
                      "--log-file", dir / "sparkd.log"},
                     env, dir / "sparkd-out.txt");
  REQUIRE_MESSAGE(wait_http(port, "/health"), slurp(dir / "sparkd.log"));

  // The default endpoint is rank 0 of the cluster file; its one node is sampled locally.
  auto args = words(
      "--runs 2 --max-tokens 8 --concurrency 3 --ttft-samples 3 --prefill-sizes 32,64,128 "
      "--prefix-tokens 96 --long-tokens 160 --tool-calls 2 --count-to 5 "
      "--thinking-max-tokens 16 --gate-max-tokens 6 --mem-interval 1s --label demo-a");
  // Global option before the command.
  std::vector<std::string> argv = {SPARKCTL_BIN, "--config", cfg, "bench", "--out", dir / "a"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto t0 = std::chrono::steady_clock::now();
  auto [bst, btext] = test::run_capture(argv, env, 180s);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(btext);
  MESSAGE("bench on the demo model took " << secs << " s");
  json r = json::parse(slurp(dir / "a/bench.json"), nullptr, false);
  REQUIRE(r.is_object());
  REQUIRE_FALSE(r.contains("error"));
  // Gates may fail on random weights (exit 13); nothing else may.
  int code = exit_of(bst);
  CHECK((code == 0 || code == 13));
  CHECK(r["schema"] == "sparkctl-bench/1");
  CHECK(r["base"] == "http://127.0.0.1:" + std::to_string(port) + "/v1");
  CHECK(r["server"]["model_id"] == "demo");
  CHECK(r["server"]["version"].is_string());
  CHECK(r["protocol"]["ignore_eos"] == "accepted");
  CHECK(r["protocol"]["chat_template_kwargs"] == "accepted");
  CHECK(r["protocol"]["warmup"]["discarded"] == true);
  const json& s = r["sections"];
  CHECK(s["c1"]["tokens_per_s"]["median"].get<double>() > 0);
  CHECK(s["c1"]["tokens_per_s"]["runs"].size() == 2);
  CHECK(s["c1"]["tokens"] == json::array({8, 8}));  // ignore_eos: exactly max_tokens
  CHECK(s["c8"]["streams"] == 3);
  CHECK(s["c8"]["aggregate_tokens_per_s"]["median"].get<double>() > 0);
  CHECK(s["c8"]["per_stream_tokens_per_s"]["median"].get<double>() > 0);
  CHECK(s["ttft"]["samples"] == 3);
  CHECK(s["ttft"]["p50_s"].get<double>() > 0);
  CHECK(s["ttft"]["max_s"].get<double>() >= s["ttft"]["p95_s"].get<double>());
  REQUIRE(s["prefill"]["sizes"].size() == 3);
  for (const auto& e : s["prefill"]["sizes"]) {
    // Either a figure or the inversion check's verdict, never both.
    CHECK(e["prompt_tokens"].get<int>() > 0);
    CHECK((e["tokens_per_s"].is_object() != e.contains("noise")));
  }
  // Sizes are calibrated from usage and steered run to run: the 128-token prompt is near 128.
  MESSAGE("prefill prompt tokens for 32,64,128: " << s["prefill"]["sizes"][0]["prompt_tokens"] << ","
                                                 << s["prefill"]["sizes"][1]["prompt_tokens"] << ","
                                                 << s["prefill"]["sizes"][2]["prompt_tokens"]);
  CHECK(std::abs(s["prefill"]["sizes"][2]["prompt_tokens"].get<int>() - 128) < 32);
  CHECK(s["prefill"]["sizes"][0]["tokens_per_s"].is_object());
  // Our server reports cached tokens: the follow-up turn hits the prefix cache.
  CHECK(s["prefix_cache"]["hit_rate"]["median"].get<double>() > 0.5);
  CHECK(s["prefix_cache"]["followup_ttft_s"]["median"].get<double>() > 0);
  CHECK(s["short_during_long"]["short_ttft_s"]["median"].get<double>() > 0);
  CHECK(s["short_during_long"]["long_ttft_s"]["median"].get<double>() > 0);
  CHECK(s["short_during_long"]["blocked_runs"].get<int>() +
            s["short_during_long"]["inconclusive_runs"].get<int>() <=
        2);
  CHECK(r["memory"]["sampled"] == true);
  CHECK(r["memory"]["nodes"][0]["node"] == "local");
  CHECK(r["memory"]["min_available_bytes"].get<uint64_t>() > 0);
  for (const char* g : {"known_answers", "count", "rare_tokens", "tool_calls", "determinism"}) {
    INFO(g);
    REQUIRE(r["gates"].contains(g));
    CHECK_FALSE(r["gates"][g].contains("error"));
    CHECK(r["gates"][g]["pass"].is_boolean());
  }
  CHECK(r["gates"]["known_answers"]["modes"]["thinking_off"]["total"].get<int>() >= 10);
  CHECK(r["gates"]["known_answers"]["modes"]["thinking_on"]["total"].get<int>() >= 10);
  CHECK(r["gates"]["count"]["runs"].size() == 3);
  CHECK(r["gates"]["tool_calls"]["calls"].size() == 2);
  CHECK(r["gates"]["rare_tokens"]["probes"].size() >= 4);
  // The same seed twice on our engine: the same text and logprobs.
  CHECK(r["gates"]["determinism"]["pass"] == true);
  CHECK(r["gates"]["determinism"]["same_logprobs"] == true);
  CHECK(slurp(dir / "a/bench.txt").find("C1 decode") != std::string::npos);

  // compare: this run beside a run of the fault double, the best marked, an SVG written.
  Fault f(dir, "good");
  auto b = bench(dir, small(f.base(), "c1,ttft,prefill",
                            SPARK_SOURCE_DIR "/packaging/bench/known-answers.jsonl"));
  REQUIRE_MESSAGE(b.result.is_object(), b.out);
  auto [cst, ctext] = test::run_capture(
      {SPARKCTL_BIN, "bench", "compare", dir / "a", b.dir + "/bench.json", "--svg", dir / "c.svg"},
      {}, 30s);
  INFO(ctext);
  CHECK(exit_of(cst) == 0);
  CHECK(ctext.find("arm A: demo-a") != std::string::npos);
  CHECK(ctext.find("C1 decode") != std::string::npos);
  CHECK(ctext.find("*") != std::string::npos);
  std::string svg = slurp(dir / "c.svg");
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(svg.find("C1 decode") != std::string::npos);
  CHECK(svg.find("demo-a") != std::string::npos);
}

TEST_CASE("bench: the fault double: gates fail when they should, bad replies end bounded") {
  test::TempDir dir("bench-fault");
  std::string known =
      dir.write("ka.jsonl",
                "{\"id\":\"echo\",\"prompt\":\"Say banana\",\"expect\":\"banana\"}\n"
                "# a comment\n"
                "{\"prompt\":\"Say 다람쥐\",\"expect\":[\"다람쥐\"]}\n");
  const std::string gates = "known_answers,count,rare_tokens,tool_calls,determinism";

  SUBCASE("a good server passes every gate (so a failure below is the fault's)") {
    Fault f(dir, "good");
    auto r = bench(
        dir, small(f.base(), "c1,c8,ttft,prefill,prefix_cache,short_during_long," + gates, known));
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK(r.result["ok"] == true);
    for (const char* g : {"known_answers", "count", "rare_tokens", "tool_calls", "determinism"}) {
      INFO(g);
      CHECK(gate(r, g)["pass"] == true);
    }
    CHECK(r.result["sections"]["prefix_cache"]["hit_rate"]["median"] == 0.0);
    CHECK(r.result["server"]["version"] == "fault-1");
  }
  SUBCASE("U+FFFD in a reply fails the rare-token probe") {
    Fault f(dir, "fffd");
    auto r = bench(dir, small(f.base(), "rare_tokens,count", known));
    INFO(r.out);
    CHECK(r.code == 13);
    CHECK(gate(r, "rare_tokens")["pass"] == false);
    CHECK(gate(r, "rare_tokens")["probes"][0]["problem"].get<std::string>().find("U+FFFD") !=
          std::string::npos);
    CHECK(gate(r, "count")["pass"] == true);  // ASCII only: untouched
  }
  SUBCASE("invalid UTF-8 fails the rare-token probe, naming the chunk") {
    Fault f(dir, "bad-utf8");
    auto r = bench(dir, small(f.base(), "rare_tokens", known));
    INFO(r.out);
    CHECK(r.code == 13);
    CHECK(gate(r, "rare_tokens")["pass"] == false);
    CHECK(gate(r, "rare_tokens")["probes"][0]["problem"].get<std::string>().find("invalid UTF-8") !=
          std::string::npos);
  }
  SUBCASE("broken tool-call JSON fails the tool-call harness") {
    Fault f(dir, "bad-tool-json");
    auto r = bench(dir, small(f.base(), "tool_calls", known));
    INFO(r.out);
    CHECK(r.code == 13);
    CHECK(gate(r, "tool_calls")["pass"] == false);
    CHECK(gate(r, "tool_calls")["right"] == 0);
    CHECK(gate(r, "tool_calls")["calls"][0]["problem"].get<std::string>().find(
              "not a JSON object") != std::string::npos);
  }
  SUBCASE("text that differs per call fails determinism and the count") {
    Fault f(dir, "varying");
    auto r = bench(dir, small(f.base(), "count,determinism", known));
    INFO(r.out);
    CHECK(r.code == 13);
    CHECK(gate(r, "determinism")["pass"] == false);
    CHECK(gate(r, "determinism")["same_text"] == false);
    CHECK(gate(r, "count")["pass"] == false);
    CHECK(gate(r, "count")["identical"] == false);
  }
  struct Bad {
    const char* mode;
    int code;
    const char* says;
    const char* ended_by;  // the client's limit that ended a stream the double never ends
  };
  for (const Bad& b :
       {Bad{"stall", 7, "stalled", "nothing for 1000 ms"},
        Bad{"error-mid", 9, "failed mid-stream", ""}, Bad{"endless", 7, "endless", "3 s limit"},
        Bad{"bad-json", 9, "not a JSON object", ""},
        Bad{"http-500", 9, "HTTP 500: injected internal error", ""}}) {
    SUBCASE(b.mode) {
      Fault f(dir, b.mode);
      auto args = small(f.base(), "c1,count", known);
      if (b.mode == std::string("endless"))
        // The whole-request limit, not the silence, must end an endless stream, even when
        // this loaded machine delays the double's writes.
        for (size_t i = 0; i + 1 < args.size(); ++i)
          if (args[i] == "--stall") args[i + 1] = "30s";
      auto r = bench(dir, args);
      INFO(r.out);
      CHECK(r.code == b.code);
      CHECK(r.result["ok"] == false);
      for (const char* part : {"sections", "gates"}) {
        const json& e = r.result[part][part == std::string("sections") ? "c1" : "count"]["error"];
        CHECK(e["message"].get<std::string>().find(b.says) != std::string::npos);
        // Bounded by cause: the stream that would never end was ended by --stall 1s or
        // --request-timeout 3s, not the default 15 minutes (which the 120 s limit of this
        // run would have killed, failing the exit code above).
        CHECK(e["message"].get<std::string>().find(b.ended_by) != std::string::npos);
      }
      CHECK(r.out.find(b.says) != std::string::npos);  // the table says it too
    }
  }
  SUBCASE("a server that refuses ignore_eos: said so, the figures still come") {
    Fault f(dir, "no-ignore-eos");
    auto r = bench(dir, small(f.base(), "c1", known));
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK(r.result["protocol"]["ignore_eos"].get<std::string>().rfind("refused", 0) == 0);
    CHECK(r.result["sections"]["c1"]["tokens_per_s"]["median"].get<double>() > 0);
    CHECK(r.result["sections"]["c1"]["length_note"].is_string());
  }
  SUBCASE("a short request queued behind a long prefill is seen as blocked") {
    // 300 us per prompt byte: the long prompt's prefill takes about a second, the short
    // one's about 30 ms; concurrent prefills leave the short one unblocked.
    for (const char* mode : {"good", "serial-prefill"}) {
      INFO(mode);
      Fault f(dir, mode, 300);
      auto args = small(f.base(), "short_during_long", known);
      for (size_t i = 0; i + 1 < args.size(); ++i) {
        if (args[i] == "--runs") args[i + 1] = "2";
        if (args[i] == "--long-tokens") args[i + 1] = "600";
        if (args[i] == "--timeout" || args[i] == "--request-timeout") args[i + 1] = "20s";
      }
      auto r = bench(dir, args);
      INFO(r.out);
      const json& s = r.result["sections"]["short_during_long"];
      CHECK(s["inconclusive_runs"] == 0);
      CHECK(s["blocked_runs"] == (mode == std::string("good") ? 0 : 2));
    }
  }
  SUBCASE("a bad known-answer file is named with its line") {
    Fault f(dir, "good");
    std::string bad =
        dir.write("bad.jsonl", "{\"prompt\":\"x\",\"expect\":\"y\"}\n{\"prompt\":1}\n");
    auto r = bench(dir, small(f.base(), "known_answers", bad));
    CHECK(r.code == 3);
    CHECK(gate(r, "known_answers")["error"]["message"].get<std::string>().find("bad.jsonl:2:") !=
          std::string::npos);
  }
}

TEST_CASE("bench: the memory guard cancels the run under BENCH_MEM_MIN") {
  test::TempDir dir("bench-mem");
  Fault f(dir, "good");
  std::string known = SPARK_SOURCE_DIR "/packaging/bench/known-answers.jsonl";
  auto args = small(f.base(), "c1", known);
  args.pop_back();  // sample this machine (--base on loopback without a cluster file)
  // Many long runs (minutes) that the guard must cut short: a floor of 1 PiB is above any
  // machine's MemAvailable, 3 samples 200 ms apart.
  for (size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--runs") args[i + 1] = "2000";
  for (auto x : {"--mem-interval", "200ms"}) args.push_back(x);
  auto r = bench(dir, args, {{"BENCH_MEM_MIN", "1024TiB"}, {"SPARK_CONFIG", dir / "none.env"}});
  INFO(r.out);
  CHECK(r.code == 14);
  REQUIRE(r.result.is_object());
  CHECK(r.result["cancelled"]["reason"].get<std::string>().find("BENCH_MEM_MIN") !=
        std::string::npos);
  CHECK(r.result["memory"]["nodes"][0]["samples"].get<int>() >= 3);
  CHECK(r.result["sections"]["c1"]["error"]["kind"] == "resource");
  // (Bounded by cause: only the guard's cancel exits 14; without it the 2000 runs end
  // otherwise, or this run's 120 s limit kills them.)
}

TEST_CASE("bench: the memory guard stops a request that is silent (a long prefill)") {
  test::TempDir dir("bench-mem2");
  Fault f(dir, "stall");
  auto args = small(f.base(), "c1", SPARK_SOURCE_DIR "/packaging/bench/known-answers.jsonl");
  args.pop_back();  // --no-memory
  // The stream goes silent for far longer than the test runs; only the guard can end it.
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--stall") args[i + 1] = "120s";
    if (args[i] == "--request-timeout") args[i + 1] = "240s";
  }
  for (auto x : {"--mem-interval", "200ms", "--mem-min", "1024TiB"}) args.push_back(x);
  auto r = bench(dir, args, {{"SPARK_CONFIG", dir / "none.env"}});
  INFO(r.out);
  CHECK(r.code == 14);
  REQUIRE(r.result.is_object());
  CHECK(r.result["sections"]["c1"]["error"]["message"].get<std::string>().find("memory guard") !=
        std::string::npos);
  // (Bounded by cause: the double stays silent until the client goes, so only the guard
  // ends the request with 14; without it this run's 120 s limit kills it.)
}
