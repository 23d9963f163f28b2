// sparkctl stage-weights, and its internal halves stage-recv (target) and stage-send (source).
#include "cli/cmd_stage.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/node_exec.h"
#include "core/log.h"
#include "core/process.h"
#include "core/stage_recv.h"
#include "core/stage_send.h"
#include "core/strings.h"

namespace spark::cli {
namespace {

using json = nlohmann::json;
constexpr const char* kRecvBanner = "SPARKCTL-STAGE-RECV";

// Prints progress: a live bar on a terminal, a line every 5 s otherwise.
class ProgressPrinter {
 public:
  ProgressPrinter(std::ostream& err, bool quiet)
      : err_(err), tty_(::isatty(2) != 0), quiet_(quiet) {}
  void operator()(const stage::Progress& p) {
    if (quiet_ && !tty_) return;
    std::lock_guard<std::mutex> g(mu_);
    if (!tty_ && p.seconds - last_ < 5.0 && p.done < p.total) return;
    last_ = p.seconds;
    double rate = p.rate();
    std::string eta =
        rate > 0 ? fmt::format("{:.0f} s",
                               static_cast<double>(p.total - std::min(p.done, p.total)) / rate)
                 : std::string("?");
    std::string per;
    for (const auto& t : p.targets)
      per += fmt::format(
          " {} {:.0f}%", t.node,
          t.total ? 100.0 * static_cast<double>(t.done) / static_cast<double>(t.total) : 100.0);
    if (tty_) {
      const int w = 30;
      int fill =
          p.total ? static_cast<int>(w * static_cast<double>(p.done) / static_cast<double>(p.total))
                  : w;
      err_ << fmt::format("\r\033[K[{}{}] {} / {}  {}/s  ETA {} |{}", std::string(fill, '#'),
                          std::string(w - std::min(fill, w), '.'), format_size(p.done),
                          format_size(p.total), format_size(static_cast<uint64_t>(rate)), eta, per)
           << std::flush;
    } else {
      err_ << fmt::format(
          "stage: {} / {} ({:.0f}%), {}/s, ETA {};{}\n", format_size(p.done), format_size(p.total),
          p.total ? 100.0 * static_cast<double>(p.done) / static_cast<double>(p.total) : 100.0,
          format_size(static_cast<uint64_t>(rate)), eta, per);
    }
  }
  void end() {
    if (tty_ && !quiet_) err_ << "\r\033[K" << std::flush;
  }

