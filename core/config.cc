#include "core/config.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/strings.h"

extern char** environ;

namespace spark {

// The ring-wide keys. Keep man/sparkctl.env.5 in step (a test checks every key is there).
const std::vector<KeySpec>& ring_keys() {
  static const std::vector<KeySpec> k = {
      {"RING_NAME", KeyType::string, "spark", nullptr, "Name of the ring; names its state directory."},
      {"MODEL", KeyType::string, nullptr, nullptr, "Model name served on the API (default: the last component of MODEL_PATH)."},
      {"MODEL_PATH", KeyType::path, nullptr, nullptr, "Model directory on every node unless NODE<i>_MODEL_PATH says otherwise."},
      {"ENGINE", KeyType::choice, "native", "native|exec", "Engine backend: our own engine (native) or an external command (exec)."},
      {"ENGINE_EXEC", KeyType::string, nullptr, nullptr, "Command run per rank when ENGINE=exec (sh -c, with the rank's environment)."},
      {"ENGINE_HEALTH_URL", KeyType::string, nullptr, nullptr, "Health URL of the external engine (ENGINE=exec)."},
      {"ENGINE_HEALTH_RANKS", KeyType::choice, "all", "all|0", "Which ranks poll ENGINE_HEALTH_URL: all, or 0 (followers are ready while their engine process runs)."},
      {"ENGINE_API_URL", KeyType::string, nullptr, nullptr, "OpenAI-compatible base URL of the external engine (ENGINE=exec), for the readiness probe."},
      {"PROBE_PROMPT", KeyType::string, "The capital of France is", nullptr, "Prompt of the readiness probe completion."},
      {"PROBE_EXPECT", KeyType::string, nullptr, nullptr, "Text the probe completion must contain (empty: any non-empty text)."},
      {"API_BIND", KeyType::ipv4, "127.0.0.1", nullptr, "Address rank 0 serves HTTP on; anything but loopback needs API_KEY_FILE."},
      {"API_PORT", KeyType::port, "8000", nullptr, "HTTP port of the OpenAI-compatible API on rank 0."},
      {"API_KEY_FILE", KeyType::path, nullptr, nullptr, "File holding the API key on one line (mode 0600)."},
      {"METRICS_AUTH", KeyType::choice, "api_key", "api_key|none", "Whether GET /metrics needs the API key when API_KEY_FILE is set: api_key (like every other path) or none (open, as vLLM leaves it)."},
      {"API_MAX_CONNECTIONS", KeyType::integer, "512", nullptr, "Open HTTP connections rank 0 accepts in all (0 = no limit); one more is answered 503."},
      {"API_MAX_CONNECTIONS_PER_PEER", KeyType::integer, "128", nullptr, "Open HTTP connections rank 0 accepts from one client address (0 = no limit)."},
      {"RDZV_PORT", KeyType::port, "29551", nullptr, "Rendezvous TCP store port on rank 0's fabric address."},
      {"SLOTS", KeyType::integer, "4", nullptr, "Serving slots (concurrent sequences) per ring."},
      {"CONTEXT_LEN", KeyType::integer, "4096", nullptr, "Context length in tokens per slot."},
      {"PREFILL_CHUNK", KeyType::integer, "256", nullptr, "Tokens one engine step computes (at least SLOTS): every decoding request's next token, the rest shared evenly among prompts being prefilled, so a long prompt prefills in chunks between the others' tokens."},
      {"KV_DTYPE", KeyType::choice, "auto", "auto|bf16|fp16|fp8|fp32", "KV cache element type (native engine: auto = bf16 on a GPU, fp32 on the CPU; fp8 = e4m3, one byte a value on a GPU; fp16 is refused)."},
      {"DEVICE", KeyType::choice, "auto", "auto|cpu|cuda", "What the native engine computes on: auto = the GPU when one is usable, else the CPU (the reason is logged and shown in /health); a GPU this build has no kernels for fails the start instead."},
      {"WEIGHTS_PLACEMENT", KeyType::choice, "auto", "auto|device|host-mapped", "Where a GPU rank keeps its weights: device memory (device), or one page-locked host allocation the GPU reads in place, filled straight from the files (host-mapped: on unified memory the weights then exist once; on a discrete GPU reads cross the bus). auto = host-mapped on an integrated GPU (GB10), device elsewhere."},
      {"KV_LAYOUT", KeyType::choice, "auto", "auto|native|vllm", "Whose KV records plan and preflight size: ours (native), vLLM's, or auto (native with ENGINE=native, vllm with ENGINE=exec)."},
      {"CONTEXT_SPLIT", KeyType::integer, "1", nullptr, "Ranks that split each sequence's tokens (decode context parallel); divides the per-token KV of every attention layer."},
      {"EXPERT_PARALLEL", KeyType::choice, "auto", "auto|tp|ep", "How a mixture-of-experts model's routed experts spread over the ranks: a share of every expert's intermediate dimension on each rank (tp: one all-reduce per MoE layer, as a dense MLP), or whole experts per rank (ep). auto = tp where the ranks split each expert into equal shares of whole quantization blocks, else ep. plan, /health and status say which is used and why."},
      {"MEM_FREE_MIN", KeyType::size, "1GiB", nullptr, "MemFree every node needs before start."},
      {"MEM_AVAILABLE_MIN", KeyType::size, "2GiB", nullptr, "MemAvailable every node needs."},
      {"MEM_RESERVE", KeyType::size, "4GiB", nullptr, "Memory kept free per node beyond weights and KV cache."},
      {"KV_OVERHEAD", KeyType::size, "0", nullptr, "KV cache memory the engine charges per rank beyond the per-token records and per-sequence states plan derives from config.json (for vLLM on hybrid models, the constant of its own KV figures); planned as KV."},
      {"MEM_WORKSPACE", KeyType::size, "0", nullptr, "Activation and graph workspace the engine takes per rank, planned on top of weights and KV."},
      {"MEM_MTP", KeyType::size, "0", nullptr, "Memory per rank of a multi-token-prediction layer the engine loads besides the files' weights."},
      {"MEM_VISION", KeyType::size, "0", nullptr, "Memory per rank of a vision tower (weights not in the files, encoder cache)."},
      {"MEM_WAIT", KeyType::duration, "120s", nullptr, "How long start waits for MEM_FREE_MIN on every node."},
      {"DISK_MAX_USE", KeyType::integer, "85", nullptr, "Highest disk use in percent allowed after staging."},
      {"LINK_SPEED_MIN", KeyType::string, "auto", nullptr, "Lowest fabric link speed in Gb/s; auto = 200 on GB10, else no floor."},
      {"MTU_MIN", KeyType::integer, "9000", nullptr, "MTU below which preflight warns."},
      {"STATE_DIR", KeyType::path, nullptr, nullptr, "State directory (markers, pidfiles, counters), shared by every user of the ring; default /var/lib/sparkctl/RING_NAME when that exists, else ~/.local/state/sparkctl/RING_NAME."},
      {"LOG_DIR", KeyType::path, nullptr, nullptr, "Log directory on every node; default STATE_DIR/logs."},
      {"SPARKD_BIN", KeyType::path, nullptr, nullptr, "Path of sparkd on the nodes; default: PREFIX/sbin/sparkd of this sparkctl, beside it, the build tree, PATH."},
      {"SPARKCTL_BIN", KeyType::path, nullptr, nullptr, "Path of sparkctl on the other nodes (preflight, evict, stage-weights and start run it there); default: the head's own path."},
      {"SSH_USER", KeyType::string, nullptr, nullptr, "SSH user when a node's target names none (default: the current user)."},
      {"SSH_PORT", KeyType::port, "22", nullptr, "SSH port when a node's target names none."},
      {"SSH_IDENTITY", KeyType::path, nullptr, nullptr, "Private key file (default: the agent, then ~/.ssh/id_*)."},
      {"SSH_KNOWN_HOSTS", KeyType::path, nullptr, nullptr, "known_hosts file (default ~/.ssh/known_hosts)."},
      {"SSH_TIMEOUT", KeyType::duration, "10s", nullptr, "Connect timeout per node."},
      {"READY_TIMEOUT", KeyType::duration, "30m", nullptr, "How long start waits for READY."},
      {"START_RETRIES", KeyType::integer, "0", nullptr, "Extra start attempts after a failed start."},
      {"WATCH_FAILURES", KeyType::integer, "3", nullptr, "Consecutive failed checks before watch restarts the ring."},
      {"WATCH_GRACE", KeyType::duration, "30m", nullptr, "Start-up grace period during which watch does not restart."},
      {"WATCH_MAX_RESTARTS", KeyType::integer, "3", nullptr, "Restarts allowed per WATCH_WINDOW before GAVE_UP."},
      {"WATCH_WINDOW", KeyType::duration, "6h", nullptr, "Window for WATCH_MAX_RESTARTS."},
      {"WATCH_ALERT_CMD", KeyType::string, nullptr, nullptr, "Command run on heal and on give-up."},
      {"WATCH_BACKOFF", KeyType::duration, "5m", nullptr, "Least time between two watch restarts; doubles with each restart in WATCH_WINDOW."},
      {"KNOWN_BAD_FILE", KeyType::path, nullptr, nullptr, "More known-bad versions (JSON, as the built-in list), read on each node by preflight's sw.known_bad."},
      {"START_CHECKS", KeyType::list, nullptr, nullptr, "Preflight checks start runs, fail-closed (IDs or groups); default every check but net.bandwidth."},
      {"STOP_GRACE", KeyType::duration, "30s", nullptr, "How long stop waits after SIGTERM before SIGKILL of a rank."},
      {"STAGE_STREAMS", KeyType::integer, "4", nullptr, "TCP streams per target for stage-weights."},
      {"STAGE_CHUNK_SIZE", KeyType::size, "64MiB", nullptr, "Manifest chunk size: the unit of per-chunk verification and of resume."},
      {"STAGE_TIMEOUT", KeyType::duration, "120s", nullptr, "stage-weights: how long a network read or write may stall before the peer is declared gone."},
      {"CHAT_FORMAT", KeyType::choice, "auto", "auto|template|llama3|chatml|mistral", "Chat format of the model; auto renders the checkpoint's chat template, else detects a built-in format from the architecture and the vocabulary."},
      {"TEMPLATE_MAX_STEPS", KeyType::integer, "10000000", nullptr, "Work budget of one chat template render (evaluated nodes, loop iterations, list items and 32-byte pieces of text built); a render past it is answered 400."},
      {"TEMPLATE_TIMEOUT", KeyType::duration, "5s", nullptr, "Wall time one chat template render may take (0: no wall-time limit; the step budget still applies); a render past it is answered 400."},
      {"CHAT_SPECIAL_TOKENS", KeyType::choice, "escape", "escape|allow", "Special-token spellings in chat message content: escape (read as plain text) or allow (they become the tokens)."},
      {"LOG_LEVEL", KeyType::choice, "info", "debug|info|warn|error", "Log level of sparkd."},
      {"SHUTDOWN_GRACE", KeyType::duration, "10s", nullptr, "How long sparkd lets requests in flight finish after SIGTERM."},
      {"HEARTBEAT_INTERVAL", KeyType::duration, "1s", nullptr, "How often follower ranks send heartbeats to rank 0."},
      {"HEARTBEAT_TIMEOUT", KeyType::duration, "5s", nullptr, "Silence after which rank 0 reports a follower dead (fatal)."},
      {"JOIN_TIMEOUT", KeyType::duration, "120s", nullptr, "Deadline for every rank to join rendezvous and for each barrier."},
      {"STALL_TIMEOUT", KeyType::duration, "60s", nullptr, "Age of an engine call after which sparkd reports stalled."},
      {"HEALTH_SAMPLE_INTERVAL", KeyType::duration, "10s", nullptr, "How often sparkd writes a health sample (memory, PSI, GPU clocks, power, throttle reasons, tokens/s) to its on-disk history (0 = off)."},
      {"HEALTH_HISTORY_SAMPLES", KeyType::integer, "8640", nullptr, "Samples the health history of each rank keeps (256 bytes each; 8640 = one day at 10 s)."},
      {"MEM_GUARD_WAIT", KeyType::size, "4GiB", nullptr, "MemAvailable under which sparkd holds new requests back (0 = off)."},
      {"MEM_GUARD_CANCEL", KeyType::size, "2GiB", nullptr, "MemAvailable under which sparkd cancels the newest request (0 = off)."},
      {"BENCH_MEM_MIN", KeyType::size, "2GiB", nullptr, "sparkctl bench cancels its run when a node's MemAvailable stays under this for 3 samples 5 s apart."},
      {"MEM_GUARD_MAX_WAIT", KeyType::duration, "30s", nullptr, "How long a held-back request waits for memory before it fails."},
      {"COLLECTIVE", KeyType::choice, "auto", "auto|gloo|nccl", "How the native engine's ranks talk: nccl (device data plane over NCCL, control plane over Gloo), gloo (everything over Gloo on the CPU), or auto (nccl when the ring has several ranks, a GPU and libnccl)."},
      {"NVLS_ENABLE", KeyType::boolean, "false", nullptr, "Let NCCL use NVLink multicast (NCCL_NVLS_ENABLE); off by default."},
      {"FABRIC_TEST", KeyType::boolean, "true", nullptr, "Run the fabric self-test (NCCL all-reduce and all-gather sweep) before READY."},
      {"FABRIC_MIN_BUSBW", KeyType::string, "0", nullptr, "Least bus bandwidth in GB/s the fabric self-test accepts at its largest size (0: no floor)."},
  };
  return k;
}

const std::vector<KeySpec>& node_keys() {
  static const std::vector<KeySpec> k = {
      {"NAME", KeyType::string, nullptr, nullptr, "Node name used in reports (default node<i>)."},
      {"SSH", KeyType::string, nullptr, nullptr, "SSH target [user@]host[:port], or 'local' for this machine."},
      {"FABRIC_IP", KeyType::ipv4, nullptr, nullptr, "The node's IPv4 address on the fabric (RoCE) link."},
      {"NETDEVS", KeyType::list, nullptr, nullptr, "Fabric netdev(s), comma-separated (both twins allowed)."},
      {"HCAS", KeyType::list, nullptr, nullptr, "RDMA device(s), comma-separated, in the order of NETDEVS."},
      {"GID_INDEX", KeyType::gid, "auto", nullptr, "RoCE v2 GID index, or auto (resolved at start)."},
      {"MODEL_PATH", KeyType::path, nullptr, nullptr, "Model directory on this node (default MODEL_PATH)."},
      {"GPUS", KeyType::list, "0", nullptr, "GPU ordinals on this node, one rank each."},
  };
  return k;
}

bool is_documentation_ipv4(uint32_t ip) {
  uint32_t net = ip & 0xFFFFFF00u;
  return net == 0xC0000200u || net == 0xC6336400u || net == 0xCB007100u;
}

Environment Environment::current() {
  Environment e;
  for (char** p = environ; p && *p; ++p) {
    std::string_view kv(*p);
    auto eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    e.vars.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return e;
}

const std::string& RingConfig::get(const std::string& key) const {
  static const std::string empty;
  auto it = settings.find(key);
  return it == settings.end() ? empty : it->second.value;
}
int64_t RingConfig::get_int(const std::string& key) const {
  return parse_i64(get(key)).value_or(0);
}
uint64_t RingConfig::get_size(const std::string& key) const {
  return parse_size(get(key), nullptr).value_or(0);
}
uint64_t RingConfig::get_duration_ms(const std::string& key) const {
  return parse_duration_ms(get(key), nullptr).value_or(0);
}
bool RingConfig::get_bool(const std::string& key) const {
  const auto& v = get(key);
  return v == "1" || v == "true" || v == "yes" || v == "on";
}

std::vector<RankPlace> RingConfig::ranks() const {
  std::vector<RankPlace> out;
  int r = 0;
  for (const auto& n : nodes)
    for (size_t l = 0; l < n.gpus.size(); ++l)
      out.push_back(RankPlace{r++, n.index, static_cast<int>(l), n.gpus[l]});
  return out;
}

int RingConfig::world_size() const { return static_cast<int>(ranks().size()); }

std::string RingConfig::canonical_text() const {
  std::string out;
  for (const auto& [k, s] : settings) out += fmt::format("{}={}\n", k, s.value);
  return out;
}

std::string RingConfig::digest() const {
  auto text = canonical_text();
  XXH128_hash_t h = XXH3_128bits(text.data(), text.size());
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

namespace {

struct Raw {
  std::string value;
  std::string source;
  bool from_env = false;
};

// Splits NODE<digits>_<SUFFIX> (SUFFIX: A-Z 0-9 _). A hand-written matcher: std::regex
// recurses per character and overflows the stack on a long key.
bool split_node_key(std::string_view key, std::string_view* digits, std::string_view* suffix) {
  if (!starts_with(key, "NODE")) return false;
  size_t i = 4;
  while (i < key.size() && key[i] >= '0' && key[i] <= '9') ++i;
  if (i == 4 || i >= key.size() || key[i] != '_' || i + 1 == key.size()) return false;
  for (size_t j = i + 1; j < key.size(); ++j) {
    char c = key[j];
    if (!((c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  *digits = key.substr(4, i - 4);
  *suffix = key.substr(i + 1);
  return true;
}

std::string upper(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

// "did you mean" for an unknown key: compared upper-cased, against the ring keys and, for a
// NODE<i>_ key, against the node keys of the same index.
std::string suggest_key(const std::string& key) {
  if (key.size() > 64) return "";  // no key is that long; spare the quadratic distance
  std::string up = upper(key);
  std::vector<std::string> names;
  for (const auto& k : ring_keys()) names.emplace_back(k.name);
  std::string_view digits, suffix;
  std::string prefix = "NODE0_";
  if (split_node_key(up, &digits, &suffix)) prefix = fmt::format("NODE{}_", digits);
  for (const auto& k : node_keys()) names.push_back(prefix + k.name);
  if (std::find(names.begin(), names.end(), up) != names.end()) return up;  // wrong case
  return did_you_mean(up, names);
}

// The line of a diagnostic's `where` ("file:12", "file:12 (empty: default)"); 0 for the
// file as a whole, INT_MAX for the environment, so that sorting puts them first and last.
int diag_order(const std::string& where, std::string_view file) {
  if (where == "environment" || starts_with(where, "environment")) return INT_MAX;
  if (!file.empty() && starts_with(where, file) && where.size() > file.size() &&
      where[file.size()] == ':') {
    size_t i = file.size() + 1, j = i;
    while (j < where.size() && where[j] >= '0' && where[j] <= '9') ++j;
    if (auto n = parse_u64(std::string_view(where).substr(i, j - i)); n && *n < INT_MAX)
      return static_cast<int>(*n);
  }
  return 0;
}

// A Linux interface name: 1-15 bytes, no '/', ':' or whitespace.
bool valid_netdev_name(const std::string& n) {
  if (n.empty() || n.size() > 15 || n == "." || n == "..") return false;
  return n.find_first_of("/: \t") == std::string::npos;
}

// Validates one value against its type; returns an error text or "".
std::string check_value(const KeySpec& spec, const std::string& v) {
  if (v.empty()) return "";
  std::string why;
  switch (spec.type) {
    case KeyType::string:
    case KeyType::path:
    case KeyType::list:
      return "";
    case KeyType::integer:
      if (!parse_i64(v)) return fmt::format("'{}' is not a whole number", v);
      return "";
    case KeyType::port: {
      auto p = parse_u64(v);
      if (!p || *p < 1 || *p > 65535) return fmt::format("port '{}' is out of range 1-65535", v);
      return "";
    }
    case KeyType::size:
      if (!parse_size(v, &why)) return why;
      return "";
    case KeyType::duration:
      if (!parse_duration_ms(v, &why)) return why;
      return "";
    case KeyType::ipv4: {
      auto ip = parse_ipv4(v);
      if (!ip) return fmt::format("'{}' is not an IPv4 address (dotted quad)", v);
      if (is_documentation_ipv4(*ip))
        return fmt::format("{} is a documentation address (RFC 5737), not a real one: put the "
                           "node's own address here", v);
      return "";
    }
    case KeyType::gid: {
      if (v == "auto") return "";
      auto g = parse_u64(v);
      if (!g || *g > 255) return fmt::format("GID index '{}' must be 'auto' or 0-255", v);
      return "";
    }
    case KeyType::choice: {
      auto opts = split_list(spec.choices, '|');
      if (std::find(opts.begin(), opts.end(), v) == opts.end())
        return fmt::format("'{}' is not one of {}", v, spec.choices);
      return "";
    }
    case KeyType::boolean:
      if (v != "0" && v != "1" && v != "true" && v != "false" && v != "yes" && v != "no")
        return fmt::format("'{}' is not a boolean (true/false)", v);
      return "";
  }
  return "";
}

const KeySpec* find_spec(const std::vector<KeySpec>& specs, const std::string& name) {
  for (const auto& s : specs)
    if (name == s.name) return &s;
  return nullptr;
}

// A template placeholder such as <head-ip> or <user@host>: '<', then text without '<' or
// '>' that neither starts nor ends with a space, then '>'. Shell redirections in a command
// ("cmd < in > out") are not placeholders.
bool has_placeholder(const std::string& v) {
  for (size_t lt = v.find('<'); lt != std::string::npos; lt = v.find('<', lt + 1)) {
    size_t gt = v.find_first_of("<>", lt + 1);
    if (gt == std::string::npos || v[gt] != '>' || gt == lt + 1) continue;
    if (v[lt + 1] == ' ' || v[gt - 1] == ' ') continue;
    return true;
  }
  return false;
}

}  // namespace

namespace {

// What load_config_text builds up, step by step: the raw values (file, then environment),
// the node indices seen and where each first appeared, the keys whose values were refused,
// and the diagnostics.
struct Loading {
  RingConfig cfg;
  std::map<std::string, Raw> raw;  // every known key that was set
  std::set<int> node_ids;
  std::map<int, std::string> node_first_where;
  std::set<std::string> refused;  // refused by validate_values; not checked again
  std::vector<Diagnostic>* d = nullptr;
};

// The schema entry of a key: a node key (NODE<i>_SUFFIX, *node = i) or a ring key (*node = -1).
const KeySpec* classify(const std::string& key, int* node, std::string* suffix) {
  std::string_view digits, sfx;
  if (split_node_key(key, &digits, &sfx)) {
    auto idx = parse_u64(digits);
    *node = idx ? static_cast<int>(std::min<uint64_t>(*idx, 1000)) : 1000;
    *suffix = std::string(sfx);
    return find_spec(node_keys(), *suffix);
  }
  *node = -1;
  return find_spec(ring_keys(), key);
}

// The file's entries: unknown keys warned about, node indices noted, repeats warned about.
void read_entries(Loading& L, const std::vector<EnvEntry>& entries) {
  auto& d = *L.d;
  auto& raw = L.raw;
  auto& node_ids = L.node_ids;
  auto& node_first_where = L.node_first_where;
  for (const auto& e : entries) {
    std::string where = fmt::format("{}:{}", e.file, e.line);
    int node = -1;
    std::string suffix;
    const KeySpec* spec = classify(e.key, &node, &suffix);
    if (!spec) {
      // A key that looks like a known one misspelt (MODLE_PATH, api_port) is an error: the
      // ring would otherwise run on the default of the key that was meant. Anything else
      // is ignored with a warning (a variable the file keeps for its own use).
      auto hint = suggest_key(e.key);
      if (hint.empty())
        d.push_back({false, where, fmt::format("unknown key {}; it is ignored", e.key)});
      else
        d.push_back({true, where,
                     fmt::format("unknown key {} (did you mean {}?): fix its spelling, or the "
                                 "ring runs without it",
                                 e.key, hint)});
      continue;
    }
    if (node >= 0) {
      if (node >= kMaxNodes) {
        d.push_back({true, where, fmt::format("{}: node index {} is over the limit of {} nodes",
                                              e.key, node, kMaxNodes)});
        continue;
      }
      node_ids.insert(node);
      node_first_where.emplace(node, where);
    }
    if (auto it = raw.find(e.key); it != raw.end())
      d.push_back({false, where, fmt::format("{} is set again (first at {}); the last value wins",
                                             e.key, it->second.source)});
    raw[e.key] = Raw{e.value, where, false};
  }
}

// The environment overrides, an explicit empty value included.
void apply_environment(Loading& L, const Environment& env) {
  auto& raw = L.raw;
  auto& node_ids = L.node_ids;
  auto& node_first_where = L.node_first_where;
  for (const auto& [k, v] : env.vars) {
    int node = -1;
    std::string suffix;
    const KeySpec* spec = classify(k, &node, &suffix);
    if (!spec) continue;  // the environment holds plenty of unrelated names
    if (node >= kMaxNodes) continue;
    if (node >= 0 && !v.empty()) {  // an empty override clears a key; it adds no node
      node_ids.insert(node);
      node_first_where.emplace(node, "environment");
    }
    raw[k] = Raw{v, "environment", true};
  }
}

// Validates each set value. A key whose value is refused here is not checked again later.
void validate_values(Loading& L) {
  auto& d = *L.d;
  auto& raw = L.raw;
  auto& refused = L.refused;
  for (const auto& [k, r] : raw) {
    int node = -1;
    std::string suffix;
    const KeySpec* spec = classify(k, &node, &suffix);
    // A value that is not UTF-8 passes every other check and then poisons what carries
    // it (the /health JSON of a ring that serves answered 400 forever); a NUL cuts it short
    // wherever it becomes a C string.
    if (auto at = r.value.find('\0'); at != std::string::npos) {
      d.push_back({true, r.source,
                   fmt::format("{}: the value holds a NUL byte at offset {}; remove it", k, at)});
      refused.insert(k);
      continue;
    }
    if (auto at = utf8_invalid_at(r.value); at != std::string::npos) {
      d.push_back({true, r.source,
                   fmt::format("{}: the value is not UTF-8 (byte 0x{:02x} at offset {}); write "
                               "the file in UTF-8",
                               k, static_cast<unsigned char>(r.value[at]), at)});
      refused.insert(k);
      continue;
    }
    if (has_placeholder(r.value)) {
      d.push_back({true, r.source,
                   fmt::format("{}={} is still a placeholder: replace it with the real value", k,
                               r.value)});
      refused.insert(k);
      continue;
    }
    auto why = check_value(*spec, r.value);
    if (!why.empty()) {
      d.push_back({true, r.source, fmt::format("{}: {}", k, why)});
      refused.insert(k);
    }
  }
}

// Ring-wide keys: the value set, else the default, else empty; each with its source.
void resolve_ring_keys(Loading& L) {
  auto& cfg = L.cfg;
  auto& raw = L.raw;
  for (const auto& spec : ring_keys()) {
    auto it = raw.find(spec.name);
    if (it != raw.end() && !it->second.value.empty()) {
      cfg.settings[spec.name] = Setting{it->second.value, it->second.source};
    } else if (spec.default_value) {
      cfg.settings[spec.name] =
          Setting{spec.default_value, it != raw.end() ? it->second.source + " (empty: default)"
                                                      : "default"};
    } else {
      cfg.settings[spec.name] = Setting{"", it != raw.end() ? it->second.source : "unset"};
    }
  }
}

// Nodes: indices must run 0..n-1 without gaps, and there must be one.
void check_node_numbering(Loading& L, std::string_view file) {
  auto& d = *L.d;
  auto& node_ids = L.node_ids;
  auto& node_first_where = L.node_first_where;
  int expect = 0;
  for (int id : node_ids) {
    if (id != expect) {
      d.push_back({true, node_first_where[id],
                   fmt::format("NODE{} is defined but NODE{} is not: nodes are numbered 0, 1, 2, "
                               "... in rank order without gaps",
                               id, expect)});
      break;
    }
    ++expect;
  }
  if (node_ids.empty())
    d.push_back({true, std::string(file),
                 "no nodes: define at least NODE0_SSH (use NODE0_SSH=local for this machine)"});
}

// Node `id`: its keys resolved like the ring's, then its SSH target, fabric address, netdevs,
// HCAs, GID index, model path and GPUs checked.
NodeConfig resolve_node(Loading& L, int id) {
  auto& d = *L.d;
  auto& cfg = L.cfg;
  auto& raw = L.raw;
  auto& node_first_where = L.node_first_where;
  NodeConfig n;
  n.index = id;
  for (const auto& spec : node_keys()) {
    std::string key = fmt::format("NODE{}_{}", id, spec.name);
    auto it = raw.find(key);
    Setting s;
    if (it != raw.end() && !it->second.value.empty())
      s = Setting{it->second.value, it->second.source};
    else if (spec.default_value)
      s = Setting{spec.default_value, "default"};
    else
      s = Setting{"", it != raw.end() ? it->second.source : "unset"};
    cfg.settings[key] = s;
  }
  auto val = [&](const char* f) { return cfg.settings[fmt::format("NODE{}_{}", id, f)].value; };
  auto where = [&](const char* f) {
    auto& src = cfg.settings[fmt::format("NODE{}_{}", id, f)].source;
    return src == "unset" || src == "default" ? node_first_where[id] : src;
  };
  n.name = val("NAME").empty() ? fmt::format("node{}", id) : val("NAME");
  if (val("NAME").empty())
    cfg.settings[fmt::format("NODE{}_NAME", id)] = Setting{n.name, "default"};
  n.ssh = val("SSH");
  if (n.ssh.empty()) {
    d.push_back({true, where("SSH"),
                 fmt::format("NODE{}_SSH is not set: give [user@]host[:port], or 'local' for "
                             "this machine",
                             id)});
  } else if (n.ssh == "local") {
    n.local = true;
    n.ssh_host = "localhost";
  } else {
    std::string t = n.ssh;
    if (auto at = t.find('@'); at != std::string::npos) {
      n.ssh_user = t.substr(0, at);
      t = t.substr(at + 1);
    }
    n.ssh_port = static_cast<int>(cfg.get_int("SSH_PORT"));
    if (auto colon = t.rfind(':'); colon != std::string::npos) {
      auto p = parse_u64(t.substr(colon + 1));
      if (!p || *p < 1 || *p > 65535) {
        d.push_back({true, where("SSH"),
                     fmt::format("NODE{}_SSH={}: port is out of range 1-65535", id, n.ssh)});
      } else {
        n.ssh_port = static_cast<int>(*p);
      }
      t = t.substr(0, colon);
    }
    n.ssh_host = t;
    if (n.ssh_user.empty()) n.ssh_user = cfg.get("SSH_USER");
    if (t.empty() || t.find_first_of(" \t/") != std::string::npos)
      d.push_back({true, where("SSH"), fmt::format("NODE{}_SSH={}: not a host name", id, n.ssh)});
    if (auto ip = parse_ipv4(t); ip && is_documentation_ipv4(*ip))
      d.push_back(
          {true, where("SSH"),
           fmt::format("NODE{}_SSH={}: {} is a documentation address (RFC 5737)", id, n.ssh, t)});
  }
  n.fabric_ip = val("FABRIC_IP");
  if (n.fabric_ip.empty()) {
    if (n.local)
      n.fabric_ip = "127.0.0.1";
    else
      d.push_back(
          {true, where("FABRIC_IP"),
           fmt::format("NODE{}_FABRIC_IP is not set: the node's IPv4 on the fabric link", id)});
  }
  if (auto ip = parse_ipv4(n.fabric_ip); ip && (*ip >> 24) == 127 && !n.local)
    d.push_back({true, where("FABRIC_IP"),
                 fmt::format("NODE{}_FABRIC_IP={} is a loopback address on a remote node; NCCL "
                             "cannot use loopback",
                             id, n.fabric_ip)});
  if (auto ip = parse_ipv4(n.fabric_ip);
      ip && (*ip == 0 || *ip == 0xFFFFFFFFu || (*ip >> 28) == 0xE || (*ip >> 24) == 0))
    d.push_back({true, where("FABRIC_IP"),
                 fmt::format("NODE{}_FABRIC_IP={} is not a unicast host address: give the "
                             "address configured on the node's fabric netdev",
                             id, n.fabric_ip)});
  n.netdevs = split_list(val("NETDEVS"));
  n.hcas = split_list(val("HCAS"));
  for (const auto& nd : n.netdevs)
    if (!valid_netdev_name(nd))
      d.push_back({true, where("NETDEVS"),
                   fmt::format("NODE{}_NETDEVS: '{}' is not an interface name (1-15 characters, "
                               "no '/', ':' or spaces; see `ip -br link`)",
                               id, nd)});
  for (const auto& h : n.hcas)
    if (h.size() > 63 || h.find_first_of("/ \t") != std::string::npos)
      d.push_back({true, where("HCAS"),
                   fmt::format("NODE{}_HCAS: '{}' is not an RDMA device name (see "
                               "`ibv_devices` or /sys/class/infiniband)",
                               id, h)});
  // One link per entry: a netdev or HCA listed twice would drive one link as two twins.
  for (auto [list, key] : {std::pair{&n.netdevs, "NETDEVS"}, std::pair{&n.hcas, "HCAS"}})
    for (size_t a = 0; a < list->size(); ++a)
      if (std::find(list->begin(), list->begin() + static_cast<long>(a), (*list)[a]) !=
          list->begin() + static_cast<long>(a))
        d.push_back({true, where(key),
                     fmt::format("NODE{}_{} lists {} twice: one entry per twin (each HCA with "
                                 "its own netdev)",
                                 id, key, (*list)[a])});
  if (!n.hcas.empty() && !n.netdevs.empty() && n.hcas.size() != n.netdevs.size())
    d.push_back({true, where("HCAS"),
                 fmt::format("NODE{}: {} HCAs but {} netdevs; list them in the same order, one "
                             "netdev per HCA",
                             id, n.hcas.size(), n.netdevs.size())});
  if (val("GID_INDEX") != "auto" && !val("GID_INDEX").empty())
    if (auto g = parse_u64(val("GID_INDEX")); g && *g <= 255) n.gid_index = static_cast<int>(*g);
  n.model_path = val("MODEL_PATH").empty() ? cfg.get("MODEL_PATH") : val("MODEL_PATH");
  for (const auto& g : split_list(val("GPUS"))) {
    auto v = parse_u64(g);
    if (!v || *v > 1023) {
      d.push_back(
          {true, where("GPUS"), fmt::format("NODE{}_GPUS: '{}' is not a GPU ordinal", id, g)});
      continue;
    }
    if (std::find(n.gpus.begin(), n.gpus.end(), static_cast<int>(*v)) != n.gpus.end())
      d.push_back({true, where("GPUS"), fmt::format("NODE{}_GPUS lists GPU {} twice", id, *v)});
    n.gpus.push_back(static_cast<int>(*v));
  }
  if (n.gpus.empty()) n.gpus.push_back(0);
  return n;
}

// No two nodes with the same name, SSH target or fabric address.
void check_duplicate_nodes(Loading& L) {
  auto& d = *L.d;
  auto& cfg = L.cfg;
  auto& node_first_where = L.node_first_where;
  for (size_t i = 0; i < cfg.nodes.size(); ++i)
    for (size_t j = i + 1; j < cfg.nodes.size(); ++j) {
      const auto& a = cfg.nodes[i];
      const auto& b = cfg.nodes[j];
      auto where_b = cfg.settings[fmt::format("NODE{}_NAME", b.index)].source;
      if (where_b == "default") where_b = node_first_where[b.index];
      if (a.name == b.name)
        d.push_back({true, where_b, fmt::format("NODE{} and NODE{} are both named '{}'", a.index,
                                                b.index, a.name)});
      if (!a.local && !b.local && a.ssh_host == b.ssh_host && a.ssh_port == b.ssh_port)
        d.push_back({true, cfg.settings[fmt::format("NODE{}_SSH", b.index)].source,
                     fmt::format("NODE{} and NODE{} have the same SSH target {}:{}", a.index,
                                 b.index, a.ssh_host, a.ssh_port)});
      if (!a.fabric_ip.empty() && a.fabric_ip == b.fabric_ip)
        d.push_back({true, cfg.settings[fmt::format("NODE{}_FABRIC_IP", b.index)].source,
                     fmt::format("NODE{} and NODE{} have the same fabric address {}", a.index,
                                 b.index, a.fabric_ip)});
    }
}

// Keys that must agree with each other.
void check_ring_consistency(Loading& L) {
  auto& d = *L.d;
  auto& cfg = L.cfg;
  auto& refused = L.refused;
  if (cfg.get("ENGINE") == "exec" && cfg.get("ENGINE_EXEC").empty())
    d.push_back({true, cfg.settings["ENGINE"].source,
                 "ENGINE=exec needs ENGINE_EXEC, the command to run on every rank"});
  if (!refused.count("LINK_SPEED_MIN") && cfg.get("LINK_SPEED_MIN") != "auto" &&
      !parse_u64(cfg.get("LINK_SPEED_MIN")))
    d.push_back({true, cfg.settings["LINK_SPEED_MIN"].source,
                 fmt::format("LINK_SPEED_MIN: '{}' must be 'auto' or Gb/s as a whole number",
                             cfg.get("LINK_SPEED_MIN"))});
  if (auto b = parse_ipv4(cfg.get("API_BIND")); b && (*b >> 24) != 127 &&
                                                cfg.get("API_KEY_FILE").empty())
    d.push_back({true, cfg.settings["API_BIND"].source,
                 fmt::format("API_BIND={} is not loopback: set API_KEY_FILE (a file of mode 0600 "
                             "holding the key) or bind 127.0.0.1",
                             cfg.get("API_BIND"))});
  for (const char* k : {"SLOTS", "CONTEXT_LEN"})
    if (!refused.count(k) && cfg.get_int(k) < 1)
      d.push_back({true, cfg.settings[k].source, fmt::format("{} must be at least 1", k)});
  // The engine sizes its step buffers for a full step: a few extra digits must not reach
  // the allocator.
  constexpr int64_t kMaxPrefillChunk = 1 << 20;
  if (auto chunk = cfg.get_int("PREFILL_CHUNK");
      !refused.count("PREFILL_CHUNK") && (chunk < 1 || chunk > kMaxPrefillChunk))
    d.push_back({true, cfg.settings["PREFILL_CHUNK"].source,
                 fmt::format("PREFILL_CHUNK must be 1-{} (tokens per engine step)",
                             kMaxPrefillChunk)});
  if (auto pct = cfg.get_int("DISK_MAX_USE"); !refused.count("DISK_MAX_USE") && (pct < 1 || pct > 100))
    d.push_back({true, cfg.settings["DISK_MAX_USE"].source, "DISK_MAX_USE must be 1-100 (percent)"});
  if (cfg.get("API_PORT") == cfg.get("RDZV_PORT"))
    d.push_back({true, cfg.settings["RDZV_PORT"].source, "RDZV_PORT and API_PORT must differ"});
  if (cfg.get("MODEL").empty() && !cfg.get("MODEL_PATH").empty()) {
    auto p = cfg.get("MODEL_PATH");
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    cfg.settings["MODEL"] = Setting{p.substr(p.rfind('/') + 1), "derived from MODEL_PATH"};
  }
}

}  // namespace

Result<RingConfig> load_config_text(std::string_view text, std::string_view file,
                                    const Environment& env, std::vector<Diagnostic>* diags) {
  std::vector<Diagnostic> local_diags;
  auto& d = diags ? *diags : local_diags;
  size_t first_diag = d.size();
  auto parsed = parse_env_text(text, file);
  if (!parsed) return parsed.error();

  Loading L;
  L.d = &d;
  L.cfg.path = std::string(file);
  read_entries(L, parsed.value());
  apply_environment(L, env);
  validate_values(L);
  resolve_ring_keys(L);
  check_node_numbering(L, file);
  for (int id : L.node_ids)
    if (id < kMaxNodes) L.cfg.nodes.push_back(resolve_node(L, id));
  check_duplicate_nodes(L);
  check_ring_consistency(L);
  // Diagnostics in file order: whole-file ones first, then by line, the environment last.
  std::stable_sort(d.begin() + static_cast<std::ptrdiff_t>(first_diag), d.end(),
                   [&](const Diagnostic& a, const Diagnostic& b) {
                     return diag_order(a.where, file) < diag_order(b.where, file);
                   });
  std::vector<std::string> errors;
  for (size_t i = first_diag; i < d.size(); ++i)
    if (d[i].error) errors.push_back(fmt::format("{}: {}", d[i].where, d[i].message));
  if (!errors.empty()) return make_error(Errc::config, join(errors, "\n"));
  return std::move(L.cfg);
}

Result<std::string> read_api_key_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    return make_error(Errc::config, "API_KEY_FILE " + path + ": " + std::strerror(errno) +
                                        " (create it with the key on one line, chmod 600)");
  if (!S_ISREG(st.st_mode))
    return make_error(Errc::config, "API_KEY_FILE " + path + " is not a regular file");
  if ((st.st_mode & 077) != 0)
    return make_error(Errc::auth, fmt::format("API_KEY_FILE {} has mode {:04o}; other users could "
                                              "read the key: chmod 600 {}",
                                              path, st.st_mode & 07777, path));
  auto text = read_file(path);
  if (!text) return make_error(Errc::io, "API_KEY_FILE " + path + ": cannot read");
  std::string key(trim(*text));
  if (key.empty()) return make_error(Errc::config, "API_KEY_FILE " + path + " is empty");
  // Two lines would make a key no client can send (a header value ends at the line).
  if (key.find_first_of("\r\n") != std::string::npos)
    return make_error(Errc::config, "API_KEY_FILE " + path +
                                        " holds more than one line; put the key alone on the "
                                        "first line");
  for (unsigned char c : key)
    if (c < 0x20 || c == 0x7f || c == ' ')
      return make_error(Errc::config,
                        fmt::format("API_KEY_FILE {}: the key holds a space or control character "
                                    "(0x{:02x}); clients cannot send it in a Bearer header",
                                    path, c));
  return key;
}

Result<RingConfig> load_config(const std::string& path, const Environment& env,
                               std::vector<Diagnostic>* diags) {
  // The cluster file the package's systemd units and cron example read.
  static constexpr const char* kPackageRingFile = "/etc/sparkctl/ring.env";
  auto text = read_file(path);
  if (!text) {
    // Say why (errno), and where the installed package keeps its cluster file.
    int why = 0;
    if (FILE* f = std::fopen(path.c_str(), "r")) {
      std::fclose(f);
    } else {
      why = errno;
    }
    std::error_code ec;
    std::string reason = why                                       ? std::strerror(why)
                         : std::filesystem::is_directory(path, ec) ? "it is a directory"
                                                                   : "not a readable file";
    bool etc = path != kPackageRingFile && std::filesystem::exists(kPackageRingFile, ec);
    return make_error(
        Errc::not_found,
        fmt::format("{}: cannot read the cluster file: {} (pass --config FILE or set "
                    "SPARK_CONFIG; the package's units read {}{}; examples: env/examples/ or "
                    "share/sparkctl/examples/)",
                    path, reason, kPackageRingFile,
                    etc ? fmt::format(", which exists: --config {}", kPackageRingFile) : ""));
  }
  return load_config_text(*text, path, env, diags);
}

}  // namespace spark
