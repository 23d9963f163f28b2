#include "cli/ring_ops.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <sstream>
#include <thread>

#include "cli/cmd_preflight.h"
#include "cli/engine_pin.h"
#include "cli/node_exec.h"
#include "core/install_layout.h"
#include "core/process.h"
#include "core/strings.h"
#include "env/rank_env.h"

namespace spark::cli {

using nlohmann::json;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string endpoint_of(const RingConfig& cfg) {
  std::string host = cfg.get("API_BIND").empty() ? "127.0.0.1" : cfg.get("API_BIND");
  return fmt::format("http://{}:{}", host, cfg.get("API_PORT"));
}

milliseconds dur(const RingConfig& cfg, const char* key, milliseconds def) {
  return cfg.get(key).empty() ? def : milliseconds(cfg.get_duration_ms(key));
}

std::string secs(milliseconds d) {
  return fmt::format("{:.1f} s", static_cast<double>(d.count()) / 1000.0);
}

// One step of start: timed, recorded in the report.
struct Step {
  StartReport& rep;
  std::string name;
  Clock::time_point t0 = Clock::now();
  void done(bool ok, std::string detail) {
    rep.steps.push_back(StartStep{name, ok, std::move(detail), since(t0)});
    if (rep.progress.step) rep.progress.step(rep.steps.back());
  }
};

std::string first_lines(const std::string& s, size_t max = 600) {
  std::string t(trim(s));
  return t.size() > max ? t.substr(0, max) + "..." : t;
}

// Fast preflight, fail-closed. Returns the node reports (for the rank environment).
Result<std::vector<env::NodeReport>> run_start_preflight(const RingConfig& cfg,
                                                         const RingLayout& lay, StartReport& rep) {
  Step st{rep, "preflight"};
  PreflightRun run;
  auto only = split_list(cfg.get("START_CHECKS"));
  if (only.empty())
    run.filter.skip = {"net.bandwidth"};
  else
    run.filter.only = only;
  run.sparkctl_bin = lay.sparkctl_bin;
  run.timeout = lay.node_timeout;
  auto pr = run_ring_preflight(cfg, run);
  std::vector<std::string> fails;
  int warns = 0;
  for (const auto& c : pr.checks) {
    if (c.verdict == env::Verdict::fail)
      fails.push_back(fmt::format("{} {}{}: {}{}", c.node, c.id,
                                  c.subject.empty() ? "" : " " + c.subject, c.message,
                                  c.fix.empty() ? "" : " (fix: " + c.fix + ")"));
    if (c.verdict == env::Verdict::warn) {
      ++warns;
      rep.warnings.push_back(fmt::format("preflight {} {}: {}", c.node, c.id, c.message));
    }
  }
  if (!fails.empty()) {
    st.done(false, fmt::format("{} check(s) failed", fails.size()));
    return make_error(Errc::precondition,
                      fmt::format("preflight failed, so the ring was not started (fail-closed; "
                                  "`sparkctl preflight` shows every check): {}",
                                  join(fails, "; ")));
  }
  st.done(true, fmt::format("{} checks, {} warning(s)", pr.checks.size(), warns));
  return pr.nodes;
}

// Renders every rank's environment from the preflight facts (or from the config alone).
Result<std::vector<std::vector<std::pair<std::string, std::string>>>> render_envs(
    const RingConfig& cfg, const std::vector<env::NodeReport>& reports) {
  std::vector<std::vector<std::pair<std::string, std::string>>> out;
  for (const auto& p : cfg.ranks()) {
    env::NodeReport rep;
    rep.index = p.node;
    rep.node = cfg.nodes.at(static_cast<size_t>(p.node)).name;
    for (const auto& r : reports)
      if (r.index == p.node) rep = r;
    auto e = env::render_rank_env(cfg, p.rank, rep);
    if (!e) return e.error();
    out.push_back(e->vars);
  }
  return out;
}

Status evict_models(const RingConfig& cfg, const RingLayout& lay, StartReport& rep) {
  Step st{rep, "evict"};
  std::vector<int> nodes;
  std::vector<std::string> cmds;
  for (const auto& n : cfg.nodes) {
    if (n.model_path.empty()) continue;
    nodes.push_back(n.index);
    cmds.push_back(fmt::format("{} evict --local --json --node {} {}",
                               spark::shell_quote(lay.sparkctl_bin), spark::shell_quote(n.name),
                               spark::shell_quote(n.model_path)));
  }
  if (nodes.empty()) {
    st.done(true, "skipped: no MODEL_PATH");
    return Status::Ok();
  }
  auto runs =
      run_on_nodes(cfg, jobs_on(nodes, cmds), std::max(lay.node_timeout, milliseconds(300000)));
  std::vector<std::string> parts;
  for (const auto& r : runs) {
    if (r.error) {
      st.done(false, r.error->message);
      return *r.error;
    }
    json j = json::parse(r.out, nullptr, false);
    if (j.is_object() && j.contains("nodes") && j["nodes"].is_array() && !j["nodes"].empty())
      j = j["nodes"][0];
    if (!j.is_object() || j.contains("error") ||
        (r.exit_status != 0 && r.exit_status != exit_code(Errc::precondition))) {
      if (j.is_object() && j.contains("error") && j["error"].is_object())
        j = j["error"].value("message", "");
      std::string why = j.is_string() ? j.get<std::string>() : first_lines(r.err + r.out);
      // Not fatal by itself: the memory gate that follows decides whether the node has room;
      // a missing model directory is preflight's model.files check.
      rep.warnings.push_back(
          fmt::format("{}: evicting the page cache of the model files failed "
                      "(exit {}): {}",
                      r.node, r.exit_status, why));
      parts.push_back(r.node + " FAILED (see warnings)");
      continue;
    }
    if (!j.value("ok", true))
      rep.warnings.push_back(
          fmt::format("{}: some model files stay in the page cache (mapped by "
                      "a process?): sparkctl cache-stat shows which",
                      r.node));
    parts.push_back(fmt::format("{} {} -> {}", r.node,
                                format_size(j.value("bytes_before", uint64_t{0})),
                                format_size(j.value("bytes_after", uint64_t{0}))));
  }
  st.done(true, join(parts, ", "));
  return Status::Ok();
}

Status wait_memory(const RingConfig& cfg, const RingLayout& lay, StartReport& rep) {
  Step st{rep, "memory"};
  uint64_t need = cfg.get_size("MEM_FREE_MIN");
  milliseconds wait = dur(cfg, "MEM_WAIT", milliseconds(120000));
  auto deadline = Clock::now() + wait;
  for (;;) {
    auto probes = probe_nodes(cfg, lay);
    std::vector<std::string> short_of;
    for (const auto& p : probes) {
      if (p.error) {
        st.done(false, p.error->message);
        return *p.error;
      }
      if (p.mem_free < 0 || static_cast<uint64_t>(p.mem_free) < need)
        short_of.push_back(
            fmt::format("{}: MemFree {} < MEM_FREE_MIN {}", p.node,
                        p.mem_free < 0 ? "unknown" : format_size(static_cast<uint64_t>(p.mem_free)),
                        format_size(need)));
    }
    if (short_of.empty()) {
      st.done(true, fmt::format("MemFree >= {} on every node", format_size(need)));
      return Status::Ok();
    }
    if (Clock::now() >= deadline) {
      Error e = make_error(
          Errc::resource,
          fmt::format("not enough free memory after waiting {} (MEM_WAIT): {} — free memory on "
                      "that node (stop what holds it; sparkctl evict drops the model's page cache) "
                      "or lower MEM_FREE_MIN; the ring was not started",
                      secs(wait), join(short_of, "; ")));
      st.done(false, e.message);
      return e;
    }
    std::this_thread::sleep_for(milliseconds(1000));
  }
}

std::string log_tail_one_line(const RingConfig& cfg, const RingLayout& lay, int rank, int lines) {
  auto t = read_rank_log(cfg, lay, rank, lines);
  if (!t) return "(no log: " + t.error().message + ")";
  std::string s(trim(*t));
  for (auto& c : s)
    if (c == '\n') c = '|';
  return s;
}

// Waits for READY on rank 0; fails early on fatal or a dead rank.
Status wait_ready(const RingConfig& cfg, const RingLayout& lay, StartReport& rep) {
  Step st{rep, "ready"};
  milliseconds limit = dur(cfg, "READY_TIMEOUT", milliseconds(1800000));
  auto deadline = Clock::now() + limit;
  auto next_probe = Clock::now() + milliseconds(1000);
  std::string last = "rank 0 has not answered yet";
  // Rank 0's phase as a step of its own each time it moves on (it is the slowest rank's:
  // rank 0 waits for every follower at each barrier).
  std::optional<Step> phase;
  std::string phase_detail;
  auto phase_to = [&](const std::string& next) {
    if (phase && phase->name == next) return;
    if (phase) phase->done(true, phase_detail);
    phase.reset();
    if (!next.empty() && next != "ready") phase.emplace(Step{rep, next});
  };
  for (;;) {
    auto h = fetch_health(cfg, lay, milliseconds(2000));
    if (h) {
      std::string problem = strict_problem(*h);
      std::string p = start_phase(h->value("state", ""), h->value("reason", ""));
      if (!p.empty()) {
        phase_to(p);
        phase_detail = h->value("reason", "");
      }
      if (rep.progress.waiting) {
        std::vector<std::string> ranks;
        if (h->contains("ranks") && (*h)["ranks"].is_array())
          for (const auto& r : (*h)["ranks"]) {
            std::string why = r.value("reason", "");
            std::string state = r.value("state", "?");
            std::string rp = start_phase(state, why);
            ranks.push_back(fmt::format("rank {} {}{}", r.value("rank", -1),
                                        rp.empty() ? state : rp,
                                        why.empty() ? "" : " (" + why + ")"));
          }
        rep.progress.waiting(join(ranks, ", "));
      }
      if (problem.empty()) {
        phase_to("ready");
        st.done(true, fmt::format("READY: {} rank(s) joined, slots {}", h->value("world_size", 0),
                                  (*h)["slots"].value("total", 0)));
        return Status::Ok();
      }
      last = problem;
      if (h->value("fatal", false)) {
        Error e = make_error(
            Errc::remote, "rank 0 reports the ring fatal: " + h->value("reason", std::string("?")));
        st.done(false, e.message);
        return e;
      }
    } else {
      last = h.error().message;
    }
    if (Clock::now() >= next_probe) {
      next_probe = Clock::now() + milliseconds(1000);
      for (const auto& p : probe_nodes(cfg, lay)) {
        for (const auto& r : p.ranks) {
          if (r.alive) continue;
          std::string why =
              p.error ? p.error->message
                      : fmt::format("rank {} (node {}) exited during start", r.rank, p.node);
          auto h2 = fetch_health(cfg, lay, milliseconds(1000));
          if (h2 && h2->contains("reason"))
            why += "; rank 0 says: " + (*h2)["reason"].get<std::string>();
          why += "; its log: " + log_tail_one_line(cfg, lay, r.rank, 6);
          Error e = make_error(Errc::remote, why);
          st.done(false, e.message);
          return e;
        }
      }
    }
    if (Clock::now() >= deadline) {
      Error e = make_error(
          Errc::timeout,
          fmt::format("the ring was not READY within READY_TIMEOUT {}: {}", secs(limit), last));
      st.done(false, e.message);
      return e;
    }
    std::this_thread::sleep_for(milliseconds(200));
  }
}

std::string stop_leftovers(const std::vector<StopResult>& rs) {
  std::vector<std::string> left;
  for (const auto& r : rs) {
    for (const auto& l : r.left) left.push_back(l);
    if (!r.error.empty()) left.push_back(r.error);
  }
  return join(left, "; ");
}

// The part of start that runs under the lock.
// A manual start clears DISABLED and GAVE_UP and ends the restart cap's window.
void clear_for_manual_start(const std::string& state) {
  clear_marker(state, Marker::disabled);
  clear_marker(state, Marker::gave_up);
  WatchRecord w = read_watch_record(state);
  w.failures = 0;
  w.restarts_ms.clear();
  (void)write_watch_record(state, w);
}

// Every node answers over SSH, and a ring that already runs is not started twice.
Status check_not_running(const RingConfig& cfg, const RingLayout& lay, StartReport& rep) {
  Step st{rep, "ssh"};
  std::vector<std::string> running;
  for (const auto& p : probe_nodes(cfg, lay)) {
    if (p.error) {
      st.done(false, p.error->message);
      return *p.error;
    }
    for (const auto& r : p.ranks)
      if (r.alive) running.push_back(fmt::format("rank {} on {} (pid {})", r.rank, p.node, r.pid));
  }
  if (!running.empty()) {
    st.done(false, "the ring already runs");
    return make_error(Errc::busy,
                      fmt::format("the ring already runs ({}); nothing was changed: `sparkctl "
                                  "status` shows it, `sparkctl restart` starts it again",
                                  join(running, ", ")));
  }
  st.done(true, fmt::format("{} node(s) answer; no rank runs", cfg.nodes.size()));
  return Status::Ok();
}

// Each node's facts for the rank environments: from the preflight gate, or with
// --skip-preflight from the RDMA probe alone (netdev addresses, GID indexes), said loudly.
Result<std::vector<env::NodeReport>> start_facts(const RingConfig& cfg, const RingLayout& lay,
                                                 const StartOptions& opt, StartReport& rep) {
  if (!opt.skip_preflight) return run_start_preflight(cfg, lay, rep);
  rep.warnings.push_back(
      "PREFLIGHT SKIPPED (--skip-preflight): the ring starts without the checks for wrong GID "
      "indexes, interface pins, memory and parity; a ring that dies later may be one of those");
  rep.steps.push_back(StartStep{"preflight", true, "SKIPPED (--skip-preflight)", 0});
  PreflightRun facts;
  facts.filter.only = {"rdma"};
  facts.sparkctl_bin = lay.sparkctl_bin;
  facts.timeout = lay.node_timeout;
  std::vector<int> all;
  for (const auto& n : cfg.nodes) all.push_back(n.index);
  std::vector<env::NodeReport> reports;
  for (auto& o : collect_node_reports(cfg, facts, all)) {
    if (o.error) return *o.error;
    if (o.report) reports.push_back(std::move(*o.report));
  }
  return reports;
}

// One attempt: the memory gate, the launch of every rank (recorded in ring.json), and unless
// --no-wait, READY. Ok when the ring is up (rep.ready says whether READY was waited for).
Status launch_once(const RingConfig& cfg, const RingLayout& lay, const StartOptions& opt,
                   const std::string& state, const std::string& wire,
                   const std::vector<std::vector<std::pair<std::string, std::string>>>& envs,
                   StartReport& rep) {
  SPARK_TRY(wait_memory(cfg, lay, rep));
  Step st{rep, "launch"};
  RingRecord rec;
  rec.started = true;
  rec.launched_ms = wall_ms();
  rec.endpoint = rep.endpoint;
  rec.model = rep.model;
  rec.by = opt.by;
  rep.ranks = launch_ranks(cfg, lay, wire, envs);
  std::vector<std::string> errs;
  for (const auto& r : rep.ranks) {
    rec.pids.push_back(r.pid);
    if (!r.error.empty()) errs.push_back(r.error);
  }
  (void)write_ring_record(state, rec);
  if (!errs.empty()) {
    Status s = make_error(Errc::remote, join(errs, "; "));
    st.done(false, s.message());
    return s;
  }
  st.done(true, fmt::format("{} rank(s) launched", rep.ranks.size()));
  // What was started (image digest or binary hashes, cluster file): rollback's record.
  (void)write_engine_set(state, "current",
                         collect_engine_set(cfg, lay.sparkctl_bin, wire, lay.node_timeout));
  if (!opt.wait_ready) return Status::Ok();
  SPARK_TRY(wait_ready(cfg, lay, rep));
  rec.ready_ms = wall_ms();
  (void)write_ring_record(state, rec);
  WatchRecord w = read_watch_record(state);
  w.failures = 0;
  (void)write_watch_record(state, w);
  rep.ready = true;
  (void)mark_last_good(state);  // the set that reached READY is the last good one
  return Status::Ok();
}

// Tears the whole ring down after a failed attempt: nothing half-started stays on any node.
// What is still running, or "".
std::string tear_down(const RingConfig& cfg, const RingLayout& lay, StartReport& rep) {
  rep.torn_down = true;
  Step td{rep, "teardown"};
  auto stopped = stop_ranks(cfg, lay, dur(cfg, "STOP_GRACE", milliseconds(30000)));
  std::string left = stop_leftovers(stopped);
  td.done(left.empty(), left.empty() ? "nothing left on any node" : "LEFT RUNNING: " + left);
  return left;
}

StartReport start_locked(const RingConfig& cfg, const RingLayout& lay, const StartOptions& opt,
                         const std::string& state) {
  auto t0 = Clock::now();
  StartReport rep;
  rep.progress = opt.progress;
  rep.endpoint = endpoint_of(cfg);
  rep.model = cfg.get("MODEL");
  rep.world_size = cfg.world_size();
  auto fail = [&](Error e) {
    rep.error = std::move(e);
    rep.seconds = since(t0);
    return rep;
  };
  if (opt.by != "watch") clear_for_manual_start(state);
  if (Status s = check_not_running(cfg, lay, rep); !s.ok()) return fail(s.error());
  auto reports = start_facts(cfg, lay, opt, rep);
  if (!reports) return fail(reports.error());
  auto envs = render_envs(cfg, *reports);
  if (!envs) return fail(envs.error());
  if (Status s = evict_models(cfg, lay, rep); !s.ok()) return fail(s.error());

  int attempts = 1 + static_cast<int>(std::max<int64_t>(0, cfg.get_int("START_RETRIES")));
  std::string wire = config_wire_text(cfg);
  std::vector<std::string> failures;
  for (int a = 1; a <= attempts; ++a) {
    rep.attempts = a;
    Status s = launch_once(cfg, lay, opt, state, wire, *envs, rep);
    if (s.ok()) {
      rep.seconds = since(t0);
      return rep;
    }
    failures.push_back(fmt::format("attempt {}: {}", a, s.message()));
    if (std::string left = tear_down(cfg, lay, rep); !left.empty())
      failures.back() += "; teardown left processes running: " + left;
    if (s.code() == Errc::config || s.code() == Errc::usage || s.code() == Errc::resource)
      return fail(make_error(s.code(), join(failures, " | ")));
    if (a == attempts) return fail(make_error(s.code(), join(failures, " | ")));
  }
  return fail(make_error(Errc::internal, "start: no attempt ran"));
}

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("sparkctl") : p.string();
}

