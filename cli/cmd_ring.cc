// sparkctl start | stop | restart | status | watch | logs | health-get
#include "cli/cmd_ring.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <thread>

#include "cli/args.h"
#include "cli/engine_pin.h"
#include "cli/history_view.h"
#include "cli/node_exec.h"
#include "cli/ring_ops.h"
#include "core/http_client.h"
#include "core/remote.h"
#include "core/strings.h"

namespace spark::cli {

using nlohmann::json;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

Result<int64_t> duration_arg(const po::variables_map& vm, const char* name) {
  if (!vm.count(name)) return int64_t{-1};
  std::string why;
  auto v = parse_duration_ms(vm[name].as<std::string>(), &why);
  if (!v) return make_error(Errc::usage, fmt::format("--{}: {}", name, why));
  return static_cast<int64_t>(*v);
}

std::string age(int64_t ms_then) {
  if (ms_then <= 0) return "never";
  double s = static_cast<double>(wall_ms() - ms_then) / 1000.0;
  if (s < 120) return fmt::format("{:.0f} s ago", s);
  if (s < 7200) return fmt::format("{:.0f} min ago", s / 60);
  return fmt::format("{:.1f} h ago", s / 3600);
}

std::string size_or(int64_t v) {
  return v < 0 ? "?" : format_size(static_cast<uint64_t>(v));
}

std::string step_line(const StartStep& s) {
  return fmt::format("{:<10} {:<4} {:>6.1f} s  {}\n", s.name, s.ok ? "ok" : "FAIL", s.seconds,
                     s.detail);
}

// start's live progress: each step on stdout as it ends; while the ring comes up, every
// rank's phase, on a terminal as one line rewritten in place (stderr), otherwise as a line
// when it changes, at most every 5 s and at least every 30 s (a log or a mail stays short).
StartProgress live_progress(const Context& ctx) {
  struct State {
    bool tty = false;
    bool shown = false;  // a rewritten line is on the terminal
    std::string last;
    Clock::time_point t0 = Clock::now(), printed{};
  };
  auto st = std::make_shared<State>();
  st->tty = ctx.err == &std::cerr && ::isatty(STDERR_FILENO) == 1;
  StartProgress p;
  std::ostream* out = ctx.out;
  std::ostream* err = ctx.err;
  p.step = [st, out, err](const StartStep& s) {
    if (st->shown) *err << "\r\033[K" << std::flush;
    st->shown = false;
    st->last.clear();
    *out << step_line(s) << std::flush;
  };
  p.waiting = [st, out, err](const std::string& ranks) {
    const auto now = Clock::now();
    const double t = std::chrono::duration<double>(now - st->t0).count();
    const bool changed = ranks != st->last;
    if (st->tty) {
      if (!changed && now - st->printed < std::chrono::seconds(1)) return;
      std::string line = fmt::format("  {:.0f} s  {}", t, ranks);
      if (line.size() > 160) line = line.substr(0, 157) + "...";
      *err << "\r\033[K" << line << std::flush;
      st->shown = true;
    } else {
      const auto since = now - st->printed;
      if (!(changed && since >= std::chrono::seconds(5)) && since < std::chrono::seconds(30))
        return;
      *out << fmt::format("  {:.0f} s  {}\n", t, ranks) << std::flush;
    }
    st->last = ranks;
    st->printed = now;
  };
  return p;
}

void print_start(const Context& ctx, const StartReport& r, bool steps_shown) {
  auto& out = *ctx.out;
  for (const auto& w : r.warnings) *ctx.err << "sparkctl: WARNING: " << w << "\n";
  if (!steps_shown)
    for (const auto& s : r.steps) out << step_line(s);
  if (r.ready) {
    out << fmt::format("READY: model {} on {} rank(s), endpoint {} (attempt {}, {:.1f} s)\n",
                       r.model, r.world_size, r.endpoint, r.attempts, r.seconds);
    for (const auto& k : r.ranks)
      out << fmt::format("  rank {} on {}: sparkd pid {}\n", k.rank, k.node, k.pid);
  } else if (!r.error) {
    out << fmt::format(
        "launched {} rank(s); not waiting for READY (--no-wait): sparkctl status "
        "shows progress; endpoint {}\n",
        r.ranks.size(), r.endpoint);
  }
}

int finish_start(const Context& ctx, const StartReport& r) {
  if (ctx.opts.json) {
    *ctx.out << to_json(r).dump(2) << "\n";
    for (const auto& w : r.warnings) *ctx.err << "sparkctl: WARNING: " << w << "\n";
    return r.error ? exit_code(r.error->code) : 0;
  }
  print_start(ctx, r, static_cast<bool>(r.progress.step));
  if (r.error) {
    // Say what happened to the ring: a refusal changed nothing; a failed launch was undone.
    if (r.error->code == Errc::busy)
      *ctx.err << "sparkctl: start refused: " << r.error->message << "\n";
    else if (r.torn_down)
      *ctx.err << "sparkctl: start failed; the ring was torn down (nothing left on any node): "
               << r.error->message << "\n";
    else
      *ctx.err << "sparkctl: start failed before any rank was launched (nothing changed on the "
                  "nodes): "
               << r.error->message << "\n";
    return exit_code(r.error->code);
  }
  return 0;
}

void print_stop(const Context& ctx, const StopReport& r) {
  for (const auto& k : r.ranks)
    *ctx.out << fmt::format(
        "rank {} on {}: {}{}{}\n", k.rank, k.node,
        k.pid ? fmt::format("pid {} stopped by {}", k.pid, k.how) : std::string("not running"),
        k.left.empty() ? "" : "; STILL RUNNING: " + join(k.left, ", "),
        k.error.empty() ? "" : "; " + k.error);
  if (r.clean) *ctx.out << "nothing of the ring is left on any node\n";
  if (r.disabled) *ctx.out << "DISABLED: watch will not restart the ring until `sparkctl start`\n";
}

std::optional<int> parse_start_flags(Context& ctx, const char* name, const char* synopsis,
                                     const std::vector<std::string>& args, StartOptions* opt) {
  po::options_description desc(std::string(name) + " options");
  desc.add_options()("skip-preflight", "start without the preflight checks (warns loudly)")(
      "no-wait", "return once every rank is launched; do not wait for READY")(
      "lock-wait", po::value<std::string>()->default_value("30s"),
      "how long to wait for the ring lock held by another start/stop/watch");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, name, synopsis, desc, args, vm)) return rc;
  opt->skip_preflight = vm.count("skip-preflight") > 0;
  opt->wait_ready = vm.count("no-wait") == 0;
  auto lw = duration_arg(vm, "lock-wait");
  if (!lw) return ctx.fail(lw.error());
  opt->lock_wait_ms = *lw;
  opt->by = name;
  return std::nullopt;
}

}  // namespace

