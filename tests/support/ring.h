#pragma once
// A test ring: N network-namespace hosts joined by `links` twin links, a real sshd on port
// 22 in every host but the head (host 0, reached as NODE0_SSH=local), one known_hosts file,
// a small model directory, and a cluster file naming it all. Used by the preflight e2e tests
// and the preflight benchmark. Needs root, iproute2 and sshd: check ring_unavailable_reason().
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/process.h"
#include "support/netns.h"
#include "support/sshd.h"
#include "support/tempdir.h"

namespace spark::test {

struct TestRingOptions {
  int nodes = 2;
  int links = 2;
  int mtu = 9000;
  std::string sparkctl_bin{};               // the sparkctl every node runs (same filesystem)
  std::vector<std::string> extra_config{};  // more cluster-file lines
};

/// Why a test ring cannot be built here ("" when it can).
std::string ring_unavailable_reason();

class TestRing {
 public:
  static Result<std::unique_ptr<TestRing>> create(const TestRingOptions& opts);
  NetNs& net() { return *net_; }
  Sshd& sshd(int node) { return *sshd_.at(static_cast<size_t>(node - 1)); }
  /// The cluster file.
  const std::string& config() const { return config_; }
  /// known_hosts holding every node's host key.
  const std::string& known_hosts() const { return known_hosts_; }
  const std::string& dir() const { return dir_.path(); }
  /// Runs sparkctl (SPARKCTL_BIN of the build) with `args` inside the head's namespace.
  Result<ProcessResult> sparkctl(const std::string& args,
                                 std::chrono::milliseconds timeout = std::chrono::seconds{
                                     60}) const;

 private:
  TestRing() = default;
  TempDir dir_{"spark-ring"};
  std::unique_ptr<NetNs> net_;
  std::vector<std::unique_ptr<Sshd>> sshd_;
  std::string config_, known_hosts_, sparkctl_bin_;
};

}  // namespace spark::test
