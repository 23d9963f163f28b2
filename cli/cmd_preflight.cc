// sparkctl preflight: every known ring-killer on every node at once (see
// man/sparkctl-preflight.1 for the check IDs, the JSON schema and the exit codes).
#include "cli/cmd_preflight.h"

#include <fmt/format.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/fabric_preflight.h"
#include "core/process.h"
#include "core/strings.h"
#include "env/bwtest.h"

namespace spark::cli {

using nlohmann::json;

namespace {

std::vector<std::string> ids_of(const po::variables_map& vm, const char* key) {
  std::vector<std::string> out;
  if (!vm.count(key)) return out;
  for (const auto& v : vm[key].as<std::vector<std::string>>())
    for (const auto& id : split_list(v)) out.push_back(id);
  return out;
}

}  // namespace

Status check_sysroot_dir(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    int e = errno;
    if (e == ELOOP)
      return make_error(Errc::not_found,
                        fmt::format("--sysroot {}: symlink loop (ELOOP): the path never reaches a "
                                    "directory; point it at the captured tree itself",
                                    path));
    return make_error(Errc::not_found, fmt::format("--sysroot {}: {}", path, std::strerror(e)));
  }
  if (!S_ISDIR(st.st_mode))
    return make_error(Errc::not_found,
                      fmt::format("--sysroot {}: not a directory or .tar.gz", path));
  return Status::Ok();
}

/// A captured tree: a directory, or a capture-node archive unpacked into a temporary one.
class SysrootHandle {
 public:
  SysrootHandle() = default;
  SysrootHandle(const SysrootHandle&) = delete;
  SysrootHandle& operator=(const SysrootHandle&) = delete;
  ~SysrootHandle() {
    if (!tmp_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(tmp_, ec);
    }
  }
  Status open(const std::string& path) {
    if (!ends_with(path, ".tar.gz") && !ends_with(path, ".tgz")) {
      if (auto s = check_sysroot_dir(path); !s.ok()) return s;
      dir_ = path;
      return Status::Ok();
    }
    std::string tmpl = "/tmp/sparkctl-sysroot-XXXXXX";
    if (!::mkdtemp(tmpl.data())) return make_error(Errc::io, "mkdtemp failed");
    tmp_ = dir_ = tmpl;
    auto r = run_process(
        ProcessSpec{{"tar", "-xzf", path, "-C", dir_}, {}, {}, {}, std::chrono::seconds(60)});
    if (!r || !r->success())
      return make_error(Errc::io, fmt::format("--sysroot {}: cannot unpack: {}", path,
                                              r ? tail(r->err) : r.error().message));
    return Status::Ok();
  }
  const std::string& dir() const { return dir_; }

 private:
  static std::string tail(const std::string& s) { return std::string(trim(s)).substr(0, 300); }
  std::string dir_, tmp_;
};

