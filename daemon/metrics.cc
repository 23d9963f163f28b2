#include "daemon/metrics.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace spark::daemon {

namespace {
// vLLM's bucket bounds, so that a quantile over sparkd and over vLLM compares like with like.
const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                          0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                          20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kTokenGapBuckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                                              0.3,  0.4,   0.5,  0.75,  1.0, 2.5,  5.0,
                                              7.5,  10.0,  20.0, 40.0,  80.0};
const std::vector<double> kRequestBuckets = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                             5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                             60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

// vLLM's request_params_n and iteration_tokens_total buckets (the latter as vLLM has them
// when it captures no CUDA graphs: a fixed list, not the capture sizes).
const std::vector<double> kChoiceBuckets = {1, 2, 5, 10, 20};
const std::vector<double> kStepTokenBuckets = {1,   8,    16,   32,   64,   128,  256,
                                               512, 1024, 2048, 4096, 8192, 16384};

// 1, 2, 5, 10, 20, 50, ... while <= max (vLLM's token-count buckets).
std::vector<double> one_two_five(int max) {
  std::vector<double> b;
  for (double e = 1;; e *= 10)
    for (double m : {1.0, 2.0, 5.0}) {
      if (m * e > std::max(1, max)) return b;
      b.push_back(m * e);
    }
}

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
  using T = MetricType;
  using B = Buckets;
  static const std::vector<MetricSpec> k = {
      {"sparkd_up", T::gauge, "1 while this sparkd process answers.", nullptr},
      {"sparkd_ready", T::gauge, "1 when the whole ring is ready to serve.", nullptr},
      {"sparkd_fatal", T::gauge, "1 when the ring failed and needs a restart.", nullptr},
      {"sparkd_stalled", T::gauge, "1 when an engine call is older than STALL_TIMEOUT.", nullptr},
      {"sparkd_ranks_alive", T::gauge, "Ranks whose process answers (rank 0 included).", nullptr},
      {"sparkd_world_size", T::gauge, "Ranks in the ring.", nullptr},
      {"sparkd_uptime_seconds", T::gauge, "Seconds since this sparkd started.", nullptr},
      {"sparkd_rank_alive", T::gauge,
       "Per rank (labels rank, node): 1 while rank 0 hears from it (rank 0: itself).", nullptr},
      {"sparkd_rank_mem_available_bytes", T::gauge,
       "Per rank (labels rank, node): MemAvailable of the rank's node, as its last heartbeat "
       "reported it (rank 0: sampled here).",
       nullptr},
      {"sparkd_rank_heartbeat_age_seconds", T::gauge,
       "Per follower rank (labels rank, node): seconds since its last heartbeat.", nullptr},
      {"sparkd_http_requests_total", T::counter, "HTTP responses sent, by status code.", nullptr},
      {"sparkd_http_requests_in_flight", T::gauge,
       "API requests received and not yet answered (queued, held by the memory guard, or "
       "running).",
       nullptr},
      {"sparkd_requests_running", T::gauge,
       "Sequences in the engine's running batch (each holds a serving slot; a request with n "
       "choices counts n).",
       "vllm:num_requests_running"},
      {"sparkd_requests_waiting", T::gauge,
       "Requests handed to the engine and waiting for a serving slot or KV blocks.",
       "vllm:num_requests_waiting"},
      {"sparkd_slots_configured", T::gauge, "Serving slots (concurrent sequences) configured.",
       nullptr},
      {"sparkd_slots_busy", T::gauge, "Serving slots in use.", nullptr},
      {"sparkd_kv_cache_usage_ratio", T::gauge, "Fraction of KV cache blocks in use (0-1).",
       "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"},
      {"sparkd_cache_config_info", T::gauge,
       "KV cache configuration in the labels (block_size, cache_dtype, enable_prefix_caching, "
       "num_gpu_blocks); the value is 1.",
       "vllm:cache_config_info"},
      {"sparkd_prefix_cache_queries_total", T::counter,
       "Prompt tokens looked up in the prefix cache (every admitted sequence's prompt).",
       "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"},
      {"sparkd_prefix_cache_hits_total", T::counter,
       "Prompt tokens found in the prefix cache (not computed again).",
       "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"},
      {"sparkd_prompt_tokens_total", T::counter,
       "Prompt tokens prefilled, those served by the prefix cache included.",
       "vllm:prompt_tokens_total"},
      {"sparkd_prompt_tokens_computed_total", T::counter,
       "Prompt tokens the engine computed (prefix-cache hits left out).", nullptr},
      {"sparkd_generation_tokens_total", T::counter, "Tokens generated (decode).",
       "vllm:generation_tokens_total"},
      {"sparkd_preemptions_total", T::counter,
       "Sequences preempted (their KV blocks taken back); the native engine reserves a "
       "sequence's blocks when it admits it, so this stays 0.",
       "vllm:num_preemptions_total"},
      {"sparkd_request_success_total", T::counter, "Requests finished, by finish reason.",
       "vllm:request_success_total"},
      {"sparkd_time_to_first_token_seconds", T::histogram,
       "Time from request arrival to the first generated token.",
       "vllm:time_to_first_token_seconds", nullptr, B::ttft},
      {"sparkd_time_per_output_token_seconds", T::histogram,
       "Time between two generated tokens of a request (inter-token latency).",
       "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds", B::token_gap},
      {"sparkd_request_time_per_output_token_seconds", T::histogram,
       "Per finished sequence: decode time over its generated tokens after the first.",
       "vllm:request_time_per_output_token_seconds", nullptr, B::token_gap},
      {"sparkd_e2e_request_latency_seconds", T::histogram,
       "Time from request arrival to its last token.", "vllm:e2e_request_latency_seconds", nullptr,
       B::request_latency},
      {"sparkd_request_queue_time_seconds", T::histogram,
       "Per finished sequence: time from submission to the engine until it got a serving slot.",
       "vllm:request_queue_time_seconds", nullptr, B::request_latency},
      {"sparkd_request_prefill_time_seconds", T::histogram,
       "Per finished sequence: time from getting a slot to its first token.",
       "vllm:request_prefill_time_seconds", nullptr, B::request_latency},
      {"sparkd_request_decode_time_seconds", T::histogram,
       "Per finished sequence: time from its first token to its last.",
       "vllm:request_decode_time_seconds", nullptr, B::request_latency},
      {"sparkd_request_inference_time_seconds", T::histogram,
       "Per finished sequence: time from getting a slot to its last token (prefill + decode).",
       "vllm:request_inference_time_seconds", nullptr, B::request_latency},
      {"sparkd_request_prompt_tokens", T::histogram,
       "Per finished sequence: prompt tokens (prefix-cache hits included).",
       "vllm:request_prompt_tokens", nullptr, B::tokens},
      {"sparkd_request_generation_tokens", T::histogram, "Per finished sequence: tokens generated.",
       "vllm:request_generation_tokens", nullptr, B::tokens},
      {"sparkd_request_params_n", T::histogram,
       "Per finished request: the number of choices it asked for (n).", "vllm:request_params_n",
       nullptr, B::choices},
      {"sparkd_request_params_max_tokens", T::histogram,
       "Per finished request that set it: its max_tokens.", "vllm:request_params_max_tokens",
       nullptr, B::tokens},
      {"sparkd_iteration_tokens", T::histogram,
       "Per engine step: tokens it computed (prompt tokens prefilled and tokens decoded).",
       "vllm:iteration_tokens_total", nullptr, B::step_tokens},
      {"sparkd_mem_available_bytes", T::gauge, "MemAvailable of this node (/proc/meminfo).",
       nullptr},
      {"sparkd_mem_guard_waits_total", T::counter,
       "Requests held back because MemAvailable was under the wait floor.", nullptr},
      {"sparkd_mem_guard_cancels_total", T::counter,
       "Requests cancelled because MemAvailable fell under the cancel floor.", nullptr},
      {"sparkd_metrics_errors_total", T::counter,
       "Updates to unknown metric names (a bug in sparkd).", nullptr},
      // The process series under Prometheus' standard names (client libraries' process
      // collector), read from /proc/self at each scrape (sample_process).
      {"process_resident_memory_bytes", T::gauge, "Resident memory size in bytes.", nullptr},
      {"process_virtual_memory_bytes", T::gauge, "Virtual memory size in bytes.", nullptr},
      {"process_cpu_seconds_total", T::counter, "Total user and system CPU time spent in seconds.",
       nullptr},
      {"process_open_fds", T::gauge, "Number of open file descriptors.", nullptr},
      {"process_max_fds", T::gauge, "Maximum number of open file descriptors.", nullptr},
      {"process_start_time_seconds", T::gauge,
       "Start time of the process since unix epoch in seconds.", nullptr},
  };
  return k;
}