 private:
  std::ostream& err_;
  bool tty_;
  bool quiet_;
  double last_ = -100;
  std::mutex mu_;
};

json report_json(const std::string& dir, const stage::SendReport& r, bool rebuilt) {
  json j;
  j["ok"] = r.ok;
  j["source"] = dir;
  j["digest"] = r.digest;
  j["manifest_rebuilt"] = rebuilt;
  j["total_bytes"] = r.total_bytes;
  j["bytes_read"] = r.bytes_read;
  j["cache_dropped_bytes"] = r.cache_dropped_bytes;
  j["cache_left_bytes"] = r.cache_left_bytes;
  j["seconds"] = r.seconds;
  uint64_t sent = 0;
  for (const auto& t : r.targets) sent += t.bytes_sent;
  j["bytes_sent"] = sent;
  j["bytes_per_second"] = r.seconds > 0 ? static_cast<double>(sent) / r.seconds : 0.0;
  j["targets"] = json::array();
  for (const auto& t : r.targets) {
    json jt = {{"node", t.node},
               {"ok", t.ok},
               {"need_bytes", t.need_bytes},
               {"bytes_sent", t.bytes_sent},
               {"chunks_sent", t.chunks_sent},
               {"chunks_resent", t.chunks_resent},
               {"skip_files", t.skip_files},
               {"skip_bytes", t.skip_bytes},
               {"resume_bytes", t.resume_bytes},
               {"resume_mismatch_chunks", t.resume_mismatch_chunks},
               {"fs_free", t.fs_free},
               {"fs_total", t.fs_total}};
    if (!t.ok) {
      jt["error"] = t.error;
      jt["code"] = std::string(errc_name(t.code));
    }
    auto rr = json::parse(t.receiver_report, nullptr, false);
    if (!rr.is_discarded()) jt["receiver"] = rr;
    j["targets"].push_back(std::move(jt));
  }
  return j;
}

void print_report(std::ostream& out, const json& j) {
  out << fmt::format(
      "# stage-weights {} digest {}: {} total, {} read from the source, {:.1f} s, {}/s{}\n",
      j["source"].get<std::string>(), j["digest"].get<std::string>(),
      format_size(j["total_bytes"].get<uint64_t>()), format_size(j["bytes_read"].get<uint64_t>()),
      j["seconds"].get<double>(),
      format_size(static_cast<uint64_t>(j["bytes_per_second"].get<double>())),
      j["manifest_rebuilt"].get<bool>() ? " (manifest rebuilt)" : "");
  out << fmt::format("{:<12} {:<6} {:>11} {:>11} {:>11} {:>7} {:>6}  {}\n", "NODE", "RESULT",
                     "SENT", "SKIPPED", "RESUMED", "RESENT", "FILES", "DETAIL");
  for (const auto& t : j["targets"]) {
    std::string detail = t.value("error", std::string());
    if (detail.empty() && t.contains("receiver"))
      detail =
          fmt::format("{} written, {} skipped, verified", t["receiver"].value("files_written", 0),
                      t["receiver"].value("files_skipped", 0));
    out << fmt::format(
        "{:<12} {:<6} {:>11} {:>11} {:>11} {:>7} {:>6}  {}\n", t["node"].get<std::string>(),
        t["ok"].get<bool>() ? "OK" : "FAILED", format_size(t["bytes_sent"].get<uint64_t>()),
        format_size(t["skip_bytes"].get<uint64_t>()),
        format_size(t["resume_bytes"].get<uint64_t>()), t["chunks_resent"].get<uint64_t>(),
        t.contains("receiver") ? t["receiver"].value("files_total", 0) : 0, detail);
  }
}

// Sends to receivers that are already listening; prints and returns the exit code.
int run_send(Context& ctx, const std::string& dir, const std::vector<stage::TargetSpec>& targets,
             stage::SendOptions so, uint64_t chunk_size) {
  bool rebuilt = false;
  auto m = current_manifest(dir, chunk_size, &rebuilt);
  if (!m) return ctx.fail(m.error());
  ProgressPrinter pp(*ctx.err, ctx.opts.json);
  so.progress = [&](const stage::Progress& p) { pp(p); };
  auto r = stage::send_model(dir, *m, targets, so);
  pp.end();
  if (!r) return ctx.fail(r.error());
  auto j = report_json(dir, *r, rebuilt);
  if (ctx.opts.json)
    *ctx.out << j.dump(2) << "\n";
  else
    print_report(*ctx.out, j);
  if (r->ok) return 0;
  for (const auto& t : r->targets)
    if (!t.ok) {
      if (!ctx.opts.json) *ctx.err << "sparkctl: " << t.error << "\n";
      return exit_code(t.code == Errc::ok ? Errc::remote : t.code);
    }
  return exit_code(Errc::remote);
}

// Parses "NAME=IP:PORT[,IP:PORT]".
Result<stage::TargetSpec> parse_target(const std::string& s) {
  auto eq = s.find('=');
  if (eq == std::string::npos || eq == 0)
    return make_error(Errc::usage, fmt::format("--target '{}': want NAME=IP:PORT[,IP:PORT]", s));
  stage::TargetSpec t;
  t.node = s.substr(0, eq);
  for (const auto& a : split_list(s.substr(eq + 1), ',')) {
    auto c = a.rfind(':');
    auto port = c == std::string::npos ? std::nullopt : parse_u64(a.substr(c + 1));
    if (!port || *port == 0 || *port > 65535 || !parse_ipv4(a.substr(0, c)))
      return make_error(Errc::usage, fmt::format("--target '{}': '{}' is not IP:PORT", s, a));
    t.addrs.emplace_back(a.substr(0, c), static_cast<int>(*port));
  }
  if (t.addrs.empty()) return make_error(Errc::usage, fmt::format("--target '{}': no address", s));
  return t;
}

void apply_faults(const Context& ctx, stage::SendOptions& so) {
  // Fault injection for tests (named as such; never set in production).
  if (auto it = ctx.env.vars.find("SPARK_STAGE_FAULT_CORRUPT_CHUNK"); it != ctx.env.vars.end())
    so.fault_corrupt_chunk = parse_i64(it->second).value_or(-1);
  if (auto it = ctx.env.vars.find("SPARK_STAGE_FAULT_DELAY_MS"); it != ctx.env.vars.end())
    so.fault_delay_ms = static_cast<int>(parse_i64(it->second).value_or(0));
}

Result<uint64_t> size_opt(const po::variables_map& vm, const char* name, uint64_t lo, uint64_t hi) {
  std::string why;
  auto v = parse_size(vm[name].as<std::string>(), &why);
  if (!v || *v < lo || *v > hi)
    return make_error(Errc::usage, fmt::format("--{} '{}' must be between {} and {}{}", name,
                                               vm[name].as<std::string>(), format_size(lo),
                                               format_size(hi), why.empty() ? "" : ": " + why));
  return *v;
}

// The first IPv4 address of a network interface ("" when it has none).
std::string netdev_ipv4(const std::string& dev) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string out;
  for (ifaddrs* a = list; a && out.empty(); a = a->ifa_next)
    if (a->ifa_addr && a->ifa_addr->sa_family == AF_INET && dev == a->ifa_name) {
      char buf[INET_ADDRSTRLEN];
      auto* sin = reinterpret_cast<sockaddr_in*>(a->ifa_addr);
      if (::inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof buf)) out = buf;
    }
  ::freeifaddrs(list);
  return out;
}