void run_alert(const RingConfig& cfg, const std::string& event, const std::string& reason,
               WatchReport& w) {
  const std::string& cmd = cfg.get("WATCH_ALERT_CMD");
  if (cmd.empty()) return;
  ProcessSpec spec = shell_spec(cmd, milliseconds(30000));
  spec.env["SPARK_EVENT"] = event;
  spec.env["SPARK_RING"] = cfg.get("RING_NAME");
  spec.env["SPARK_REASON"] = reason;
  auto r = run_process(spec);
  w.alerts.push_back(
      event + (r && r->success()
                   ? ""
                   : " (alert command failed: " + (r ? r->describe() : r.error().message) + ")"));
}

std::string timestamp_name() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return fmt::format("{}-{}", buf, ::getpid());
}

// Saves the tail of every rank's log under STATE_DIR/incidents/<time>/.
std::string save_log_tails(const RingConfig& cfg, const RingLayout& lay, const std::string& state,
                           const std::string& reason) {
  std::string dir = state + "/incidents/" + timestamp_name();
  (void)make_dirs(dir);
  std::string why;
  (void)write_file_atomic(dir + "/reason.txt", reason + "\n", &why, 0640);
  adopt_dir_owner(dir + "/reason.txt");
  for (const auto& p : cfg.ranks()) {
    auto t = read_rank_log(cfg, lay, p.rank, 200);
    const std::string log = fmt::format("{}/rank{}.log", dir, p.rank);
    (void)write_file_atomic(log, t ? *t : "(could not read the log: " + t.error().message + ")\n",
                            &why, 0640);
    adopt_dir_owner(log);
  }
  return dir;
}

