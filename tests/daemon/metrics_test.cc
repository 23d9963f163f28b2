// /metrics: Prometheus text with sparkd_* series and their vllm:* twins, checked by the real
// promtool (Debian prometheus) when it is installed.
#include "daemon/metrics.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "core/http_client.h"
#include "core/strings.h"
#include "daemon/daemon.h"
#include "support/spawn.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::daemon;
using namespace std::chrono_literals;

namespace {
// Runs `promtool check metrics` on text; {exit status, output}, or nullopt without promtool.
std::optional<std::pair<int, std::string>> promtool(const std::string& text) {
  for (const char* p : {"/usr/bin/promtool", "/usr/local/bin/promtool"}) {
    if (::access(p, X_OK) != 0) continue;
    test::TempDir dir("promtool");
    std::string in = dir.write("m.txt", text);
    auto [st, out] =
        test::run_capture({"/bin/sh", "-c", std::string(p) + " check metrics < " + in}, {}, 30s);
    return std::make_pair(WIFEXITED(st) ? WEXITSTATUS(st) : -1, out);
  }
  return std::nullopt;
}

std::string only_sparkd(const std::string& text) {
  std::string out, line;
  std::istringstream in(text);
  while (std::getline(in, line))
    if (line.find("vllm:") == std::string::npos) out += line + "\n";
  return out;
}
}  // namespace

TEST_CASE("metrics: counters, gauges, histograms, and vLLM twins with model_name") {
  Metrics m("demo-model");
  m.inc("sparkd_prompt_tokens_total", 120);
  m.inc("sparkd_prompt_tokens_total", 30);
  m.inc("sparkd_request_success_total", 1, {{"finished_reason", "stop"}});
  m.set("sparkd_requests_running", 2);
  m.observe("sparkd_time_to_first_token_seconds", 0.3);
  m.observe("sparkd_time_to_first_token_seconds", 12);
  m.inc("sparkd_no_such_metric");
  CHECK(m.value("sparkd_prompt_tokens_total") == 150);
  std::string t = m.render();
  CHECK(t.find("sparkd_prompt_tokens_total 150\n") != std::string::npos);
  CHECK(t.find("vllm:prompt_tokens_total{model_name=\"demo-model\",engine=\"0\"} 150\n") !=
        std::string::npos);
  CHECK(t.find("vllm:num_requests_running{model_name=\"demo-model\",engine=\"0\"} 2\n") !=
        std::string::npos);
  CHECK(t.find("sparkd_request_success_total{finished_reason=\"stop\"} 1\n") != std::string::npos);
  CHECK(t.find("sparkd_time_to_first_token_seconds_bucket{le=\"0.5\"} 1\n") != std::string::npos);
  // The current vLLM name and the deprecated one it still exports, from one series.
  CHECK(t.find("vllm:time_to_first_token_seconds_count{model_name=\"demo-model\",engine=\"0\"} "
               "2\n") != std::string::npos);
  CHECK(t.find("sparkd_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2\n") != std::string::npos);
  CHECK(t.find("sparkd_time_to_first_token_seconds_count 2\n") != std::string::npos);
  CHECK(t.find("sparkd_metrics_errors_total 1\n") != std::string::npos);
}

