#include "bench/engine/engine_bench.h"

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>

namespace spark::engine {

bool BenchReport::ok() const {
  for (const auto& r : rows)
    if (r.wrong) return false;
  return !rows.empty();
}

namespace {

std::vector<int32_t> bench_prompt(int n, int salt, int vocab) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 131 + salt * 977 + 7) % (vocab - 3) + 3);
  return p;
}

struct Run {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<double> ttft_ms;
  double seconds = 0;
  std::string error;
};

Run run_concurrent(Engine& eng, int c, int prompt_tokens, int max_tokens) {
  using clock = std::chrono::steady_clock;
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    int done = 0;
  } sh;
  Run run;
  run.tokens.resize(static_cast<size_t>(c));
  run.ttft_ms.assign(static_cast<size_t>(c), 0);
  const int V = eng.config().vocab_size;
  const auto t0 = clock::now();
  std::vector<RequestId> ids;
  for (int i = 0; i < c; ++i) {
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    GenerateRequest req{
        bench_prompt(prompt_tokens, i, V), p, [&, i](const TokenEvent& e) {
          std::lock_guard<std::mutex> lk(sh.mu);
          auto& toks = run.tokens[static_cast<size_t>(i)];
          if (e.token >= 0) {
            if (toks.empty())
              run.ttft_ms[static_cast<size_t>(i)] =
                  std::chrono::duration<double, std::milli>(clock::now() - t0).count();
            toks.push_back(e.token);
          }
          if (!e.error.empty()) run.error = e.error;
          if (e.request_done) {
            ++sh.done;
            sh.cv.notify_all();
          }
        }};
    auto id = eng.submit(std::move(req));
    if (!id) {
      run.error = id.error().message;
      return run;
    }
    ids.push_back(*id);
  }
  std::unique_lock<std::mutex> lk(sh.mu);
  if (!sh.cv.wait_for(lk, std::chrono::minutes(10), [&] { return sh.done == c; })) {
    run.error = "benchmark requests did not finish within 10 minutes";
    lk.unlock();
    for (auto id : ids) eng.cancel(id);
    return run;
  }
  run.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return run;
}

}  // namespace

Result<BenchReport> run_bench(Engine& eng, const std::vector<int>& concurrency, int prompt_tokens,
                              int max_tokens) {
  BenchReport rep;
  rep.architecture = eng.config().architecture;
  // Reference: request 0's prompt alone.
  Run alone = run_concurrent(eng, 1, prompt_tokens, max_tokens);
  if (!alone.error.empty()) return make_error(Errc::internal, "benchmark: " + alone.error);
  for (int c : concurrency) {
    Run r = run_concurrent(eng, c, prompt_tokens, max_tokens);
    if (!r.error.empty()) return make_error(Errc::internal, "benchmark: " + r.error);
    BenchRow row;
    row.concurrency = c;
    row.requests = c;
    row.prompt_tokens = prompt_tokens;
    row.max_tokens = max_tokens;
    row.seconds = r.seconds;
    for (size_t i = 0; i < r.tokens.size(); ++i) {
      row.generated_tokens += static_cast<double>(r.tokens[i].size());
      row.mean_ttft_ms += r.ttft_ms[i] / c;
      if (static_cast<int>(r.tokens[i].size()) != max_tokens) ++row.wrong;
    }
    if (r.tokens[0] != alone.tokens[0]) ++row.wrong;  // batching must not change the result
    row.tokens_per_s = row.seconds > 0 ? row.generated_tokens / row.seconds : 0;
    rep.rows.push_back(row);
  }
  return rep;
}

std::string bench_table(const BenchReport& r) {
  std::string out = fmt::format("# engine CPU benchmark: {} ({})\n", r.model, r.architecture);
  out += fmt::format("# {:>11} {:>8} {:>7} {:>10} {:>9} {:>10} {:>12} {:>6}\n", "concurrency",
                     "requests", "prompt", "max_tokens", "seconds", "tokens/s", "mean_ttft_ms",
                     "#wrong");
  for (const auto& row : r.rows)
    out += fmt::format("  {:>11} {:>8} {:>7} {:>10} {:>9.3f} {:>10.1f} {:>12.1f} {:>6}\n",
                       row.concurrency, row.requests, row.prompt_tokens, row.max_tokens,
                       row.seconds, row.tokens_per_s, row.mean_ttft_ms, row.wrong);
  out += r.ok() ? "# result: ok\n" : "# result: WRONG OUTPUT\n";
  return out;
}

std::string bench_json(const BenchReport& r) {
  nlohmann::json j = {{"model", r.model},
                      {"architecture", r.architecture},
                      {"ok", r.ok()},
                      {"rows", nlohmann::json::array()}};
  for (const auto& row : r.rows)
    j["rows"].push_back({{"concurrency", row.concurrency},
                         {"requests", row.requests},
                         {"prompt_tokens", row.prompt_tokens},
                         {"max_tokens", row.max_tokens},
                         {"seconds", row.seconds},
                         {"generated_tokens", row.generated_tokens},
                         {"tokens_per_s", row.tokens_per_s},
                         {"mean_ttft_ms", row.mean_ttft_ms},
                         {"wrong", row.wrong}});
  return j.dump(2) + "\n";
}

}  // namespace spark::engine