// Tells a receiver that was started but will not be used to exit now.
void release_receiver(const stage::TargetSpec& t, const std::string& why) {
  auto c = stage::connect_to(t.addrs[0].first, t.addrs[0].second, std::chrono::seconds(5), t.node);
  if (!c) return;
  (void)c->send_frame(stage::Header{stage::Frame::hello, 0, 0, 0, t.token.size()}, t.token.data());
  (void)c->send_frame(stage::Header{stage::Frame::abort, 0, 0, 0, why.size()}, why.data());
}

}  // namespace

int cmd_stage_recv(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("stage-recv options (internal: started by stage-weights over SSH)");
  desc.add_options()("dir", po::value<std::string>()->required(), "target model directory")(
      "bind", po::value<std::string>()->required(),
      "fabric address(es) to listen on, comma-separated")(
      "port", po::value<int>()->default_value(0), "port (0: any free port)")(
      "node", po::value<std::string>()->default_value("receiver"), "this node's name in messages")(
      "idle-timeout", po::value<std::string>()->default_value("120s"),
      "give up after this long without traffic")(
      "foreground",
      "serve in the foreground and print the report (default: detach after the banner)")(
      "log", po::value<std::string>(),
      "log file when detached (default /tmp/sparkctl-stage-recv-PORT.log)")(
      "netdevs", po::value<std::string>(),
      "also listen on the IPv4 address of each of these netdevs (both twins of a cable)");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "stage-recv", "stage-recv --dir DIR --bind IP[,IP] < token", desc,
                           args, vm))
    return *rc;
  std::string why;
  auto idle = parse_duration_ms(vm["idle-timeout"].as<std::string>(), &why);
  if (!idle) return ctx.fail(make_error(Errc::usage, "stage-recv: --idle-timeout: " + why));
  // The token arrives on stdin so that it never shows in ps.
  if (::isatty(0))
    return ctx.fail(make_error(Errc::usage, "stage-recv: give the token on standard input"));
  std::string token;
  char c;
  while (token.size() < 1024 && ::read(0, &c, 1) == 1 && c != '\n') token += c;
  token = std::string(trim(token));
  stage::ReceiverOptions ro;
  ro.dir = vm["dir"].as<std::string>();
  ro.bind_ips = split_list(vm["bind"].as<std::string>(), ',');
  if (vm.count("netdevs"))
    for (const auto& dev : split_list(vm["netdevs"].as<std::string>(), ',')) {
      auto ip = netdev_ipv4(dev);
      if (ip.empty())
        *ctx.err << fmt::format(
            "sparkctl: stage-recv: warning: netdev {} has no IPv4 address; "
            "not listening there\n",
            dev);
      else if (std::find(ro.bind_ips.begin(), ro.bind_ips.end(), ip) == ro.bind_ips.end())
        ro.bind_ips.push_back(ip);
    }
  ro.port = vm["port"].as<int>();
  ro.token = token;
  ro.idle_timeout = std::chrono::milliseconds(*idle);
  ro.node = vm["node"].as<std::string>();
  // Fault injection for tests (named as such; never set in production).
  if (auto it = ctx.env.vars.find("SPARK_STAGE_FAULT_TRUST_JOURNAL"); it != ctx.env.vars.end())
    ro.fault_trust_journal = it->second == "1";
  auto r = stage::Receiver::create(ro);
  if (!r) return ctx.fail(r.error());
  std::string ports, addrs;
  for (size_t i = 0; i < (*r)->ports().size(); ++i) {
    ports += fmt::format("{}{}", i ? "," : "", (*r)->ports()[i]);
    addrs += fmt::format("{}{}:{}", i ? "," : "", ro.bind_ips[i], (*r)->ports()[i]);
  }
  std::string logpath = vm.count("log")
                            ? vm["log"].as<std::string>()
                            : fmt::format("/tmp/sparkctl-stage-recv-{}.log", (*r)->ports()[0]);
  if (vm.count("foreground")) {
    *ctx.out << fmt::format("{} ports={} addrs={} pid={} log=-\n", kRecvBanner, ports, addrs,
                            ::getpid())
             << std::flush;
    auto rep = (*r)->run();
    if (!rep) return ctx.fail(rep.error());
    *ctx.out << *rep << "\n";
    return 0;
  }
  ctx.out->flush();
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) return ctx.fail(make_error(Errc::io, "stage-recv: fork failed"));
  if (pid > 0) {
    *ctx.out << fmt::format("{} ports={} addrs={} pid={} log={}\n", kRecvBanner, ports, addrs, pid,
                            logpath)
             << std::flush;
    return 0;
  }
  // The detached receiver: no terminal, no SSH channel held open, output to its log.
  ::setsid();
  int nul = ::open("/dev/null", O_RDWR);
  int lg = ::open(logpath.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (nul >= 0) ::dup2(nul, 0);
  if (lg >= 0) {
    ::dup2(lg, 1);
    ::dup2(lg, 2);
  }
  auto rep = (*r)->run();
  int code = 0;
  if (!rep) {
    std::fprintf(stderr, "stage-recv %s: %s\n", ro.node.c_str(), rep.error().message.c_str());
    code = exit_code(rep.error().code);
  } else {
    std::fprintf(stdout, "%s\n", rep->c_str());
  }
  std::fflush(nullptr);
  ::_exit(code);
}

