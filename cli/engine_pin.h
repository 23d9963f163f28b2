#pragma once
// Engine pinning and rollback (ENGINE=exec). `sparkctl start` records the engine set it
// started: on every node (`sparkctl --config - node engine-set --node N`) the container
// image behind the command, by digest, when the command runs one (docker or podman: the
// runtime is asked to inspect each word after `run` until one is an image), else the
// executables the command names with their XXH3 digests; plus the resolved cluster file and
// its digest. The set that reached READY is the last good one. `sparkctl rollback` starts
// the last good set: its cluster file, with the image named by digest (ref@sha256:...), so
// a tag that moved to a broken build no longer matters; a binary that changed since is
// refused (it cannot be brought back). Files, in the head's STATE_DIR (mode 0600: the
// cluster file may hold tokens in ENGINE_EXEC):
//   engine/current.json     the set the last start launched
//   engine/last-good.json   the last set that reached READY
#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "core/config.h"
#include "core/error.h"

namespace spark::cli {

/// The container image a command line runs, as its runtime reports it.
struct ImagePin {
  std::string runtime;  // "docker" or "podman"
  std::string ref;      // as written in the command ("vllm/vllm-openai:nightly")
  std::string id;       // image id ("sha256:...")
  std::string digest;   // first repo digest ("vllm/vllm-openai@sha256:..."), may be empty
};

/// The executables a command line names: absolute paths that are executable files, and its
/// first word (or the word after `exec`) when PATH resolves it.
std::vector<std::string> command_binaries(const std::string& command);

/// On this machine: the image the command runs (nullopt when it runs none or the runtime
/// knows none of its words).
std::optional<ImagePin> image_of_command(const std::string& command);

/// On this machine, as node `node`: {"node", "image"?: {...}, "binaries": [{path, xxh3}]}.
nlohmann::json engine_set_here(const RingConfig& cfg, int node);

/// What one start launched.
struct EngineSet {
  int64_t at_ms = 0;
  std::string engine;                              // ENGINE
  std::string command;                             // ENGINE_EXEC as started
  std::string config_digest;                       // RingConfig::digest()
  std::string config_text;                         // the resolved cluster file (config_wire_text)
  nlohmann::json nodes = nlohmann::json::array();  // engine_set_here per node
  bool ready = false;
  std::string error;  // a node that did not answer
};

/// Asks every node for its engine set (all at once).
EngineSet collect_engine_set(const RingConfig& cfg, const std::string& sparkctl_bin,
                             const std::string& config_text, std::chrono::milliseconds timeout);

/// STATE_DIR/engine/current.json and last-good.json.
Status write_engine_set(const std::string& state_dir, const char* which, const EngineSet& s);
std::optional<EngineSet> read_engine_set(const std::string& state_dir, const char* which);
/// The current set reached READY: it becomes the last good one.
Status mark_last_good(const std::string& state_dir);

nlohmann::json to_json(const EngineSet& s);
EngineSet engine_set_from_json(const nlohmann::json& j);

/// The command with the image `ref` replaced by the pinned name (ref@digest, else the id).
std::string pin_command(const std::string& command, const ImagePin& pin);

/// The cluster file that starts `last` again: its cluster text with ENGINE_EXEC pinned.
/// Errc::integrity naming the node and binary when an executable changed since (`now` is
/// the set the nodes report now), or when the nodes disagree about the image.
Result<RingConfig> rollback_config(const EngineSet& last, const EngineSet& now);

/// One line for status: "image vllm/vllm-openai:nightly sha256:1234abcd...; config ...".
std::string describe_set(const EngineSet& s);

/// sparkctl rollback.
int cmd_rollback(Context& ctx, const std::vector<std::string>& args);

}  // namespace spark::cli