// Why the ring is not strictly healthy ("" when it is); *only_loading when the ring is merely
// not ready yet (every process alive, nothing fatal or stalled); *capped when all that is
// known is that rank 0's listener refused the check at its connection cap (every process
// alive): the ring's health is then unknown, not bad.
std::string ring_problem(const RingConfig& cfg, const RingLayout& lay, bool* only_loading,
                         bool* capped) {
  *only_loading = false;
  *capped = false;
  std::vector<std::string> problems;
  for (const auto& p : probe_nodes(cfg, lay)) {
    if (p.error) {
      problems.push_back(p.error->message);
      continue;
    }
    for (const auto& r : p.ranks)
      if (!r.alive)
        problems.push_back(fmt::format("rank {} on {}: sparkd is not running", r.rank, p.node));
  }
  auto h = fetch_health(cfg, lay, milliseconds(5000));
  if (!h) {
    if (h.error().code == Errc::busy && problems.empty()) {
      *capped = true;
      return h.error().message;
    }
    problems.push_back("rank 0 does not answer: " + h.error().message);
    return join(problems, "; ");
  }
  std::string sp = strict_problem(*h);
  if (!sp.empty()) problems.push_back(sp);
  if (problems.size() == 1 && !sp.empty() && !h->value("fatal", false) &&
      !h->value("stalled", false)) {
    std::string state = h->value("state", "");
    bool dead = false;
    if (h->contains("ranks"))
      for (const auto& r : (*h)["ranks"])
        if (r.value("joined", true) && !r.value("alive", false)) dead = true;
    *only_loading = !dead && (state == "starting" || state == "loading");
  }
  return join(problems, "; ");
}

}  // namespace

