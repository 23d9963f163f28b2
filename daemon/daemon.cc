#include "daemon/daemon.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/program_options.hpp>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <thread>

#include "core/log.h"
#include "core/strings.h"
#include "daemon/history_sampler.h"
#include "daemon/http_server.h"
#include "daemon/memory_guard.h"
#include "daemon/metrics.h"
#include "daemon/probe.h"
#include "daemon/rendezvous.h"
#include "daemon/sd_notify.h"
#include "spark/version.h"

namespace spark::daemon {

namespace net = boost::asio;
namespace po = boost::program_options;
using namespace std::chrono_literals;
using std::chrono::milliseconds;

namespace {
constexpr std::string_view kComp = "sparkd";

std::string node_name(const RingConfig& cfg, int rank) {
  for (const auto& p : cfg.ranks())
    if (p.rank == rank) return cfg.nodes.at(static_cast<size_t>(p.node)).name;
  return "?";
}
}  // namespace

bool is_loopback(const std::string& ipv4) {
  auto ip = parse_ipv4(ipv4);
  return ip && (*ip >> 24) == 127;
}

DaemonTiming timing_from_config(const RingConfig& cfg) {
  DaemonTiming t;
  auto ms = [&](const char* key, milliseconds def) {
    return cfg.get(key).empty() ? def : milliseconds(cfg.get_duration_ms(key));
  };
  t.shutdown_grace = ms("SHUTDOWN_GRACE", t.shutdown_grace);
  t.heartbeat_interval = ms("HEARTBEAT_INTERVAL", t.heartbeat_interval);
  t.heartbeat_timeout = ms("HEARTBEAT_TIMEOUT", t.heartbeat_timeout);
  t.join_timeout = ms("JOIN_TIMEOUT", t.join_timeout);
  t.stall_timeout = ms("STALL_TIMEOUT", t.stall_timeout);
  return t;
}

std::variant<DaemonOptions, int> parse_daemon_args(int argc, const char* const* argv,
                                                   std::ostream& out, std::ostream& err) {
  DaemonOptions o;
  std::string bind, log_level, grace;
  int port = -1, rdzv = -1;
  po::options_description desc("sparkd options");
  desc.add_options()("help,h", "show this help")("version", "print the version")(
      "config,c", po::value<std::string>(&o.config_path),
      "cluster file (.env); default $SPARK_CONFIG")(
      "rank,r", po::value<int>(&o.rank)->default_value(0), "this process's rank (0 = head)")(
      "bind", po::value<std::string>(&bind), "HTTP bind address (overrides API_BIND)")(
      "port", po::value<int>(&port), "HTTP port (overrides API_PORT; 0 = any free port)")(
      "rdzv-port", po::value<int>(&rdzv), "rendezvous port (overrides RDZV_PORT)")(
      "log-file", po::value<std::string>(&o.log_file), "append logs here instead of stderr")(
      "pidfile", po::value<std::string>(&o.pidfile), "write the pid here")(
      "log-level", po::value<std::string>(&log_level),
      "debug|info|warn|error (overrides LOG_LEVEL)")("grace", po::value<std::string>(&grace),
                                                     "shutdown grace (overrides SHUTDOWN_GRACE)");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    err << "sparkd: " << e.what() << " (see sparkd --help)\n";
    return exit_code(Errc::usage);
  }
  if (vm.count("help")) {
    out << "usage: sparkd --config FILE [--rank N] [options]\n\n" << desc << "\n";
    return 0;
  }
  if (vm.count("version")) {
    out << "sparkd " << kVersion << "\n";
    return 0;
  }
  auto usage = [&](const std::string& m) {
    err << "sparkd: " << m << " (see sparkd --help)\n";
    return exit_code(Errc::usage);
  };
  if (o.rank < 0) return usage("--rank must be >= 0");
  if (vm.count("bind")) {
    if (!parse_ipv4(bind)) return usage("--bind '" + bind + "' is not an IPv4 address");
    o.bind = bind;
  }
  if (vm.count("port")) {
    if (port < 0 || port > 65535) return usage("--port must be 0..65535");
    o.port = static_cast<uint16_t>(port);
  }
  if (vm.count("rdzv-port")) {
    if (rdzv < 0 || rdzv > 65535) return usage("--rdzv-port must be 0..65535");
    o.rdzv_port = static_cast<uint16_t>(rdzv);
  }
  if (vm.count("log-level")) {
    log::Level l;
    if (!log::parse_level(log_level, &l)) return usage("--log-level must be debug|info|warn|error");
    o.log_level = log_level;
  }
  if (vm.count("grace")) {
    std::string why;
    auto g = parse_duration_ms(grace, &why);
    if (!g) return usage("--grace: " + why);
    o.shutdown_grace = milliseconds(*g);
  }
  return o;
}

