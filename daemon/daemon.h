#pragma once
// sparkd as a library: parse the command line, load the ring, serve HTTP on rank 0 (the
// listener starts before anything loads and answers 503 "loading" until ready), join the
// ring's rendezvous, start the engine on its own lifecycle thread, watch it, and shut down
// on SIGTERM/SIGINT with a bounded grace. main.cc only calls sparkd_main().
//
// Threads: the HTTP reactor (HttpServer), the control reactor (signals, watchdog timer,
// rendezvous store on rank 0, heartbeats), and the lifecycle thread (rendezvous joins and
// engine start; it may block for minutes and never runs on a reactor).
#include <chrono>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <variant>

#include "core/config.h"
#include "core/error.h"
#include "daemon/backend.h"
#include "daemon/health.h"

namespace spark::daemon {

class Metrics;

/// sparkd's command line.
struct DaemonOptions {
  std::string config_path;
  int rank = 0;
  std::optional<std::string> bind;    // --bind overrides API_BIND
  std::optional<uint16_t> port;       // --port overrides API_PORT (0: any free port)
  std::optional<uint16_t> rdzv_port;  // --rdzv-port overrides RDZV_PORT (0: any free port)
  std::string log_file;               // --log-file: append here (rotated at start)
  std::string pidfile;                // --pidfile: written at start, removed at exit
  std::optional<std::string> log_level;
  std::optional<std::chrono::milliseconds> shutdown_grace;  // --grace
  bool handle_signals = false;  // sparkd_main: SIGTERM/SIGINT stop the daemon
  std::string proc_root = "/";  // /proc/meminfo is read under this root (tests: a fixture)
};

/// Parses argv. Returns the options, or an exit code when the program must stop now
/// (--help / --version printed: 0; usage error printed: exit_code(Errc::usage)).
std::variant<DaemonOptions, int> parse_daemon_args(int argc, const char* const* argv,
                                                   std::ostream& out, std::ostream& err);

/// Timing knobs resolved from the config (tests shorten them).
struct DaemonTiming {
  std::chrono::milliseconds shutdown_grace{10000};
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds heartbeat_timeout{5000};
  std::chrono::milliseconds join_timeout{120000};
  std::chrono::milliseconds stall_timeout{60000};
  std::chrono::milliseconds watchdog_period{250};
};
/// Timing from the ring's keys (SHUTDOWN_GRACE, HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT,
/// JOIN_TIMEOUT, STALL_TIMEOUT).
DaemonTiming timing_from_config(const RingConfig& cfg);

/// True for 127.0.0.0/8.
bool is_loopback(const std::string& ipv4);

class Daemon {
 public:
  /// `engine` null: the backend ENGINE names.
  Daemon(RingConfig cfg, DaemonOptions opts, std::unique_ptr<Backend> engine = nullptr);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  /// Overrides timing (before start()).
  void set_timing(const DaemonTiming& t);
  /// Starts the listener (rank 0), the control reactor and the lifecycle thread. Returns an
  /// error when the listener or rendezvous port cannot be bound or the API key is missing.
  Status start();
  /// Rank 0's bound HTTP port (0 on other ranks).
  uint16_t http_port() const;
  /// Rank 0's bound rendezvous port.
  uint16_t rdzv_port() const;
  /// Asks the daemon to stop (thread-safe). `exit_code` is what wait() returns.
  void request_stop(const std::string& why, int exit_code = 0);
  /// Blocks until a stop is requested, then stops everything (HTTP grace, engine stop) and
  /// returns the exit code.
  int wait();
  /// What /health reports now.
  HealthSnapshot snapshot() const;
  /// The metrics registry /metrics renders (the engine adds its counters through it).
  Metrics& metrics();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// Everything sparkd's main does; returns the process exit code.
int sparkd_main(int argc, const char* const* argv);

}  // namespace spark::daemon