RingLayout ring_layout(const RingConfig& cfg, const std::string& /*argv0*/) {
  RingLayout lay;
  std::string exe = self_exe();
  lay.sparkctl_bin = cfg.get("SPARKCTL_BIN").empty() ? exe : cfg.get("SPARKCTL_BIN");
  if (!cfg.get("SPARKD_BIN").empty()) {
    lay.sparkd_bin = cfg.get("SPARKD_BIN");
    lay.sparkd_explicit = true;
  } else {
    // The installed prefix, beside, the build tree; the nodes fall back to their own.
    lay.sparkd_bin = spark::locate_sparkd(exe);
    if (lay.sparkd_bin.empty()) lay.sparkd_bin = "sparkd";
  }
  milliseconds ssh = dur(cfg, "SSH_TIMEOUT", milliseconds(10000));
  lay.node_timeout = ssh + milliseconds(20000);
  return lay;
}

std::string start_phase(const std::string& state, const std::string& reason) {
  if (state == "ready") return "ready";
  if (state != "loading" && state != "starting") return "";
  // sparkd's loading reasons (daemon.cc, engine/runtime.cc); rank 0's "waiting for rank N
  // ...: R" quotes the follower's own reason, so the follower's phase is found in it.
  static const std::vector<std::pair<const char*, const char*>> k = {
      {"has not joined", "rendezvous"},
      {"rendezvous", "rendezvous"},
      {"every rank to join", "rendezvous"},
      {"tensor-parallel mesh", "fabric"},
      {"NCCL", "fabric"},
      {"fabric", "fabric"},
      {"warm-up", "probe"},
      {"probe", "probe"},
  };
  for (const auto& [needle, phase] : k)
    if (reason.find(needle) != std::string::npos) return phase;
  if (reason.empty() || reason == "starting") return "rendezvous";
  return "load";  // choosing the device, loading weights, chat format, starting the engine
}