TEST_CASE("metrics: vLLM's current names, the deprecated ones beside them, vLLM's buckets") {
  // The names a vLLM dashboard or alert reads (vLLM's v1 PrometheusStatLogger).
  const std::set<std::string> want = {"vllm:num_requests_running",
                                      "vllm:num_requests_waiting",
                                      "vllm:kv_cache_usage_perc",
                                      "vllm:gpu_cache_usage_perc",
                                      "vllm:prefix_cache_queries_total",
                                      "vllm:prefix_cache_hits_total",
                                      "vllm:gpu_prefix_cache_queries_total",
                                      "vllm:gpu_prefix_cache_hits_total",
                                      "vllm:num_preemptions_total",
                                      "vllm:prompt_tokens_total",
                                      "vllm:generation_tokens_total",
                                      "vllm:request_success_total",
                                      "vllm:request_prompt_tokens",
                                      "vllm:request_generation_tokens",
                                      "vllm:time_to_first_token_seconds",
                                      "vllm:inter_token_latency_seconds",
                                      "vllm:time_per_output_token_seconds",
                                      "vllm:request_time_per_output_token_seconds",
                                      "vllm:e2e_request_latency_seconds",
                                      "vllm:request_queue_time_seconds",
                                      "vllm:request_inference_time_seconds",
                                      "vllm:request_prefill_time_seconds",
                                      "vllm:request_decode_time_seconds",
                                      "vllm:cache_config_info",
                                      "vllm:request_params_n",
                                      "vllm:request_params_max_tokens",
                                      "vllm:iteration_tokens_total"};
  Metrics m("x", 4096);
  std::string t = m.render();
  for (const auto& n : want) CHECK_MESSAGE(t.find("# TYPE " + n + " ") != std::string::npos, n);
  // Token counts in 1-2-5 steps up to the context, as vLLM's max_model_len bounds them.
  CHECK(m.bounds("sparkd_request_prompt_tokens") ==
        std::vector<double>{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000});
  CHECK(m.bounds("sparkd_request_params_max_tokens") == m.bounds("sparkd_request_prompt_tokens"));
  CHECK(m.bounds("sparkd_request_params_n") == std::vector<double>{1, 2, 5, 10, 20});
  CHECK(m.bounds("sparkd_iteration_tokens") ==
        std::vector<double>{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384});
  CHECK(m.bounds("sparkd_time_to_first_token_seconds").back() == 2560.0);
  CHECK(m.bounds("sparkd_e2e_request_latency_seconds").back() == 7680.0);
  CHECK(m.bounds("sparkd_time_per_output_token_seconds").front() == 0.01);
  // Families of labelled series only (per rank, info) print no unlabelled zero.
  CHECK(t.find("\nsparkd_rank_alive ") == std::string::npos);
  CHECK(t.find("\nvllm:cache_config_info{model_name=\"x\",engine=\"0\"} 0") == std::string::npos);
  m.set("sparkd_cache_config_info", 1, {{"block_size", "16"}});
  CHECK(m.render().find(
            "vllm:cache_config_info{model_name=\"x\",engine=\"0\",block_size=\"16\"} 1\n") !=
        std::string::npos);
}

TEST_CASE("metrics: without the native engine (ENGINE=exec) the vLLM twins are left out") {
  Metrics m("x");
  m.export_vllm(false);
  std::string t = m.render();
  CHECK(t.find("vllm:") == std::string::npos);
  CHECK(t.find("sparkd_requests_running 0\n") != std::string::npos);
}

TEST_CASE("metrics: every family is documented in sparkd(8)") {
  auto man = read_file(std::string(SPARK_SOURCE_DIR) + "/man/sparkd.8");
  if (!man && !std::filesystem::exists(SPARK_SOURCE_DIR)) {  // a staged test binary
    MESSAGE("SKIP: the source tree " SPARK_SOURCE_DIR " is not on this machine");
    std::puts("SKIP: source tree absent (man page check)");
    return;
  }
  REQUIRE(man.has_value());
  const std::string& text = *man;
  for (const auto& s : Metrics::specs()) {
    std::string name = s.name;
    // The per-sequence family is listed once with its suffixes.
    if (name.starts_with("sparkd_request_") && name != "sparkd_request_success_total")
      name = name.substr(std::string("sparkd_request").size());
    CHECK_MESSAGE(text.find(name) != std::string::npos, s.name << " is not in man/sparkd.8");
    for (const char* v : {s.vllm, s.vllm_old})
      if (v && !std::string_view(v).starts_with("vllm:request_"))
        CHECK_MESSAGE(text.find(v) != std::string::npos, v << " is not in man/sparkd.8");
  }
}

