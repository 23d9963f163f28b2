// The bench's tables, the side-by-side comparison and its SVG chart.
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>

#include "cli/bench.h"
#include "core/strings.h"

namespace spark::cli::bench {

namespace fs = std::filesystem;

namespace {

// The value at a path of keys, or null.
const json* at(const json& j, std::initializer_list<const char*> path) {
  const json* p = &j;
  for (const char* k : path) {
    if (!p->is_object() || !p->contains(k)) return nullptr;
    p = &(*p)[k];
  }
  return p;
}

std::optional<double> num(const json& j, std::initializer_list<const char*> path) {
  const json* p = at(j, path);
  if (!p || !p->is_number()) return std::nullopt;
  return p->get<double>();
}

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '&')
      o += "&amp;";
    else if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '"')
      o += "&quot;";
    else
      o += c;
  }
  return o;
}

std::string fmt_value(std::optional<double> v, const std::string& unit) {
  if (!v) return "-";
  if (unit == "GiB") return fmt::format("{:.2f}", *v);
  if (unit == "%") return fmt::format("{:.1f}", *v);
  if (unit == "s") return fmt::format("{:.3f}", *v);
  if (unit == "pass") return *v >= 1 ? "pass" : "FAIL";
  return fmt::format("{:.1f}", *v);
}

}  // namespace

std::string concurrency_label(const std::vector<json>& rs) {
  std::vector<std::string> seen;
  for (const auto& r : rs)
    if (const json* c = at(r, {"sections", "c8", "streams"}); c && c->is_number_integer()) {
      std::string n = std::to_string(c->get<int>());
      if (std::find(seen.begin(), seen.end(), n) == seen.end()) seen.push_back(n);
    }
  return seen.empty() ? "C8" : "C" + join(seen, "/C");
}

std::vector<Metric> compare_metrics(const std::vector<json>& rs) {
  std::vector<Metric> m;
  auto add = [&](std::string name, std::string unit, bool hb, bool chart, auto get) {
    Metric x{std::move(name), std::move(unit), hb, chart, {}};
    bool any = false;
    for (const auto& r : rs) {
      x.values.push_back(get(r));
      any = any || x.values.back().has_value();
    }
    if (any) m.push_back(std::move(x));
  };
  add("C1 decode", "tok/s", true, true, [](const json& r) {
    return num(r, {"sections", "c1", "tokens_per_s", "median"});
  });
  // The concurrent section's rows say the concurrency each arm ran (--concurrency).
  const std::string cn = concurrency_label(rs);
  add(cn + " aggregate", "tok/s", true, true, [](const json& r) {
    return num(r, {"sections", "c8", "aggregate_tokens_per_s", "median"});
  });
  add(cn + " per stream", "tok/s", true, true, [](const json& r) {
    return num(r, {"sections", "c8", "per_stream_tokens_per_s", "median"});
  });
  add("TTFT p50", "s", false, true, [](const json& r) {
    return num(r, {"sections", "ttft", "p50_s"});
  });
  add("TTFT p95", "s", false, false, [](const json& r) {
    return num(r, {"sections", "ttft", "p95_s"});
  });
  add("TTFT max", "s", false, false, [](const json& r) {
    return num(r, {"sections", "ttft", "max_s"});
  });
  // Prefill rows: every size any arm measured.
  std::vector<int> sizes;
  for (const auto& r : rs)
    if (const json* s = at(r, {"sections", "prefill", "sizes"}); s && s->is_array())
      for (const auto& e : *s)
        if (e.contains("target_tokens") &&
            std::find(sizes.begin(), sizes.end(), e["target_tokens"].get<int>()) == sizes.end())
          sizes.push_back(e["target_tokens"].get<int>());
  std::sort(sizes.begin(), sizes.end());
  for (int size : sizes)
    add(fmt::format("prefill {}", size), "tok/s", true, true,
        [size](const json& r) -> std::optional<double> {
          const json* s = at(r, {"sections", "prefill", "sizes"});
          if (!s || !s->is_array()) return std::nullopt;
          for (const auto& e : *s)
            if (e.value("target_tokens", 0) == size) return num(e, {"tokens_per_s", "median"});
          return std::nullopt;
        });
  add("prefix hit rate", "%", true, false, [](const json& r) -> std::optional<double> {
    auto v = num(r, {"sections", "prefix_cache", "hit_rate", "median"});
    return v ? std::optional<double>(*v * 100) : std::nullopt;
  });
  add("prefix follow-up TTFT", "s", false, false, [](const json& r) {
    return num(r, {"sections", "prefix_cache", "followup_ttft_s", "median"});
  });
  add("short TTFT during long", "s", false, false, [](const json& r) {
    return num(r, {"sections", "short_during_long", "short_ttft_s", "median"});
  });
  add("lowest MemAvailable", "GiB", true, false, [](const json& r) -> std::optional<double> {
    auto v = num(r, {"memory", "min_available_bytes"});
    return v ? std::optional<double>(*v / (1024.0 * 1024 * 1024)) : std::nullopt;
  });
  for (const char* g : {"known_answers", "count", "rare_tokens", "tool_calls", "determinism"})
    add(fmt::format("gate {}", g), "pass", true, false,
        [g](const json& r) -> std::optional<double> {
          const json* p = at(r, {"gates", g, "pass"});
          if (!p || !p->is_boolean()) return std::nullopt;
          return p->get<bool>() ? 1.0 : 0.0;
        });
  return m;
}

