#pragma once
// Prometheus text exposition for sparkd. Every family is declared once in specs(), with its
// sparkd_* name and, where vLLM has the same quantity, its vllm:* name: /metrics prints both
// so existing vLLM dashboards work unchanged (vLLM series carry a model_name label).
// Thread-safe: the engine counts tokens and latencies, the HTTP thread renders.
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spark::daemon {

enum class MetricType { counter, gauge, histogram };

/// One metric family.
struct MetricSpec {
  const char* name;  // sparkd_*
  MetricType type;
  const char* help;
  const char* vllm;  // vllm:* twin, or nullptr
};

using Labels = std::vector<std::pair<std::string, std::string>>;

class Metrics {
 public:
  explicit Metrics(std::string model_name);
  /// Every family sparkd exports.
  static const std::vector<MetricSpec>& specs();
  /// Adds to a counter (or gauge). Unknown names are a programming error: ignored, counted
  /// in sparkd_metrics_errors_total.
  void inc(std::string_view name, double v = 1, const Labels& labels = {});
  /// Sets a gauge (or a counter mirrored from another count).
  void set(std::string_view name, double v, const Labels& labels = {});
  /// Records one observation of a histogram.
  void observe(std::string_view name, double v);
  /// Current value of a counter/gauge series (0 when absent).
  double value(std::string_view name, const Labels& labels = {}) const;
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
};

}  // namespace spark::daemon