TEST_CASE("metrics: /metrics of a running daemon passes promtool check metrics") {
  Environment env;
  std::vector<Diagnostic> d;
  auto cfg = load_config_text("MODEL=demo\nNODE0_SSH=local\n", "t.env", env, &d);
  REQUIRE(cfg.ok());
  DaemonOptions o;
  o.port = 0;
  Daemon daemon(*cfg, o);
  REQUIRE(daemon.start().ok());
  daemon.metrics().observe("sparkd_e2e_request_latency_seconds", 1.5);
  HttpCall c;
  c.port = daemon.http_port();
  c.target = "/health";
  REQUIRE(http_call(c).ok());
  c.target = "/metrics";
  auto r = http_call(c);
  REQUIRE(r.ok());
  CHECK(r->status == 200);
  CHECK(r->headers["content-type"].find("text/plain; version=0.0.4") != std::string::npos);
  const std::string& t = r->body;
  CHECK(t.find("sparkd_up 1\n") != std::string::npos);
  CHECK(t.find("sparkd_ready 0\n") != std::string::npos);
  CHECK(t.find("sparkd_world_size 1\n") != std::string::npos);
  CHECK(t.find("sparkd_http_requests_total{code=\"200\"} 1\n") != std::string::npos);
  CHECK(t.find("sparkd_mem_available_bytes ") != std::string::npos);
  CHECK(t.find("vllm:e2e_request_latency_seconds_count{model_name=\"demo\",engine=\"0\"} 1\n") !=
        std::string::npos);
  CHECK(t.find("sparkd_rank_mem_available_bytes{rank=\"0\",node=\"node0\"} ") != std::string::npos);

  auto whole = promtool(t);
  if (!whole) {
    MESSAGE("SKIP: promtool not installed (Debian package prometheus); format not linted");
    std::puts("SKIP: promtool not installed (Debian package prometheus)");
    return;
  }
  // sparkd_* series: clean under promtool's lint.
  auto ours = promtool(only_sparkd(t));
  CHECK_MESSAGE(ours->first == 0, ours->second);
  // The whole text parses (exit 1 would be a parse error); promtool's only complaint is the
  // ':' that vLLM's names contain by design.
  CHECK_MESSAGE(whole->first != 1, whole->second);
  std::istringstream lines(whole->second);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    // ... and the _total of vLLM's histogram vllm:iteration_tokens_total, vLLM's name as it is.
    if (line.starts_with("vllm:iteration_tokens_total ") &&
        line.find("should not have \"_total\" suffix") != std::string::npos)
      continue;
    CHECK_MESSAGE(line.find("should not contain ':'") != std::string::npos, line);
  }
}

