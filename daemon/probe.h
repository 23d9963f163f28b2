#pragma once
// The readiness probe: a port that answers is not a model that can prefill. Once every rank
// reports ready, rank 0 sends one real completion through the engine and checks the text;
// on an RDMA fabric it also checks that the HCA port counters of rank 0's node moved during
// the probe (traffic crossed the fabric, not a socket fallback). READY waits for it.
#include <chrono>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"

namespace spark::daemon {

class Backend;

/// What the probe found.
struct ProbeResult {
  std::string status = "pending";  // pending, passed, failed, skipped
  std::string reason;              // why failed/skipped
  std::string text;                // the completion
  double seconds = 0;
  bool rdma_checked = false;
  uint64_t rdma_bytes = 0;  // port_xmit_data + port_rcv_data delta (4-byte words)
  std::string rdma_note;
  int attempts = 0;
};
nlohmann::json to_json(const ProbeResult& p);

/// Sum of port_xmit_data + port_rcv_data over the HCAs' ports under <root>/sys/class/
/// infiniband; nullopt when none of them is readable.
std::optional<uint64_t> read_rdma_counters(const std::string& root,
                                           const std::vector<std::string>& hcas);

struct ProbeSpec {
  std::string prompt = "The capital of France is";
  std::string expect;  // substring the text must contain; empty: any text
  std::chrono::milliseconds timeout{120000};
  std::vector<std::string> hcas;  // rank 0 node's HCAs; empty: no RDMA check
  bool check_rdma = false;        // world > 1 and HCAs configured
  std::string root = "/";
};
/// From PROBE_PROMPT, PROBE_EXPECT, NODE0_HCAS (checked when the ring has >1 rank).
ProbeSpec probe_spec(const RingConfig& cfg);

/// Runs one probe through the engine (blocking; never on a reactor).
ProbeResult run_probe(Backend& engine, const ProbeSpec& spec);

}  // namespace spark::daemon
