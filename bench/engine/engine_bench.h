#pragma once
// Throughput of the CPU path: tokens per second at a given number of concurrent requests,
// checked against itself (every request must produce exactly max_tokens tokens, and the
// first request's tokens must equal a single-request run of the same prompt).
#include <string>
#include <vector>

#include "daemon/engine/engine.h"

namespace spark::engine {

struct BenchRow {
  int concurrency = 0;
  int requests = 0;
  int prompt_tokens = 0;  // per request
  int max_tokens = 0;     // per request
  double seconds = 0;     // submit of the first to end of the last
  double generated_tokens = 0;
  double tokens_per_s = 0;  // generated tokens / seconds, all requests together
  double mean_ttft_ms = 0;  // time to first token
  int wrong = 0;            // requests whose output failed the checks
};

struct BenchReport {
  std::string model;
  std::string architecture;
  std::vector<BenchRow> rows;
  bool ok() const;
};

/// Runs one row per entry of `concurrency` on `engine`.
Result<BenchReport> run_bench(Engine& engine, const std::vector<int>& concurrency,
                              int prompt_tokens, int max_tokens);

/// Table (non-data lines start with '#') and JSON renderings.
std::string bench_table(const BenchReport& r);
std::string bench_json(const BenchReport& r);

}  // namespace spark::engine
