#pragma once
// The health history from the head: `sparkctl status --history [--node N] [--since D]`
// asks each node (`sparkctl --config - node history --node N`, JSON) for its ranks' samples
// (core/health_history.h) and shows a sparkline per series, with the events: state changes,
// ranks lost or back (as the sampling rank saw them), reboots (a new boot id), GPU throttle
// reasons, and gaps (a freeze or a power cut: no samples for several intervals).
#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/health_history.h"

namespace spark::cli {

/// On this machine, as node `node`: every rank's samples newer than `since_ms` (wall
/// clock; 0: all), as {"node", "ranks": [{"rank", "path", "samples": [...], "error"?}]}.
nlohmann::json history_here(const RingConfig& cfg, int node, int64_t since_ms);

/// One rank's history as the head got it.
struct RankHistory {
  int rank = 0;
  std::string node;
  std::vector<HealthSample> samples;
  std::string error;  // node unreachable, no history file, ...
};

/// Asks the nodes (all, or only `node` when >= 0) for their history since `since_ms`.
std::vector<RankHistory> collect_history(const RingConfig& cfg, const std::string& sparkctl_bin,
                                         int node, int64_t since_ms,
                                         std::chrono::milliseconds timeout);

/// A sparkline of `width` columns (each the mean of its samples; a blank where unknown).
std::string sparkline(const std::vector<double>& values, int width);

/// The events in a rank's samples, oldest first ("12:01:05 rank 1 lost", "... reboot", ...);
/// `interval_ms` is HEALTH_SAMPLE_INTERVAL (a gap of more than three of them is named).
std::vector<std::string> history_events(const std::vector<HealthSample>& s, int64_t interval_ms);

/// The text `status --history` prints.
std::string render_history(const std::vector<RankHistory>& h, int64_t interval_ms, int width);

nlohmann::json to_json(const std::vector<RankHistory>& h, int64_t interval_ms);

}  // namespace spark::cli
