#pragma once
// Commands that move and manage model weights: manifest, cache-stat, evict, stage-weights,
// and the internal halves stage-recv / stage-send that stage-weights starts over SSH.
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "core/manifest.h"

namespace spark::cli {

int cmd_manifest(Context& ctx, const std::vector<std::string>& args);
int cmd_cache_stat(Context& ctx, const std::vector<std::string>& args);
int cmd_evict(Context& ctx, const std::vector<std::string>& args);
int cmd_stage_weights(Context& ctx, const std::vector<std::string>& args);
int cmd_stage_recv(Context& ctx, const std::vector<std::string>& args);
int cmd_stage_send(Context& ctx, const std::vector<std::string>& args);

/// The manifest of `dir`, reusing DIR/.sparkctl-manifest.json when every file still has the
/// recorded size and mtime and no file was added; otherwise hashed again and rewritten.
/// *rebuilt says which.
Result<Manifest> current_manifest(const std::string& dir, uint64_t chunk_size, bool* rebuilt);

}  // namespace spark::cli