int cmd_stage_send(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("stage-send options (internal: the source half of stage-weights)");
  desc.add_options()("dir", po::value<std::string>()->required(), "source model directory")(
      "target", po::value<std::vector<std::string>>()->required(),
      "NAME=IP:PORT[,IP:PORT] (repeat)")("streams", po::value<int>()->default_value(4),
                                         "TCP streams per target")(
      "chunk-size", po::value<std::string>()->default_value("64MiB"), "manifest chunk size")(
      "max-use", po::value<int>()->default_value(85), "DISK_MAX_USE percent")(
      "deep", "targets rehash existing files")("keep-cache", "do not evict page cache")(
      "chain", "feed the first target only; each forwards to the next");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "stage-send",
                           "stage-send --dir DIR --target NAME=IP:PORT... < 'NAME TOKEN' lines",
                           desc, args, vm))
    return *rc;
  if (::isatty(0))
    return ctx.fail(make_error(Errc::usage,
                               "stage-send: give the tokens on standard input, one "
                               "'NAME TOKEN' line per target"));
  std::map<std::string, std::string> tokens;
  std::string line;
  while (std::getline(std::cin, line)) {
    auto parts = split_list(line, ' ');
    if (parts.size() == 2) tokens[parts[0]] = parts[1];
  }
  std::vector<stage::TargetSpec> targets;
  for (const auto& s : vm["target"].as<std::vector<std::string>>()) {
    auto t = parse_target(s);
    if (!t) return ctx.fail(t.error());
    if (!tokens.count(t->node))
      return ctx.fail(make_error(Errc::usage, fmt::format("stage-send: no token for {} on stdin "
                                                          "(want lines 'NAME TOKEN')",
                                                          t->node)));
    t->token = tokens[t->node];
    targets.push_back(*t);
  }
  auto cs = size_opt(vm, "chunk-size", 4096, 1ull << 30);
  if (!cs) return ctx.fail(cs.error());
  stage::SendOptions so;
  so.streams = std::clamp(vm["streams"].as<int>(), 1, 64);
  so.deep = vm.count("deep") > 0;
  so.keep_cache = vm.count("keep-cache") > 0;
  so.max_use_pct = vm["max-use"].as<int>();
  so.chain = vm.count("chain") > 0;
  apply_faults(ctx, so);
  return run_send(ctx, vm["dir"].as<std::string>(), targets, so, *cs);
}