struct Daemon::Impl {
  Daemon* self = nullptr;
  RingConfig cfg;
  DaemonOptions opts;
  DaemonTiming timing;
  std::unique_ptr<Backend> engine;
  Health health;
  RankPlace place;
  int world = 1;
  std::string node;

  std::unique_ptr<HttpServer> http;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<MemoryGuard> memguard;
  std::unique_ptr<HistorySampler> history;  // null: HEALTH_SAMPLE_INTERVAL=0 or no file
  uint32_t history_mask = 0;                // ranks alive at the last poke
  State history_state = State::starting;
  void start_history();
  uint32_t alive_mask() const;
  int watchdog_ticks = 0;
  mutable std::mutex probe_mu;
  ProbeResult probe;  // rank 0
  bool probe_done() const {
    std::lock_guard lk(probe_mu);
    return probe.status == "passed" || probe.status == "skipped";
  }
  void run_probes();
  net::io_context ctl{1};
  std::optional<net::executor_work_guard<net::io_context::executor_type>> ctl_work;
  std::thread ctl_thread;
  std::optional<net::signal_set> signals;
  std::optional<net::signal_set> hangup;  // SIGHUP: reopen the log file
  void wait_hangup();
  std::optional<net::steady_timer> watchdog;
  std::thread lifecycle;

  std::mutex mu;
  std::condition_variable cv;
  bool stop_requested = false;
  int exit_code = 0;
  std::string stop_reason;
  std::atomic<bool> engine_started{false};
  std::atomic<bool> stopping{false};
  std::atomic<bool> ready_notified{false};  // systemd told READY=1 (sd_notify.h)

  // Rendezvous (world > 1): the store on rank 0, a client per rank, heartbeats on followers.
  std::unique_ptr<RendezvousServer> rdzv_server;
  std::unique_ptr<RendezvousClient> rdzv;
  std::mutex rdzv_mu;  // guards creating `rdzv` against abort() from wait(); calls go unlocked
  std::thread heartbeat;
  std::atomic<bool> joined{false};
  std::string rdzv_host;
  uint16_t rdzv_port = 0;

  RankIdentity identity() const;
  Status join_ring();
  void run_heartbeats();
  void fail(const std::string& why, Errc code);

  void arm_watchdog();
  void on_watchdog();
  void run_lifecycle();
  void add_routes();
  std::string log_dir() const;
  std::map<std::string, std::string> rank_env() const;
};

Daemon::Daemon(RingConfig cfg, DaemonOptions opts, std::unique_ptr<Backend> engine)
    : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  I.self = this;
  I.cfg = std::move(cfg);
  I.opts = std::move(opts);
  I.timing = timing_from_config(I.cfg);
  if (I.opts.shutdown_grace) I.timing.shutdown_grace = *I.opts.shutdown_grace;
  I.world = I.cfg.world_size();
  for (const auto& p : I.cfg.ranks())
    if (p.rank == I.opts.rank) I.place = p;
  I.node = node_name(I.cfg, I.opts.rank);
  I.engine = engine ? std::move(engine) : make_backend(I.cfg, I.opts.rank);
  I.metrics =
      std::make_unique<Metrics>(I.cfg.get("MODEL"), static_cast<int>(I.cfg.get_int("CONTEXT_LEN")));
  I.metrics->export_vllm(I.cfg.get("ENGINE") != "exec");
  MemGuardConfig mg = mem_guard_config(I.cfg);
  mg.root = I.opts.proc_root;
  I.memguard = std::make_unique<MemoryGuard>(mg, I.metrics.get());
}

Daemon::~Daemon() {
  auto& I = *impl_;
  request_stop("daemon destroyed");
  if (I.ctl_thread.joinable() || I.lifecycle.joinable() || I.http) wait();
  if (I.history) I.history->stop();  // its thread reads members destroyed before it
}

void Daemon::set_timing(const DaemonTiming& t) {
  impl_->timing = t;
}

