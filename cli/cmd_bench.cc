// sparkctl bench [--base URL] ...   and   sparkctl bench compare A B ...
#include "cli/cmd_bench.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <ostream>

#include "cli/args.h"
#include "cli/bench.h"
#include "core/json_text.h"
#include "core/strings.h"

namespace spark::cli {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

Result<std::vector<int>> int_list(const std::string& opt, const std::string& s) {
  std::vector<int> out;
  for (const auto& p : split_list(s)) {
    std::string t = p;
    uint64_t mult = 1;
    if (!t.empty() && (t.back() == 'k' || t.back() == 'K')) {
      mult = 1024;
      t.pop_back();
    }
    auto v = parse_u64(t);
    if (!v || *v == 0 || *v * mult > (1u << 24))
      return make_error(
          Errc::usage,
          fmt::format("{}: '{}' is not a token count (e.g. 1k,8k,32k or 1024)", opt, p));
    out.push_back(static_cast<int>(*v * mult));
  }
  if (out.empty()) return make_error(Errc::usage, opt + ": empty list");
  return out;
}

Result<milliseconds> duration(const std::string& opt, const std::string& s) {
  std::string why;
  auto v = parse_duration_ms(s, &why);
  if (!v || *v == 0)
    return make_error(Errc::usage,
                      fmt::format("{} {}: {}", opt, s, why.empty() ? "must be above 0" : why));
  return milliseconds(*v);
}

int cmd_compare(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("bench compare options");
  desc.add_options()("results", po::value<std::vector<std::string>>(),
                     "result files or --out directories")(
      "svg", po::value<std::string>()->default_value("bench-compare.svg"),
      "where to write the chart ('' for none)");
  po::positional_options_description pos;
  pos.add("results", -1);
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "bench compare", "bench compare RESULT RESULT... [--svg FILE]",
                           desc, args, vm, &pos))
    return *rc;
  if (!vm.count("results"))
    return ctx.fail(make_error(Errc::usage,
                               "bench compare: name the results to compare (files "
                               "or directories written by bench --out)"));
  std::vector<bench::json> rs;
  for (const auto& p : vm["results"].as<std::vector<std::string>>()) {
    auto r = bench::load_result(p);
    if (!r) return ctx.fail(r.error());
    rs.push_back(std::move(*r));
  }
  std::string svg = vm["svg"].as<std::string>();
  if (!svg.empty()) {
    std::string why;
    if (!write_file_atomic(svg, bench::compare_svg(rs), &why))
      return ctx.fail(make_error(Errc::io, fmt::format("bench compare: writing {}: {}", svg, why)));
  }
  if (ctx.opts.json) {
    bench::json j = {{"arms", bench::json::array()}, {"metrics", bench::json::array()}};
    for (const auto& r : rs) j["arms"].push_back(r.value("label", ""));
    for (const auto& m : bench::compare_metrics(rs)) {
      bench::json vals = bench::json::array();
      for (const auto& v : m.values) vals.push_back(v ? bench::json(*v) : bench::json(nullptr));
      j["metrics"].push_back({{"name", m.name},
                              {"unit", m.unit},
                              {"higher_is_better", m.higher_better},
                              {"values", vals}});
    }
    if (!svg.empty()) j["svg"] = svg;
    *ctx.out << dump_json(j, 2) << "\n";
  } else {
    *ctx.out << bench::format_compare(rs);
    if (!svg.empty()) *ctx.out << "# chart: " << svg << "\n";
  }
  return 0;
}

}  // namespace

