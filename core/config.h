#pragma once
// The cluster file model. One .env file describes the whole ring: ring-wide keys plus, per
// node, NODE<i>_<FIELD> keys with i = 0, 1, 2, ... in rank order (node 0 is the head).
// The caller's environment overrides the file, an explicit empty value included. Every
// resolved value remembers where it came from (file:line, environment, default).
// man/sparkctl.env.5 documents every key; keep it in step with kRingKeys / kNodeKeys.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/envfile.h"
#include "core/error.h"

namespace spark {

/// The kinds of value a key holds; each is parsed strictly.
enum class KeyType { string, path, integer, port, size, duration, ipv4, list, gid, choice, boolean };

/// One documented key. For node keys `name` is the suffix after NODE<i>_.
struct KeySpec {
  const char* name;
  KeyType type;
  const char* default_value;  // nullptr: no default (empty)
  const char* choices;        // for KeyType::choice: "a|b|c"
  const char* doc;
};

/// The ring-wide keys.
const std::vector<KeySpec>& ring_keys();
/// The per-node keys (suffixes of NODE<i>_).
const std::vector<KeySpec>& node_keys();
/// The most nodes a ring may have.
inline constexpr int kMaxNodes = 16;

/// One resolved value and its origin.
struct Setting {
  std::string value;
  std::string source;  // "file:line", "environment", "default"
};

/// A warning or an error found while loading; `where` is file:line or "environment".
struct Diagnostic {
  bool error = false;
  std::string where;
  std::string message;
};

/// One node of the ring.
struct NodeConfig {
  int index = 0;
  std::string name;
  std::string ssh;          // "[user@]host[:port]" or "local"
  bool local = false;       // reached without SSH
  std::string ssh_user;     // from ssh target or SSH_USER
  std::string ssh_host;
  int ssh_port = 22;
  std::string fabric_ip;    // IPv4 on the fabric
  std::vector<std::string> netdevs;
  std::vector<std::string> hcas;
  std::optional<int> gid_index;  // nullopt: auto (resolve at start)
  std::string model_path;
  std::vector<int> gpus;    // one rank per GPU; default {0}
};

/// Where one rank runs.
struct RankPlace {
  int rank = 0;
  int node = 0;
  int local_rank = 0;
  int gpu = 0;
};

/// The whole resolved ring.
struct RingConfig {
  std::string path;  // the cluster file
  std::vector<NodeConfig> nodes;
  std::map<std::string, Setting> settings;  // every known key, resolved

  /// The resolved text value of a ring-wide key ("" when unset).
  const std::string& get(const std::string& key) const;
  /// Typed accessors for ring-wide keys (values were validated at load).
  int64_t get_int(const std::string& key) const;
  uint64_t get_size(const std::string& key) const;
  uint64_t get_duration_ms(const std::string& key) const;
  bool get_bool(const std::string& key) const;

  /// All ranks in order: node 0's GPUs first.
  std::vector<RankPlace> ranks() const;
  int world_size() const;
  /// Stable digest of the resolved settings (hex), compared across ranks.
  std::string digest() const;
  /// Canonical KEY=VALUE text of the resolved settings (what the digest covers).
  std::string canonical_text() const;
};

/// The caller's environment, as a seam: tests pass their own.
struct Environment {
  std::map<std::string, std::string> vars;
  /// Captures this process's environment.
  static Environment current();
};

/// Loads, resolves and validates. Returns an error when any Diagnostic is an error (the
/// error message lists them all); warnings are appended to *diags either way.
Result<RingConfig> load_config(const std::string& path, const Environment& env,
                               std::vector<Diagnostic>* diags);
/// Same, from text (for tests and fuzzing).
Result<RingConfig> load_config_text(std::string_view text, std::string_view file,
                                    const Environment& env, std::vector<Diagnostic>* diags);

/// Reads an API key file the way sparkd does at start (and `config check` before it): a
/// regular file of mode 0600 or stricter holding one line, the key, without spaces or
/// control characters. Errc::auth / Errc::config naming the file and the fix.
Result<std::string> read_api_key_file(const std::string& path);

/// True if the address is in a documentation range (192.0.2/24, 198.51.100/24, 203.0.113/24).
bool is_documentation_ipv4(uint32_t ip);

}  // namespace spark