std::string strict_problem(const json& h) {
  if (!h.is_object()) return "no health";
  std::string state = h.value("state", "?");
  std::string reason = h.value("reason", "");
  if (h.value("fatal", false)) return "fatal: " + reason;
  if (h.value("stalled", false)) return "stalled: " + reason;
  if (h.contains("ranks") && h["ranks"].is_array())
    for (const auto& r : h["ranks"])
      if (r.value("joined", true) && !r.value("alive", false))  // not joined yet: loading
        return fmt::format("rank {} (node {}) is not alive", r.value("rank", -1),
                           r.value("node", "?"));
  if (!h.value("ready", false)) return state + (reason.empty() ? "" : ": " + reason);
  return "";
}

StartReport start_ring(const RingConfig& cfg, const RingLayout& lay, const StartOptions& opt) {
  auto t0 = Clock::now();
  std::string state = head_state_dir(cfg);
  auto lock = RingLock::acquire(state, opt.by, opt.lock_wait_ms);
  if (!lock) {
    StartReport rep;
    rep.endpoint = endpoint_of(cfg);
    rep.steps.push_back(StartStep{"lock", false, lock.error().message, since(t0)});
    rep.error = lock.error();
    return rep;
  }
  return start_locked(cfg, lay, opt, state);
}

StopReport stop_ring(const RingConfig& cfg, const RingLayout& lay, bool disable,
                     int64_t lock_wait_ms) {
  auto t0 = Clock::now();
  StopReport rep;
  std::string state = head_state_dir(cfg);
  if (disable) {
    // The marker first: a watch that starts while we stop finds it and does nothing.
    if (Status s = set_marker(state, Marker::disabled, "sparkctl stop"); !s.ok()) {
      rep.error = s.error();
      return rep;
    }
    rep.disabled = true;
  }
  auto lock = RingLock::acquire(state, disable ? "stop" : "restart", lock_wait_ms);
  if (!lock) {
    rep.error = lock.error();
    rep.clean = false;
    return rep;
  }
  rep.ranks = stop_ranks(cfg, lay, dur(cfg, "STOP_GRACE", milliseconds(30000)));
  std::string left = stop_leftovers(rep.ranks);
  rep.clean = left.empty();
  if (!rep.clean)
    rep.error = make_error(Errc::remote,
                           "not everything stopped: " + left +
                               " — kill it by hand (kill -9 PID) and run `sparkctl stop` again");
  rep.seconds = since(t0);
  return rep;
}

StartReport restart_ring(const RingConfig& cfg, const RingLayout& lay, const StartOptions& opt,
                         StopReport* stopped,
                         const std::function<void(const StopReport&)>& on_stopped) {
  auto t0 = Clock::now();
  std::string state = head_state_dir(cfg);
  auto lock = RingLock::acquire(state, opt.by, opt.lock_wait_ms);
  if (!lock) {
    StartReport rep;
    rep.steps.push_back(StartStep{"lock", false, lock.error().message, since(t0)});
    rep.error = lock.error();
    return rep;
  }
  StopReport sr;
  sr.ranks = stop_ranks(cfg, lay, dur(cfg, "STOP_GRACE", milliseconds(30000)));
  std::string left = stop_leftovers(sr.ranks);
  sr.clean = left.empty();
  sr.seconds = since(t0);
  if (stopped) *stopped = sr;
  if (on_stopped) on_stopped(sr);
  if (!sr.clean) {
    StartReport rep;
    rep.error = make_error(Errc::remote, "restart: the old ring did not stop: " + left);
    return rep;
  }
  return start_locked(cfg, lay, opt, state);
}