Metrics::Metrics(std::string model_name, int max_context) : model_(std::move(model_name)) {
  for (const auto& s : specs()) {
    if (s.type != MetricType::histogram) continue;
    std::vector<double> b;
    switch (s.buckets) {
      case Buckets::ttft:
        b = kTtftBuckets;
        break;
      case Buckets::token_gap:
        b = kTokenGapBuckets;
        break;
      case Buckets::none:
      case Buckets::request_latency:
        b = kRequestBuckets;
        break;
      case Buckets::tokens:
        b = one_two_five(max_context);
        break;
      case Buckets::choices:
        b = kChoiceBuckets;
        break;
      case Buckets::step_tokens:
        b = kStepTokenBuckets;
        break;
    }
    hists_[s.name] = Hist{b, std::vector<uint64_t>(b.size() + 1, 0)};
  }
  // Every finish reason's series exists from the start, at 0, as vLLM's do: a rate() or an
  // alert on "length" or "abort" then has a series before the first such request.
  for (const char* reason : {"stop", "length", "abort", "error"})
    values_["sparkd_request_success_total"][{{"finished_reason", reason}}] = 0;
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

void Metrics::export_vllm(bool on) {
  std::lock_guard lk(mu_);
  vllm_ = on;
}

void Metrics::clear(std::string_view name) {
  std::lock_guard lk(mu_);
  auto it = values_.find(name);
  if (it != values_.end()) it->second.clear();
}

std::vector<double> Metrics::bounds(std::string_view name) const {
  std::lock_guard lk(mu_);
  auto it = hists_.find(name);
  return it == hists_.end() ? std::vector<double>{} : it->second.bounds;
}

double Metrics::value(std::string_view name, const Labels& labels) const {
  std::lock_guard lk(mu_);
  auto it = values_.find(name);
  if (it == values_.end()) return 0;
  auto jt = it->second.find(labels);
  return jt == it->second.end() ? 0 : jt->second;
}

void sample_process(Metrics& m, const std::string& proc) {
  // /proc/PID/stat: the fields after the command's closing parenthesis; utime and stime
  // are fields 14 and 15, starttime 22, vsize 23, rss 24 (pages).
  std::ifstream st(proc + "/stat");
  std::string line;
  if (std::getline(st, line)) {
    auto close = line.rfind(')');
    if (close != std::string::npos) {
      std::istringstream in(line.substr(close + 2));
      std::vector<std::string> f;
      for (std::string w; in >> w;) f.push_back(w);
      // f[0] is field 3 (state).
      auto field = [&](size_t n) -> double {
        return n >= 3 && n - 3 < f.size() ? std::strtod(f[n - 3].c_str(), nullptr) : 0.0;
      };
      const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
      const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
      if (tick > 0) m.set("process_cpu_seconds_total", (field(14) + field(15)) / tick);
      m.set("process_virtual_memory_bytes", field(23));
      m.set("process_resident_memory_bytes", field(24) * page);
      std::ifstream ps("/proc/stat");
      for (std::string l; std::getline(ps, l);)
        if (l.rfind("btime ", 0) == 0 && tick > 0)
          m.set("process_start_time_seconds",
                std::strtod(l.c_str() + 6, nullptr) + field(22) / tick);
    }
  }
  std::error_code ec;
  double fds = 0;
  for (auto it = std::filesystem::directory_iterator(proc + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++fds;
  if (!ec) m.set("process_open_fds", fds);
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    m.set("process_max_fds", static_cast<double>(rl.rlim_cur));
}

std::string Metrics::render() const {
  std::lock_guard lk(mu_);
  std::string out;
  auto family = [&](const std::string& name, const MetricSpec& s, bool vllm) {
    Labels extra;
    if (vllm) {
      extra.emplace_back("model_name", model_);
      extra.emplace_back("engine", "0");
    }
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
      // A family whose series all carry labels of their own (per rank, the info gauge) has
      // no unlabelled zero; the others read 0 until their first update.
      const std::string_view n = s.name;
      if (n.ends_with("_info") || n.starts_with("sparkd_rank_")) return;
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
  for (const auto& s : specs()) {
    if (!vllm_) break;
    if (s.vllm) family(s.vllm, s, true);
    if (s.vllm_old) family(s.vllm_old, s, true);
  }
  return out;
}

}  // namespace spark::daemon
