#include "cli/history_view.h"

#include <fmt/format.h>

#include <algorithm>
#include <ctime>

#include "cli/cmd_preflight.h"
#include "cli/node_exec.h"
#include "cli/node_ops.h"
#include "core/process.h"
#include "core/strings.h"
#include "env/nvml.h"

namespace spark::cli {

using nlohmann::json;

namespace {

// The daemon's states in daemon/health.h order (the CLI does not link the daemon).
const char* state_text(int s) {
  static const char* kStates[] = {"starting", "loading", "ready", "fatal", "stalled", "stopping"};
  return s >= 0 && s < 6 ? kStates[s] : "?";
}

std::string clock_text(int64_t ms) {
  std::time_t t = static_cast<std::time_t>(ms / 1000);
  struct tm tm {};
  ::localtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%d %H:%M:%S", &tm);
  return b;
}

std::string ranks_text(uint32_t m) {
  std::vector<std::string> v;
  for (int r = 0; r < 32; ++r)
    if (m & (1u << r)) v.push_back(std::to_string(r));
  return join(v, ",");
}

}  // namespace

json history_here(const RingConfig& cfg, int node, int64_t since_ms) {
  auto dirs = node_dirs(cfg);
  json ranks = json::array();
  for (int r : ranks_of_node(cfg, node)) {
    std::string path = history_path(dirs.state, r);
    json e{{"rank", r}, {"path", path}, {"samples", json::array()}};
    auto h = read_history(path);
    if (!h) {
      e["error"] = h.error().message;
    } else {
      for (const auto& s : *h)
        if (s.time_ms >= since_ms) e["samples"].push_back(to_json(s));
    }
    ranks.push_back(e);
  }
  return {{"node", cfg.nodes.at(static_cast<size_t>(node)).name}, {"ranks", ranks}};
}

std::vector<RankHistory> collect_history(const RingConfig& cfg, const std::string& sparkctl_bin,
                                         int node, int64_t since_ms,
                                         std::chrono::milliseconds timeout) {
  std::vector<int> nodes;
  for (const auto& n : cfg.nodes)
    if (node < 0 || n.index == node) nodes.push_back(n.index);
  std::vector<std::string> commands;
  for (int n : nodes)
    commands.push_back(fmt::format("{} --config - node history --node {} --since-ms {}",
                                   shell_quote(sparkctl_bin), n, since_ms));
  auto runs = run_on_nodes(cfg, jobs_on(nodes, commands, config_wire_text(cfg)), timeout);
  std::vector<RankHistory> out;
  for (const auto& run : runs) {
    std::string why;
    json doc;
    if (!run.ok())
      why = run.error->message;
    else if (run.exit_status != 0)
      why = fmt::format("`node history` exited {}: {}", run.exit_status,
                        std::string(trim(run.err)).substr(0, 500));
    else if (doc = json::parse(run.out, nullptr, false); doc.is_discarded())
      why = "its answer is not JSON (a different sparkctl on that node? set SPARKCTL_BIN)";
    if (!why.empty()) {
      for (int r : ranks_of_node(cfg, run.index)) out.push_back({r, run.node, {}, why});
      continue;
    }
    try {
      for (const auto& e : doc.value("ranks", json::array())) {
        RankHistory h{e.value("rank", 0), run.node, {}, e.value("error", "")};
        for (const auto& s : e.value("samples", json::array()))
          h.samples.push_back(sample_from_json(s));
        out.push_back(std::move(h));
      }
    } catch (const json::exception& e) {
      for (int r : ranks_of_node(cfg, run.index))
        out.push_back(
            {r, run.node, {}, std::string("its history answer is malformed: ") + e.what()});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const RankHistory& a, const RankHistory& b) { return a.rank < b.rank; });
  return out;
}

std::string sparkline(const std::vector<double>& v, int width) {
  static const char* kBars[] = {"\u2581", "\u2582", "\u2583", "\u2584",
                                "\u2585", "\u2586", "\u2587", "\u2588"};
  if (v.empty() || width <= 0) return "";
  int cols = std::min<int>(width, static_cast<int>(v.size()));
  std::vector<double> col(static_cast<size_t>(cols), -1);
  for (int c = 0; c < cols; ++c) {
    size_t from = v.size() * static_cast<size_t>(c) / static_cast<size_t>(cols);
    size_t to = v.size() * static_cast<size_t>(c + 1) / static_cast<size_t>(cols);
    double sum = 0;
    int n = 0;
    for (size_t k = from; k < to; ++k)
      if (v[k] >= 0) {
        sum += v[k];
        ++n;
      }
    if (n) col[static_cast<size_t>(c)] = sum / n;
  }
  double lo = 1e300, hi = -1e300;
  for (double x : col)
    if (x >= 0) {
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
  std::string s;
  for (double x : col) {
    if (x < 0) {
      s += ' ';
      continue;
    }
    int k = hi > lo ? static_cast<int>((x - lo) / (hi - lo) * 7.0 + 0.5) : 3;
    s += kBars[std::clamp(k, 0, 7)];
  }
  return s;
}

std::vector<std::string> history_events(const std::vector<HealthSample>& s, int64_t interval_ms) {
  std::vector<std::string> ev;
  for (size_t k = 0; k < s.size(); ++k) {
    const auto& c = s[k];
    std::string at = clock_text(c.time_ms);
    if (k == 0) {
      ev.push_back(fmt::format("{} first sample: {}, ranks alive {}", at, state_text(c.state),
                               ranks_text(c.ranks_alive)));
      continue;
    }
    const auto& p = s[k - 1];
    if (c.boot_id != p.boot_id && !c.boot_id.empty())
      ev.push_back(fmt::format("{} REBOOT: new boot id {} (last sample of the previous boot {})",
                               at, c.boot_id.substr(0, 8), clock_text(p.time_ms)));
    else if (interval_ms > 0 && c.time_ms - p.time_ms > 3 * interval_ms)
      ev.push_back(
          fmt::format("{} GAP of {} s without samples since {} (sparkd down, or the "
                      "host froze)",
                      at, (c.time_ms - p.time_ms) / 1000, clock_text(p.time_ms)));
    uint32_t lost = p.ranks_alive & ~c.ranks_alive, back = c.ranks_alive & ~p.ranks_alive;
    if (lost) ev.push_back(fmt::format("{} LOST rank(s) {}", at, ranks_text(lost)));
    if (back) ev.push_back(fmt::format("{} rank(s) {} alive again", at, ranks_text(back)));
    if (c.state != p.state)
      ev.push_back(fmt::format("{} {} -> {}{}", at, state_text(p.state), state_text(c.state),
                               c.reason.empty() ? "" : ": " + c.reason));
    auto slow = [](uint64_t r) {
      return r == HealthSample::kUnknownThrottle ? uint64_t{0} : r & env::throttle::kSlowdown;
    };
    if (slow(c.throttle_reasons) && slow(c.throttle_reasons) != slow(p.throttle_reasons))
      ev.push_back(fmt::format("{} THROTTLE: {} (SM {} MHz of {}, {} W)", at,
                               env::throttle_names(slow(c.throttle_reasons)), c.sm_clock_mhz,
                               c.sm_clock_max_mhz, c.power_mw / 1000.0));
  }
  return ev;
}

std::string render_history(const std::vector<RankHistory>& hs, int64_t interval_ms, int width) {
  std::string out;
  for (const auto& h : hs) {
    if (!h.error.empty() && h.samples.empty()) {
      out += fmt::format("rank {} on {}: no history: {}\n\n", h.rank, h.node, h.error);
      continue;
    }
    const auto& s = h.samples;
    if (s.empty()) {
      out += fmt::format("rank {} on {}: no samples in that window\n\n", h.rank, h.node);
      continue;
    }
    out += fmt::format("rank {} on {}: {} samples, {} .. {}\n", h.rank, h.node, s.size(),
                       clock_text(s.front().time_ms), clock_text(s.back().time_ms));
    struct Series {
      const char* name;
      double (*get)(const HealthSample&);
      const char* unit;
      double scale;
    };
    static const Series kSeries[] = {
        {"MemAvailable", [](const HealthSample& x) { return double(x.mem_available); }, "GiB",
         1.0 / (1 << 30)},
        {"MemFree", [](const HealthSample& x) { return double(x.mem_free); }, "GiB",
         1.0 / (1 << 30)},
        {"page cache", [](const HealthSample& x) { return double(x.page_cache); }, "GiB",
         1.0 / (1 << 30)},
        {"PSI memory", [](const HealthSample& x) { return x.psi_mem_some; }, "%", 1},
        {"PSI cpu", [](const HealthSample& x) { return x.psi_cpu_some; }, "%", 1},
        {"PSI io", [](const HealthSample& x) { return x.psi_io_some; }, "%", 1},
        {"SM clock", [](const HealthSample& x) { return double(x.sm_clock_mhz); }, "MHz", 1},
        {"power", [](const HealthSample& x) { return double(x.power_mw); }, "W", 1e-3},
        {"temperature", [](const HealthSample& x) { return double(x.temp_c); }, "C", 1},
        {"GPU memory", [](const HealthSample& x) { return double(x.gpu_mem_used); }, "GiB",
         1.0 / (1 << 30)},
        {"tokens/s", [](const HealthSample& x) { return x.tokens_per_s; }, "", 1},
        {"step age", [](const HealthSample& x) { return double(x.step_age_ms); }, "s", 1e-3},
        {"ranks alive",
         [](const HealthSample& x) { return double(__builtin_popcount(x.ranks_alive)); }, "", 1},
    };
    for (const auto& ser : kSeries) {
      std::vector<double> v;
      double lo = 1e300, hi = -1e300, last = -1;
      for (const auto& x : s) {
        double y = ser.get(x);
        v.push_back(y);
        if (y >= 0) {
          lo = std::min(lo, y);
          hi = std::max(hi, y);
          last = y;
        }
      }
      if (last < 0) {
        out += fmt::format("  {:<13} n/a\n", ser.name);
        continue;
      }
      out += fmt::format("  {:<13} {}  last {:.1f}{} (min {:.1f}, max {:.1f})\n", ser.name,
                         sparkline(v, width), last * ser.scale, ser.unit, lo * ser.scale,
                         hi * ser.scale);
    }
    auto ev = history_events(s, interval_ms);
    if (!ev.empty()) out += "  events:\n";
    for (const auto& e : ev) out += "    " + e + "\n";
    out += "\n";
  }
  return out;
}

json to_json(const std::vector<RankHistory>& hs, int64_t interval_ms) {
  json ranks = json::array();
  for (const auto& h : hs) {
    json samples = json::array();
    for (const auto& s : h.samples) samples.push_back(to_json(s));
    json e{{"rank", h.rank},
           {"node", h.node},
           {"samples", samples},
           {"events", history_events(h.samples, interval_ms)}};
    if (!h.error.empty()) e["error"] = h.error;
    ranks.push_back(e);
  }
  return {{"interval_ms", interval_ms}, {"ranks", ranks}};
}

}  // namespace spark::cli
