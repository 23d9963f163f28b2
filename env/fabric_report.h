#pragma once
// The fabric self-test's report and verdict, without NCCL or CUDA: the sweep's sizes and
// nccl-tests' bandwidth arithmetic, the parser of NCCL's own INIT/NET debug output (the
// transport per peer), the verdict (wrong values, sockets where RDMA was configured, an HCA
// or GID index other than the pins, bus bandwidth under FABRIC_MIN_BUSBW), and the table and
// JSON. sparkd runs the sweep (daemon/engine/fabric_test.h); sparkctl, which links neither
// the engine nor CUDA, reads the ranks' reports for `preflight --fabric`. Tested against
// NCCL debug outputs of real rings (tests/fixtures/nccl-debug/).
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"

namespace spark::env {

/// One point of the sweep (one collective at one size), in nccl-tests' terms: `bytes` is the
/// whole result buffer (for all-gather, every rank's part together).
struct FabricPoint {
  std::string op;  // "all_reduce" or "all_gather"
  size_t bytes = 0;
  size_t count = 0;  // fp32 elements of the result
  int iters = 0;
  double time_us = 0;  // per operation, device time
  double algbw = 0;    // GB/s (1e9 bytes/s)
  double busbw = 0;    // GB/s, algbw times the collective's bus factor
  uint64_t wrong = 0;
};

/// What this rank's NCCL said about itself in its INIT/NET debug output.
struct NcclTransportFacts {
  std::string network;                  // "IB" or "Socket" ("Using network ..."), "" unknown
  std::vector<std::string> ib_devices;  // "rocep1s0f0:1" in NET/IB's order ("Using [0]...")
  std::string ib_link;                  // "RoCE" or "IB"
  bool ib_no_device = false;  // "NET/IB : No device found." or "Failed to initialize NET plugin IB"
  std::vector<std::string> socket_ifs;  // "enp1s0f0np0:10.10.1.1" (NET/Socket : Using ...)
  std::optional<int> gid_index;         // "NCCL_IB_GID_INDEX set by environment to N."
  std::string version;                  // "2.28.9+cuda13.0"
  struct Peer {
    int peer = -1;
    std::string transport;  // "NET/IB", "NET/Socket", "P2P", "SHM", or NCCL's word
    std::string detail;     // the rest, e.g. "NET/IB/1/GDRDMA", "P2P/CUMEM"
    std::string hca;        // the NET/IB device the channel uses, when it says
  };
  std::vector<Peer> peers;            // one per peer (the first channel to it names it)
  std::vector<std::string> warnings;  // NCCL WARN lines, verbatim after "NCCL WARN "
};

/// Parses NCCL's debug output (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET) of rank `rank`.
NcclTransportFacts parse_nccl_debug(const std::string& text, int rank);

/// What the rank was configured with, to check NCCL's choice against.
struct FabricExpect {
  int rank = 0;
  int world = 1;
  std::string node;
  bool rdma = false;              // NCCL_IB_DISABLE=0 with NCCL_IB_HCA set
  std::vector<std::string> hcas;  // "rocep1s0f0" (NCCL_IB_HCA without '=' and ports)
  std::optional<int> gid_index;   // NCCL_IB_GID_INDEX
  double min_busbw = 0;           // GB/s at the largest size of each collective; 0: none
};

/// The expectation from this process's NCCL_* environment (as `sparkctl env` rendered it).
FabricExpect fabric_expect_from_env(int rank, int world, const std::string& node, double min_busbw);

/// Sizes of the sweep: min_bytes doubling up to max_bytes (both included).
std::vector<size_t> fabric_sizes(size_t min_bytes, size_t max_bytes);
/// nccl-tests' bus factor: 2(n-1)/n for all-reduce, (n-1)/n for all-gather.
double fabric_bus_factor(const std::string& op, int world);
/// Timed iterations for a size: many for small messages, few for large ones.
int fabric_iters(size_t bytes);
/// Fills algbw and busbw of `p` from bytes and time_us.
void fabric_bandwidth(FabricPoint& p, int world);

struct FabricReport {
  int rank = 0;
  int world = 1;
  std::string node;
  std::vector<FabricPoint> points;
  double decode_latency_us_8k = 0;   // all-reduce at 8 KB
  double decode_latency_us_16k = 0;  // all-reduce at 16 KB
  NcclTransportFacts nccl;
  std::vector<std::string> failures;  // empty: passed
  double seconds = 0;
  bool passed() const { return failures.empty(); }
  /// "passed: all-reduce 22.1 GB/s, all-gather 21.9 GB/s at 256 MB, 8 KB in 31 us, NET/IB"
  std::string summary() const;
};

/// The verdict: wrong values, sockets where RDMA was configured, HCAs or GID index other than
/// configured, NCCL warnings, bus bandwidth under the floor. Appends to report.failures.
void judge_fabric(FabricReport& report, const FabricExpect& expect);

nlohmann::json to_json(const FabricReport& r);
Result<FabricReport> fabric_report_from_json(const nlohmann::json& j);
/// nccl-tests-style table (non-data lines start with '#') of one or more ranks' reports.
std::string render_fabric_table(const std::vector<FabricReport>& reports);

}  // namespace spark::env