uint16_t Daemon::http_port() const {
  return impl_->http ? impl_->http->port() : 0;
}
uint16_t Daemon::rdzv_port() const {
  return impl_->rdzv_server ? impl_->rdzv_server->port() : impl_->rdzv_port;
}

Status Daemon::start() {
  auto& I = *impl_;
  if (I.opts.rank >= I.world)
    return make_error(Errc::usage, "--rank " + std::to_string(I.opts.rank) +
                                       " is outside the ring: " + I.cfg.path + " defines " +
                                       std::to_string(I.world) + " rank(s) (0.." +
                                       std::to_string(I.world - 1) + ")");
  I.ctl_work.emplace(I.ctl.get_executor());
  if (I.opts.handle_signals) {
    I.signals.emplace(I.ctl, SIGTERM, SIGINT);
    I.signals->async_wait([this](const boost::system::error_code& ec, int sig) {
      if (ec) return;
      log::info(kComp, "signal {} received; shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
      request_stop(sig == SIGTERM ? "SIGTERM" : "SIGINT", 0);
    });
    I.hangup.emplace(I.ctl, SIGHUP);
    I.wait_hangup();
  }

  if (I.opts.rank == 0) {
    ServerOptions so;
    so.bind = I.opts.bind ? *I.opts.bind : I.cfg.get("API_BIND");
    if (so.bind.empty()) so.bind = "127.0.0.1";
    so.port = I.opts.port ? *I.opts.port : static_cast<uint16_t>(I.cfg.get_int("API_PORT"));
    const std::string& keyfile = I.cfg.get("API_KEY_FILE");
    if (!keyfile.empty()) {
      auto key = read_api_key_file(keyfile);
      if (!key) return key.error();
      so.api_key = *key;
    } else if (!is_loopback(so.bind)) {
      return make_error(Errc::config,
                        "API bind address " + so.bind +
                            " is not loopback and no API key is configured: set API_KEY_FILE to a "
                            "file (mode 0600) holding the key, or bind 127.0.0.1");
    }
    so.max_connections =
        static_cast<size_t>(std::max<int64_t>(0, I.cfg.get_int("API_MAX_CONNECTIONS")));
    so.max_connections_per_peer =
        static_cast<size_t>(std::max<int64_t>(0, I.cfg.get_int("API_MAX_CONNECTIONS_PER_PEER")));
    // As vLLM: liveness, /ping and /version answer without the key.
    so.public_paths = {"/health", "/ping", "/version"};
    so.ungated_paths = {"/health", "/metrics", "/ping", "/version"};
    // vLLM leaves /metrics open; here that is the operator's choice (the default asks for
    // the key like every other path, so a key protects everything it is set for).
    if (I.cfg.get("METRICS_AUTH") == "none") so.public_paths.insert("/metrics");
    so.not_ready = [this]() -> std::string {
      State st = impl_->health.state();
      if (st == State::ready) return {};
      return std::string(state_name(st)) + ": " + impl_->health.reason();
    };
    I.http = std::make_unique<HttpServer>(so);
    I.add_routes();
    I.engine->add_routes(*I.http);
    SPARK_TRY(I.http->start());
  }

  if (I.world > 1) {
    I.rdzv_host = I.cfg.nodes.at(0).fabric_ip;
    I.rdzv_port =
        I.opts.rdzv_port ? *I.opts.rdzv_port : static_cast<uint16_t>(I.cfg.get_int("RDZV_PORT"));
    if (I.opts.rank == 0) {
      std::vector<std::string> nodes;
      for (const auto& p : I.cfg.ranks())
        nodes.push_back(I.cfg.nodes.at(static_cast<size_t>(p.node)).name);
      I.rdzv_server = std::make_unique<RendezvousServer>(I.ctl, I.identity(), nodes,
                                                         I.timing.heartbeat_timeout);
      SPARK_TRY(I.rdzv_server->listen(I.rdzv_host, I.rdzv_port));
      I.rdzv_port = I.rdzv_server->port();
    }
  }
  I.health.set(State::loading, "starting");
  I.start_history();
  I.ctl_thread = std::thread([this] {
    for (;;) {
      try {
        impl_->ctl.run();
        break;
      } catch (const std::exception& e) {
        log::error(kComp, "control reactor: unhandled exception: {}", e.what());
      }
    }
  });
  net::post(I.ctl, [this] { impl_->arm_watchdog(); });
  I.lifecycle = std::thread([this] { impl_->run_lifecycle(); });
  log::info(kComp, "rank {}/{} on node {} started (engine {}, pid {})", I.opts.rank, I.world,
            I.node, I.engine->name(), ::getpid());
  return Status::Ok();
}

void Daemon::Impl::add_routes() {
  // Liveness: 200 whenever the process answers. Readiness: ?strict answers 503 unless the
  // whole ring is ready and healthy.
  http->route("GET", "/health", [this](const Request& req) {
    HealthSnapshot s = self->snapshot();
    bool strict = req.has_query("strict");
    int status = strict && !strict_ok(s) ? 503 : 200;
    return Response::json(status, health_json(s));
  });
  http->route("GET", "/metrics", [this](const Request&) {
    HealthSnapshot s = self->snapshot();
    Metrics& m = *metrics;
    if (memguard->available() == 0) memguard->sample();
    sample_process(m);
    m.set("sparkd_up", 1);
    m.set("sparkd_ready", s.state == State::ready ? 1 : 0);
    m.set("sparkd_fatal", s.state == State::fatal ? 1 : 0);
    m.set("sparkd_stalled", s.state == State::stalled ? 1 : 0);
    int alive = 0;
    for (const auto& r : s.ranks) alive += r.alive ? 1 : 0;
    m.set("sparkd_ranks_alive", alive);
    m.set("sparkd_world_size", s.world_size);
    m.set("sparkd_uptime_seconds", s.uptime_s);
    m.set("sparkd_slots_configured", s.slots_total);
    m.set("sparkd_slots_busy", s.slots_busy);
    BackendStatus es = engine->status();
    // vLLM's running/waiting are the scheduler's: sequences in the batch, requests queued
    // for it. HTTP requests in flight (held by the memory guard too) are our own series.
    m.set("sparkd_requests_running", es.slots_busy);
    m.set("sparkd_requests_waiting", es.requests_waiting);
    m.set("sparkd_http_requests_in_flight", s.requests_in_flight);
    // Every rank's node, from rank 0: one scrape target sees the whole ring.
    m.clear("sparkd_rank_heartbeat_age_seconds");
    for (const auto& r : s.ranks) {
      const Labels l = {{"rank", std::to_string(r.rank)}, {"node", r.node}};
      m.set("sparkd_rank_alive", r.alive ? 1 : 0, l);
      m.set("sparkd_rank_mem_available_bytes", static_cast<double>(r.mem_available), l);
      if (r.rank != 0 && r.last_seen_s >= 0)
        m.set("sparkd_rank_heartbeat_age_seconds", r.last_seen_s, l);
    }
    for (const auto& [code, n] : http->responses_by_status())
      m.set("sparkd_http_requests_total", static_cast<double>(n), {{"code", std::to_string(code)}});
    Response r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    r.body = m.render();
    return r;
  });
  http->route("GET", "/v1/models", [this](const Request&) {
    nlohmann::json m = {
        {"id", cfg.get("MODEL")}, {"object", "model"}, {"owned_by", "sparkctl"}, {"created", 0}};
    return Response::json(200, {{"object", "list"}, {"data", nlohmann::json::array({m})}});
  });
  http->route("GET", "/v1/models/*", [this](const Request& req) {
    const std::string id = req.path.substr(std::string_view("/v1/models/").size());
    if (id != cfg.get("MODEL"))
      return Response::json(404, {{"error",
                                   {{"message", fmt::format("The model `{}` does not exist.", id)},
                                    {"type", "NotFoundError"},
                                    {"param", "model"},
                                    {"code", 404}}}});
    return Response::json(
        200, {{"id", id}, {"object", "model"}, {"owned_by", "sparkctl"}, {"created", 0}});
  });
  // vLLM's /version and /ping (SageMaker's health path: 200 ready, 503 not, no body).
  http->route("GET", "/version", [](const Request&) {
    return Response::json(200, {{"version", kVersion}});
  });
  for (const char* method : {"GET", "POST"})
    http->route(method, "/ping", [this](const Request&) {
      Response r;
      r.status = self->snapshot().state == State::ready ? 200 : 503;
      r.body.clear();
      return r;
    });
}

void Daemon::Impl::arm_watchdog() {
  if (stopping.load()) return;
  if (!watchdog) watchdog.emplace(ctl);
  watchdog->expires_after(timing.watchdog_period);
  watchdog->async_wait([this](const boost::system::error_code& ec) {
    if (ec) return;
    on_watchdog();
    arm_watchdog();
  });
}

uint32_t Daemon::Impl::alive_mask() const {
  if (!rdzv_server) return 1u << std::min(31, place.rank);
  uint32_t m = 1u << std::min(31, place.rank);
  for (const auto& r : rdzv_server->ranks())
    if (r.alive && r.rank < 32) m |= 1u << r.rank;
  return m;
}

void Daemon::Impl::start_history() {
  auto every = cfg.get_duration_ms("HEALTH_SAMPLE_INTERVAL");
  if (every == 0) return;
  // The node's state directory: STATE_DIR, else the one the pidfile lives under (S/run/).
  std::string dir = cfg.get("STATE_DIR");
  if (dir.empty() && !opts.pidfile.empty())
    dir = std::filesystem::path(opts.pidfile).parent_path().parent_path().string();
  if (dir.empty()) dir = log_dir();
  SamplerOptions so;
  so.path = history_path(dir, place.rank);
  so.capacity = static_cast<uint64_t>(std::max<int64_t>(1, cfg.get_int("HEALTH_HISTORY_SAMPLES")));
  so.interval = milliseconds(static_cast<int64_t>(every));
  so.rank = place.rank;
  so.world_size = world;
  so.gpu = place.gpu;
  history = std::make_unique<HistorySampler>(so, [this] {
    DaemonSample d;
    d.state = static_cast<int>(health.state());
    d.reason = health.reason();
    d.ranks_alive = alive_mask();
    if (engine_started.load()) d.step_age_ms = engine->status().oldest_call.count();
    d.generated_tokens = metrics->value("sparkd_generation_tokens_total");
    return d;
  });
  if (auto st = history->start(); !st.ok()) {
    log::warn(kComp, "no health history: {}", st.error().message);
    history.reset();
  }
}

void Daemon::Impl::on_watchdog() {
  if (stopping.load()) return;
  // A rank lost or a change of state is sampled at once, not at the next interval.
  if (history) {
    uint32_t m = alive_mask();
    State st = health.state();
    if (m != history_mask || st != history_state) history->poke();
    history_mask = m;
    history_state = st;
  }
  // MemAvailable about once a second: cheap, and enough for the guard's floors.
  if (watchdog_ticks++ %
          std::max<int64_t>(1, 1000 / std::max<int64_t>(1, timing.watchdog_period.count())) ==
      0)
    memguard->sample();
  if (rdzv_server) {
    rdzv_server->set_ring_state(health.state(), health.reason());
    if (auto p = rdzv_server->problem()) {
      if (p->state == State::fatal || engine_started.load()) {
        if (p->state == State::fatal) engine->on_ring_problem(p->reason);
        health.set(p->state, p->reason);
        return;
      }
    }
  }
  if (!engine_started.load()) return;
  BackendStatus es = engine->status();
  if (es.fatal) {
    health.set(State::fatal, es.reason.empty() ? "engine failed" : es.reason);
    return;
  }
  if (es.oldest_call > timing.stall_timeout) {
    health.set(State::stalled, "engine call '" + es.oldest_call_what + "' running for " +
                                   std::to_string(es.oldest_call.count() / 1000) +
                                   " s (STALL_TIMEOUT " +
                                   std::to_string(timing.stall_timeout.count() / 1000) + " s)");
    return;
  }
  std::string why;
  if (es.ready && rdzv_server && !rdzv_server->followers_ready(&why)) {
    health.set(State::loading, "waiting for " + why);
  } else if (es.ready && place.rank == 0 && !probe_done()) {
    std::lock_guard lk(probe_mu);
    health.set(State::loading, probe.reason.empty() ? std::string("waiting for the readiness probe")
                                                    : "readiness probe: " + probe.reason);
  } else if (es.ready) {
    health.set(State::ready, "");
    // Type=notify: systemd holds the unit "activating" until /health first says ready.
    if (!ready_notified.exchange(true))
      if (Status st = notify_systemd("READY=1\nSTATUS=ready"); !st.ok())
        log::warn(kComp, "systemd readiness: {}", st.message());
  } else {
    health.set(State::loading, es.reason.empty() ? "engine loading" : es.reason);
  }
}

std::string Daemon::Impl::log_dir() const {
  if (!opts.log_file.empty()) {
    auto p = std::filesystem::path(opts.log_file).parent_path();
    return p.empty() ? "." : p.string();
  }
  if (!cfg.get("LOG_DIR").empty()) return cfg.get("LOG_DIR");
  if (!cfg.get("STATE_DIR").empty()) return cfg.get("STATE_DIR") + "/logs";
  return "/tmp/sparkd-" + std::to_string(::getuid());
}

std::map<std::string, std::string> Daemon::Impl::rank_env() const {
  std::map<std::string, std::string> e;
  const NodeConfig& n = cfg.nodes.at(static_cast<size_t>(place.node));
  e["SPARK_RANK"] = std::to_string(place.rank);
  e["SPARK_WORLD_SIZE"] = std::to_string(world);
  e["SPARK_LOCAL_RANK"] = std::to_string(place.local_rank);
  e["SPARK_GPU"] = std::to_string(place.gpu);
  e["SPARK_NODE"] = n.name;
  e["SPARK_NODE_INDEX"] = std::to_string(place.node);
  e["SPARK_FABRIC_IP"] = n.fabric_ip;
  e["SPARK_MASTER_ADDR"] = cfg.nodes.at(0).fabric_ip;
  e["SPARK_RDZV_PORT"] = cfg.get("RDZV_PORT");
  e["SPARK_API_PORT"] = cfg.get("API_PORT");
  e["SPARK_MODEL"] = cfg.get("MODEL");
  e["SPARK_MODEL_PATH"] = n.model_path.empty() ? cfg.get("MODEL_PATH") : n.model_path;
  e["SPARK_CONFIG"] = cfg.path;
  e["SPARKD_PID"] = std::to_string(::getpid());
  return e;
}

void Daemon::Impl::run_lifecycle() {
  BackendContext ctx;
  ctx.cfg = &cfg;
  ctx.place = place;
  ctx.world_size = world;
  ctx.log_dir = log_dir();
  (void)make_dirs(ctx.log_dir);
  ctx.pidfile = opts.pidfile;
  ctx.env = rank_env();
  ctx.stall_timeout = timing.stall_timeout;
  ctx.metrics = metrics.get();
  ctx.memory_guard = memguard.get();
  ctx.progress = [this](const std::string& what) { health.set(State::loading, what); };
  if (world > 1) {
    Status js = join_ring();
    if (!js.ok()) return fail(js.message(), js.code());
    ctx.barrier = [this](const std::string& name) -> Status {
      return rdzv->barrier(name, place.rank, timing.join_timeout);
    };
    ctx.store_set = [this](const std::string& key, const std::string& value) {
      return rdzv->set(key, value);
    };
    ctx.store_get = [this](const std::string& key, milliseconds timeout) {
      return rdzv->get(key, timeout);
    };
    ctx.missing_ranks = [this]() -> std::string {
      if (!rdzv_server) return "";
      auto p = rdzv_server->problem();
      return p ? p->reason : std::string();
    };
    ctx.share = [this](const std::string& key, const std::string& value) -> Result<std::string> {
      if (place.rank == 0) {
        SPARK_TRY(rdzv->set(key, value));
        return value;
      }
      return rdzv->get(key, timing.join_timeout);
    };
  }
  health.set(State::loading, std::string("starting the ") + engine->name() + " engine");
  Status st = engine->start(ctx);
  if (stopping.load()) {
    if (!st.ok()) log::info(kComp, "engine {} start given up: {}", engine->name(), st.message());
    return;
  }
  if (!st.ok())
    return fail("engine " + std::string(engine->name()) + " failed to start: " + st.message(),
                st.code());
  engine_started = true;
  log::info(kComp, "engine {} started", engine->name());
  if (place.rank == 0) run_probes();
}

// Rank 0, on the lifecycle thread: once every rank reports ready, one real completion (and
// the RDMA counters) decide READY. Retried every few seconds until it passes.

// SIGHUP, as logrotate sends it after moving the log away: the log file is reopened under
// its name (a new file), and sparkd goes on serving.
void Daemon::Impl::wait_hangup() {
  hangup->async_wait([this](const boost::system::error_code& ec, int) {
    if (ec) return;
    if (log::reopen())
      log::info(kComp, "SIGHUP received; log file reopened");
    else
      log::warn(kComp,
                "SIGHUP received; cannot reopen the log file ({}): logging goes on to "
                "the file already open",
                std::strerror(errno));
    wait_hangup();
  });
}

void Daemon::Impl::run_probes() {
  ProbeSpec spec = probe_spec(cfg);
  int attempts = 0;
  while (!stopping.load()) {
    {
      std::unique_lock lk(mu);
      cv.wait_for(lk, milliseconds(attempts == 0 ? 100 : 3000), [&] { return stop_requested; });
    }
    if (stopping.load() || health.state() == State::fatal) continue;
    BackendStatus es = engine->status();
    std::string why;
    if (!es.ready || (rdzv_server && !rdzv_server->followers_ready(&why))) continue;
    ProbeResult r = run_probe(*engine, spec);
    r.attempts = ++attempts;
    if (r.status == "passed")
      log::info(kComp, "readiness probe passed in {:.2f} s: '{}'{}", r.seconds, r.text,
                r.rdma_checked ? fmt::format(", RDMA {} bytes", r.rdma_bytes * 4) : "");
    else if (r.status == "skipped")
      log::warn(kComp, "readiness probe skipped: {}", r.reason);
    else
      log::warn(kComp, "readiness probe failed (attempt {}): {}", attempts, r.reason);
    bool done = r.status == "passed" || r.status == "skipped";
    {
      std::lock_guard lk(probe_mu);
      probe = r;
    }
    if (done) return;
  }
}

RankIdentity Daemon::Impl::identity() const {
  RankIdentity id;
  id.rank = place.rank;
  id.world_size = world;
  id.node = node;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  id.host = host;
  id.pid = static_cast<int>(::getpid());
  id.version = kVersion;
  id.config_digest = cfg.digest();
  // The model manifest digest: sparkctl start passes it once the stage tooling writes one.
  if (const char* md = std::getenv("SPARK_MODEL_DIGEST")) id.model_digest = md;
  return id;
}

// The lifecycle thread gives up: the state says why. A follower also exits (non-zero) so
// that no half-joined rank lingers; rank 0 stays up to report the reason on /health.
void Daemon::Impl::fail(const std::string& why, Errc code) {
  if (stopping.load()) return;
  log::error(kComp, "{}", why);
  health.set(State::fatal, why);
  if (place.rank != 0) self->request_stop(why, spark::exit_code(code));
}

Status Daemon::Impl::join_ring() {
  std::string who = "rank " + std::to_string(place.rank) + " (node " + node + ")";
  {
    std::lock_guard lk(rdzv_mu);
    rdzv = std::make_unique<RendezvousClient>(rdzv_host, rdzv_port, who);
  }
  if (stopping.load()) return make_error(Errc::network, "stopping");
  health.set(State::loading,
             "connecting to rank 0's rendezvous at " + rdzv_host + ":" + std::to_string(rdzv_port));
  SPARK_TRY(rdzv->connect(timing.join_timeout));
  SPARK_TRY(rdzv->join(identity(), milliseconds(10000)));
  joined = true;
  log::info(kComp, "joined the ring at {}:{}", rdzv_host, rdzv_port);
  if (place.rank != 0) heartbeat = std::thread([this] { run_heartbeats(); });
  health.set(State::loading, "waiting for every rank to join");
  SPARK_TRY(rdzv->barrier("joined", place.rank, timing.join_timeout));
  log::info(kComp, "all {} ranks joined", world);
  return Status::Ok();
}

void Daemon::Impl::run_heartbeats() {
  RendezvousClient hb(rdzv_host, rdzv_port, "rank " + std::to_string(place.rank) + " heartbeat");
  auto last_ok = std::chrono::steady_clock::now();
  std::string last_err;
  while (!stopping.load()) {
    Status st = Status::Ok();
    auto c = hb.connect(std::min(timing.heartbeat_timeout, milliseconds(2000)));
    if (c.ok()) {
      while (!stopping.load()) {
        BackendStatus es = engine->status();
        nlohmann::json req = {{"op", "heartbeat"},
                              {"rank", place.rank},
                              {"state", state_name(health.state())},
                              {"reason", health.reason()},
                              {"pid", static_cast<int>(::getpid())},
                              {"slots_total", es.slots_total},
                              {"slots_busy", es.slots_busy},
                              {"device", es.device},
                              {"mem_available", memguard->available()}};
        auto r = hb.call(req, timing.heartbeat_timeout);
        if (!r.ok()) {
          st = r.error();
          break;
        }
        last_ok = std::chrono::steady_clock::now();
        std::unique_lock lk(mu);
        cv.wait_for(lk, timing.heartbeat_interval, [&] { return stop_requested; });
      }
    } else {
      st = c;
    }
    if (stopping.load()) break;
    if (st.code() == Errc::precondition) {  // rank 0 declared this rank lost: do not linger
      fail(st.message(), st.code());
      break;
    }
    last_err = st.message();
    if (std::chrono::steady_clock::now() - last_ok > timing.heartbeat_timeout) {
      fail("lost rank 0 (" + rdzv_host + ":" + std::to_string(rdzv_port) + "): " + last_err,
           Errc::network);
      break;
    }
    std::unique_lock lk(mu);
    cv.wait_for(lk, milliseconds(200), [&] { return stop_requested; });
  }
}

Metrics& Daemon::metrics() {
  return *impl_->metrics;
}

HealthSnapshot Daemon::snapshot() const {
  auto& I = *impl_;
  HealthSnapshot s;
  s.state = I.health.state();
  s.reason = I.health.reason();
  s.rank = I.opts.rank;
  s.world_size = I.world;
  s.uptime_s = I.health.uptime_s();
  BackendStatus es = I.engine->status();
  s.slots_total = es.slots_total;
  s.slots_busy = es.slots_busy;
  s.fabric = es.fabric;
  s.fabric_ranks = es.fabric_ranks;
  s.requests_in_flight = I.http ? I.http->api_in_flight() : 0;
  s.engine = I.engine->name();
  s.device = es.device;
  s.device_note = es.device_note;
  s.model_info = es.model_info;
  s.model = I.cfg.get("MODEL");
  s.version = kVersion;
  s.pid = static_cast<int>(::getpid());
  if (I.place.rank == 0 && I.engine_started.load()) {
    std::lock_guard lk(I.probe_mu);
    s.probe = to_json(I.probe);
  }
  RankHealth self;
  self.rank = I.opts.rank;
  self.node = I.node;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  self.host = host;
  self.state = state_name(s.state);
  if (s.state != State::ready) self.reason = s.reason;
  self.joined = true;
  self.alive = true;  // this process answers; its state says whether it is well
  self.last_seen_s = 0;
  self.pid = s.pid;
  self.device = es.device;
  self.mem_available = I.memguard->available();
  if (I.rdzv_server) {
    s.ranks = I.rdzv_server->ranks();
    if (!s.ranks.empty()) s.ranks[0] = self;
  } else {
    s.ranks.push_back(self);
  }
  return s;
}

void Daemon::request_stop(const std::string& why, int code) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  if (I.stop_requested) return;
  I.stop_requested = true;
  I.exit_code = code;
  I.stop_reason = why;
  I.cv.notify_all();
}