RingStatus ring_status(const RingConfig& cfg, const RingLayout& lay) {
  RingStatus s;
  std::string state = head_state_dir(cfg);
  s.ring = cfg.get("RING_NAME");
  s.model = cfg.get("MODEL");
  s.engine = cfg.get("ENGINE");
  s.endpoint = endpoint_of(cfg);
  s.record = read_ring_record(state);
  s.disabled = read_marker(state, Marker::disabled);
  s.gave_up = read_marker(state, Marker::gave_up);
  WatchRecord w = read_watch_record(state);
  s.watch_failures = w.failures;
  s.last_watch_verdict = w.last_verdict;
  s.last_watch_reason = w.last_reason;
  s.last_watch_ms = w.last_check_ms;
  int64_t window = static_cast<int64_t>(cfg.get_duration_ms("WATCH_WINDOW"));
  for (int64_t t : w.restarts_ms)
    if (wall_ms() - t < window) ++s.restarts;

  auto probes = probe_nodes(cfg, lay);
  auto h = fetch_health(cfg, lay, milliseconds(3000));
  s.answered = h.ok();
  if (h) {
    s.health = *h;
    s.state = h->value("state", "?");
    s.reason = h->value("reason", "");
    s.slots_total = (*h)["slots"].value("total", 0);
    s.slots_busy = (*h)["slots"].value("busy", 0);
    s.requests_in_flight = h->value("requests_in_flight", 0);
  } else {
    // At the connection cap rank 0 answers but tells nothing of the ring: unknown, not down.
    s.state = h.error().code == Errc::busy ? "unknown" : "down";
    s.reason = h.error().message;
  }
  bool all_alive = true;
  for (const auto& p : probes) {
    NodeStatus ns;
    ns.node = p.node;
    if (p.error) ns.error = p.error->message;
    ns.mem_free = p.mem_free;
    ns.mem_available = p.mem_available;
    ns.mem_total = p.mem_total;
    ns.gpu_mem_mib = p.gpu_mem_mib;
    s.nodes.push_back(ns);
    for (const auto& r : p.ranks) {
      RankStatus rs;
      rs.rank = r.rank;
      rs.node = p.node;
      rs.pid = r.pid;
      rs.alive = r.alive;
      rs.uptime_s = r.uptime_s;
      if (!r.alive) all_alive = false;
      if (!r.alive) {
        rs.state = "down";
        rs.reason = p.error ? p.error->message : "sparkd is not running";
      } else if (r.stopped) {
        // A stopped process keeps its pid and its sockets and answers nothing.
        rs.state = "stopped";
        rs.reason = fmt::format(
            "sparkd pid {} is stopped (SIGSTOP or a debugger) and does not answer: send "
            "SIGCONT or restart the ring",
            r.pid);
      } else if (h && h->contains("ranks")) {
        rs.state = "starting";
        rs.reason = "rank 0 does not list it";
        for (const auto& hr : (*h)["ranks"])
          if (hr.value("rank", -1) == r.rank) {
            rs.state = hr.value("state", "unknown");
            rs.reason = hr.value("reason", "");
            rs.last_seen_s = hr.value("last_seen_s", -1.0);
            rs.device = hr.value("device", "");
            if (!hr.value("alive", false) && hr.value("joined", false)) {
              rs.state = "fatal";
              rs.reason = "rank 0 lost its heartbeats";
            }
          }
      } else if (!h && h.error().code == Errc::busy) {
        rs.state = "unknown";
        rs.reason = "rank 0's listener is at its connection cap: " + h.error().message;
      } else if (r.uptime_s >= 0 && r.uptime_s < 30) {
        rs.state = "starting";
        rs.reason = "rank 0 does not answer yet";
      } else {
        rs.state = "unresponsive";
        rs.reason = "its process runs but rank 0's /health does not answer" +
                    (h ? std::string() : ": " + h.error().message);
      }
      s.ranks.push_back(rs);
    }
  }
  std::sort(s.ranks.begin(), s.ranks.end(),
            [](const RankStatus& a, const RankStatus& b) { return a.rank < b.rank; });
  s.ready = h && strict_problem(*h).empty() && all_alive;
  if (h && !all_alive && s.ready == false && strict_problem(*h).empty())
    s.reason = "a rank's process is gone";
  return s;
}

