#include "cli/ring_nodes.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "cli/cmd_preflight.h"
#include "cli/node_exec.h"
#include "cli/ring_state.h"
#include "core/http_client.h"
#include "core/install_layout.h"
#include "core/process.h"
#include "core/strings.h"

namespace spark::cli {

using nlohmann::json;

namespace {

std::vector<int> all_nodes(const RingConfig& cfg) {
  std::vector<int> out;
  for (const auto& n : cfg.nodes) out.push_back(n.index);
  return out;
}

// Runs `sparkctl --config - node <op> --node N <args[k]>` on nodes[k], all at once, with the
// head's resolved cluster file on stdin; the JSON reply of each, or why there is none.
struct NodeReply {
  NodeRun run;
  json reply;  // an object when the node answered
  std::optional<Error> error;
};
std::vector<NodeReply> node_op(const RingConfig& cfg, const RingLayout& lay, const char* op,
                               const std::vector<int>& nodes, const std::vector<std::string>& args,
                               const std::string& config_text, std::chrono::milliseconds timeout) {
  std::vector<NodeJob> jobs;
  for (size_t k = 0; k < nodes.size(); ++k)
    jobs.push_back(NodeJob{
        nodes[k],
        fmt::format("{} --config - node {} --node {}{}", spark::shell_quote(lay.sparkctl_bin), op,
                    nodes[k], args.empty() ? std::string() : args[k]),
        config_text});
  std::vector<NodeReply> out;
  for (auto& run : run_on_nodes(cfg, jobs, timeout)) {
    NodeReply r;
    r.run = std::move(run);
    if (r.run.error) {
      r.error = r.run.error;
    } else {
      auto j = json::parse(r.run.out, nullptr, false);
      if (j.is_object() && j.contains("error") && j["error"].is_object())
        r.error = make_error(Errc::remote, fmt::format("{}: sparkctl node {}: {}", r.run.node, op,
                                                       j["error"].value("message", "failed")));
      else if (!j.is_object())
        r.error = make_error(
            Errc::remote,
            fmt::format("{}: `{} node {}` exited {} without a reply{}{} (is this sparkctl "
                        "installed there? SPARKCTL_BIN)",
                        r.run.node, lay.sparkctl_bin, op, r.run.exit_status,
                        trim(r.run.err).empty() ? "" : ": ", trim(r.run.err)));
      else
        r.reply = std::move(j);
    }
    out.push_back(std::move(r));
  }
  return out;
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

std::vector<NodeProbe> probe_nodes(const RingConfig& cfg, const RingLayout& lay) {
  std::vector<NodeProbe> out;
  for (auto& r :
       node_op(cfg, lay, "probe", all_nodes(cfg), {}, config_wire_text(cfg), lay.node_timeout)) {
    NodeProbe p = r.error ? NodeProbe{} : probe_from_json(r.reply);
    p.node = r.run.node;
    p.index = r.run.index;
    if (r.error) {
      p.error = r.error;
      for (int rank : ranks_of_node(cfg, r.run.index))
        p.ranks.push_back(RankProcess{rank, 0, false, -1});
    }
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<LaunchResult> launch_ranks(
    const RingConfig& cfg, const RingLayout& lay, const std::string& config_text,
    const std::vector<std::vector<std::pair<std::string, std::string>>>& rank_env) {
  std::vector<int> nodes = all_nodes(cfg);
  std::vector<std::string> args;
  for (int n : nodes) {
    std::string a = " --sparkd " + spark::shell_quote(lay.sparkd_bin);
    for (int r : ranks_of_node(cfg, n))
      if (static_cast<size_t>(r) < rank_env.size())
        for (const auto& [k, v] : rank_env[static_cast<size_t>(r)])
          a += " --env " + spark::shell_quote(fmt::format("{}:{}={}", r, k, v));
    args.push_back(a);
  }
  std::vector<LaunchResult> out;
  for (auto& r : node_op(cfg, lay, "launch", nodes, args, config_text, lay.node_timeout)) {
    if (r.error) {
      for (int rank : ranks_of_node(cfg, r.run.index))
        out.push_back(LaunchResult{rank, r.run.node, 0, r.error->message});
      continue;
    }
    for (auto& lr : launches_from_json(r.reply)) out.push_back(std::move(lr));
  }
  std::sort(out.begin(), out.end(),
            [](const LaunchResult& a, const LaunchResult& b) { return a.rank < b.rank; });
  return out;
}

std::vector<StopResult> stop_ranks(const RingConfig& cfg, const RingLayout& lay,
                                   std::chrono::milliseconds grace) {
  std::vector<int> nodes = all_nodes(cfg);
  std::vector<std::string> args(nodes.size(), fmt::format(" --grace-ms {}", grace.count()));
  std::vector<StopResult> out;
  for (auto& r :
       node_op(cfg, lay, "stop", nodes, args, config_wire_text(cfg), grace + lay.node_timeout)) {
    if (r.error) {
      for (int rank : ranks_of_node(cfg, r.run.index)) {
        StopResult sr;
        sr.rank = rank;
        sr.node = r.run.node;
        sr.error = r.error->message;
        out.push_back(sr);
      }
      continue;
    }
    for (auto& sr : stops_from_json(r.reply)) out.push_back(std::move(sr));
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
  auto runs = run_on_nodes(cfg, jobs_on({p.node}, {s}, ""), lay.node_timeout);
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

// Drops what does not have the type a health body gives it, so that readers of the body
// (status, watch, start) never meet a null or a wrong type where they read a field.
json sanitize_health(json h) {
  auto keep = [](json& o, const char* key, bool (json::*is)() const noexcept) {
    if (o.contains(key) && !(o[key].*is)()) o.erase(key);
  };
  for (const char* k : {"state", "reason"}) keep(h, k, &json::is_string);
  for (const char* k : {"live", "ready", "fatal", "stalled", "ok"}) keep(h, k, &json::is_boolean);
  for (const char* k : {"world_size", "requests_in_flight"}) keep(h, k, &json::is_number);
  if (!h.contains("slots") || !h["slots"].is_object()) h["slots"] = json::object();
  for (const char* k : {"total", "busy"}) keep(h["slots"], k, &json::is_number);
  if (h.contains("ranks")) {
    if (!h["ranks"].is_array()) {
      h.erase("ranks");
    } else {
      json ranks = json::array();
      for (auto& r : h["ranks"]) {
        if (!r.is_object()) continue;
        for (const char* k : {"state", "reason", "device", "node"}) keep(r, k, &json::is_string);
        for (const char* k : {"alive", "joined"}) keep(r, k, &json::is_boolean);
        for (const char* k : {"rank", "last_seen_s"}) keep(r, k, &json::is_number);
        ranks.push_back(std::move(r));
      }
      h["ranks"] = std::move(ranks);
    }
  }
  return h;
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
    auto runs = run_on_nodes(cfg, jobs_on({0}, {cmd}, ""), timeout + lay.node_timeout);
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
  if (!h.contains("live")) {
    // Not a health body: an error of the listener itself (its connection cap: 503 "busy",
    // which says nothing about the ring; a 401 or 404 of something else on the port).
    std::string msg;
    if (h.contains("error") && h["error"].is_object() && h["error"].contains("message") &&
        h["error"]["message"].is_string())
      msg = h["error"]["message"].get<std::string>();
    bool capped = status == 503 && msg.find("too many connections") != std::string::npos;
    return make_error(capped ? Errc::busy : Errc::network,
                      fmt::format("rank 0 ({}) /health answered {}{}{}", n0.name, status,
                                  msg.empty() ? " without a health body" : ": ", msg));
  }
  return sanitize_health(std::move(h));
}

}  // namespace spark::cli