int cmd_start(Context& ctx, const std::vector<std::string>& args) {
  StartOptions opt;
  if (auto rc = parse_start_flags(
          ctx, "start", "start [--skip-preflight] [--no-wait] [--lock-wait D]", args, &opt))
    return *rc;
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  if (opt.skip_preflight)
    *ctx.err << "sparkctl: WARNING: --skip-preflight: starting WITHOUT preflight checks\n";
  if (!ctx.opts.json) opt.progress = live_progress(ctx);
  auto rep = start_ring(*cfg, ring_layout(*cfg, ctx.argv0), opt);
  return finish_start(ctx, rep);
}

int cmd_restart(Context& ctx, const std::vector<std::string>& args) {
  StartOptions opt;
  if (auto rc = parse_start_flags(
          ctx, "restart", "restart [--skip-preflight] [--no-wait] [--lock-wait D]", args, &opt))
    return *rc;
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  if (opt.skip_preflight)
    *ctx.err << "sparkctl: WARNING: --skip-preflight: starting WITHOUT preflight checks\n";
  StopReport stopped;
  if (!ctx.opts.json) opt.progress = live_progress(ctx);
  // The stop half's results as soon as it is done, ahead of the start half's live steps.
  auto rep =
      restart_ring(*cfg, ring_layout(*cfg, ctx.argv0), opt, &stopped, [&ctx](const StopReport& s) {
        if (!ctx.opts.json) print_stop(ctx, s);
      });
  return finish_start(ctx, rep);
}