namespace {

// The source and the targets of stage-weights: --from (default node 0) and --to (default
// every other node), each with a model path, the targets with a fabric address.
struct StagePlan {
  const NodeConfig* src = nullptr;
  std::vector<const NodeConfig*> dst;
};
Result<StagePlan> pick_nodes(const RingConfig& cfg, const po::variables_map& vm) {
  auto find = [&](const std::string& name) -> const NodeConfig* {
    for (const auto& n : cfg.nodes)
      if (n.name == name || std::to_string(n.index) == name) return &n;
    return nullptr;
  };
  StagePlan plan;
  const NodeConfig* src = vm.count("from") ? find(vm["from"].as<std::string>()) : &cfg.nodes.at(0);
  if (!src)
    return make_error(Errc::not_found, fmt::format("stage-weights: no node '{}' in {}",
                                                   vm["from"].as<std::string>(), cfg.path));
  std::vector<const NodeConfig*> dst;
  if (vm.count("to")) {
    for (const auto& name : split_list(vm["to"].as<std::string>())) {
      const NodeConfig* n = find(name);
      if (!n)
        return make_error(Errc::not_found,
                          fmt::format("stage-weights: no node '{}' in {}", name, cfg.path));
      if (n == src)
        return make_error(Errc::usage, fmt::format("stage-weights: {} is the source", name));
      dst.push_back(n);
    }
  } else {
    for (const auto& n : cfg.nodes)
      if (&n != src) dst.push_back(&n);
  }
  if (dst.empty())
    return make_error(Errc::usage,
                      "stage-weights: no target nodes (a ring of one node "
                      "has nothing to stage)");
  for (const auto* n : std::vector<const NodeConfig*>{src})
    if (n->model_path.empty())
      return make_error(Errc::config, fmt::format("{}: no model path (set MODEL_PATH or "
                                                  "NODE{}_MODEL_PATH)",
                                                  n->name, n->index));
  for (const auto* n : dst) {
    if (n->model_path.empty())
      return make_error(Errc::config, fmt::format("{}: no model path (set MODEL_PATH or "
                                                  "NODE{}_MODEL_PATH)",
                                                  n->name, n->index));
    if (n->fabric_ip.empty())
      return make_error(Errc::config,
                        fmt::format("{}: NODE{}_FABRIC_IP is not set; stage-weights sends "
                                    "over the fabric only",
                                    n->name, n->index));
  }
  plan.src = src;
  plan.dst = dst;
  return plan;
}

// --verify-only: every node verifies its copy against its own manifest; the digests must
// equal the source's.
int verify_only(Context& ctx, const RingConfig& cfg, const StagePlan& plan, const std::string& bin,
                bool deep) {
  const NodeConfig* src = plan.src;
  const auto& dst = plan.dst;
  std::vector<NodeJob> jobs;
  std::vector<const NodeConfig*> all{src};
  all.insert(all.end(), dst.begin(), dst.end());
  for (const auto* n : all)
    jobs.push_back({n->index,
                    fmt::format("{} --json manifest {} --verify{}", shell_quote(bin),
                                shell_quote(n->model_path), deep ? "" : " --quick"),
                    ""});
  auto res = run_on_nodes(cfg, jobs, std::chrono::hours(2));
  for (const auto& r : res) forward_stderr(r);
  json out = {{"nodes", json::array()}};
  bool ok = true;
  std::string want;
  for (size_t i = 0; i < jobs.size(); ++i) {
    json jn = {{"node", res[i].node}};
    json rep = res[i].ok() ? json::parse(res[i].out, nullptr, false) : json();
    if (!res[i].ok()) {
      jn["ok"] = false;
      jn["error"] = res[i].error->message;
    } else if (rep.is_discarded() || !rep.is_object() || rep.contains("error")) {
      jn["ok"] = false;
      jn["error"] = rep.is_object() && rep.contains("error") && rep["error"].is_object()
                        ? rep["error"].value("message", std::string("failed"))
                        : "no report";
    } else {
      jn = rep;
      jn["node"] = res[i].node;
      if (i == 0) want = rep.value("digest", std::string());
      if (rep.value("digest", std::string()) != want) {
        jn["ok"] = false;
        jn["error"] = fmt::format("manifest digest {} differs from the source's {}",
                                  rep.value("digest", std::string()), want);
      }
    }
    ok = ok && jn.value("ok", false);
    out["nodes"].push_back(jn);
  }
  out["ok"] = ok;
  if (ctx.opts.json) {
    *ctx.out << out.dump(2) << "\n";
  } else {
    for (const auto& n : out["nodes"])
      *ctx.out << fmt::format("{:<12} {:<8} {}\n", n.value("node", "?"),
                              n.value("ok", false) ? "OK" : "MISMATCH",
                              n.value("ok", false) ? n.value("digest", std::string())
                                                   : n.value("error", std::string("see --json")));
  }
  return ok ? 0 : exit_code(Errc::integrity);
}

// Starts a receiver on every target with its own one-time token (on stdin, never in argv)
// and reads back where each listens. On any failure the receivers that did start are
// released.
Result<std::vector<stage::TargetSpec>> start_receivers(const Context& ctx, const RingConfig& cfg,
                                                       const std::vector<const NodeConfig*>& dst,
                                                       const std::string& bin) {
  // Fault injection for tests (named as such; never set in production): the receivers'
  // switches travel with their command line.
  std::string faults;
  if (auto it = ctx.env.vars.find("SPARK_STAGE_FAULT_TRUST_JOURNAL"); it != ctx.env.vars.end())
    faults = "SPARK_STAGE_FAULT_TRUST_JOURNAL=" + shell_quote(it->second) + " ";
  std::vector<NodeJob> jobs;
  std::vector<std::string> tokens;
  const auto idle_s = cfg.get_duration_ms("STAGE_TIMEOUT") / 1000;
  for (const auto* n : dst) {
    auto tok = stage::make_token();
    if (!tok) return tok.error();
    tokens.push_back(*tok);
    jobs.push_back(
        {n->index,
         fmt::format("{}{} stage-recv --dir {} --bind {} --node {} --idle-timeout {}s{}", faults,
                     shell_quote(bin), shell_quote(n->model_path), n->fabric_ip,
                     shell_quote(n->name), std::max<uint64_t>(idle_s, 5),
                     n->netdevs.size() > 1 ? " --netdevs " + shell_quote(join(n->netdevs, ","))
                                           : std::string()),
         *tok + "\n"});
  }
  auto started = run_on_nodes(cfg, jobs, std::chrono::seconds(60));
  for (const auto& r : started) forward_stderr(r);
  std::vector<stage::TargetSpec> targets;
  std::string errs;
  Errc code = Errc::ok;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const auto* n = &cfg.nodes.at(static_cast<size_t>(jobs[i].node));
    const auto& run = started[i];
    std::string line;
    if (run.ok())
      for (const auto& l : split_list(run.out, '\n'))
        if (starts_with(l, kRecvBanner)) line = l;
    if (!run.ok() || line.empty()) {
      std::string why = !run.ok() ? run.error->message
                                  : fmt::format(
                                        "{}: stage-recv exited {} without listening "
                                        "(output: {})",
                                        n->name, run.exit_status, trim(run.out));
      errs += (errs.empty() ? "" : "; ") + why;
      if (code == Errc::ok) code = run.ok() ? Errc::remote : run.error->code;
      continue;
    }
    stage::TargetSpec t;
    t.node = n->name;
    t.token = tokens[i];
    for (const auto& kv : split_list(line, ' '))
      if (starts_with(kv, "addrs="))
        for (const auto& a : split_list(kv.substr(6), ',')) {
          auto colon = a.rfind(':');
          if (colon == std::string::npos) continue;
          t.addrs.emplace_back(a.substr(0, colon),
                               static_cast<int>(parse_u64(a.substr(colon + 1)).value_or(0)));
        }
    targets.push_back(std::move(t));
  }
  if (!errs.empty()) {
    for (const auto& t : targets) release_receiver(t, "another target failed to start");
    return make_error(code, errs);
  }
  return targets;
}

