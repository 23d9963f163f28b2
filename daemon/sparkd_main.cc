// sparkd's main, as a library function: options, logging, config, pidfile, the Daemon.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "core/log.h"
#include "core/strings.h"
#include "daemon/daemon.h"
#include "daemon/fabric_rank.h"
#include "daemon/gpu_load.h"

namespace spark::daemon {

namespace {
constexpr std::string_view kComp = "sparkd";

// Keeps LOG, LOG.1 .. LOG.3: each start begins a fresh file so a crash's log survives
// the restart that follows it.
void rotate_log(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec) || fs::file_size(path, ec) == 0) return;
  for (int i = 3; i >= 1; --i) {
    std::string from = i == 1 ? path : path + "." + std::to_string(i - 1);
    fs::rename(from, path + "." + std::to_string(i), ec);
  }
}

// Refuses to start over a live sparkd; replaces a stale pidfile.
Status write_pidfile(const std::string& path) {
  if (auto old = read_file(path)) {
    auto pid = parse_i64(trim(*old));
    if (pid && *pid > 0 && *pid != ::getpid() && ::kill(static_cast<pid_t>(*pid), 0) == 0) {
      return make_error(Errc::busy,
                        "pidfile " + path + " names pid " + std::to_string(*pid) +
                            ", which is running: stop that sparkd first "
                            "(sparkctl stop) or remove the pidfile if it is not sparkd");
    }
  }
  std::string why;
  std::error_code ec;
  auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) ec = make_dirs(parent.string());
  if (!write_file_atomic(path, std::to_string(::getpid()) + "\n", &why, 0640))
    return make_error(Errc::io, "cannot write pidfile " + path + ": " + why);
  return Status::Ok();
}
}  // namespace

int sparkd_main(int argc, const char* const* argv) {
  // `sparkd fabric-rank ...`: one rank of `sparkctl preflight --fabric`, no daemon.
  if (argc > 1 && std::string_view(argv[1]) == "fabric-rank")
    return fabric_rank_main(argc - 1, argv + 1);
  // `sparkd gpu-load ...`: the load of preflight's gpu.throttle, no daemon.
  if (argc > 1 && std::string_view(argv[1]) == "gpu-load") return gpu_load_main(argc - 1, argv + 1);
  auto parsed = parse_daemon_args(argc, argv, std::cout, std::cerr);
  if (std::holds_alternative<int>(parsed)) return std::get<int>(parsed);
  DaemonOptions opts = std::get<DaemonOptions>(std::move(parsed));
  opts.handle_signals = true;
  ::signal(SIGPIPE, SIG_IGN);
  // SIGHUP never kills sparkd: until the daemon's handler (which reopens the log) is in
  // place it is ignored.
  ::signal(SIGHUP, SIG_IGN);

  if (opts.config_path.empty()) {
    const char* env = std::getenv("SPARK_CONFIG");
    if (env && *env) opts.config_path = env;
  }
  if (opts.config_path.empty()) {
    std::cerr << "sparkd: no cluster file: pass --config FILE or set SPARK_CONFIG\n";
    return exit_code(Errc::usage);
  }
  log::set_rank(opts.rank);
  if (!opts.log_file.empty()) {
    std::error_code ec;
    auto parent = std::filesystem::path(opts.log_file).parent_path();
    if (!parent.empty()) ec = make_dirs(parent.string());
    rotate_log(opts.log_file);
    if (!log::set_file(opts.log_file)) {
      std::cerr << "sparkd: cannot open log file " << opts.log_file << ": " << std::strerror(errno)
                << "\n";
      return exit_code(Errc::io);
    }
  }

  std::vector<Diagnostic> diags;
  auto cfg = load_config(opts.config_path, Environment::current(), &diags);
  for (const auto& d : diags)
    if (!d.error) log::warn(kComp, "{}: {}", d.where, d.message);
  if (!cfg) {
    log::error(kComp, "{}", cfg.error().message);
    if (!opts.log_file.empty()) std::cerr << "sparkd: " << cfg.error().message << "\n";
    return exit_code(cfg.error().code);
  }
  log::Level lvl = log::Level::info;
  if (opts.log_level)
    log::parse_level(*opts.log_level, &lvl);
  else if (!cfg->get("LOG_LEVEL").empty())
    log::parse_level(cfg->get("LOG_LEVEL"), &lvl);
  log::set_level(lvl);

  if (!opts.pidfile.empty()) {
    Status st = write_pidfile(opts.pidfile);
    if (!st.ok()) {
      log::error(kComp, "{}", st.message());
      if (!opts.log_file.empty()) std::cerr << "sparkd: " << st.message() << "\n";
      return exit_code(st.code());
    }
  }
  int rc = 0;
  {
    Daemon d(std::move(*cfg), opts);
    Status st = d.start();
    if (!st.ok()) {
      log::error(kComp, "{}", st.message());
      if (!opts.log_file.empty()) std::cerr << "sparkd: " << st.message() << "\n";
      d.request_stop("start failed", exit_code(st.code()));
    }
    rc = d.wait();
  }
  if (!opts.pidfile.empty()) {
    auto cur = read_file(opts.pidfile);
    if (cur && parse_i64(trim(*cur)) == ::getpid()) ::unlink(opts.pidfile.c_str());
  }
  return rc;
}

}  // namespace spark::daemon