int cmd_stop(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("stop options");
  desc.add_options()("lock-wait", po::value<std::string>()->default_value("60s"),
                     "how long to wait for the ring lock");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "stop", "stop [--lock-wait D]", desc, args, vm)) return *rc;
  auto lw = duration_arg(vm, "lock-wait");
  if (!lw) return ctx.fail(lw.error());
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  auto rep = stop_ring(*cfg, ring_layout(*cfg, ctx.argv0), true, *lw);
  if (ctx.opts.json) {
    *ctx.out << to_json(rep).dump(2) << "\n";
    return rep.error ? exit_code(rep.error->code) : 0;
  }
  print_stop(ctx, rep);
  if (rep.error) return ctx.fail(*rep.error);
  return 0;
}

namespace {

// status --history: the nodes' health history, a sparkline per series (JSON with --json).
int status_history(Context& ctx, const RingConfig& cfg, const po::variables_map& vm) {
  int node = -1;
  if (vm.count("node")) {
    const auto& want = vm["node"].as<std::string>();
    for (const auto& n : cfg.nodes)
      if (n.name == want || std::to_string(n.index) == want) node = n.index;
    if (node < 0)
      return ctx.fail(make_error(Errc::usage, fmt::format("--node {}: no such node in {} (give "
                                                          "its name or index)",
                                                          want, cfg.path)));
  }
  auto since = duration_arg(vm, "since");
  if (!since) return ctx.fail(since.error());
  int64_t since_ms = *since < 0 ? 0 : wall_ms() - *since;
  auto h = collect_history(
      cfg, sparkctl_on(cfg, ctx), node, since_ms,
      std::chrono::milliseconds(cfg.get_duration_ms("SSH_TIMEOUT")) + std::chrono::seconds(30));
  int64_t every = static_cast<int64_t>(cfg.get_duration_ms("HEALTH_SAMPLE_INTERVAL"));
  bool any = false, unreachable = false;
  for (const auto& r : h) {
    any = any || !r.samples.empty() || r.error.empty();
    unreachable =
        unreachable || (!r.error.empty() && r.error.find("health history") == std::string::npos);
  }
  int rc = unreachable ? exit_code(Errc::remote) : any ? 0 : exit_code(Errc::not_found);
  if (ctx.opts.json) {
    *ctx.out << to_json(h, every).dump(2) << "\n";
    return rc;
  }
  *ctx.out << render_history(h, every, vm["width"].as<int>());
  return rc;
}

}  // namespace

