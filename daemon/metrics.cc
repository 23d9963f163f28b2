#include "daemon/metrics.h"

#include <fmt/format.h>

#include <cmath>

namespace spark::daemon {

namespace {
// Latency buckets in seconds, from a fast decode step to a long prefill.
const std::vector<double> kLatencyBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                             0.1,   0.25,  0.5,  0.75, 1.0,  2.5,  5.0,
                                             7.5,   10.0,  20.0, 40.0, 80.0};

std::string escape(const std::string& v) {
  std::string o;
  for (char c : v) {
    if (c == '\\' || c == '"') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}

std::string fmt_labels(const Labels& l) {
  if (l.empty()) return "";
  std::string s = "{";
  for (size_t i = 0; i < l.size(); ++i)
    s += (i ? "," : "") + l[i].first + "=\"" + escape(l[i].second) + "\"";
  return s + "}";
}

std::string fmt_value(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);
}

const char* type_name(MetricType t) {
  switch (t) {
    case MetricType::counter:
      return "counter";
    case MetricType::gauge:
      return "gauge";
    case MetricType::histogram:
      return "histogram";
  }
  return "untyped";
}
}  // namespace

const std::vector<MetricSpec>& Metrics::specs() {
  static const std::vector<MetricSpec> k = {
      {"sparkd_up", MetricType::gauge, "1 while this sparkd process answers.", nullptr},
      {"sparkd_ready", MetricType::gauge, "1 when the whole ring is ready to serve.", nullptr},
      {"sparkd_fatal", MetricType::gauge, "1 when the ring failed and needs a restart.", nullptr},
      {"sparkd_stalled", MetricType::gauge, "1 when an engine call is older than STALL_TIMEOUT.",
       nullptr},
      {"sparkd_ranks_alive", MetricType::gauge, "Ranks whose process answers (rank 0 included).",
       nullptr},
      {"sparkd_world_size", MetricType::gauge, "Ranks in the ring.", nullptr},
      {"sparkd_uptime_seconds", MetricType::gauge, "Seconds since this sparkd started.", nullptr},
      {"sparkd_http_requests_total", MetricType::counter, "HTTP responses sent, by status code.",
       nullptr},
      {"sparkd_requests_running", MetricType::gauge, "API requests being processed.",
       "vllm:num_requests_running"},
      {"sparkd_requests_waiting", MetricType::gauge, "API requests queued for a serving slot.",
       "vllm:num_requests_waiting"},
      {"sparkd_slots_configured", MetricType::gauge,
       "Serving slots (concurrent sequences) configured.", nullptr},
      {"sparkd_slots_busy", MetricType::gauge, "Serving slots in use.", nullptr},
      {"sparkd_kv_cache_usage_ratio", MetricType::gauge,
       "Fraction of KV cache blocks in use (0-1).", "vllm:gpu_cache_usage_perc"},
      {"sparkd_prompt_tokens_total", MetricType::counter, "Prompt tokens processed (prefill).",
       "vllm:prompt_tokens_total"},
      {"sparkd_generation_tokens_total", MetricType::counter, "Tokens generated (decode).",
       "vllm:generation_tokens_total"},
      {"sparkd_request_success_total", MetricType::counter, "Requests finished, by finish reason.",
       "vllm:request_success_total"},
      {"sparkd_time_to_first_token_seconds", MetricType::histogram,
       "Time from request arrival to the first generated token.",
       "vllm:time_to_first_token_seconds"},
      {"sparkd_time_per_output_token_seconds", MetricType::histogram,
       "Time between generated tokens (decode step latency).",
       "vllm:time_per_output_token_seconds"},
      {"sparkd_e2e_request_latency_seconds", MetricType::histogram,
       "Time from request arrival to its last token.", "vllm:e2e_request_latency_seconds"},
      {"sparkd_mem_available_bytes", MetricType::gauge,
       "MemAvailable of this node (/proc/meminfo).", nullptr},
      {"sparkd_mem_guard_waits_total", MetricType::counter,
       "Requests held back because MemAvailable was under the wait floor.", nullptr},
      {"sparkd_mem_guard_cancels_total", MetricType::counter,
       "Requests cancelled because MemAvailable fell under the cancel floor.", nullptr},
      {"sparkd_metrics_errors_total", MetricType::counter,
       "Updates to unknown metric names (a bug in sparkd).", nullptr},
  };
  return k;
}