int cmd_preflight(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("preflight options");
  desc.add_options()("local", "node mode: run this node's checks only and print its node report")(
      "node", po::value<int>()->default_value(-1), "node mode: which node of the ring this is")(
      "sysroot", po::value<std::vector<std::string>>()->composing(),
      "read a captured tree (directory or capture-node .tar.gz) instead of the live node; "
      "without --local, once per node in rank order to replay a whole ring")(
      "only", po::value<std::vector<std::string>>()->composing(),
      "run only these check IDs or groups (comma-separated)")(
      "skip", po::value<std::vector<std::string>>()->composing(), "skip these check IDs or groups")(
      "bandwidth", "also measure TCP throughput per twin between neighbouring nodes")(
      "list-checks", "print every check ID and what it checks, and exit (no cluster file needed)")(
      "fabric",
      "run the fabric self-test instead: NCCL all-reduce and all-gather from 8 KB to 256 MB on "
      "every rank's GPU with the ring's own pins, checked values, bus bandwidth, transports")(
      "bw-seconds", po::value<double>()->default_value(2.0), "length of the bandwidth test")(
      "timeout", po::value<std::string>()->default_value("30s"),
      "deadline for every node's answer")("bw-listen",
                                          po::value<std::vector<std::string>>()->composing(),
                                          "(internal) bandwidth receiver ADDR:PORT")(
      "bw-send", po::value<std::vector<std::string>>()->composing(),
      "(internal) bandwidth sender BIND>ADDR:PORT");
  po::variables_map vm;
  if (auto rc = parse_args(
          ctx, "preflight",
          "preflight [--only IDS] [--skip IDS] [--bandwidth] [--fabric] [--local [--node N]] "
          "[--sysroot DIR|TAR.GZ ...] | --list-checks",
          desc, args, vm))
    return *rc;

  if (vm.count("list-checks")) {  // also what shell completion offers after --only/--skip
    nlohmann::json list = nlohmann::json::array();
    for (const auto& c : env::check_catalog()) {
      if (ctx.opts.json)
        list.push_back({{"id", c.id}, {"summary", c.summary}});
      else
        *ctx.out << fmt::format("{:<14} {}\n", c.id, c.summary);
    }
    if (ctx.opts.json) *ctx.out << list.dump(2) << "\n";
    return 0;
  }

  // The bandwidth test's node side: no config needed.
  if (vm.count("bw-listen") || vm.count("bw-send")) {
    env::BwSpec spec;
    if (vm.count("bw-listen")) spec.listen = vm["bw-listen"].as<std::vector<std::string>>();
    if (vm.count("bw-send")) spec.send = vm["bw-send"].as<std::vector<std::string>>();
    spec.seconds = std::clamp(vm["bw-seconds"].as<double>(), 0.1, 60.0);
    *ctx.out << env::run_bw_node(spec).dump() << "\n";
    return 0;
  }

  env::CheckFilter filter;
  filter.only = ids_of(vm, "only");
  filter.skip = ids_of(vm, "skip");
  if (auto s = env::validate_check_ids(filter.only); !s.ok()) return ctx.fail(s.error());
  if (auto s = env::validate_check_ids(filter.skip); !s.ok()) return ctx.fail(s.error());
  std::string why;
  auto timeout_ms = parse_duration_ms(vm["timeout"].as<std::string>(), &why);
  if (!timeout_ms) return ctx.fail(make_error(Errc::usage, "--timeout: " + why));

  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  bool verbose = ctx.opts.verbose > 0;
  std::vector<std::string> sysroots;
  if (vm.count("sysroot")) sysroots = vm["sysroot"].as<std::vector<std::string>>();
  std::vector<std::unique_ptr<SysrootHandle>> handles;
  for (const auto& s : sysroots) {
    handles.push_back(std::make_unique<SysrootHandle>());
    if (auto st = handles.back()->open(s); !st.ok()) return ctx.fail(st.error());
  }

  env::RingReport rep;
  if (vm.count("local")) {
    if (sysroots.size() > 1)
      return ctx.fail(make_error(Errc::usage, "--local takes one --sysroot"));
    auto node = this_node(*cfg, vm["node"].as<int>());
    if (!node) return ctx.fail(node.error());
    auto t0 = std::chrono::steady_clock::now();
    auto nr = env::run_node_checks(
        *cfg, *node, env::Sysroot(sysroots.empty() ? "/" : handles[0]->dir()), filter, verbose);
    if (ctx.opts.json) {
      *ctx.out << env::report_to_json(nr).dump(2, ' ', false, json::error_handler_t::replace)
               << "\n";
      env::add_checks(&rep, nr.checks);
      return rep.exit_code();
    }
    rep.nodes.push_back(nr);
    env::add_checks(&rep, nr.checks);
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } else if (!sysroots.empty()) {
    if (sysroots.size() != cfg->nodes.size())
      return ctx.fail(make_error(
          Errc::usage, fmt::format("replaying a ring needs one --sysroot per node ({} given, "
                                   "{} nodes)",
                                   sysroots.size(), cfg->nodes.size())));
    std::vector<std::string> dirs;
    for (const auto& h : handles) dirs.push_back(h->dir());
    auto t0 = std::chrono::steady_clock::now();
    rep = env::replay_ring(*cfg, dirs, filter, verbose);
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } else if (vm.count("fabric")) {
    PreflightRun run;
    run.verbose = verbose;
    run.timeout = std::chrono::milliseconds(*timeout_ms);
    run.sparkctl_bin = cfg->get("SPARKCTL_BIN");
    if (run.sparkctl_bin.empty()) {
      std::error_code ec;
      auto p = std::filesystem::canonical("/proc/self/exe", ec);
      run.sparkctl_bin = ec ? ctx.argv0 : p.string();
    }
    auto f = run_fabric_preflight(*cfg, run);
    if (ctx.opts.json)
      *ctx.out << fabric_preflight_to_json(f).dump(2) << "\n";
    else
      *ctx.out << render_fabric_preflight(f);
    return f.passed() ? 0 : 1;  // a failed check, as for the other checks
  } else {
    PreflightRun run;
    run.filter = filter;
    run.verbose = verbose;
    run.bandwidth = vm.count("bandwidth") > 0;
    run.bw_seconds = std::clamp(vm["bw-seconds"].as<double>(), 0.1, 60.0);
    run.timeout = std::chrono::milliseconds(*timeout_ms);
    run.sparkctl_bin = cfg->get("SPARKCTL_BIN");
    if (run.sparkctl_bin.empty()) {
      std::error_code ec;
      auto p = std::filesystem::canonical("/proc/self/exe", ec);
      run.sparkctl_bin = ec ? ctx.argv0 : p.string();
    }
    rep = run_ring_preflight(*cfg, run);
  }
  if (ctx.opts.json)
    // Node files may hold any bytes: replace what is not UTF-8 so the report always comes out.
    *ctx.out << env::ring_report_to_json(rep, verbose)
                    .dump(2, ' ', false, json::error_handler_t::replace)
             << "\n";
  else
    *ctx.out << env::format_report_table(rep, verbose);
  return rep.exit_code();
}

}  // namespace spark::cli
