// sparkctl evict [PATHS] [--local]   and   sparkctl cache-stat PATHS [-v]
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/cmd_stage.h"
#include "cli/node_exec.h"
#include "core/pagecache.h"
#include "core/process.h"
#include "core/strings.h"
#include "env/meminfo.h"

namespace spark::cli {
namespace {

using json = nlohmann::json;

// One node's eviction as JSON (what `evict --local --json` prints and the head merges).
Result<json> evict_here(const std::vector<std::string>& paths, const std::string& node) {
  auto mem0 = env::read_meminfo("/");
  auto rep = evict_page_cache(paths, "/");
  if (!rep) return rep.error();
  auto mem1 = env::read_meminfo("/");
  json j;
  j["node"] = node;
  j["ok"] = rep->problems() == 0;
  j["paths"] = paths;
  j["total_bytes"] = rep->total_bytes;
  j["bytes_before"] = rep->bytes_before;
  j["bytes_after"] = rep->bytes_after;
  j["seconds"] = rep->seconds;
  if (mem0 && mem1) {
    j["mem_free_before"] = mem0->get("MemFree");
    j["mem_free_after"] = mem1->get("MemFree");
    j["mem_available_before"] = mem0->get("MemAvailable");
    j["mem_available_after"] = mem1->get("MemAvailable");
  }
  j["files"] = json::array();
  for (const auto& f : rep->files) {
    json jf = {{"path", f.path},
               {"size", f.size},
               {"resident_before", f.resident_before},
               {"resident_after", f.resident_after},
               {"synced", f.synced},
               {"status", f.status}};
    if (!f.reason.empty()) jf["reason"] = f.reason;
    for (const auto& m : f.mapped_by) jf["mapped_by"].push_back({{"pid", m.pid}, {"comm", m.comm}});
    j["files"].push_back(std::move(jf));
  }
  j["skipped"] = rep->skipped;
  return j;
}

void print_node(std::ostream& out, const json& n, int verbose) {
  auto sz = [&](const char* k) { return format_size(n.value(k, uint64_t{0})); };
  if (n.contains("error")) {
    out << fmt::format("{}: FAILED: {}\n", n.value("node", "?"), n["error"].get<std::string>());
    return;
  }
  out << fmt::format("{}: resident {} -> {} of {} in {} files ({:.2f} s)", n.value("node", "?"),
                     sz("bytes_before"), sz("bytes_after"), sz("total_bytes"), n["files"].size(),
                     n.value("seconds", 0.0));
  if (n.contains("mem_free_before"))
    out << fmt::format("; MemFree {} -> {}, MemAvailable {} -> {}", sz("mem_free_before"),
                       sz("mem_free_after"), sz("mem_available_before"), sz("mem_available_after"));
  out << "\n";
  for (const auto& f : n["files"]) {
    bool problem = f.value("status", "") != "evicted";
    if (!problem && verbose == 0) continue;
    out << fmt::format("  {:<10} {}  {} -> {}{}\n", f.value("status", ""), f.value("path", ""),
                       format_size(f.value("resident_before", uint64_t{0})),
                       format_size(f.value("resident_after", uint64_t{0})),
                       f.contains("reason") ? "  (" + f["reason"].get<std::string>() + ")" : "");
  }
}

}  // namespace

int cmd_evict(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("evict options");
  desc.add_options()("paths", po::value<std::vector<std::string>>(), "files or directories")(
      "local", "only this machine, no cluster file (what evict runs on each node)")(
      "node", po::value<std::string>()->default_value("local"), "name for this machine in reports");
  po::positional_options_description pos;
  pos.add("paths", -1);
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "evict", "evict [PATHS...] [--local]", desc, args, vm, &pos))
    return *rc;
  std::vector<std::string> paths;
  if (vm.count("paths")) paths = vm["paths"].as<std::vector<std::string>>();
  std::vector<json> nodes;
  if (vm.count("local") || !paths.empty()) {
    // Explicit paths are paths on this machine.
    if (paths.empty())
      return ctx.fail(make_error(Errc::usage, "evict --local: name the files or directories"));
    auto j = evict_here(paths, vm["node"].as<std::string>());
    if (!j) return ctx.fail(j.error());
    nodes.push_back(std::move(*j));
  } else {
    auto cfg = ctx.load_config();
    if (!cfg) return ctx.fail(cfg.error());
    std::vector<NodeJob> jobs;
    for (const auto& n : cfg->nodes) {
      if (n.model_path.empty())
        return ctx.fail(make_error(Errc::config, fmt::format("{}: no model path (set MODEL_PATH "
                                                             "or NODE{}_MODEL_PATH)",
                                                             n.name, n.index)));
      jobs.push_back(
          {n.index,
           fmt::format("{} evict --local --json --node {} {}", shell_quote(sparkctl_on(*cfg, ctx)),
                       shell_quote(n.name), shell_quote(n.model_path)),
           ""});
    }
    auto results = run_on_nodes(*cfg, jobs, std::chrono::minutes(10));
    for (const auto& r : results) {
      forward_stderr(r);
      json j;
      if (!r.ok()) {
        j = {{"node", r.node}, {"ok", false}, {"error", r.error->message}};
      } else {
        j = json::parse(r.out, nullptr, false);
        if (j.is_discarded() || !j.is_object())
          j = {{"node", r.node},
               {"ok", false},
               {"error", fmt::format("evict exited {} without a report", r.exit_status)}};
        else if (j.contains("error") && j["error"].is_object())
          j = {{"node", r.node},
               {"ok", false},
               {"error", j["error"].value("message", std::string("failed"))}};
      }
      nodes.push_back(std::move(j));
    }
  }
  bool ok = true;
  for (const auto& n : nodes) ok = ok && n.value("ok", false);
  if (ctx.opts.json) {
    if (vm.count("local"))
      *ctx.out << nodes[0].dump(2) << "\n";
    else
      *ctx.out << json{{"ok", ok}, {"nodes", nodes}}.dump(2) << "\n";
  } else {
    for (const auto& n : nodes) print_node(*ctx.out, n, ctx.opts.verbose);
  }
  return ok ? 0 : exit_code(Errc::precondition);
}