namespace {

// One watch pass: the records it reads and writes and the report it builds.
struct WatchPass {
  const RingConfig& cfg;
  const RingLayout& lay;
  std::string state;
  WatchRecord rec;
  RingRecord ring;
  WatchReport w;
  // Records the verdict in the report and in watch.json.
  WatchReport save(const std::string& verdict, const std::string& reason) {
    w.verdict = verdict;
    w.reason = reason;
    w.failures = rec.failures;
    rec.last_check_ms = wall_ms();
    rec.last_verdict = verdict;
    rec.last_reason = reason;
    (void)write_watch_record(state, rec);
    return w;
  }
};

// The reasons not to restart an unhealthy ring yet: the start-up grace (only loading), fewer
// failed checks in a row than WATCH_FAILURES, the restart cap (then GAVE_UP and an alert),
// the backoff after earlier restarts. The report of the held-off pass, or nullopt to restart.
std::optional<WatchReport> hold_off(WatchPass& p, const std::string& problem, bool only_loading,
                                    int64_t now, int64_t window) {
  int64_t grace = static_cast<int64_t>(p.cfg.get_duration_ms("WATCH_GRACE"));
  if (only_loading && now - p.ring.launched_ms < grace) {
    return p.save("grace", fmt::format("{} (start-up grace: {:.0f} s of {:.0f} s used)", problem,
                                       (now - p.ring.launched_ms) / 1000.0, grace / 1000.0));
  }
  ++p.rec.failures;
  p.w.failures = p.rec.failures;
  if (p.rec.failures < p.w.failures_needed)
    return p.save("unhealthy", fmt::format("{} (failed check {} of {})", problem, p.rec.failures,
                                           p.w.failures_needed));
  int max_restarts = static_cast<int>(p.cfg.get_int("WATCH_MAX_RESTARTS"));
  int k = static_cast<int>(p.rec.restarts_ms.size());
  if (k >= max_restarts) {
    std::string why = fmt::format(
        "{} restart(s) in the last {:.0f} s (WATCH_MAX_RESTARTS {} per "
        "WATCH_WINDOW) and the ring is unhealthy again: {}",
        k, window / 1000.0, max_restarts, problem);
    (void)set_marker(p.state, Marker::gave_up, why);
    p.save("gave_up", why);
    run_alert(p.cfg, "gave_up", why, p.w);
    return p.w;
  }
  if (k > 0) {
    int64_t backoff = static_cast<int64_t>(p.cfg.get_duration_ms("WATCH_BACKOFF"));
    int64_t need = backoff << std::min(k - 1, 20);
    int64_t waited = now - p.rec.restarts_ms.back();
    if (waited < need)
      return p.save("backoff", fmt::format("{}; next restart allowed in {:.0f} s (backoff {:.0f} s "
                                           "after restart {} in the window)",
                                           problem, (need - waited) / 1000.0, need / 1000.0, k));
  }
  return std::nullopt;
}

// Heals: keeps the ranks' log tails as an incident, stops the whole ring, starts it again,
// and alerts with the outcome.
WatchReport heal(WatchPass& p, const std::string& problem, int64_t now) {
  p.w.incident_dir = save_log_tails(p.cfg, p.lay, p.state, problem);
  p.rec.restarts_ms.push_back(now);
  p.w.restarts_in_window = static_cast<int>(p.rec.restarts_ms.size());
  p.save("restarting", problem);
  auto stopped = stop_ranks(p.cfg, p.lay, dur(p.cfg, "STOP_GRACE", milliseconds(30000)));
  std::string left = stop_leftovers(stopped);
  StartOptions so;
  so.by = "watch";
  StartReport sr;
  if (!left.empty()) {
    sr.error = make_error(Errc::remote, "the old ring did not stop: " + left);
  } else {
    sr = start_locked(p.cfg, p.lay, so, p.state);
  }
  p.w.restart = sr;
  p.rec = read_watch_record(p.state);  // start_locked updated it
  if (sr.ready) {
    p.rec.failures = 0;
    p.save("restarted", "was: " + problem);
    run_alert(p.cfg, "healed", "restarted the ring; it is READY again (was: " + problem + ")", p.w);
  } else {
    p.save("restart_failed", sr.error ? sr.error->message : "not ready");
    run_alert(p.cfg, "restart_failed", p.w.reason, p.w);
  }
  return p.w;
}

}  // namespace

WatchReport watch_once(const RingConfig& cfg, const RingLayout& lay) {
  WatchReport w;
  std::string state = head_state_dir(cfg);
  w.failures_needed = static_cast<int>(std::max<int64_t>(1, cfg.get_int("WATCH_FAILURES")));
  auto marker_exit = [&]() -> bool {
    if (read_marker(state, Marker::disabled)) {
      w.verdict = "disabled";
      w.reason = "DISABLED marker set (sparkctl stop); sparkctl start clears it";
      // Saved like every other verdict, so that `watch --quiet` says it once, not every
      // minute while the ring is down on purpose.
      WatchRecord rec = read_watch_record(state);
      rec.last_check_ms = wall_ms();
      rec.last_verdict = w.verdict;
      rec.last_reason = w.reason;
      (void)write_watch_record(state, rec);
      return true;
    }
    return false;
  };
  if (marker_exit()) return w;
  auto lock = RingLock::acquire(state, "watch", 0);
  if (!lock) {
    w.verdict = "busy";
    w.reason = lock.error().message;
    return w;
  }
  if (marker_exit()) return w;  // a stop may have finished while we took the lock
  WatchPass p{cfg, lay, state, read_watch_record(state), read_ring_record(state), w};
  int64_t window = static_cast<int64_t>(cfg.get_duration_ms("WATCH_WINDOW"));
  int64_t now = wall_ms();
  auto& restarts = p.rec.restarts_ms;
  restarts.erase(std::remove_if(restarts.begin(), restarts.end(),
                                [&](int64_t t) { return now - t >= window; }),
                 restarts.end());
  p.w.restarts_in_window = static_cast<int>(restarts.size());
  if (auto g = read_marker(state, Marker::gave_up)) {
    return p.save("gave_up", "GAVE_UP marker set (" + g->value("reason", std::string("?")) +
                                 "); no restarts until `sparkctl start`");
  }
  if (!p.ring.started) {
    p.w.verdict = "not_started";
    p.w.reason =
        "the ring was never started with `sparkctl start`; watch only keeps a started ring up";
    return p.w;
  }
  bool only_loading = false, capped = false;
  std::string problem = ring_problem(cfg, lay, &only_loading, &capped);
  if (problem.empty()) {
    p.rec.failures = 0;
    return p.save("healthy", "");
  }
  if (capped)  // neither healthy nor a failure: the failure counter stays as it is
    return p.save("capped", problem +
                                " (every rank's process runs; rank 0's listener is at its "
                                "connection cap, so the ring's health is unknown; not counted "
                                "as a failed check)");
  if (auto held = hold_off(p, problem, only_loading, now, window)) return *held;
  return heal(p, problem, now);
}

// ---- JSON ----