int cmd_status(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("status options");
  desc.add_options()("history", "the health history of every rank (sparklines; JSON with --json)")(
      "node", po::value<std::string>(), "with --history: only this node (name or index)")(
      "since", po::value<std::string>()->default_value("1h"),
      "with --history: samples of this last stretch of time (e.g. 10m, 6h)")(
      "width", po::value<int>()->default_value(60), "with --history: sparkline width");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "status",
                           "status [--json] [--history [--node N] [--since D] [--width W]]", desc,
                           args, vm))
    return *rc;
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  if (vm.count("history")) return status_history(ctx, *cfg, vm);
  auto s = ring_status(*cfg, ring_layout(*cfg, ctx.argv0));
  int rc = s.ready ? 0 : exit_code(Errc::precondition);
  auto state = head_state_dir(*cfg);
  auto current = read_engine_set(state, "current"), good = read_engine_set(state, "last-good");
  if (ctx.opts.json) {
    auto j = to_json(s);
    auto brief = [](const std::optional<EngineSet>& e) {
      if (!e) return nlohmann::json(nullptr);
      auto x = to_json(*e);
      x.erase("config_text");  // may hold tokens; the file is mode 0600
      x["summary"] = describe_set(*e);
      return x;
    };
    j["engine_sets"] = {{"current", brief(current)}, {"last_good", brief(good)}};
    *ctx.out << j.dump(2) << "\n";
    return rc;
  }
  auto& out = *ctx.out;
  out << fmt::format("ring {}  model {}  engine {}  endpoint {}\n", s.ring, s.model, s.engine,
                     s.endpoint);
  out << fmt::format(
      "READY: {}{}\n", s.ready ? "yes" : "NO",
      s.ready ? "" : fmt::format(" ({}{}{})", s.state, s.reason.empty() ? "" : ": ", s.reason));
  out << fmt::format("DISABLED: {}   GAVE_UP: {}\n",
                     s.disabled ? "yes, " + age(s.disabled->value("at_ms", int64_t{0})) : "no",
                     s.gave_up ? "yes, " + age(s.gave_up->value("at_ms", int64_t{0})) + " (" +
                                     s.gave_up->value("reason", std::string("")) + ")"
                               : "no");
  out << fmt::format("watch: last {} {}{}; failures {}; restarts in window {}\n",
                     s.last_watch_verdict.empty() ? "-" : s.last_watch_verdict,
                     age(s.last_watch_ms),
                     s.last_watch_reason.empty() ? "" : " (" + s.last_watch_reason + ")",
                     s.watch_failures, s.restarts);
  if (current || good)
    out << fmt::format("engine: current {}\n        last good {}\n",
                       current ? describe_set(*current) : "-", good ? describe_set(*good) : "-");
  // When READY was seen is recorded by a start that waits for it; after `start --no-wait`
  // (or a restart that did not wait) the ring may be ready with no time recorded.
  const std::string ready_when = s.record.ready_ms > 0 ? age(s.record.ready_ms)
                                 : s.ready             ? "now (start did not wait to record when)"
                                                       : "not yet";
  out << fmt::format("slots {} total, {} busy; requests in flight {}; launched {}, ready {}\n",
                     s.slots_total, s.slots_busy, s.requests_in_flight, age(s.record.launched_ms),
                     ready_when);
  if (s.health && s.health->contains("model_info") && (*s.health)["model_info"].is_object()) {
    // What the native engine serves: architecture, active parameters, experts and their split.
    const auto& m = (*s.health)["model_info"];
    std::string line =
        fmt::format("model: {}, {} layers, {:.2f}B parameters", m.value("architecture", "?"),
                    m.value("layers", 0), m.value("parameters", 0.0) / 1e9);
    if (m.contains("checkpoint_format") && m["checkpoint_format"].is_string())
      line += fmt::format(", weights {} held as {}", m["checkpoint_format"].get<std::string>(),
                          m.value("weights", "?"));
    if (m.contains("experts") && m["experts"].is_object()) {
      const auto& x = m["experts"];
      line +=
          fmt::format(" ({:.2f}B active a token); {} experts, {} a token, split {} ({})",
                      m.value("active_parameters", 0.0) / 1e9, x.value("routed", 0),
                      x.value("per_token", 0), x.value("split", "?"), x.value("split_reason", ""));
    }
    out << line << "\n";
  }
  if (s.health) out << fabric_status_lines(*s.health);
  out << fmt::format("{:<5} {:<12} {:<9} {:>8} {:>9} {:>9}  {}\n", "RANK", "NODE", "STATE", "PID",
                     "UPTIME", "LAST-HB", "REASON");
  for (const auto& r : s.ranks) {
    out << fmt::format("{:<5} {:<12} {:<9} {:>8} {:>9} {:>9}  {}\n", r.rank, r.node, r.state,
                       r.pid ? std::to_string(r.pid) : "-",
                       r.uptime_s >= 0 ? fmt::format("{} s", r.uptime_s) : "-",
                       r.last_seen_s >= 0 ? fmt::format("{:.1f} s", r.last_seen_s) : "-", r.reason);
    if (!r.device.empty()) out << fmt::format("{:<5} device: {}\n", "", r.device);
  }
  out << fmt::format("{:<12} {:>12} {:>12} {:>12}  {}\n", "NODE", "MEMFREE", "MEMAVAILABLE",
                     "MEMTOTAL", "GPU MEMORY (used/total MiB)");
  for (const auto& n : s.nodes) {
    std::vector<std::string> gpus;
    for (const auto& [u, t] : n.gpu_mem_mib) gpus.push_back(fmt::format("{}/{}", u, t));
    out << fmt::format("{:<12} {:>12} {:>12} {:>12}  {}{}\n", n.node, size_or(n.mem_free),
                       size_or(n.mem_available), size_or(n.mem_total),
                       gpus.empty() ? "n/a" : join(gpus, " "),
                       n.error.empty() ? "" : "  UNREACHABLE: " + n.error);
  }
  return rc;
}