int cmd_cache_stat(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("cache-stat options");
  desc.add_options()("paths", po::value<std::vector<std::string>>(), "files or directories");
  po::positional_options_description pos;
  pos.add("paths", -1);
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "cache-stat", "cache-stat PATHS... [-v]", desc, args, vm, &pos))
    return *rc;
  if (!vm.count("paths"))
    return ctx.fail(make_error(Errc::usage, "cache-stat: name the files or directories"));
  std::vector<std::string> skipped;
  auto files = expand_regular_files(vm["paths"].as<std::vector<std::string>>(), &skipped);
  if (!files) return ctx.fail(files.error());
  const bool map = ctx.opts.verbose > 0 && !ctx.opts.json;
  uint64_t pages = 0, resident = 0, bytes = 0, rbytes = 0;
  json jf = json::array();
  int errors = 0;
  for (const auto& p : *files) {
    auto r = file_residency(p, map);
    if (!r) {
      ++errors;
      if (ctx.opts.json)
        jf.push_back({{"path", p}, {"error", r.error().message}});
      else
        *ctx.err << "sparkctl: cache-stat: " << r.error().message << "\n";
      continue;
    }
    pages += r->pages;
    resident += r->resident_pages;
    bytes += r->size;
    rbytes += r->resident_bytes();
    if (ctx.opts.json) {
      jf.push_back({{"path", p},
                    {"size", r->size},
                    {"pages", r->pages},
                    {"resident_pages", r->resident_pages},
                    {"resident_bytes", r->resident_bytes()}});
      continue;
    }
    double pct =
        r->pages ? 100.0 * static_cast<double>(r->resident_pages) / static_cast<double>(r->pages)
                 : 0.0;
    std::string bar;
    if (map) {
      // One character per 1/60 of the file: 'O' all resident, 'o' some, ' ' none.
      const uint64_t cols = 60;
      bar = " [";
      for (uint64_t c = 0; c < cols; ++c) {
        uint64_t a = r->pages * c / cols, b = std::max(a + 1, r->pages * (c + 1) / cols);
        uint64_t in = 0;
        for (uint64_t i = a; i < b && i < r->pages; ++i) in += r->map[i];
        bar += r->pages == 0 ? ' ' : in == 0 ? ' ' : in == b - a ? 'O' : 'o';
      }
      bar += "]";
    }
    *ctx.out << fmt::format("{:>10}/{:<10} {:5.1f}%  {:>10}  {}{}\n", r->resident_pages, r->pages,
                            pct, format_size(r->resident_bytes()), p, bar);
  }
  if (ctx.opts.json) {
    *ctx.out << json{{"files", jf},    {"total_bytes", bytes},       {"resident_bytes", rbytes},
                     {"pages", pages}, {"resident_pages", resident}, {"skipped", skipped}}
                    .dump(2)
             << "\n";
  } else {
    double pct = pages ? 100.0 * static_cast<double>(resident) / static_cast<double>(pages) : 0;
    *ctx.out << fmt::format("# {} files, {} pages, {} resident ({:.1f}%, {} of {})\n",
                            files->size(), pages, resident, pct, format_size(rbytes),
                            format_size(bytes));
  }
  return errors ? exit_code(Errc::io) : 0;
}

}  // namespace spark::cli