// The source is another node: it runs the sending half, with the tokens on its stdin. Its
// progress lines arrive when it ends (the runner returns output at exit).
int send_from_node(Context& ctx, const RingConfig& cfg, const NodeConfig* src,
                   const std::vector<stage::TargetSpec>& targets, const std::string& bin,
                   const stage::SendOptions& so, uint64_t chunk) {
  std::string cmd = fmt::format(
      "{} --json stage-send --dir {} --streams {} --chunk-size {} "
      "--max-use {}{}{}",
      shell_quote(bin), shell_quote(src->model_path), so.streams, chunk ? chunk : kDefaultChunkSize,
      so.max_use_pct, so.deep ? " --deep" : "", so.keep_cache ? " --keep-cache" : "");
  std::string input;
  for (const auto& t : targets) {
    std::string addrs;
    for (const auto& a : t.addrs)
      addrs += fmt::format("{}{}:{}", addrs.empty() ? "" : ",", a.first, a.second);
    cmd += fmt::format(" --target {}", shell_quote(t.node + "=" + addrs));
    input += t.node + " " + t.token + "\n";
  }
  auto res = run_on_nodes(cfg, {NodeJob{src->index, cmd, input}}, std::chrono::hours(12));
  forward_stderr(res[0]);
  if (!res[0].ok()) {
    for (const auto& t : targets) release_receiver(t, "the source could not be reached");
    return ctx.fail(*res[0].error);
  }
  auto j = json::parse(res[0].out, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return ctx.fail(make_error(
        Errc::remote,
        fmt::format("{}: stage-send exited {} without a report", src->name, res[0].exit_status)));
  if (j.contains("error") && j["error"].is_object()) {
    auto rcode = Errc::remote;
    for (int e = 1; e <= static_cast<int>(Errc::internal); ++e)
      if (errc_name(static_cast<Errc>(e)) == j["error"].value("code", std::string()))
        rcode = static_cast<Errc>(e);
    return ctx.fail(make_error(
        rcode, fmt::format("{}: {}", src->name, j["error"].value("message", std::string()))));
  }
  if (ctx.opts.json)
    *ctx.out << j.dump(2) << "\n";
  else
    print_report(*ctx.out, j);
  return res[0].exit_status;
}

}  // namespace

