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

/// What a command printed and how it ended, for a command run on this machine.
struct LocalRun {
  int exit_status = -1;
  std::string out;
};
/// Runs `sh -c command` here with `input` on stdin, capturing stdout (stderr passes through)
/// until the command exits or `timeout` passes (then it is killed and an Errc::timeout
/// naming `who` is returned).
Result<LocalRun> run_local(const std::string& command, const std::string& input,
                           std::chrono::milliseconds timeout, const std::string& who);

/// Quotes a word for /bin/sh.
std::string shell_quote(const std::string& s);

}  // namespace spark::cli