TEST_CASE("metrics: the shipped Grafana dashboard uses only series sparkd exports") {
  auto text = read_file(std::string(SPARK_SOURCE_DIR) + "/packaging/grafana/sparkd-dashboard.json");
  if (!text && !std::filesystem::exists(SPARK_SOURCE_DIR)) {  // a staged test binary
    MESSAGE("SKIP: the source tree " SPARK_SOURCE_DIR " is not on this machine");
    std::puts("SKIP: source tree absent (dashboard check)");
    return;
  }
  REQUIRE(text.has_value());
  auto dash = nlohmann::json::parse(*text);
  std::set<std::string> known;
  for (const auto& s : Metrics::specs()) {
    known.insert(s.name);
    if (s.vllm) known.insert(s.vllm);
    if (s.vllm_old) known.insert(s.vllm_old);
  }
  std::regex metric_re(R"((sparkd_[a-z0-9_]+|vllm:[a-z0-9_]+))");
  int exprs = 0;
  for (const auto& p : dash.at("panels")) {
    for (const auto& t : p.at("targets")) {
      std::string e = t.at("expr").get<std::string>();
      ++exprs;
      for (std::sregex_iterator it(e.begin(), e.end(), metric_re), end; it != end; ++it) {
        std::string name = (*it)[1];
        for (const char* suffix : {"_bucket", "_sum", "_count"})
          if (ends_with(name, suffix) && !known.count(name))
            name = name.substr(0, name.size() - std::string(suffix).size());
        CHECK_MESSAGE(known.count(name) == 1, "panel '" << p.at("title").get<std::string>()
                                                        << "' uses unknown series " << name);
      }
    }
  }
  CHECK(exprs >= 10);
  // vLLM's current names, never the deprecated ones; and the panels an operator of a ring
  // looks for: prefix-cache hit rate, queue time, every node's free memory.
  std::string all;
  for (const auto& p : dash.at("panels"))
    for (const auto& t : p.at("targets")) all += t.at("expr").get<std::string>() + "\n";
  for (const auto& s : Metrics::specs())
    if (s.vllm_old) {
      std::regex old_re(std::string(s.vllm_old) + "(_bucket|_sum|_count)?(?![a-z0-9_])");
      CHECK_MESSAGE(!std::regex_search(all, old_re),
                    "the dashboard queries the deprecated " << s.vllm_old);
    }
  for (const char* want : {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                           "vllm:request_queue_time_seconds_bucket",
                           "sparkd_rank_mem_available_bytes", "vllm:kv_cache_usage_perc"})
    CHECK_MESSAGE(all.find(want) != std::string::npos, "the dashboard lacks " << want);
}

TEST_CASE("metrics: every finish reason's series reads 0 before its first request, as vLLM's") {
  Metrics m("demo-model");
  std::string t = m.render();
  for (const char* reason : {"stop", "length", "abort", "error"}) {
    CHECK(t.find(fmt::format("sparkd_request_success_total{{finished_reason=\"{}\"}} 0\n",
                             reason)) != std::string::npos);
    CHECK(t.find(fmt::format("vllm:request_success_total{{model_name=\"demo-model\",engine=\"0\","
                             "finished_reason=\"{}\"}} 0\n",
                             reason)) != std::string::npos);
  }
  m.inc("sparkd_request_success_total", 1, {{"finished_reason", "length"}});
  t = m.render();
  CHECK(t.find("sparkd_request_success_total{finished_reason=\"length\"} 1\n") !=
        std::string::npos);
  CHECK(t.find("sparkd_request_success_total{finished_reason=\"stop\"} 0\n") != std::string::npos);
}

TEST_CASE("metrics: process_* series from /proc/self, as Prometheus' process collector") {
  Metrics m("demo-model");
  // Work and memory this test can see move: CPU time spent, a page-touched buffer, fds.
  std::vector<char> big(64 << 20);
  for (size_t i = 0; i < big.size(); i += 4096) big[i] = 1;
  volatile double x = 0;
  for (int i = 0; i < 20000000; ++i) x = x + i * 0.5;
  test::TempDir d("metrics-proc");
  std::ifstream a(d.write("a", "x")), b(d.write("b", "y"));
  sample_process(m);
  CHECK(m.value("process_resident_memory_bytes") >= 64.0 * (1 << 20));
  CHECK(m.value("process_virtual_memory_bytes") >= m.value("process_resident_memory_bytes"));
  CHECK(m.value("process_cpu_seconds_total") > 0);
  CHECK(m.value("process_open_fds") >= 3);
  CHECK(m.value("process_max_fds") >= m.value("process_open_fds"));
  CHECK(m.value("process_start_time_seconds") > 1.6e9);  // after 2020, in epoch seconds
  const double fds = m.value("process_open_fds");
  a.close();
  b.close();
  sample_process(m);
  CHECK(m.value("process_open_fds") == fds - 2);
  std::string t = m.render();
  for (const char* n : {"process_resident_memory_bytes", "process_cpu_seconds_total",
                        "process_open_fds", "process_start_time_seconds"})
    CHECK(t.find(fmt::format("# TYPE {} ", n)) != std::string::npos);
  CHECK(big[4096] == 1);
}