int cmd_watch(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("watch options");
  desc.add_options()("quiet,q",
                     "print only changes of verdict and failures (for cron and timers: a "
                     "healthy ring prints nothing)");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "watch", "watch [--quiet] [--json]", desc, args, vm)) return *rc;
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  std::string state = head_state_dir(*cfg);
  std::string before = read_watch_record(state).last_verdict;
  auto w = watch_once(*cfg, ring_layout(*cfg, ctx.argv0));
  int rc = 0;
  if (w.verdict == "gave_up") rc = exit_code(Errc::precondition);
  if (w.verdict == "restart_failed")
    rc =
        w.restart && w.restart->error ? exit_code(w.restart->error->code) : exit_code(Errc::remote);
  // A watch that finds no ring to watch must not pass silently from cron: most often the
  // ring was started by another user, whose state this watch cannot see.
  if (w.verdict == "not_started") {
    rc = exit_code(Errc::not_found);
    *ctx.err << fmt::format(
        "watch: error: no started ring '{}' in STATE_DIR {}: nothing to watch. Start it with "
        "`sparkctl start`; if it was started by another user or with another cluster file, "
        "point STATE_DIR in the cluster file at the ring's shared state directory\n",
        cfg->get("RING_NAME"), state);
  }
  if (ctx.opts.json) {
    *ctx.out << to_json(w).dump(2) << "\n";
    return rc;
  }
  // --quiet: a steady verdict (healthy, grace, busy, capped, disabled, gave_up) is silent
  // unless it changed; healthy is news only after trouble (a recovery, a heal confirmed), not
  // after a start, a grace or the first watch, which the operator's own start already announced.
  bool steady = w.verdict == "healthy" || w.verdict == "grace" || w.verdict == "busy" ||
                w.verdict == "capped" || w.verdict == "disabled" || w.verdict == "gave_up";
  bool after_trouble = before == "unhealthy" || before == "backoff" || before == "restarted" ||
                       before == "restart_failed" || before == "gave_up";
  bool news = w.verdict == "healthy" ? after_trouble : w.verdict != before;
  if (vm.count("quiet") && steady && !news && w.alerts.empty()) return rc;
  if (vm.count("quiet") && w.verdict == "not_started") return rc;  // said on stderr
  *ctx.out << fmt::format("watch: {}{}\n", w.verdict, w.reason.empty() ? "" : ": " + w.reason);
  if (!w.incident_dir.empty()) *ctx.out << "log tails saved in " << w.incident_dir << "\n";
  if (w.restart) print_start(ctx, *w.restart, false);
  for (const auto& a : w.alerts) *ctx.out << "alert: " << a << "\n";
  return rc;
}

