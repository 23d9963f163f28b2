#include "cli/node_ops.h"

#include <dirent.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "cli/ring_state.h"
#include "core/install_layout.h"
#include "core/process.h"
#include "core/strings.h"
#include "env/meminfo.h"

namespace spark::cli {

using nlohmann::json;
using std::chrono::milliseconds;

namespace {

// The pid in a pidfile (digits only; 0 when absent or empty).
int read_pid(const std::string& path) {
  auto text = read_file(path);
  if (!text) return 0;
  std::string digits;
  for (char c : *text)
    if (c >= '0' && c <= '9') digits += c;
  auto v = parse_i64(digits);
  return v && *v > 0 && *v < (1ll << 31) ? static_cast<int>(*v) : 0;
}

// Fields of /proc/PID/stat after the command name: [0] is the state, [2] the process group,
// [19] the start time in clock ticks. Empty when the process is gone.
std::vector<std::string> stat_fields(int pid) {
  auto text = read_file(fmt::format("/proc/{}/stat", pid));
  if (!text) return {};
  auto close = text->rfind(") ");
  if (close == std::string::npos) return {};
  std::vector<std::string> out;
  for (const auto& f : split_list(text->substr(close + 2), ' ')) out.push_back(f);
  return out;
}

// The pid runs and is not a zombie (a killed daemon whose parent does not reap it stays a
// zombie; it holds nothing).
bool alive(int pid) {
  if (pid <= 0) return false;
  auto f = stat_fields(pid);
  return !f.empty() && f[0] != "Z";
}

std::string cmdline(int pid) {
  auto text = read_file(fmt::format("/proc/{}/cmdline", pid));
  if (!text) return {};
  std::replace(text->begin(), text->end(), '\0', ' ');
  return *text;
}

// Alive and its command line contains `text`: guards against a recycled pid in a stale
// pidfile.
bool ours(int pid, const std::string& text) {
  return alive(pid) && cmdline(pid).find(text) != std::string::npos;
}

int64_t uptime_s(int pid) {
  auto f = stat_fields(pid);
  auto up = read_file("/proc/uptime");
  if (f.size() < 20 || !up) return -1;
  auto start = parse_i64(f[19]);
  double now = std::atof(up->c_str());
  long tck = ::sysconf(_SC_CLK_TCK);
  if (!start || tck <= 0) return -1;
  return std::max<int64_t>(0, static_cast<int64_t>(now - static_cast<double>(*start) / tck));
}

// Every live process whose command line contains `text` (this process excluded).
std::vector<int> processes_with(const std::string& text) {
  std::vector<int> out;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  while (auto* e = ::readdir(d)) {
    auto pid = parse_i64(e->d_name);
    if (!pid || *pid == ::getpid()) continue;
    if (ours(static_cast<int>(*pid), text)) out.push_back(static_cast<int>(*pid));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// Every live process of process group `pgid`.
std::vector<int> group_members(int pgid) {
  std::vector<int> out;
  if (pgid <= 1) return out;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  while (auto* e = ::readdir(d)) {
    auto pid = parse_i64(e->d_name);
    if (!pid) continue;
    auto f = stat_fields(static_cast<int>(*pid));
    if (f.size() > 2 && f[0] != "Z" && f[2] == std::to_string(pgid))
      out.push_back(static_cast<int>(*pid));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// The last lines of a rank's early output and log, on one line of at most ~600 characters
// (the end kept; a cut says "... ").
std::string last_words(const NodeDirs& d, int rank) {
  std::string s;
  for (const auto& f : {fmt::format("{}/sparkd-{}.out", d.log, rank),
                        fmt::format("{}/sparkd-{}.log", d.log, rank)}) {
    auto text = read_file(f);
    if (!text) continue;
    auto lines = split_list(*text, '\n');
    size_t from = lines.size() > 4 ? lines.size() - 4 : 0;
    for (size_t i = from; i < lines.size(); ++i) s += std::string(trim(lines[i])) + " ";
  }
  s = std::string(trim(s));
  if (s.size() > 600) {
    s = s.substr(s.size() - 600);
    auto sp = s.find(' ');
    s = "... " + (sp == std::string::npos ? s : s.substr(sp + 1));
  }
  return s;
}

std::string sparkd_mark(int rank) {
  return fmt::format("/sparkd-{}.pid", rank);
}

std::string config_of_node(const NodeDirs& d, int node) {
  return fmt::format("{}/run/ring-node{}.env", d.state, node);
}

// Who a rank runs as. Root starting the ranks of a ring whose state directory a user owns
// (root's watch timer healing, or root restarting, a ring that user started) starts them as
// that user: the ring stays theirs to stop and restart, and what the ranks write stays
// theirs. {-1, -1} otherwise: the ranks run as the caller.
std::pair<int, int> rank_owner(const std::string& state_dir) {
  auto o = non_root_owner(state_dir);
  if (!o) return {-1, -1};
  return {static_cast<int>(o->first), static_cast<int>(o->second)};
}

}  // namespace

NodeDirs node_dirs(const RingConfig& cfg) {
  NodeDirs d;
  if (!cfg.get("STATE_DIR").empty()) {
    d.state = cfg.get("STATE_DIR");
  } else {
    // The same rule as head_state_dir(): the system root when this node has one.
    std::string name = cfg.get("RING_NAME").empty() ? "spark" : cfg.get("RING_NAME");
    std::error_code ec;
    const char* home = std::getenv("HOME");
    d.state = std::filesystem::is_directory(kSystemStateRoot, ec)
                  ? fmt::format("{}/{}", kSystemStateRoot, name)
                  : fmt::format("{}/.local/state/sparkctl/{}", home ? home : "", name);
  }
  d.log = cfg.get("LOG_DIR").empty() ? d.state + "/logs" : cfg.get("LOG_DIR");
  return d;
}

std::string pidfile_path(const NodeDirs& d, int rank) {
  return fmt::format("{}/run/sparkd-{}.pid", d.state, rank);
}

std::vector<int> ranks_of_node(const RingConfig& cfg, int node) {
  std::vector<int> out;
  for (const auto& p : cfg.ranks())
    if (p.node == node) out.push_back(p.rank);
  return out;
}

NodeProbe probe_here(const RingConfig& cfg, int node) {
  NodeProbe p;
  p.index = node;
  p.node = cfg.nodes.at(static_cast<size_t>(node)).name;
  const NodeDirs d = node_dirs(cfg);
  for (int r : ranks_of_node(cfg, node)) {
    RankProcess rp;
    rp.rank = r;
    rp.pid = read_pid(pidfile_path(d, r));
    rp.alive = ours(rp.pid, sparkd_mark(r));
    if (rp.alive) {
      rp.uptime_s = uptime_s(rp.pid);
      auto f = stat_fields(rp.pid);
      rp.stopped = !f.empty() && (f[0] == "T" || f[0] == "t");
    }
    p.ranks.push_back(rp);
  }
  if (auto m = env::read_meminfo("/")) {
    p.mem_total = static_cast<int64_t>(m->get("MemTotal"));
    p.mem_free = static_cast<int64_t>(m->get("MemFree"));
    p.mem_available = static_cast<int64_t>(m->get("MemAvailable"));
  }
  // nvidia-smi reports what the driver holds on discrete GPUs; absent: unknown, not an error.
  auto smi = run_shell(
      "command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi "
      "--query-gpu=memory.used,memory.total --format=csv,noheader,nounits",
      milliseconds(5000));
  if (smi && smi->exit_status == 0)
    for (const auto& line : split_list(smi->out, '\n')) {
      auto parts = split_list(line, ',');
      if (parts.size() < 2) continue;
      auto used = parse_i64(trim(parts[0])), total = parse_i64(trim(parts[1]));
      if (used && total) p.gpu_mem_mib.emplace_back(*used, *total);
    }
  return p;
}

std::vector<LaunchResult> launch_here(const RingConfig& cfg, int node,
                                      const std::string& config_text, const std::string& sparkd_bin,
                                      const RankEnv& env) {
  const NodeDirs d = node_dirs(cfg);
  const std::string name = cfg.nodes.at(static_cast<size_t>(node)).name;
  const auto ranks = ranks_of_node(cfg, node);
  std::vector<LaunchResult> out;
  for (int r : ranks) out.push_back(LaunchResult{r, name, 0, ""});
  auto fail_all = [&](const std::string& why) {
    for (auto& lr : out) lr.error = fmt::format("{}: {}", name, why);
    return out;
  };
  std::error_code ec = make_dirs(d.state + "/run");
  if (!ec) ec = make_dirs(d.log);
  if (ec)
    return fail_all(fmt::format("cannot create {}/run and {}: {}", d.state, d.log, ec.message()));
  const auto [uid, gid] = rank_owner(d.state);
  // What a rank that root started before left in the user's directories: the user's again.
  adopt_dir_owner(d.state + "/run");
  adopt_dir_owner(d.log);
  const std::string conf = config_of_node(d, node);
  std::string why;
  if (!write_file_atomic(conf, config_text, &why, 0640))
    return fail_all(fmt::format("cannot write {}: {}", conf, why));
  adopt_dir_owner(conf);

  // The head's sparkd path, or this node's own install when that path is not here.
  std::string tried;
  std::error_code self_ec;
  auto self = std::filesystem::canonical("/proc/self/exe", self_ec);
  const bool explicit_bin = !cfg.get("SPARKD_BIN").empty();
  const std::string bin =
      spark::node_sparkd(sparkd_bin, explicit_bin, self_ec ? "" : self.string(), &tried);
  if (bin.empty())
    return fail_all(explicit_bin
                        ? fmt::format("SPARKD_BIN {} is not an executable on this node (install "
                                      "sparkd there or fix SPARKD_BIN in the cluster file)",
                                      sparkd_bin)
                        : fmt::format("sparkd not found on this node (tried {}): install the "
                                      "sparkctl package there or set SPARKD_BIN in the cluster "
                                      "file",
                                      tried));

  std::map<int, int> spawned;  // rank -> pid of the detached sparkd
  for (auto& lr : out) {
    const std::string pf = pidfile_path(d, lr.rank);
    if (int p = read_pid(pf); ours(p, sparkd_mark(lr.rank))) {
      lr.error = fmt::format(
          "{}: rank {} already runs (sparkd pid {}); stop the ring first (sparkctl stop)", name,
          lr.rank, p);
      continue;
    }
    const std::string out_log = fmt::format("{}/sparkd-{}.out", d.log, lr.rank);
    const std::string log = fmt::format("{}/sparkd-{}.log", d.log, lr.rank);
    for (const auto& f : {pf, pf + ".engine", out_log}) std::filesystem::remove(f, ec);
    if (std::filesystem::exists(log, ec)) adopt_dir_owner(log);
    ProcessSpec spec;
    spec.run_as_uid = uid;
    spec.run_as_gid = gid;
    spec.argv = {bin,         "--config", conf,         "--rank", std::to_string(lr.rank),
                 "--pidfile", pf,         "--log-file", log};
    if (auto it = env.find(lr.rank); it != env.end())
      for (const auto& [k, v] : it->second) spec.env[k] = v;
    // setsid and a double fork: neither the SSH session ending nor the runner's process-group
    // kill reaches sparkd, and its output goes to a file so the channel closes at once.
    auto pid = spawn_detached(spec, out_log);
    adopt_dir_owner(out_log);
    if (!pid) {
      lr.error =
          fmt::format("{}: sparkd rank {} did not start: {}", name, lr.rank, pid.error().message);
      continue;
    }
    spawned[lr.rank] = *pid;
  }
  // Wait (10 s at most) until every started rank wrote its pidfile or exited: a sparkd that
  // exits at once (bad config, a library missing, refused) is reported now, not at READY.
  auto settled = [&] {
    for (const auto& [r, pid] : spawned)
      if (read_pid(pidfile_path(d, r)) == 0 && alive(pid)) return false;
    return true;
  };
  bool in_time = settled();
  for (int i = 0; i < 100 && !in_time; ++i) {
    std::this_thread::sleep_for(milliseconds(100));
    in_time = settled();
  }
  for (auto& lr : out) {
    if (!spawned.count(lr.rank)) continue;
    const int started = spawned[lr.rank];
    int p = read_pid(pidfile_path(d, lr.rank));
    if (alive(p)) {
      lr.pid = p;
    } else if (alive(started)) {
      // Still running with no pidfile after the bound: stopped, so that no half-started
      // daemon is left behind holding the GPU or the ports.
      ::kill(-started, SIGKILL);  // its session's process group: the engine it may have begun
      lr.error = fmt::format(
          "{}: sparkd rank {} did not start: it wrote no pidfile {} within 10 s and was "
          "stopped (pid {}): {}",
          name, lr.rank, pidfile_path(d, lr.rank), started, last_words(d, lr.rank));
    } else {
      // How the wait ended is part of the report: a rank that exited is noticed when it
      // exits, not at the bound.
      lr.error = fmt::format("{}: sparkd rank {} did not start: it exited {}: {}", name, lr.rank,
                             in_time ? "before writing its pidfile"
                                     : "without a pidfile, noticed only at the 10 s bound",
                             last_words(d, lr.rank));
    }
  }
  return out;
}

std::vector<StopResult> stop_here(const RingConfig& cfg, int node, milliseconds grace) {
  const NodeDirs d = node_dirs(cfg);
  const std::string name = cfg.nodes.at(static_cast<size_t>(node)).name;
  std::vector<StopResult> out;
  std::map<int, int> engine_group;  // rank -> its exec engine's process group
  for (int r : ranks_of_node(cfg, node)) {
    StopResult sr;
    sr.rank = r;
    sr.node = name;
    const std::string pf = pidfile_path(d, r);
    engine_group[r] = read_pid(pf + ".engine");
    if (int p = read_pid(pf); ours(p, sparkd_mark(r))) {
      ::kill(p, SIGTERM);
      sr.pid = p;
      sr.how = "sigterm";
    }
    out.push_back(sr);
  }
  auto any_alive = [&] {
    for (const auto& sr : out)
      if (alive(sr.pid)) return true;
    return false;
  };
  auto deadline = std::chrono::steady_clock::now() + grace;
  while (any_alive() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(milliseconds(100));
  for (auto& sr : out) {
    if (alive(sr.pid)) {
      ::kill(sr.pid, SIGKILL);
      sr.how = "sigkill";
    }
    int g = engine_group[sr.rank];
    if (!group_members(g).empty()) {
      ::kill(-g, SIGKILL);
      if (sr.how == "none") sr.how = "sigkill";
      sr.how += " (engine group)";
    }
  }
  // Any sparkd of this node that no pidfile knows (a pidfile lost or overwritten): found by
  // its --config path.
  const std::string conf = config_of_node(d, node);
  for (int q : processes_with(conf)) {
    ::kill(q, SIGKILL);
    if (!out.empty() && out.front().pid == 0) {
      out.front().pid = q;
      out.front().how = "sigkill";
    }
  }
  std::this_thread::sleep_for(milliseconds(200));
  for (auto& sr : out) {
    if (alive(sr.pid)) sr.left.push_back(fmt::format("{}: sparkd pid {}", name, sr.pid));
    for (int q : group_members(engine_group[sr.rank]))
      sr.left.push_back(
          fmt::format("{}: engine pid {} (process group {})", name, q, engine_group[sr.rank]));
    if (sr.left.empty()) {
      std::error_code ec;
      std::filesystem::remove(pidfile_path(d, sr.rank), ec);
      std::filesystem::remove(pidfile_path(d, sr.rank) + ".engine", ec);
    }
  }
  for (int q : processes_with(conf))
    if (!out.empty())
      out.front().left.push_back(fmt::format("{}: sparkd pid {} (not in a pidfile)", name, q));
  return out;
}

json to_json(const NodeProbe& p) {
  json j = {{"node", p.node},
            {"index", p.index},
            {"mem_free", p.mem_free},
            {"mem_available", p.mem_available},
            {"mem_total", p.mem_total},
            {"ranks", json::array()},
            {"gpu_mem_mib", json::array()}};
  for (const auto& r : p.ranks)
    j["ranks"].push_back({{"rank", r.rank},
                          {"pid", r.pid},
                          {"alive", r.alive},
                          {"uptime_s", r.uptime_s},
                          {"stopped", r.stopped}});
  for (const auto& [used, total] : p.gpu_mem_mib) j["gpu_mem_mib"].push_back({used, total});
  return j;
}

NodeProbe probe_from_json(const json& j) {
  NodeProbe p;
  p.node = j.value("node", "");
  p.index = j.value("index", 0);
  p.mem_free = j.value("mem_free", int64_t{-1});
  p.mem_available = j.value("mem_available", int64_t{-1});
  p.mem_total = j.value("mem_total", int64_t{-1});
  for (const auto& r : j.value("ranks", json::array()))
    p.ranks.push_back(RankProcess{r.value("rank", 0), r.value("pid", 0), r.value("alive", false),
                                  r.value("uptime_s", int64_t{-1}), r.value("stopped", false)});
  for (const auto& g : j.value("gpu_mem_mib", json::array()))
    if (g.is_array() && g.size() == 2)
      p.gpu_mem_mib.emplace_back(g[0].get<int64_t>(), g[1].get<int64_t>());
  return p;
}

json to_json(const std::vector<LaunchResult>& v) {
  json j = {{"ranks", json::array()}};
  for (const auto& r : v)
    j["ranks"].push_back({{"rank", r.rank}, {"node", r.node}, {"pid", r.pid}, {"error", r.error}});
  return j;
}

std::vector<LaunchResult> launches_from_json(const json& j) {
  std::vector<LaunchResult> out;
  for (const auto& r : j.value("ranks", json::array()))
    out.push_back(LaunchResult{r.value("rank", 0), r.value("node", ""), r.value("pid", 0),
                               r.value("error", "")});
  return out;
}

json to_json(const std::vector<StopResult>& v) {
  json j = {{"ranks", json::array()}};
  for (const auto& r : v)
    j["ranks"].push_back({{"rank", r.rank},
                          {"node", r.node},
                          {"pid", r.pid},
                          {"how", r.how},
                          {"left", r.left},
                          {"error", r.error}});
  return j;
}

std::vector<StopResult> stops_from_json(const json& j) {
  std::vector<StopResult> out;
  for (const auto& r : j.value("ranks", json::array())) {
    StopResult s;
    s.rank = r.value("rank", 0);
    s.node = r.value("node", "");
    s.pid = r.value("pid", 0);
    s.how = r.value("how", "none");
    s.left = r.value("left", std::vector<std::string>{});
    s.error = r.value("error", "");
    out.push_back(s);
  }
  return out;
}

}  // namespace spark::cli
