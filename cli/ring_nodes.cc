#include "cli/ring_nodes.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "cli/node_exec.h"
#include "cli/ring_state.h"
#include "core/http_client.h"
#include "core/install_layout.h"
#include "core/process.h"
#include "core/strings.h"

namespace spark::cli {

using nlohmann::json;

namespace {

// Shell functions every node script uses. alive PID: the pid runs and is not a zombie (a
// killed daemon whose parent does not reap stays a zombie; it holds nothing). ours PID TEXT:
// alive and its command line contains TEXT (guards against a recycled pid in a stale pidfile).
constexpr const char* kShellFns =
    "alive() { case \"$1\" in ''|0|*[!0-9]*) return 1;; esac; "
    "st=$(sed 's/.*) //' /proc/$1/stat 2>/dev/null) || return 1; "
    "[ -n \"$st\" ] && [ \"${st%% *}\" != Z ]; }\n"
    "ours() { alive \"$1\" && tr '\\0' ' ' </proc/$1/cmdline 2>/dev/null | grep -q -- \"$2\"; }\n"
    "num() { tr -dc 0-9 <\"$1\" 2>/dev/null; }\n";

// Joins its input lines into one line of at most ~600 characters, keeping the end; a cut
// drops the partial word it leaves at the front and says so ("... ").
constexpr const char* kTailLine =
    "awk '{ s = s $0 \" \" } END { if (length(s) > 600) { s = substr(s, length(s) - 599); "
    "sub(/^[^ ]* /, \"\", s); s = \"... \" s } printf \"%s\", s }'";

std::vector<int> ranks_of_node(const RingConfig& cfg, int node) {
  std::vector<int> out;
  for (const auto& p : cfg.ranks())
    if (p.node == node) out.push_back(p.rank);
  return out;
}

std::vector<int> all_nodes(const RingConfig& cfg) {
  std::vector<int> out;
  for (const auto& n : cfg.nodes) out.push_back(n.index);
  return out;
}

// "@@tag a b c" lines of a node script's output.
// "@@tag w1 .. wn rest": the first `words` words, then the rest of the line as one field.
std::vector<std::vector<std::string>> tagged(const std::string& out, const std::string& tag,
                                             int words) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream in(out);
  std::string line;
  std::string prefix = "@@" + tag + " ";
  while (std::getline(in, line)) {
    if (!starts_with(line, prefix)) continue;
    std::vector<std::string> parts;
    std::string rest = line.substr(prefix.size());
    for (int k = 0; k < words; ++k) {
      auto sp = rest.find(' ');
      if (sp == std::string::npos) break;
      parts.push_back(rest.substr(0, sp));
      rest = rest.substr(sp + 1);
    }
    parts.push_back(rest);
    rows.push_back(parts);
  }
  return rows;
}

int to_int(const std::string& s, int def = 0) {
  auto v = parse_i64(trim(s));
  return v ? static_cast<int>(*v) : def;
}

std::string pidfile(int rank) {
  return fmt::format("\"$S/run/sparkd-{}.pid\"", rank);
}

}  // namespace

RankPlace place_of(const RingConfig& cfg, int rank) {
  for (const auto& p : cfg.ranks())
    if (p.rank == rank) return p;
  return RankPlace{rank, 0, 0, 0};
}

std::string node_dirs_prelude(const RingConfig& cfg) {
  std::string s;
  if (!cfg.get("STATE_DIR").empty()) {
    s = "S=" + spark::shell_quote(cfg.get("STATE_DIR")) + "\n";
  } else {
    // The same rule as head_state_dir(), decided on each node.
    std::string name =
        spark::shell_quote(cfg.get("RING_NAME").empty() ? "spark" : cfg.get("RING_NAME"));
    s = fmt::format(
        "if [ -d {root} ]; then S={root}/{name}; else S=\"$HOME/.local/state/sparkctl/\"{name}; "
        "fi\n",
        fmt::arg("root", kSystemStateRoot), fmt::arg("name", name));
  }
  if (!cfg.get("LOG_DIR").empty())
    s += "L=" + spark::shell_quote(cfg.get("LOG_DIR")) + "\n";
  else
    s += "L=\"$S/logs\"\n";
  return s;
}

