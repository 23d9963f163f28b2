#pragma once
// A lifecycle test ring of 2-4 ranks, each rank on its own network-namespace host behind a
// real sshd, driven by a head in a namespace of its own (host 0, outside the ring):
//   host 0        the head: sparkctl runs here (ip netns exec), reaches every node over SSH
//   host r+1      rank r: sshd on port 22, NODE<r>_SSH=<user>@<ip>:22, NODE<r>_FABRIC_IP=<ip>
// joined by a bridge (veths, names with the pid: see netns.h). The cluster file runs ENGINE=exec
// with the fault-injection server (spark_fault_server, a test fixture) as every rank's engine
// on 127.0.0.1:<engine_port> of the rank's namespace; fault_once() makes one rank's next
// engine misbehave. Intervals and timeouts are short (heartbeats 200 ms, stall 2 s).
//
// Everything goes away with the object, also after a failed test: the namespaces are deleted
// after every process inside them is killed (sparkd, engines, sshd), then the directory.
// sshd dies with the thread that started it: create() and use the ring on one thread (the
// test's). Needs root, iproute2 and sshd: check ring_unavailable_reason() (ring.h) and skip.
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/process.h"
#include "support/netns.h"
#include "support/sshd.h"
#include "support/tempdir.h"

namespace spark::test {

struct NetnsRingOptions {
  int ranks = 2;                            // 2..4
  std::string sparkctl_bin{};               // the build's sparkctl (head and nodes)
  std::string sparkd_bin{};                 // the build's sparkd
  std::string fault_server_bin{};           // spark_fault_server
  std::vector<std::string> extra_config{};  // more cluster-file lines (later lines win)
};

/// What one sparkctl run gave: exit status (-1: did not run, -2: timed out), output, and the
/// stdout parsed as JSON (discarded when it is not JSON).
struct CtlRun {
  int rc = -1;
  std::string out, err;
  nlohmann::json j;
  std::string all() const;
};

/// Runs a sparkctl command line and captures its exit status, output and parsed JSON
/// (rc -2 on timeout, -1 with err set when it could not be run).
CtlRun run_ctl(const ProcessSpec& spec);

class NetnsRing {
 public:
  static constexpr int kApiPort = 18080;
  static constexpr int kRdzvPort = 29551;
  static constexpr int kEnginePort = 18090;

  static Result<std::unique_ptr<NetnsRing>> create(const NetnsRingOptions& opts);
  ~NetnsRing();
  NetnsRing(const NetnsRing&) = delete;
  NetnsRing& operator=(const NetnsRing&) = delete;

  int ranks() const { return opts_.ranks; }
  NetNs& net() { return *net_; }
  /// The network namespace of rank r (host r+1) and of the head (host 0).
  const std::string& rank_ns(int rank) const { return net_->ns(rank + 1); }
  const std::string& head_ns() const { return net_->ns(0); }
  /// Node name of rank r in the cluster file ("node<r>").
  static std::string node_name(int rank);
  const std::string& config() const { return config_; }
  const TempDir& dir() const { return dir_; }
  /// A file under STATE_DIR (shared by head and nodes: one filesystem).
  std::string state(const std::string& file) const;

  /// Environment overrides for every sparkctl run (the environment wins over the file).
  std::map<std::string, std::string> env;

  /// The argv that runs sparkctl with `args` inside the head's namespace (for test::Child).
  std::vector<std::string> sparkctl_argv(const std::vector<std::string>& args) const;
  /// Runs sparkctl with `args` in the head's namespace; `json`: adds --json first.
  CtlRun ctl(const std::vector<std::string>& args,
             std::chrono::milliseconds timeout = std::chrono::seconds{90}) const;
  CtlRun ctl_json(std::vector<std::string> args,
                  std::chrono::milliseconds timeout = std::chrono::seconds{90}) const;

  /// Rank r's next engine start runs `mode` after `after` (see fault_server_main.cc); once.
  void fault_once(int rank, const std::string& mode, const std::string& after) const;
  /// Rank 0's /health, asked from inside its namespace (it binds loopback there).
  std::optional<nlohmann::json> health() const;
  /// Polls health() every 100 ms until pred holds; false at `limit`.
  bool wait_health(const std::function<bool(const nlohmann::json&)>& pred,
                   std::chrono::milliseconds limit) const;

  /// Every sparkd or engine process still inside a rank's namespace, and every listener on
  /// the ring's ports there, as "rank R (ns N): what" lines; empty when nothing is left.
  std::vector<std::string> leftovers() const;
  /// The sparkd processes of the ring inside rank r's namespace (pids).
  std::vector<int> sparkd_pids(int rank) const;

  /// Every rank's sparkd log and captured output, for failure messages.
  std::string logs() const;
  /// What the alert command recorded (one "EVENT REASON" line per alert).
  std::string alerts() const;
  /// STATE_DIR/watch.json, parsed.
  nlohmann::json watch_record() const;

 private:
  NetnsRing() = default;
  NetnsRingOptions opts_;
  TempDir dir_{"spark-nsring"};
  std::unique_ptr<NetNs> net_;               // after the sshds: kills what is left inside
  std::vector<std::unique_ptr<Sshd>> sshd_;  // one per rank
  std::string config_;
};

/// True when pid runs and is not a zombie.
bool pid_alive(int pid);

}  // namespace spark::test
