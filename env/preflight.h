#pragma once
// Preflight: every known way a ring dies (wrong GID index, missing pins, page cache on
// unified memory, disk, parity, ...) as a check with a stable ID, run on every node at once
// and merged. A node's checks run in one process (`sparkctl preflight --local`)
// and produce a NodeReport; the cross-node checks are pure functions over NodeReports, so
// fixtures test them without a ring. man/sparkctl-preflight.1 documents each ID.
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "env/sysroot.h"

namespace spark::env {

enum class Verdict { pass, warn, fail, skip };
/// "PASS", "WARN", "FAIL", "SKIP".
const char* verdict_name(Verdict v);
std::optional<Verdict> parse_verdict(const std::string& s);

/// One verdict of one check on one node (and subject: an HCA port, a netdev, a peer).
struct CheckResult {
  std::string node;
  std::string id;       // stable check ID, e.g. "rdma.gid"
  std::string subject;  // "rocep1s0f0:1", "enp1s0f0np0", "" for the node as a whole
  Verdict verdict = Verdict::skip;
  std::string message;
  std::string fix;
};

/// A stable check ID and one line about it.
struct CheckInfo {
  const char* id;
  const char* summary;
  bool cross_node;  // computed on the head from all node reports
};
/// All checks, in report order.
const std::vector<CheckInfo>& check_catalog();

/// --only / --skip. An entry is a check ID or a group prefix ("rdma" = rdma.*).
struct CheckFilter {
  std::vector<std::string> only, skip;
  bool enabled(const std::string& id) const;
};
/// Usage error naming an unknown ID (with "did you mean").
Status validate_check_ids(const std::vector<std::string>& ids);

/// One fabric link of a node: a configured HCA/netdev twin and what the node found.
struct LinkFacts {
  std::string hca, netdev, ipv4;
  int mtu = 0;  // 0: unknown
  std::string operstate;
  int64_t speed_mbps = 0;
  std::optional<int> gid_index;  // resolved RoCE v2 index (nullopt: none)
  std::string port_state;        // the HCA's port 1 state ("4: ACTIVE"); "" when unknown
};

/// One IPv4 address of a node, on a netdev (net.addr compares them across nodes).
struct AddrFact {
  std::string netdev, address;
  int prefix = 0;
};

/// What one node found: its verdicts plus the facts the cross-node checks compare.
struct NodeReport {
  std::string node;
  int index = 0;
  std::string hostname;
  std::vector<CheckResult> checks;
  std::map<std::string, std::string> identity;  // sw.parity fields
  std::vector<LinkFacts> links;
  int64_t clock_ms = 0;
  std::string gpu_name;         // "" when unknown
  std::string gpu_cc;           // compute capability of the node's first GPU ("12.1"); "" unknown
  std::vector<AddrFact> addrs;  // every IPv4 but loopback's
  nlohmann::json raw;           // -v: GID tables, meminfo, netdevs, facts
};

nlohmann::json report_to_json(const NodeReport& r);
Result<NodeReport> report_from_json(const nlohmann::json& j);

/// Runs the node checks of node `node_index` of `cfg` on `root`.
NodeReport run_node_checks(const RingConfig& cfg, int node_index, const Sysroot& root,
                           const CheckFilter& filter, bool verbose);

/// A node as the head saw it: its report, or why there is none.
struct NodeOutcome {
  std::string node;
  int index = 0;
  std::optional<NodeReport> report;
  std::optional<Error> error;        // could not reach or run (ssh.reach fails)
  int64_t sent_ms = 0, recv_ms = 0;  // head's clock around the request (clock skew)
  double seconds = 0;
};

/// One don't-fragment ping from a node's twin to a peer's twin.
struct PingResult {
  std::string from_node, to_node, netdev, from_addr, to_addr;
  int payload = 0;  // MTU - 28
  bool ok = false;
  std::string detail;  // ping's last line or the error
};

/// One TCP bandwidth measurement between two nodes over one twin.
struct BandwidthResult {
  std::string from_node, to_node, netdev;
  double gbps = 0;
  int64_t line_rate_mbps = 0;  // 0: unknown
  std::string error;
};

/// Where a rank runs and the GID index its node resolved per HCA (nullopt: none usable).
struct RankSummary {
  int rank = 0;
  std::string node;
  int gpu = 0;
  std::vector<std::pair<std::string, std::optional<int>>> gid_index;  // (hca, index)
};

/// The merged report.
struct RingReport {
  std::vector<RankSummary> ranks;
  std::vector<CheckResult> checks;  // node checks then cross-node checks
  std::vector<NodeReport> nodes;
  std::map<std::string, int> counts;  // "PASS" -> n, ...
  double seconds = 0;
  /// 0 all pass (SKIP allowed), kExitWarnings warnings only, 1 a failure.
  int exit_code() const;
};

/// Exit code of preflight when warnings but no failure were found (documented in
/// sparkctl-preflight(1); 1 = a check failed; 2.. = could not run, as sparkctl(1)).
inline constexpr int kExitWarnings = 15;

/// Merges node outcomes and runs the cross-node checks (ssh.reach, sw.parity, MTU parity,
/// clock). Pure: no I/O.
RingReport merge_reports(const RingConfig& cfg, const std::vector<NodeOutcome>& outcomes,
                         const CheckFilter& filter);

/// Replays a ring from captured trees: node i's checks run on roots[i] (no SSH, no clock).
RingReport replay_ring(const RingConfig& cfg, const std::vector<std::string>& roots,
                       const CheckFilter& filter, bool verbose);

/// The pings net.path needs: every node to every peer, per twin, MTU-28 bytes.
struct PingPlan {
  int node_index = 0;   // who pings
  PingResult probe;     // filled: nodes, netdev, addresses, payload
  std::string command;  // the shell command
};
std::vector<PingPlan> plan_pings(const std::vector<NodeReport>& reports);
/// net.path verdicts from ping outcomes.
std::vector<CheckResult> path_checks(const std::vector<PingResult>& pings);
/// net.bandwidth verdicts (WARN under half the line rate, FAIL under a tenth).
std::vector<CheckResult> bandwidth_checks(const std::vector<BandwidthResult>& runs);
/// Appends checks and recounts.
void add_checks(RingReport* r, const std::vector<CheckResult>& more);

/// Renders the report as a table (node, check, verdict, message, fix).
std::string format_report_table(const RingReport& r, bool verbose);
/// The report as JSON (schema in sparkctl-preflight(1)).
nlohmann::json ring_report_to_json(const RingReport& r, bool verbose);

}  // namespace spark::env