int cmd_stage_weights(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("stage-weights options");
  desc.add_options()("from", po::value<std::string>(), "source node (default: node 0, the head)")(
      "to", po::value<std::string>(), "target nodes, comma-separated (default: all others)")(
      "streams", po::value<int>(), "TCP streams per target (default STAGE_STREAMS)")(
      "verify-only", "check every node against the source manifest; copy nothing")(
      "deep", "rehash files on the targets instead of trusting size+mtime+manifest")(
      "keep-cache", "leave the page cache of read and written files alone")(
      "chain",
      "feed the targets as a chain (source -> first -> second ...) instead of in parallel");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "stage-weights",
                           "stage-weights [--from NODE] [--to NODE,...] [--streams N] [--chain] "
                           "[--verify-only] [--deep] [--keep-cache]",
                           desc, args, vm))
    return *rc;
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  auto plan = pick_nodes(*cfg, vm);
  if (!plan) return ctx.fail(plan.error());
  const std::string bin = sparkctl_on(*cfg, ctx);
  const uint64_t chunk = cfg->get_size("STAGE_CHUNK_SIZE");
  if (vm.count("verify-only")) return verify_only(ctx, *cfg, *plan, bin, vm.count("deep") > 0);
  auto targets = start_receivers(ctx, *cfg, plan->dst, bin);
  if (!targets) return ctx.fail(targets.error());
  stage::SendOptions so;
  so.streams = vm.count("streams") ? vm["streams"].as<int>()
                                   : static_cast<int>(cfg->get_int("STAGE_STREAMS"));
  so.streams = std::clamp(so.streams, 1, 64);
  so.deep = vm.count("deep") > 0;
  so.keep_cache = vm.count("keep-cache") > 0;
  so.chain = vm.count("chain") > 0;
  so.max_use_pct = static_cast<int>(cfg->get_int("DISK_MAX_USE"));
  so.timeout =
      std::chrono::milliseconds(std::max<uint64_t>(cfg->get_duration_ms("STAGE_TIMEOUT"), 5000));
  apply_faults(ctx, so);
  if (plan->src->local)
    return run_send(ctx, plan->src->model_path, *targets, so, chunk ? chunk : kDefaultChunkSize);
  return send_from_node(ctx, *cfg, plan->src, *targets, bin, so, chunk);
}

}  // namespace spark::cli