int Daemon::wait() {
  auto& I = *impl_;
  {
    std::unique_lock lk(I.mu);
    I.cv.wait(lk, [&] { return I.stop_requested; });
  }
  if (I.stopping.exchange(true)) return I.exit_code;
  log::info(kComp, "stopping ({}); grace {} ms", I.stop_reason, I.timing.shutdown_grace.count());
  I.health.set(State::stopping, "stopping: " + I.stop_reason);
  if (Status st = notify_systemd("STOPPING=1\nSTATUS=stopping: " + I.stop_reason); !st.ok())
    log::warn(kComp, "systemd stop notice: {}", st.message());
  if (I.http) {
    int cut = I.http->shutdown(I.timing.shutdown_grace);
    if (cut > 0) log::warn(kComp, "{} request(s) cut off at shutdown", cut);
  }
  {
    std::lock_guard lk(I.rdzv_mu);
    if (I.rdzv) I.rdzv->abort();
  }
  I.engine->stop(I.timing.shutdown_grace);
  if (I.history) I.history->stop();  // its last sample shows the stop
  if (I.lifecycle.joinable()) I.lifecycle.join();
  if (I.heartbeat.joinable()) I.heartbeat.join();
  if (I.rdzv_server) I.rdzv_server->close();
  net::post(I.ctl, [&I] {
    if (I.watchdog) I.watchdog->cancel();
    if (I.signals) {
      boost::system::error_code ec;
      I.signals->cancel(ec);
    }
    if (I.hangup) {
      boost::system::error_code ec;
      I.hangup->cancel(ec);
    }
    I.ctl_work.reset();
    I.ctl.stop();
  });
  if (I.ctl_thread.joinable()) I.ctl_thread.join();
  I.http.reset();
  log::info(kComp, "stopped");
  return I.exit_code;
}

}  // namespace spark::daemon