std::string format_table(const json& r) {
  std::string o;
  o += fmt::format("# sparkctl bench: {} (model {}, server version {})\n", r.value("base", ""),
                   r.contains("server") ? r["server"].value("model_id", "?") : "?",
                   r.contains("server") && r["server"]["version"].is_string()
                       ? r["server"]["version"].get<std::string>()
                       : "unknown");
  if (r.contains("protocol")) {
    const auto& p = r["protocol"];
    auto s = [](const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
    o += fmt::format("# runs {}, temperature {}, thinking {}, ignore_eos: {}\n", p.value("runs", 0),
                     p.value("temperature", 0.0), p.value("thinking", false) ? "on" : "off",
                     p.contains("ignore_eos") ? s(p["ignore_eos"]) : "?");
    if (p.value("runs", 0) == 1)
      o += "# warning: --runs 1: one sample per figure, so median, min and max are that sample "
           "and the machine's noise goes unseen; use --runs 3 or more to compare servers\n";
    if (p.contains("chat_template_kwargs"))
      o += fmt::format("# chat_template_kwargs: {}\n", s(p["chat_template_kwargs"]));
  }
  if (r.contains("error"))
    o += fmt::format("# FAILED before the sections: {}\n", r["error"].value("message", ""));
  o += fmt::format("# {:<26} {:>12} {:>10} {:>10}  {}\n", "figure", "median", "min", "max", "unit");
  auto row = [&](const std::string& name, const json* st, const char* unit) {
    if (!st || !st->is_object()) return;
    o += fmt::format("  {:<26} {:>12.3f} {:>10.3f} {:>10.3f}  {}\n", name, st->value("median", 0.0),
                     st->value("min", 0.0), st->value("max", 0.0), unit);
  };
  const json& S = r.contains("sections") ? r["sections"] : json::object();
  auto err = [&](const std::string& name, const json& v) {
    if (v.contains("error"))
      o += fmt::format("  {:<26} ERROR: {}\n", name, v["error"].value("message", ""));
    if (v.contains("skipped"))
      o += fmt::format("  {:<26} skipped: {}\n", name, v["skipped"].get<std::string>());
  };
  for (const auto& [k, v] : S.items()) err(k, v);
  row("C1 decode", at(S, {"c1", "tokens_per_s"}), "tok/s");
  const std::string cn = concurrency_label(std::vector<json>{r});
  row(cn + " aggregate", at(S, {"c8", "aggregate_tokens_per_s"}), "tok/s");
  row(cn + " per stream", at(S, {"c8", "per_stream_tokens_per_s"}), "tok/s");
  if (const json* t = at(S, {"ttft"}); t && t->contains("p50_s"))
    o += fmt::format("  {:<26} {:>12.3f} {:>10} {:>10.3f}  s (p95 {:.3f}, {} samples)\n",
                     "TTFT p50 / max", (*t)["p50_s"].get<double>(), "", (*t)["max_s"].get<double>(),
                     (*t)["p95_s"].get<double>(), (*t)["samples"].get<int>());
  if (const json* s = at(S, {"prefill", "sizes"}); s && s->is_array())
    for (const auto& e : *s) {
      std::string name = fmt::format("prefill {}", e.value("target_tokens", 0));
      if (e.contains("skipped"))
        o += fmt::format("  {:<26} skipped: {}\n", name, e["skipped"].get<std::string>());
      else if (e.contains("noise"))
        o += fmt::format("  {:<26} noise: {}\n", name, e["noise"].get<std::string>());
      else
        row(name + fmt::format(" ({} tok)", e.value("prompt_tokens", 0)), at(e, {"tokens_per_s"}),
            "tok/s");
    }
  if (const json* p = at(S, {"prefix_cache"}); p && p->contains("cold_ttft_s")) {
    row("prefix cold TTFT", at(*p, {"cold_ttft_s"}), "s");
    row("prefix follow-up TTFT", at(*p, {"followup_ttft_s"}), "s");
    if ((*p)["hit_rate"].is_object())
      row("prefix hit rate", at(*p, {"hit_rate"}), "fraction");
    else
      o += fmt::format("  {:<26} unknown: {}\n", "prefix hit rate", p->value("note", ""));
  }
  if (const json* p = at(S, {"short_during_long"}); p && p->contains("short_ttft_s")) {
    row("short TTFT during long", at(*p, {"short_ttft_s"}), "s");
    row("long prefill TTFT", at(*p, {"long_ttft_s"}), "s");
    o += fmt::format(
        "  {:<26} {:>12}  of {} runs the short request waited for the long prefill{}\n",
        "short blocked", (*p)["blocked_runs"].get<int>(), (*p)["runs"].get<int>(),
        p->value("inconclusive_runs", 0)
            ? fmt::format(" ({} inconclusive: the long prefill ended within 150 ms; raise "
                          "--long-tokens)",
                          p->value("inconclusive_runs", 0))
            : "");
  }
  if (r.contains("memory")) {
    const auto& m = r["memory"];
    if (!m.value("sampled", false))
      o += fmt::format("# memory not sampled: {}\n", m.value("reason", ""));
    else
      for (const auto& n : m["nodes"])
        o += fmt::format("  {:<26} {:>12}  lowest MemAvailable ({} samples){}\n",
                         "memory " + n.value("node", "?"),
                         n["min_available_bytes"].is_number()
                             ? format_size(n["min_available_bytes"].get<uint64_t>())
                             : "-",
                         n.value("samples", 0),
                         n.contains("error") ? "; " + n["error"].get<std::string>() : "");
  }
  const json& G = r.contains("gates") ? r["gates"] : json::object();
  for (const auto& [k, v] : G.items()) {
    if (v.contains("error")) {
      err("gate " + k, v);
      continue;
    }
    std::string detail;
    if (k == "known_answers")
      for (const auto& [m, x] : v["modes"].items())
        detail += x.contains("skipped")
                      ? fmt::format(" {}: skipped;", m)
                      : fmt::format(" {}: {}/{};", m, x["right"].get<int>(), x["total"].get<int>());
    if (k == "tool_calls")
      detail = fmt::format(" {}/{} calls right", v["right"].get<int>(), v["total"].get<int>());
    if (k == "count")
      for (const auto& x : v["runs"])
        if (x.contains("problem")) {
          detail = " " + x["problem"].get<std::string>();
          break;
        }
    if (k == "rare_tokens")
      for (const auto& x : v["probes"])
        if (x.contains("problem")) {
          detail = fmt::format(" {}: {}", x["script"].get<std::string>(),
                               x["problem"].get<std::string>());
          break;
        }
    if (k == "determinism" && v.contains("problem")) detail = " " + v["problem"].get<std::string>();
    o += fmt::format("  {:<26} {:>12} {}\n", "gate " + k, v.value("pass", false) ? "pass" : "FAIL",
                     detail);
  }
  if (r.contains("cancelled") && !r["cancelled"].is_null())
    o += fmt::format("# CANCELLED: {}\n", r["cancelled"].value("reason", ""));
  o += fmt::format("# {}\n", r.value("ok", false) ? "ok" : "NOT ok");
  return o;
}

Result<json> load_result(const std::string& path) {
  std::string file = fs::is_directory(path) ? (fs::path(path) / "bench.json").string() : path;
  auto text = read_file(file);
  if (!text)
    return make_error(Errc::not_found,
                      fmt::format("{}: cannot read it (a result of sparkctl bench --out, or its "
                                  "directory)",
                                  file));
  json j = json::parse(*text, nullptr, false);
  if (!j.is_object() || j.value("schema", "") != "sparkctl-bench/1")
    return make_error(Errc::config, fmt::format("{}: not a sparkctl bench result (no \"schema\": "
                                                "\"sparkctl-bench/1\")",
                                                file));
  if (!j.contains("label")) j["label"] = file;
  return j;
}

std::string format_compare(const std::vector<json>& rs) {
  auto ms = compare_metrics(rs);
  std::string o;
  for (size_t i = 0; i < rs.size(); ++i)
    o += fmt::format("# arm {}: {}\n", static_cast<char>('A' + i), rs[i].value("label", "?"));
  o += fmt::format("# {:<24} {:<6}", "figure", "unit");
  for (size_t i = 0; i < rs.size(); ++i) o += fmt::format(" {:>13}", static_cast<char>('A' + i));
  o += "\n";
  for (const auto& m : ms) {
    std::optional<double> best;
    if (m.unit != "pass")
      for (const auto& v : m.values)
        if (v && (!best || (m.higher_better ? *v > *best : *v < *best))) best = v;
    size_t have =
        std::count_if(m.values.begin(), m.values.end(), [](auto& v) { return v.has_value(); });
    o += fmt::format("  {:<24} {:<6}", m.name, m.unit);
    for (const auto& v : m.values) {
      bool mark = best && v && *v == *best && have > 1;
      o += fmt::format(" {:>12}{}", fmt_value(v, m.unit), mark ? "*" : " ");
    }
    o += "\n";
  }
  o += "# * marks the best value of a row (higher is better, but for times)\n";
  return o;
}

std::string compare_svg(const std::vector<json>& rs) {
  std::vector<Metric> ms;
  for (auto& m : compare_metrics(rs))
    if (m.chart) ms.push_back(std::move(m));
  static const char* colors[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759",
                                 "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"};
  const int arms = static_cast<int>(rs.size());
  const int bar = 22, gap = 26, left = 40, top = 70, plot_h = 260;
  const int group_w = std::max(arms * bar + gap, 100);
  const int width = std::max(520, left * 2 + static_cast<int>(ms.size()) * group_w);
  const int legend_h = 20 * arms;
  const int height = top + plot_h + 70 + legend_h;
  std::ostringstream s;
  s << fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"sans-serif\" font-size=\"11\">\n",
      width, height);
  s << fmt::format("<rect width=\"{}\" height=\"{}\" fill=\"white\"/>\n", width, height);
  s << fmt::format(
      "<text x=\"{}\" y=\"24\" font-size=\"15\" font-weight=\"bold\">sparkctl bench compare"
      "</text>\n",
      left);
  s << fmt::format(
      "<text x=\"{}\" y=\"44\" fill=\"#555\">bars scaled per group to its largest value; for "
      "times the shorter bar is better</text>\n",
      left);
  const int base_y = top + plot_h;
  s << fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#333\"/>\n", left - 5,
                   base_y, width - left + 5, base_y);
  for (size_t g = 0; g < ms.size(); ++g) {
    const auto& m = ms[g];
    double mx = 0;
    for (const auto& v : m.values)
      if (v) mx = std::max(mx, *v);
    int x0 = left + static_cast<int>(g) * group_w + (group_w - arms * bar) / 2;
    for (int a = 0; a < arms; ++a) {
      const auto& v = m.values[static_cast<size_t>(a)];
      int x = x0 + a * bar;
      if (!v) {
        s << fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#999\">-</text>\n",
                         x + bar / 2, base_y - 4);
        continue;
      }
      // Headroom above the tallest bar for its value.
      int h = mx > 0 ? static_cast<int>((plot_h - 50) * (*v / mx)) : 0;
      s << fmt::format(
          "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"><title>{}: {} {}"
          "</title></rect>\n",
          x + 1, base_y - h, bar - 2, h, colors[a % 8],
          esc(rs[static_cast<size_t>(a)].value("label", "")), fmt_value(v, m.unit), esc(m.unit));
      // The value reads upward from just above the bar (anchored at its start, so the
      // rotated text never reaches down into the bar), in the headroom left above it.
      s << fmt::format(
          "<text x=\"{}\" y=\"{}\" text-anchor=\"start\" font-size=\"9\" "
          "transform=\"rotate(-90 {} {})\">{}</text>\n",
          x + bar / 2 + 3, base_y - h - 4, x + bar / 2 + 3, base_y - h - 4, fmt_value(v, m.unit));
    }
    s << fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                     x0 + arms * bar / 2, base_y + 16, esc(m.name));
    s << fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#555\">{}{}</text>\n",
                     x0 + arms * bar / 2, base_y + 30, esc(m.unit),
                     m.higher_better ? "" : ", lower is better");
  }
  for (int a = 0; a < arms; ++a) {
    int y = base_y + 52 + a * 20;
    s << fmt::format("<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/>\n", left,
                     y - 10, colors[a % 8]);
    s << fmt::format("<text x=\"{}\" y=\"{}\">{}: {}</text>\n", left + 18, y,
                     static_cast<char>('A' + a),
                     esc(rs[static_cast<size_t>(a)].value("label", "")));
  }
  s << "</svg>\n";
  return s.str();
}

std::string shipped_known_answers(const std::string& self_exe) {
  std::error_code ec;
  fs::path self = fs::weakly_canonical(self_exe, ec);
  std::vector<fs::path> c;
  if (!ec && !self.empty()) {
    // Installed: PREFIX/bin/sparkctl -> PREFIX/share/...; the build tree: build/cli/sparkctl
    // -> build/share/... (CMake copies the set there).
    c.push_back(self.parent_path().parent_path() / "share/sparkctl/bench/known-answers.jsonl");
  }
  c.emplace_back("/usr/share/sparkctl/bench/known-answers.jsonl");
  c.emplace_back("/usr/local/share/sparkctl/bench/known-answers.jsonl");
  for (const auto& p : c)
    if (fs::is_regular_file(p, ec)) return p.string();
  return "";
}

}  // namespace spark::cli::bench
