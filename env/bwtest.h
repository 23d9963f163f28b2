#pragma once
// A short TCP throughput test between nodes over one fabric twin: each node listens on its
// twin addresses and sends to its successor's for a few seconds, all at once, so a "200G"
// link silently running at 13 Gb/s shows. Every wait has a deadline.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace spark::env {

/// What one node does: listen on `listen` ("addr:port"), send to `send` ("bind>addr:port").
struct BwSpec {
  std::vector<std::string> listen;
  std::vector<std::string> send;
  double seconds = 2.0;
};

/// Runs the node's part; returns {"sent":[{"from","to","bytes","seconds","gbps","error"}],
/// "received":[{"on","bytes","error"}]}. Never blocks longer than seconds + 10 s.
nlohmann::json run_bw_node(const BwSpec& spec);

}  // namespace spark::env