int cmd_logs(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("logs options");
  desc.add_options()("rank,r", po::value<int>()->default_value(0), "which rank")(
      "follow,f", "keep printing new lines (until Ctrl-C or --for)")(
      "lines,n", po::value<int>()->default_value(50), "how many lines from the end")(
      "for", po::value<std::string>(), "with -f: stop after this long (e.g. 10s)");
  po::variables_map vm;
  if (auto rc =
          parse_args(ctx, "logs", "logs [--rank N] [-f] [-n LINES] [--for D]", desc, args, vm))
    return *rc;
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  int rank = vm["rank"].as<int>();
  int lines = std::max(0, vm["lines"].as<int>());
  if (rank < 0 || rank >= cfg->world_size())
    return ctx.fail(make_error(Errc::usage, fmt::format("--rank {}: the ring has ranks 0-{}", rank,
                                                        cfg->world_size() - 1)));
  auto lay = ring_layout(*cfg, ctx.argv0);
  if (!vm.count("follow")) {
    auto text = read_rank_log(*cfg, lay, rank, lines);
    if (!text) return ctx.fail(text.error());
    if (ctx.opts.json) {
      *ctx.out << json{{"rank", rank}, {"text", *text}}.dump(2) << "\n";
    } else {
      *ctx.out << *text;
    }
    return 0;
  }
  auto f = duration_arg(vm, "for");
  if (!f) return ctx.fail(f.error());
  // Follow by polling the file from the last offset over one runner (SSH session reused);
  // a log that shrank was rotated (sparkd started again): read it from the start.
  auto place = place_of(*cfg, rank);
  auto runner = make_runner(*cfg, cfg->nodes.at(static_cast<size_t>(place.node)));
  std::string file = fmt::format("\"$L/sparkd-{}.log\"", rank);
  std::string pre = node_dirs_prelude(*cfg);
  auto first = runner->run(pre + fmt::format("f={}; wc -c <\"$f\" 2>/dev/null || echo 0; "
                                             "tail -n {} \"$f\" 2>/dev/null",
                                             file, lines),
                           lay.node_timeout);
  if (!first) return ctx.fail(first.error());
  auto nl = first->out.find('\n');
  int64_t offset = parse_i64(trim(first->out.substr(0, nl))).value_or(0);
  if (nl != std::string::npos) *ctx.out << first->out.substr(nl + 1) << std::flush;
  auto end = *f >= 0 ? std::chrono::steady_clock::now() + milliseconds(*f)
                     : std::chrono::steady_clock::time_point::max();
  while (std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(milliseconds(500));
    auto r = runner->run(pre + fmt::format("f={f}; s=$(wc -c <\"$f\" 2>/dev/null || echo 0); "
                                           "echo $s; if [ $s -lt {o} ]; then cat \"$f\"; else "
                                           "tail -c +$(({o}+1)) \"$f\" | head -c $((s-{o})); fi",
                                           fmt::arg("f", file), fmt::arg("o", offset)),
                         lay.node_timeout);
    if (!r) return ctx.fail(r.error());
    auto k = r->out.find('\n');
    if (k == std::string::npos) continue;
    int64_t size = parse_i64(trim(r->out.substr(0, k))).value_or(0);
    std::string chunk = r->out.substr(k + 1);
    *ctx.out << chunk << std::flush;
    offset = size < offset ? static_cast<int64_t>(chunk.size())
                           : offset + static_cast<int64_t>(chunk.size());
  }
  return 0;
}

int cmd_health_get(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("health-get options");
  desc.add_options()("host", po::value<std::string>()->default_value("127.0.0.1"), "address")(
      "port", po::value<int>()->required(), "port")(
      "timeout-ms", po::value<int>()->default_value(3000), "deadline");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "health-get", "health-get --port P [--host H]", desc, args, vm))
    return *rc;
  HttpCall c;
  c.host = vm["host"].as<std::string>();
  c.port = static_cast<uint16_t>(vm["port"].as<int>());
  c.target = "/health";
  c.timeout = milliseconds(std::max(1, vm["timeout-ms"].as<int>()));
  auto r = http_call(c);
  if (!r) return ctx.fail(r.error());
  *ctx.out << json{{"status", r->status}, {"body", r->body}}.dump() << "\n";
  return 0;
}

}  // namespace spark::cli
