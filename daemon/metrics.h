#pragma once
// Prometheus text exposition for sparkd. Every family is declared once in specs(), with its
// sparkd_* name and, where vLLM has the same quantity, its vllm:* name (and the name vLLM
// used before, while vLLM still exports it): /metrics prints all of them so existing vLLM
// dashboards work unchanged. A twin means what vLLM means by it, and carries vLLM's labels
// (model_name, engine="0"); histograms use vLLM's buckets.
// Thread-safe: the engine counts tokens and latencies, the HTTP thread renders.
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spark::daemon {

enum class MetricType { counter, gauge, histogram };

/// Bucket layouts of the histograms (vLLM's, so that quantiles compare across servers).
enum class Buckets {
  none,
  ttft,             // time to first token, 1 ms .. 2560 s
  token_gap,        // time between two tokens, 10 ms .. 80 s
  request_latency,  // whole phases of a request, 0.3 s .. 7680 s
  tokens,           // token counts: 1, 2, 5, 10, ... up to the context length
  choices,          // a request's n: 1, 2, 5, 10, 20
  step_tokens,      // tokens one engine step computes: 1, 8, 16, 32, ... 16384
};

/// One metric family.
struct MetricSpec {
  const char* name;  // sparkd_*
  MetricType type;
  const char* help;
  const char* vllm;                 // vllm:* twin, or nullptr
  const char* vllm_old = nullptr;   // the twin's deprecated vLLM name, still exported
  Buckets buckets = Buckets::none;  // histograms only
};

using Labels = std::vector<std::pair<std::string, std::string>>;

class Metrics {
 public:
  /// max_context bounds the token-count buckets (as vLLM's max_model_len does).
  explicit Metrics(std::string model_name, int max_context = 4096);
  /// Every family sparkd exports.
  static const std::vector<MetricSpec>& specs();
  /// Adds to a counter (or gauge). Unknown names are a programming error: ignored, counted
  /// in sparkd_metrics_errors_total.
  void inc(std::string_view name, double v = 1, const Labels& labels = {});
  /// Sets a gauge (or a counter mirrored from another count).
  void set(std::string_view name, double v, const Labels& labels = {});
  /// Drops every series of a family (a gauge whose label sets change, e.g. per rank).
  void clear(std::string_view name);
  /// Records one observation of a histogram.
  void observe(std::string_view name, double v);
  /// Current value of a counter/gauge series (0 when absent).
  double value(std::string_view name, const Labels& labels = {}) const;
  /// Whether render() prints the vllm:* twins (on by default). Off for ENGINE=exec: there
  /// the external engine schedules, sparkd's engine series stay 0, and the engine's own
  /// /metrics has the real ones (vLLM serves vllm:* itself).
  void export_vllm(bool on);
  /// Bucket upper bounds of a histogram family (empty for other names).
  std::vector<double> bounds(std::string_view name) const;
  /// The exposition text (text/plain; version=0.0.4).
  std::string render() const;

 private:
  struct Hist {
    std::vector<double> bounds;
    std::vector<uint64_t> counts;  // per bucket (not cumulative)
    double sum = 0;
    uint64_t count = 0;
  };
  const MetricSpec* find(std::string_view name) const;
  std::string model_;
  mutable std::mutex mu_;
  std::map<std::string, std::map<Labels, double>, std::less<>> values_;
  std::map<std::string, Hist, std::less<>> hists_;
  double errors_ = 0;
  bool vllm_ = true;
};

/// Sets the process_* series (resident and virtual memory, CPU seconds, open and maximum
/// fds, start time) of the process whose /proc directory is `proc`, as Prometheus' client
/// libraries name them. Called at each scrape.
void sample_process(Metrics& m, const std::string& proc = "/proc/self");

}  // namespace spark::daemon
