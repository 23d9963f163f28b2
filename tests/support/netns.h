#pragma once
// Test hosts as Linux network namespaces: N namespaces ("hosts") joined by veth pairs,
// point to point (2 hosts) or through a bridge in its own namespace (any number), each host
// with one IPv4 address per link. Names carry the pid, so concurrent test runs do not
// collide; addresses are in 10.254.<pid%250>.0/24 (link 0), 10.253.<pid%250>.0/24 (link 1)
// and so on, which exist only inside these namespaces. The destructor removes everything
// (processes left inside are killed); namespaces of crashed runs are swept at the next
// create(). Needs root and iproute2: check netns_unavailable_reason() and skip.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/process.h"

namespace spark::test {

/// Why network namespaces cannot be used here ("" when they can). Tests print
/// "SKIP: <reason>" and return when it is not empty.
std::string netns_unavailable_reason();

/// Runs `fn` on a fresh thread that has joined network namespace `ns` (sockets it opens
/// live there), and waits for it. Errc::not_found when the namespace does not exist.
Status run_in_netns(const std::string& ns, const std::function<void()>& fn);

/// Runs `command` with /bin/sh -c inside namespace `ns` (ip netns exec).
Result<ProcessResult> exec_in_netns(const std::string& ns, const std::string& command,
                                    std::chrono::milliseconds timeout = std::chrono::seconds{30});

/// Removes namespaces left by test processes that no longer run; returns how many.
int sweep_stale_netns();

/// The shape of the test network.
struct NetNsOptions {
  int hosts = 2;               // 2..32
  int links = 1;               // parallel links per host (a cable's twin ports), 1..4
  int mtu = 1500;              // on every veth
  bool bridge = false;         // forced on when hosts > 2
  std::string ifname = "fab";  // link l is "<ifname><l>" inside each host
};

/// A set of hosts; see the file comment.
class NetNs {
 public:
  /// Creates the namespaces, links and addresses; on failure nothing is left behind.
  static Result<std::unique_ptr<NetNs>> create(const NetNsOptions& opts = {});
  ~NetNs();
  NetNs(const NetNs&) = delete;
  NetNs& operator=(const NetNs&) = delete;

  int hosts() const { return static_cast<int>(ns_.size()); }
  int links() const { return opts_.links; }
  /// Namespace name of host i (for ip netns exec / ip -n).
  const std::string& ns(int host) const { return ns_.at(static_cast<size_t>(host)); }
  /// Namespace holding the bridges ("" when point to point).
  const std::string& switch_ns() const { return switch_ns_; }
  /// IPv4 address of host i on link l ("10.254.17.1").
  std::string ip(int host, int link = 0) const;
  /// Prefix length of every link's subnet (24).
  int prefix_len() const { return 24; }
  /// Interface name of link l inside every host ("fab0").
  std::string ifname(int link = 0) const;
  /// Sets the MTU of host i's link l (both ends of its veth).
  Status set_mtu(int host, int link, int mtu);
  /// Runs a shell command inside host i.
  Result<ProcessResult> exec_in(int host, const std::string& command,
                                std::chrono::milliseconds timeout = std::chrono::seconds{30}) const;
  /// Runs fn on a thread inside host i (see run_in_netns).
  Status run_in(int host, const std::function<void()>& fn) const;

 private:
  NetNs() = default;
  Status build();
  void teardown();
  NetNsOptions opts_;
  std::string prefix_;  // "spk<pid>-<seq>"
  std::vector<std::string> ns_;
  std::string switch_ns_;
  int octet_ = 0;  // third octet of every address
};

}  // namespace spark::test