Metrics::Metrics(std::string model_name) : model_(std::move(model_name)) {
  for (const auto& s : specs())
    if (s.type == MetricType::histogram)
      hists_[s.name] = Hist{kLatencyBuckets, std::vector<uint64_t>(kLatencyBuckets.size() + 1, 0)};
}

const MetricSpec* Metrics::find(std::string_view name) const {
  for (const auto& s : specs())
    if (name == s.name) return &s;
  return nullptr;
}

void Metrics::inc(std::string_view name, double v, const Labels& labels) {
  std::lock_guard lk(mu_);
  const MetricSpec* s = find(name);
  if (!s || s->type == MetricType::histogram) {
    errors_ += 1;
    return;
  }
  values_[std::string(name)][labels] += v;
}

void Metrics::set(std::string_view name, double v, const Labels& labels) {
  std::lock_guard lk(mu_);
  const MetricSpec* s = find(name);
  if (!s || s->type == MetricType::histogram) {
    errors_ += 1;
    return;
  }
  values_[std::string(name)][labels] = v;
}

void Metrics::observe(std::string_view name, double v) {
  std::lock_guard lk(mu_);
  auto it = hists_.find(name);
  if (it == hists_.end()) {
    errors_ += 1;
    return;
  }
  Hist& h = it->second;
  size_t i = 0;
  while (i < h.bounds.size() && v > h.bounds[i]) ++i;
  ++h.counts[i];
  h.sum += v;
  ++h.count;
}

double Metrics::value(std::string_view name, const Labels& labels) const {
  std::lock_guard lk(mu_);
  auto it = values_.find(name);
  if (it == values_.end()) return 0;
  auto jt = it->second.find(labels);
  return jt == it->second.end() ? 0 : jt->second;
}

std::string Metrics::render() const {
  std::lock_guard lk(mu_);
  std::string out;
  auto family = [&](const std::string& name, const MetricSpec& s, bool vllm) {
    Labels extra;
    if (vllm) extra.emplace_back("model_name", model_);
    out += "# HELP " + name + " " + s.help + "\n";
    out += "# TYPE " + name + " " + type_name(s.type) + "\n";
    if (s.type == MetricType::histogram) {
      const Hist& h = hists_.at(s.name);
      uint64_t cum = 0;
      for (size_t i = 0; i <= h.bounds.size(); ++i) {
        cum += h.counts[i];
        Labels l = extra;
        l.emplace_back("le", i < h.bounds.size() ? fmt_value(h.bounds[i]) : "+Inf");
        out += name + "_bucket" + fmt_labels(l) + " " + std::to_string(cum) + "\n";
      }
      out += name + "_sum" + fmt_labels(extra) + " " + fmt_value(h.sum) + "\n";
      out += name + "_count" + fmt_labels(extra) + " " + std::to_string(h.count) + "\n";
      return;
    }
    auto it = values_.find(s.name);
    if (std::string_view(s.name) == "sparkd_metrics_errors_total") {
      out += name + " " + fmt_value(errors_) + "\n";
      return;
    }
    if (it == values_.end() || it->second.empty()) {
      out += name + fmt_labels(extra) + " 0\n";
      return;
    }
    for (const auto& [labels, v] : it->second) {
      Labels l = extra;
      l.insert(l.end(), labels.begin(), labels.end());
      out += name + fmt_labels(l) + " " + fmt_value(v) + "\n";
    }
  };
  for (const auto& s : specs()) family(s.name, s, false);
  for (const auto& s : specs())
    if (s.vllm) family(s.vllm, s, true);
  return out;
}

}  // namespace spark::daemon
