#pragma once
// Each rank's engine environment (NCCL_*, GLOO_*, CUDA_VISIBLE_DEVICES, rendezvous), rendered
// from the cluster file plus the facts preflight resolved on that rank's node. The start path
// uses exactly this; `sparkctl env --rank N` prints it. Fails closed: a rank whose node has no
// usable RoCE v2 GID gets an error, never an empty NCCL_IB_GID_INDEX (which NCCL reads as 0).
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "env/preflight.h"

namespace spark::env {

/// Ordered NAME=value pairs.
struct RankEnv {
  int rank = 0;
  std::string node;
  std::vector<std::pair<std::string, std::string>> vars;
  /// The value of a variable ("" when not set).
  std::string get(const std::string& name) const;
  /// `export NAME='value'` lines, shell-quoted.
  std::string to_shell() const;
};

/// Renders rank `rank`'s environment; `node` is the preflight report of that rank's node
/// (its links carry the resolved GID indexes and netdev addresses).
Result<RankEnv> render_rank_env(const RingConfig& cfg, int rank, const NodeReport& node);

}  // namespace spark::env