json to_json(const StartReport& r) {
  json j;
  j["ready"] = r.ready;
  j["attempts"] = r.attempts;
  j["endpoint"] = r.endpoint;
  j["model"] = r.model;
  j["world_size"] = r.world_size;
  j["seconds"] = r.seconds;
  j["steps"] = json::array();
  for (const auto& s : r.steps)
    j["steps"].push_back(
        {{"step", s.name}, {"ok", s.ok}, {"detail", s.detail}, {"seconds", s.seconds}});
  j["ranks"] = json::array();
  for (const auto& k : r.ranks) {
    json rj = {{"rank", k.rank}, {"node", k.node}, {"pid", k.pid}};
    if (!k.error.empty()) rj["error"] = k.error;
    j["ranks"].push_back(rj);
  }
  j["warnings"] = r.warnings;
  j["torn_down"] = r.torn_down;
  if (r.error)
    j["error"] = {{"code", std::string(errc_name(r.error->code))},
                  {"exit_code", exit_code(r.error->code)},
                  {"message", r.error->message}};
  return j;
}

json to_json(const StopReport& r) {
  json j;
  j["clean"] = r.clean;
  j["disabled"] = r.disabled;
  j["seconds"] = r.seconds;
  j["ranks"] = json::array();
  for (const auto& k : r.ranks) {
    json rj = {
        {"rank", k.rank}, {"node", k.node}, {"pid", k.pid}, {"how", k.how}, {"left", k.left}};
    if (!k.error.empty()) rj["error"] = k.error;
    j["ranks"].push_back(rj);
  }
  if (r.error)
    j["error"] = {{"code", std::string(errc_name(r.error->code))},
                  {"exit_code", exit_code(r.error->code)},
                  {"message", r.error->message}};
  return j;
}

json to_json(const RingStatus& s) {
  json j;
  j["ring"] = s.ring;
  j["model"] = s.model;
  j["engine"] = s.engine;
  j["endpoint"] = s.endpoint;
  j["ready"] = s.ready;
  j["state"] = s.state;
  j["reason"] = s.reason;
  j["answered"] = s.answered;
  j["disabled"] = s.disabled ? *s.disabled : json(nullptr);
  j["gave_up"] = s.gave_up ? *s.gave_up : json(nullptr);
  j["slots"] = {{"total", s.slots_total}, {"busy", s.slots_busy}};
  j["requests_in_flight"] = s.requests_in_flight;
  j["restarts_in_window"] = s.restarts;
  j["watch"] = {{"failures", s.watch_failures},
                {"last_verdict", s.last_watch_verdict},
                {"last_reason", s.last_watch_reason},
                {"last_check_ms", s.last_watch_ms}};
  j["launched_ms"] = s.record.launched_ms;
  j["ready_ms"] = s.record.ready_ms;
  j["ranks"] = json::array();
  for (const auto& r : s.ranks)
    j["ranks"].push_back({{"rank", r.rank},
                          {"node", r.node},
                          {"state", r.state},
                          {"reason", r.reason},
                          {"pid", r.pid},
                          {"alive", r.alive},
                          {"uptime_s", r.uptime_s},
                          {"last_seen_s", r.last_seen_s},
                          {"device", r.device},
                          // ranks restart together: the ring's restarts by watch in the window
                          {"restarts", s.restarts}});
  j["nodes"] = json::array();
  for (const auto& n : s.nodes) {
    json nj = {{"node", n.node},
               {"mem_free", n.mem_free},
               {"mem_available", n.mem_available},
               {"mem_total", n.mem_total}};
    nj["gpus"] = json::array();
    for (const auto& [used, total] : n.gpu_mem_mib)
      nj["gpus"].push_back({{"used_mib", used}, {"total_mib", total}});
    if (!n.error.empty()) nj["error"] = n.error;
    j["nodes"].push_back(nj);
  }
  if (s.health) j["health"] = *s.health;
  return j;
}

json to_json(const WatchReport& w) {
  json j = {{"verdict", w.verdict},
            {"reason", w.reason},
            {"failures", w.failures},
            {"failures_needed", w.failures_needed},
            {"restarts_in_window", w.restarts_in_window},
            {"alerts", w.alerts}};
  if (!w.incident_dir.empty()) j["incident_dir"] = w.incident_dir;
  if (w.restart) j["restart"] = to_json(*w.restart);
  return j;
}

std::string fabric_status_lines(const nlohmann::json& health) {
  std::ostringstream out;
  auto fabric_line = [&out](const nlohmann::json& f, const std::string& who) {
    double ar = 0, ag = 0;
    int64_t at = 0;
    for (const auto& p : f.value("points", nlohmann::json::array())) {
      if (p.value("bytes", int64_t{0}) < at) continue;
      at = p.value("bytes", int64_t{0});
      (p.value("op", "") == "all_reduce" ? ar : ag) = p.value("busbw_gbs", 0.0);
    }
    std::vector<std::string> via;
    const auto nccl = f.value("nccl", nlohmann::json::object());
    for (const auto& p : nccl.value("peers", nlohmann::json::array()))
      via.push_back(fmt::format("{} {}", p.value("peer", -1), p.value("detail", "")));
    const auto lat = f.value("decode_latency_us", nlohmann::json::object());
    out << fmt::format(
        "{}: {}; busbw at {} MiB: all-reduce {:.1f} GB/s, all-gather {:.1f} GB/s; 8 KB "
        "all-reduce {:.1f} us; peers {}\n",
        who, f.value("passed", false) ? "passed" : "FAILED", at >> 20, ar, ag,
        lat.value("8192", 0.0), via.empty() ? "-" : join(via, ", "));
  };
  if (health.contains("fabric_ranks") && health["fabric_ranks"].is_array()) {
    for (const auto& f : health["fabric_ranks"])
      if (f.is_object()) fabric_line(f, fmt::format("fabric rank {}", f.value("rank", -1)));
  } else if (health.contains("fabric") && health["fabric"].is_object()) {
    fabric_line(health["fabric"], "fabric");
  }
  return out.str();
}

}  // namespace spark::cli