std::vector<NodeRun> run_on(const RingConfig& cfg, const std::vector<int>& nodes,
                            const std::vector<std::string>& commands, const std::string& input,
                            std::chrono::milliseconds timeout) {
  auto results = exec_on_nodes(cfg, nodes, commands, input, timeout);
  std::vector<NodeRun> out;
  for (size_t k = 0; k < nodes.size(); ++k) {
    NodeRun r;
    r.index = nodes[k];
    r.node = cfg.nodes.at(static_cast<size_t>(nodes[k])).name;
    if (k >= results.size()) {
      r.error = make_error(Errc::internal, "no result");
    } else if (!results[k].result) {
      r.error = results[k].result.error();
    } else {
      r.exit_status = results[k].result->exit_status;
      r.out = results[k].result->out;
      r.err = results[k].result->err;
      if (results[k].result->timed_out)
        r.error = make_error(Errc::timeout, fmt::format("{}: the node script timed out", r.node));
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<NodeProbe> probe_nodes(const RingConfig& cfg, const RingLayout& lay) {
  std::vector<int> nodes = all_nodes(cfg);
  std::vector<std::string> cmds;
  for (int n : nodes) {
    std::string s = node_dirs_prelude(cfg) + kShellFns;
    for (int r : ranks_of_node(cfg, n))
      s += fmt::format(
          "p=$(num {pf}); a=0; up=-1; if ours \"$p\" /sparkd-{r}.pid; then a=1; "
          "up=$(ps -o etimes= -p \"$p\" 2>/dev/null | tr -dc 0-9); fi; "
          "echo \"@@rank {r} ${{p:-0}} $a ${{up:--1}}\"\n",
          fmt::arg("pf", pidfile(r)), fmt::arg("r", r));
    s += "grep -E '^(MemTotal|MemFree|MemAvailable):' /proc/meminfo | tr -s ' ' | sed 's/^/@@mem "
         "/'\n"
         "if command -v nvidia-smi >/dev/null 2>&1; then timeout 5 nvidia-smi "
         "--query-gpu=memory.used,memory.total --format=csv,noheader,nounits 2>/dev/null | "
         "tr -d ' ' | tr ',' ' ' | sed 's/^/@@gpu /'; fi\n"
         "true\n";
    cmds.push_back(s);
  }
  auto runs = run_on(cfg, nodes, cmds, "", lay.node_timeout);
  std::vector<NodeProbe> out;
  for (auto& run : runs) {
    NodeProbe p;
    p.node = run.node;
    p.index = run.index;
    if (run.error) {
      p.error = run.error;
      for (int r : ranks_of_node(cfg, run.index)) p.ranks.push_back(RankProcess{r, 0, false, -1});
      out.push_back(std::move(p));
      continue;
    }
    for (const auto& row : tagged(run.out, "rank", 3)) {
      if (row.size() < 4) continue;
      RankProcess rp;
      rp.rank = to_int(row[0]);
      rp.pid = to_int(row[1]);
      rp.alive = row[2] == "1";
      rp.uptime_s = to_int(row[3], -1);
      p.ranks.push_back(rp);
    }
    for (const auto& row : tagged(run.out, "mem", 2)) {
      if (row.size() < 2) continue;
      int64_t kib = to_int(row[1], -1);
      int64_t bytes = kib < 0 ? -1 : kib * 1024;
      if (row[0] == "MemFree:") p.mem_free = bytes;
      if (row[0] == "MemAvailable:") p.mem_available = bytes;
      if (row[0] == "MemTotal:") p.mem_total = bytes;
    }
    for (const auto& row : tagged(run.out, "gpu", 1))
      if (row.size() >= 2) p.gpu_mem_mib.emplace_back(to_int(row[0], -1), to_int(row[1], -1));
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<LaunchResult> launch_ranks(
    const RingConfig& cfg, const RingLayout& lay, const std::string& config_text,
    const std::vector<std::vector<std::pair<std::string, std::string>>>& rank_env) {
  std::vector<int> nodes = all_nodes(cfg);
  std::vector<std::string> cmds;
  for (int n : nodes) {
    std::string s = node_dirs_prelude(cfg) + kShellFns;
    s += "mkdir -p \"$S/run\" \"$L\" || { echo \"@@fatal x cannot create $S/run and $L\"; exit 1; "
         "}\n";
    s += spark::sparkd_shell_lookup(lay.sparkd_bin, lay.sparkd_explicit);
    s += fmt::format("C=\"$S/run/ring-node{}.env\"\n", n);
    s += "cat >\"$C.tmp.$$\" && mv -f \"$C.tmp.$$\" \"$C\" || "
         "{ echo \"@@fatal x cannot write $C\"; exit 1; }\n";
    auto ranks = ranks_of_node(cfg, n);
    for (int r : ranks) {
      std::string env = "env";
      if (static_cast<size_t>(r) < rank_env.size())
        for (const auto& [k, v] : rank_env[static_cast<size_t>(r)])
          env += " " + spark::shell_quote(k + "=" + v);
      // setsid -f: a new session, so neither the SSH session ending nor the runner's process
      // group kill reaches sparkd; all output goes to files so the channel closes at once.
      // The detached shell writes its pid to <pidfile>.launch and execs sparkd, so the wait
      // below sees a sparkd that exited before it wrote its pidfile (bad config, a library
      // missing, refused at once) instead of waiting out its bound.
      s += fmt::format(
          "p=$(num {pf}); if ours \"$p\" /sparkd-{r}.pid; then echo \"@@busy {r} $p\"; else "
          "rm -f {pf} {pf}.engine {pf}.launch; {env} setsid -f /bin/sh -c "
          "'echo $$ >\"$0\"; exec \"$@\"' {pf}.launch \"$B\" --config \"$C\" --rank {r} "
          "--pidfile {pf} --log-file \"$L/sparkd-{r}.log\" </dev/null >\"$L/sparkd-{r}.out\" "
          "2>&1; fi\n",
          fmt::arg("pf", pidfile(r)), fmt::arg("r", r), fmt::arg("env", env));
    }
    // Wait (bounded, 10 s) until every rank wrote its pidfile or exited.
    s += "i=0; while [ $i -lt 100 ]; do w=0;";
    for (int r : ranks)
      s += fmt::format(
          " [ -s {pf} ] || {{ q=$(num {pf}.launch); [ -n \"$q\" ] && ! alive \"$q\"; }} || w=1;",
          fmt::arg("pf", pidfile(r)));
    s += " [ $w = 0 ] && break; sleep 0.1; i=$((i+1)); done\n";
    for (int r : ranks)
      s += fmt::format(
          "p=$(num {pf}); if alive \"$p\"; then echo \"@@pid {r} $p\"; else echo \"@@nopid {r} "
          "x $(tail -n 4 \"$L/sparkd-{r}.out\" \"$L/sparkd-{r}.log\" 2>/dev/null | grep -v '^==' | "
          "{tail})\"; fi; rm -f {pf}.launch\n",
          fmt::arg("pf", pidfile(r)), fmt::arg("r", r), fmt::arg("tail", kTailLine));
    cmds.push_back(s);
  }
  auto runs = run_on(cfg, nodes, cmds, config_text, lay.node_timeout);
  std::vector<LaunchResult> out;
  for (auto& run : runs) {
    std::map<int, LaunchResult> by_rank;
    for (int r : ranks_of_node(cfg, run.index)) {
      LaunchResult lr;
      lr.rank = r;
      lr.node = run.node;
      lr.error = run.error ? run.error->message
                           : fmt::format("{}: no answer from the launch script (exit {}): {}",
                                         run.node, run.exit_status, trim(run.err));
      by_rank[r] = lr;
    }
    for (const auto& row : tagged(run.out, "fatal", 1))
      for (auto& [r, lr] : by_rank) lr.error = fmt::format("{}: {}", run.node, row.back());
    for (const auto& row : tagged(run.out, "busy", 1))
      if (auto it = by_rank.find(to_int(row[0], -1)); it != by_rank.end())
        it->second.error = fmt::format(
            "{}: rank {} already runs (sparkd pid {}); stop the ring first (sparkctl stop)",
            run.node, it->first, row.size() > 1 ? row[1] : "?");
    for (const auto& row : tagged(run.out, "pid", 1))
      if (auto it = by_rank.find(to_int(row[0], -1)); it != by_rank.end() && row.size() > 1) {
        it->second.pid = to_int(row[1]);
        it->second.error.clear();
      }
    for (const auto& row : tagged(run.out, "nopid", 2))
      if (auto it = by_rank.find(to_int(row[0], -1)); it != by_rank.end())
        it->second.error = fmt::format("{}: sparkd rank {} did not start: {}", run.node, it->first,
                                       trim(row.back()));
    for (auto& [r, lr] : by_rank) out.push_back(lr);
  }
  std::sort(out.begin(), out.end(),
            [](const LaunchResult& a, const LaunchResult& b) { return a.rank < b.rank; });
  return out;
}

std::vector<StopResult> stop_ranks(const RingConfig& cfg, const RingLayout& lay,
                                   std::chrono::milliseconds grace) {
  std::vector<int> nodes = all_nodes(cfg);
  std::vector<std::string> cmds;
  int64_t tenths = std::max<int64_t>(1, grace.count() / 100);
  for (int n : nodes) {
    auto ranks = ranks_of_node(cfg, n);
    std::string s = node_dirs_prelude(cfg) + kShellFns;
    for (int r : ranks)
      s += fmt::format(
          "p{r}=$(num {pf}); e{r}=$(num {pf}.engine); "
          "if ours \"$p{r}\" /sparkd-{r}.pid; then kill -TERM \"$p{r}\" 2>/dev/null; "
          "echo \"@@term {r} $p{r}\"; else p{r}=; fi\n",
          fmt::arg("pf", pidfile(r)), fmt::arg("r", r));
    s += fmt::format("i=0; while [ $i -lt {} ]; do w=0;", tenths);
    for (int r : ranks) s += fmt::format(" alive \"$p{}\" && w=1;", r);
    s += " [ $w = 0 ] && break; sleep 0.1; i=$((i+1)); done\n";
    for (int r : ranks)
      s += fmt::format(
          "if alive \"$p{r}\"; then kill -KILL \"$p{r}\" 2>/dev/null; echo \"@@kill {r} $p{r}\"; "
          "fi\n"
          "if [ -n \"$e{r}\" ] && [ \"$e{r}\" -gt 1 ] && [ -n \"$(pgrep -g \"$e{r}\")\" ]; then "
          "kill -KILL -\"$e{r}\" 2>/dev/null; echo \"@@killengine {r} $e{r}\"; fi\n",
          fmt::arg("r", r));
    // Any sparkd of this node the pidfiles do not know (a pidfile lost or overwritten): found by
    // its --config path. The pattern is built at run time so it never matches this script.
    s += fmt::format(
        "pat=$(printf '%s' \"$S/run/ring-node{n}\" | sed 's|[^a-zA-Z0-9/_-]|[&]|g')\n"
        "for q in $(pgrep -f -- \"${{pat}}[.]env\"); do alive \"$q\" && "
        "{{ kill -KILL \"$q\" 2>/dev/null; echo \"@@kill -1 $q\"; }}; done\n"
        "sleep 0.2\n",
        fmt::arg("n", n));
    for (int r : ranks)
      s += fmt::format(
          "l=0; if alive \"$p{r}\"; then echo \"@@left {r} x sparkd pid $p{r}\"; l=1; fi\n"
          "if [ -n \"$e{r}\" ] && [ \"$e{r}\" -gt 1 ]; then for q in $(pgrep -g \"$e{r}\"); do "
          "alive \"$q\" && {{ echo \"@@left {r} x engine pid $q (process group $e{r})\"; l=1; }}; "
          "done; fi\n"
          "[ $l = 0 ] && rm -f {pf} {pf}.engine\n",
          fmt::arg("pf", pidfile(r)), fmt::arg("r", r));
    s += "for q in $(pgrep -f -- \"${pat}[.]env\"); do alive \"$q\" && "
         "echo \"@@left -1 x sparkd pid $q (not in a pidfile)\"; done\ntrue\n";
    cmds.push_back(s);
  }
  auto runs = run_on(cfg, nodes, cmds, "", grace + lay.node_timeout);
  std::vector<StopResult> out;
  for (auto& run : runs) {
    std::map<int, StopResult> by_rank;
    for (int r : ranks_of_node(cfg, run.index)) {
      StopResult sr;
      sr.rank = r;
      sr.node = run.node;
      sr.how = "none";
      if (run.error) sr.error = run.error->message;
      by_rank[r] = sr;
    }
    auto rank_of = [&](const std::string& s) -> StopResult* {
      int r = to_int(s, -1);
      if (r < 0) return by_rank.empty() ? nullptr : &by_rank.begin()->second;
      auto it = by_rank.find(r);
      return it == by_rank.end() ? nullptr : &it->second;
    };
    for (const auto& row : tagged(run.out, "term", 1))
      if (auto* sr = rank_of(row[0]); sr && row.size() > 1) {
        sr->pid = to_int(row[1]);
        sr->how = "sigterm";
      }
    for (const auto& row : tagged(run.out, "kill", 1))
      if (auto* sr = rank_of(row[0]); sr && row.size() > 1) {
        if (sr->pid == 0) sr->pid = to_int(row[1]);
        sr->how = "sigkill";
      }
    for (const auto& row : tagged(run.out, "killengine", 1))
      if (auto* sr = rank_of(row[0])) {
        if (sr->how == "none") sr->how = "sigkill";
        sr->how += " (engine group)";
      }
    for (const auto& row : tagged(run.out, "left", 2))
      if (auto* sr = rank_of(row[0]))
        sr->left.push_back(fmt::format("{}: {}", run.node, row.back()));
    if (!run.error && run.exit_status != 0)
      for (auto& [r, sr] : by_rank)
        sr.error =
            fmt::format("{}: stop script exited {}: {}", run.node, run.exit_status, trim(run.err));
    for (auto& [r, sr] : by_rank) out.push_back(sr);
  }
  std::sort(out.begin(), out.end(),
            [](const StopResult& a, const StopResult& b) { return a.rank < b.rank; });
  return out;
}

Result<std::string> read_rank_log(const RingConfig& cfg, const RingLayout& lay, int rank,
                                  int lines) {
  auto p = place_of(cfg, rank);
  std::string s = node_dirs_prelude(cfg) +
                  fmt::format(
                      "if [ -r \"$L/sparkd-{r}.log\" ]; then tail -n {n} \"$L/sparkd-{r}.log\"; "
                      "else echo \"no log $L/sparkd-{r}.log\" >&2; exit 4; fi\n",
                      fmt::arg("r", rank), fmt::arg("n", lines));
  auto runs = run_on(cfg, {p.node}, {s}, "", lay.node_timeout);
  if (runs.empty()) return make_error(Errc::internal, "no result");
  if (runs[0].error) return *runs[0].error;
  if (runs[0].exit_status != 0)
    return make_error(Errc::not_found,
                      fmt::format("{}: rank {}: {}", runs[0].node, rank, trim(runs[0].err)));
  return runs[0].out;
}

std::string follow_log_command(const RingConfig& cfg, int rank, int lines) {
  return node_dirs_prelude(cfg) +
         fmt::format("exec tail -n {} -F \"$L/sparkd-{}.log\" 2>&1\n", lines, rank);
}

Result<json> fetch_health(const RingConfig& cfg, const RingLayout& lay,
                          std::chrono::milliseconds timeout) {
  const auto& n0 = cfg.nodes.at(0);
  std::string host = cfg.get("API_BIND");
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  auto port = static_cast<uint16_t>(cfg.get_int("API_PORT"));
  std::string body;
  int status = 0;
  if (n0.local) {
    HttpCall c;
    c.host = host;
    c.port = port;
    c.target = "/health";
    c.timeout = timeout;
    auto r = http_call(c);
    if (!r)
      return make_error(r.error().code,
                        fmt::format("rank 0 ({}) /health: {}", n0.name, r.error().message));
    body = r->body;
    status = r->status;
  } else {
    std::string cmd =
        fmt::format("{} health-get --host {} --port {} --timeout-ms {}",
                    spark::shell_quote(lay.sparkctl_bin), host, port, timeout.count());
    auto runs = run_on(cfg, {0}, {cmd}, "", timeout + lay.node_timeout);
    if (runs.empty() || runs[0].error)
      return runs.empty() ? make_error(Errc::internal, "no result") : *runs[0].error;
    json j = json::parse(runs[0].out, nullptr, false);
    if (!j.is_object() || !j.contains("status"))
      return make_error(Errc::network,
                        fmt::format("rank 0 ({}) /health: {}", n0.name,
                                    trim(runs[0].err.empty() ? runs[0].out : runs[0].err)));
    status = j.value("status", 0);
    body = j.value("body", "");
  }
  json h = json::parse(body, nullptr, false);
  if (!h.is_object())
    return make_error(Errc::network,
                      fmt::format("rank 0 ({}) /health answered {} without JSON", n0.name, status));
  return h;
}

}  // namespace spark::cli