int cmd_bench(Context& ctx, const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "compare")
    return cmd_compare(ctx, std::vector<std::string>(args.begin() + 1, args.end()));
  bench::Options o;
  po::options_description desc("bench options");
  std::string all = join(bench::section_names(), ",");
  desc.add_options()("base", po::value<std::string>(),
                     "OpenAI-compatible base URL (default: rank 0 of the ring)")(
      "model", po::value<std::string>(), "model id (default: the first of /v1/models)")(
      "api-key-file", po::value<std::string>(), "file holding the API key (default: API_KEY_FILE)")(
      "sections", po::value<std::string>(), ("comma list of: " + all).c_str())(
      "runs", po::value<int>()->default_value(3), "runs per figure (median, min, max)")(
      "out", po::value<std::string>(), "directory for bench.json and bench.txt")(
      "label", po::value<std::string>(), "this arm's name in bench compare")(
      "temperature", po::value<double>()->default_value(0.0), "sampling temperature")(
      "thinking", po::value<std::string>()->default_value("off"),
      "on|off: chat_template_kwargs.enable_thinking")(
      "max-tokens", po::value<int>()->default_value(256), "tokens per C1/C8 reply")(
      "concurrency", po::value<int>()->default_value(8), "streams of the C8 section")(
      "ttft-samples", po::value<int>()->default_value(16), "requests of the TTFT section")(
      "prefill-sizes", po::value<std::string>()->default_value("1k,8k,32k"),
      "cold prefill prompt sizes in tokens (up to 128k and more)")(
      "prefix-tokens", po::value<int>()->default_value(8192),
      "shared prefix of the prefix-cache section")("long-tokens",
                                                   po::value<int>()->default_value(32768),
                                                   "the long prefill a short request runs beside")(
      "known-answers", po::value<std::string>(),
      "known-answer set (JSONL; default: the shipped set)")(
      "tool-calls", po::value<int>()->default_value(10), "requests of the tool-call gate")(
      "count-to", po::value<int>()->default_value(200), "the count gate's last number")(
      "thinking-max-tokens", po::value<int>()->default_value(2048),
      "max_tokens of gate requests with thinking on")(
      "gate-max-tokens", po::value<int>()->default_value(0),
      "cap on the max_tokens of every gate request (0: none; a quick smoke run)")(
      "timeout", po::value<std::string>()->default_value("120s"),
      "most wait for a reply's headers")("stall", po::value<std::string>()->default_value("60s"),
                                         "most silence inside a stream")(
      "request-timeout", po::value<std::string>()->default_value("15m"),
      "most time of one request")("mem-min", po::value<std::string>(),
                                  "memory guard floor (default: BENCH_MEM_MIN)")(
      "mem-interval", po::value<std::string>()->default_value("5s"),
      "MemAvailable sampling interval")("no-memory",
                                        "do not sample the nodes' memory (and no memory guard)");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "bench",
                           "bench [--base URL] [--model M] [--sections LIST] [--runs N] "
                           "[--out DIR] | bench compare RESULT...",
                           desc, args, vm))
    return *rc;
  auto geti = [&](const char* k, int lo) -> Result<int> {
    int v = vm[k].as<int>();
    if (v < lo)
      return make_error(Errc::usage, fmt::format("--{} {}: must be at least {}", k, v, lo));
    return v;
  };
  struct IntOpt {
    const char* name;
    int* dst;
    int lo;
  };
  for (const IntOpt& io :
       {IntOpt{"runs", &o.runs, 1}, IntOpt{"max-tokens", &o.decode_tokens, 2},
        IntOpt{"concurrency", &o.concurrency, 1}, IntOpt{"ttft-samples", &o.ttft_samples, 1},
        IntOpt{"prefix-tokens", &o.prefix_tokens, 16}, IntOpt{"long-tokens", &o.long_tokens, 16},
        IntOpt{"tool-calls", &o.tool_calls, 1}, IntOpt{"count-to", &o.count_to, 2},
        IntOpt{"thinking-max-tokens", &o.thinking_max_tokens, 16},
        IntOpt{"gate-max-tokens", &o.gate_max_tokens, 0}}) {
    auto v = geti(io.name, io.lo);
    if (!v) return ctx.fail(v.error());
    *io.dst = *v;
  }
  if (o.runs == 1)
    *ctx.err << "sparkctl: warning: --runs 1: one sample per figure, so the machine's noise "
                "goes unseen; use --runs 3 or more to compare servers\n";
  o.temperature = vm["temperature"].as<double>();
  if (o.temperature < 0 || o.temperature > 2)
    return ctx.fail(make_error(Errc::usage, "--temperature: between 0 and 2"));
  std::string th = vm["thinking"].as<std::string>();
  if (th != "on" && th != "off")
    return ctx.fail(make_error(Errc::usage, "--thinking " + th + ": on or off"));
  o.thinking = th == "on";
  auto sizes = int_list("--prefill-sizes", vm["prefill-sizes"].as<std::string>());
  if (!sizes) return ctx.fail(sizes.error());
  o.prefill_sizes = *sizes;
  if (vm.count("sections")) {
    for (const auto& s : split_list(vm["sections"].as<std::string>())) {
      const auto& names = bench::section_names();
      if (std::find(names.begin(), names.end(), s) == names.end()) {
        std::string dym = did_you_mean(s, names);
        return ctx.fail(make_error(
            Errc::usage, fmt::format("--sections: no section '{}'{}; the sections: {}", s,
                                     dym.empty() ? "" : " (did you mean '" + dym + "'?)", all)));
      }
      o.sections.push_back(s);
    }
  }
  for (auto [opt, dst] :
       {std::pair{"timeout", &o.dl.headers}, std::pair{"stall", &o.dl.idle},
        std::pair{"request-timeout", &o.dl.total}, std::pair{"mem-interval", &o.mem_interval}}) {
    auto d = duration(std::string("--") + opt, vm[opt].as<std::string>());
    if (!d) return ctx.fail(d.error());
    *dst = *d;
  }
  if (vm.count("model")) o.model = vm["model"].as<std::string>();
  if (vm.count("label")) o.label = vm["label"].as<std::string>();

  // The ring: the default endpoint, the API key, the nodes whose memory is sampled.
  std::vector<Diagnostic> diags;
  auto cfg = ctx.load_config(vm.count("base") ? &diags : nullptr);
  if (!vm.count("base") && !cfg) return ctx.fail(cfg.error());
  std::string base;
  if (vm.count("base")) {
    base = vm["base"].as<std::string>();
  } else {
    const auto& n0 = cfg->nodes.at(0);
    std::string host = cfg->get("API_BIND");
    bool loopback = host.empty() || host == "0.0.0.0" || starts_with(host, "127.");
    if (loopback && !n0.local) {
      if (host != "0.0.0.0")
        return ctx.fail(make_error(
            Errc::config,
            fmt::format("rank 0 ({}) serves on {} (API_BIND), which the head cannot reach; "
                        "pass --base http://HOST:{}/v1 or set API_BIND to an address of {}",
                        n0.name, host.empty() ? "127.0.0.1" : host, cfg->get("API_PORT"),
                        n0.name)));
      host = n0.ssh_host;
    } else if (loopback) {
      host = "127.0.0.1";
    }
    base = fmt::format("http://{}:{}/v1", host, cfg->get("API_PORT"));
  }
  auto ep = bench::parse_base(base);
  if (!ep) return ctx.fail(ep.error());
  o.ep = *ep;
  std::string key_file = vm.count("api-key-file") ? vm["api-key-file"].as<std::string>()
                         : cfg                    ? cfg->get("API_KEY_FILE")
                                                  : "";
  if (!key_file.empty()) {
    auto k = read_api_key_file(key_file);
    if (!k) return ctx.fail(k.error());
    o.ep.api_key = *k;
  }
  std::string mem_min = vm.count("mem-min")                   ? vm["mem-min"].as<std::string>()
                        : cfg                                 ? cfg->get("BENCH_MEM_MIN")
                        : ctx.env.vars.count("BENCH_MEM_MIN") ? ctx.env.vars.at("BENCH_MEM_MIN")
                                                              : "2GiB";
  {
    std::string why;
    auto v = parse_size(mem_min, &why);
    if (!v)
      return ctx.fail(make_error(Errc::usage, "BENCH_MEM_MIN / --mem-min " + mem_min + ": " + why));
    o.mem_min = *v;
  }
  bench::MemorySource mem;
  if (vm.count("no-memory")) {
    mem.why_none = "--no-memory";
  } else if (cfg) {
    for (const auto& n : cfg->nodes) mem.runners.push_back(make_runner(*cfg, n));
  } else if (o.ep.host == "127.0.0.1" || o.ep.host == "localhost") {
    mem.runners.push_back(make_local_runner("local"));
  } else {
    mem.why_none =
        "no cluster file (" + cfg.error().message + "): the nodes behind " + base + " are unknown";
  }
  o.known_answers = vm.count("known-answers") ? vm["known-answers"].as<std::string>()
                                              : bench::shipped_known_answers(ctx.argv0);
  if (o.known_answers.empty() &&
      (o.sections.empty() ||
       std::find(o.sections.begin(), o.sections.end(), "known_answers") != o.sections.end()))
    return ctx.fail(make_error(Errc::not_found,
                               "the shipped known-answer set (share/sparkctl/bench/"
                               "known-answers.jsonl beside sparkctl) is missing; reinstall, or "
                               "pass --known-answers FILE"));
  std::string out_dir = vm.count("out") ? vm["out"].as<std::string>() : "";
  if (!out_dir.empty()) {
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    if (ec)
      return ctx.fail(make_error(Errc::io, fmt::format("--out {}: {}", out_dir, ec.message())));
  }

  const bool tty = ::isatty(STDERR_FILENO) != 0;
  std::ostream& err = *ctx.err;
  auto progress = [&](const std::string& s) {
    if (tty || ctx.opts.verbose > 0) err << "bench: " << s << std::endl;
  };
  bench::json res = bench::run(o, mem, progress);
  std::string table = bench::format_table(res);
  if (!out_dir.empty()) {
    std::string why;
    for (auto [name, text] :
         {std::pair{"bench.json", dump_json(res, 2) + "\n"}, std::pair{"bench.txt", table}})
      if (!write_file_atomic((fs::path(out_dir) / name).string(), text, &why))
        return ctx.fail(
            make_error(Errc::io, fmt::format("--out {}: writing {}: {}", out_dir, name, why)));
  }
  if (ctx.opts.json)
    *ctx.out << dump_json(res, 2) << "\n";
  else
    *ctx.out << table;
  return bench::result_exit_code(res);
}

}  // namespace spark::cli
