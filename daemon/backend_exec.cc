// The exec backend: ENGINE_EXEC runs per rank under /bin/sh -c, in its own process group,
// with the rank's environment and its output in LOG_DIR/engine-rank<N>.log. Readiness comes
// from ENGINE_HEALTH_URL (polled once a second); the process exiting is fatal.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "core/http_client.h"
#include "core/json_text.h"
#include "core/log.h"
#include "core/strings.h"
#include "daemon/backend.h"
#include "daemon/process_group.h"

namespace spark::daemon {

namespace {
constexpr std::string_view kComp = "exec";
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

class ExecBackend final : public Backend {
 public:
  ExecBackend(const RingConfig& cfg, int rank) : rank_(rank) {
    command_ = cfg.get("ENGINE_EXEC");
    health_url_ = cfg.get("ENGINE_HEALTH_URL");
    api_url_ = cfg.get("ENGINE_API_URL");
    // Headless followers (ENGINE_HEALTH_RANKS=0) have no endpoint: their process is their health.
    if (rank != 0 && cfg.get("ENGINE_HEALTH_RANKS") == "0") health_url_.clear();
    model_ = cfg.get("MODEL");
    slots_ = static_cast<int>(cfg.get("SLOTS").empty() ? 0 : cfg.get_int("SLOTS"));
  }
  ~ExecBackend() override { stop(milliseconds(2000)); }

  const char* name() const override { return "exec"; }

  Status start(BackendContext& ctx) override {
    if (command_.empty())
      return make_error(Errc::config,
                        "ENGINE=exec needs ENGINE_EXEC: the command that runs this rank's engine "
                        "(sh -c, with SPARK_RANK etc. in its environment)");
    std::string dir = ctx.log_dir.empty() ? "/tmp" : ctx.log_dir;
    log_path_ = dir + "/engine-rank" + std::to_string(rank_) + ".log";
    std::string url = expand_vars(health_url_, ctx.env, rank_);
    api_url_ = expand_vars(api_url_, ctx.env, rank_);
    while (!api_url_.empty() && api_url_.back() == '/') api_url_.pop_back();
    auto pid = spawn_shell_group(command_, ctx.env, log_path_);
    if (!pid) return pid.error();
    {
      std::lock_guard lk(mu_);
      pid_ = *pid;
      running_ = true;
    }
    if (!ctx.pidfile.empty()) {
      pgid_file_ = ctx.pidfile + ".engine";
      std::string why;
      if (!write_file_atomic(pgid_file_, std::to_string(*pid) + "\n", &why, 0640))
        log::warn(kComp, "cannot record the engine's process group in {}: {}", pgid_file_, why);
    }
    log::info(kComp, "engine started: pid {} (process group), log {}: {}", *pid, log_path_,
              command_);
    reaper_ = std::thread([this] { reap(); });
    if (!url.empty()) {
      url_ = url;
      poller_ = std::thread([this] { poll(); });
    } else {
      log::warn(kComp,
                "no health URL for this rank (ENGINE_HEALTH_URL empty or ENGINE_HEALTH_RANKS=0): "
                "readiness only means the engine process runs");
    }
    return Status::Ok();
  }

  BackendStatus status() override {
    std::lock_guard lk(mu_);
    BackendStatus s;
    s.slots_total = slots_;
    if (exit_status_) {
      s.fatal = true;
      s.reason = "engine command " + describe_wait_status(*exit_status_) + " (log " + log_path_ +
                 (exit_tail_.empty() ? ")" : "; last lines: " + exit_tail_ + ")");
      return s;
    }
    if (fatal_) {
      s.fatal = true;
      s.reason = reason_;
      return s;
    }
    if (!running_) {
      s.reason = "engine not started";
      return s;
    }
    if (url_.empty()) {
      s.ready = true;
      return s;
    }
    s.ready = healthy_;
    s.reason = healthy_ ? "" : reason_;
    if (unanswered_since_) {
      s.oldest_call = std::chrono::duration_cast<milliseconds>(Clock::now() - *unanswered_since_);
      s.oldest_call_what = "GET " + url_;
    }
    return s;
  }

  Result<std::string> probe(const std::string& prompt, milliseconds timeout) override {
    if (api_url_.empty())
      return make_error(Errc::unsupported,
                        "ENGINE_API_URL is not set: the external engine's completions are not "
                        "probed, READY rests on ENGINE_HEALTH_URL");
    auto u = parse_url(api_url_ + "/v1/completions");
    if (!u) return u.error();
    HttpCall c;
    c.method = "POST";
    c.host = u->host;
    c.port = u->port;
    c.target = u->target;
    c.timeout = timeout;
    c.body = dump_json(nlohmann::json{
        {"model", model_}, {"prompt", prompt}, {"max_tokens", 16}, {"temperature", 0}});
    auto r = http_call(c);
    if (!r) return r.error();
    if (r->status != 200)
      return make_error(Errc::remote, "POST " + api_url_ + "/v1/completions answered " +
                                          std::to_string(r->status) + ": " +
                                          r->body.substr(0, 200));
    try {
      auto j = nlohmann::json::parse(r->body);
      return j.at("choices").at(0).at("text").get<std::string>();
    } catch (const std::exception& e) {
      return make_error(Errc::remote, "POST " + api_url_ +
                                          "/v1/completions: no choices[0].text in the answer (" +
                                          e.what() + ")");
    }
  }

  void stop(milliseconds grace) override {
    pid_t pid;
    {
      std::lock_guard lk(mu_);
      if (stopped_) return;
      stopped_ = true;
      pid = pid_;
    }
    cv_.notify_all();
    if (pid > 0) {
      bool clean = stop_group(pid, grace, [this] {
        std::lock_guard lk(mu_);
        return exit_status_.has_value();
      });
      log::info(kComp, "engine process group {} stopped{}", pid,
                clean ? "" : " (SIGKILL after the grace)");
    }
    if (poller_.joinable()) poller_.join();
    if (reaper_.joinable()) reaper_.join();
    if (!pgid_file_.empty()) ::unlink(pgid_file_.c_str());
  }

 private:
  void reap() {
    int st = 0;
    pid_t r;
    do {
      r = ::waitpid(pid_, &st, 0);
    } while (r < 0 && errno == EINTR);
    std::string tail = tail_file(log_path_, 3);
    for (auto& c : tail)
      if (c == '\n') c = '|';
    std::lock_guard lk(mu_);
    exit_status_ = st;
    exit_tail_ = tail;
    running_ = false;
    if (!stopped_)
      log::error(kComp, "engine process {} {}; log {}", pid_, describe_wait_status(st), log_path_);
    cv_.notify_all();
  }

  // Polls the engine's own health endpoint. 200 = ready; JSON {"fatal": true} = fatal;
  // 503/connection refused = still loading (until it has been ready: then three failures in
  // a row are fatal); no answer = the call stays open and ages toward `stalled`.
  void poll() {
    int failures_after_ready = 0;
    bool was_ready = false;
    for (;;) {
      {
        std::unique_lock lk(mu_);
        if (stopped_ || exit_status_) return;
        if (!unanswered_since_) unanswered_since_ = Clock::now();
      }
      // Short polls keep stop() prompt; a hung engine still ages toward stalled because
      // unanswered_since_ survives the timeouts.
      milliseconds timeout(2000);
      auto r = http_get(url_, timeout);
      std::unique_lock lk(mu_);
      if (stopped_ || exit_status_) return;
      if (r.ok()) {
        unanswered_since_.reset();
        bool fatal = false;
        std::string why;
        try {
          auto j = nlohmann::json::parse(r->body);
          if (j.is_object() && j.value("fatal", false)) {
            fatal = true;
            why = j.value("reason", std::string("the engine reports fatal"));
          }
        } catch (const std::exception&) {
        }
        if (fatal) {
          fatal_ = true;
          reason_ = "engine health " + url_ + " reports fatal: " + why;
          log::error(kComp, "{}", reason_);
          return;
        }
        if (r->status == 200) {
          if (!healthy_) log::info(kComp, "engine health {} answers 200: ready", url_);
          healthy_ = true;
          was_ready = true;
          failures_after_ready = 0;
        } else {
          healthy_ = false;
          std::string body(trim(r->body.substr(0, 200)));
          reason_ = "engine health " + url_ + " answered " + std::to_string(r->status) +
                    (body.empty() ? "" : ": " + body);
          if (was_ready && r->status != 503 && ++failures_after_ready >= 3) fatal_ = true;
        }
      } else if (r.error().code == Errc::timeout) {
        // Leave unanswered_since_ set: the stall keeps ageing across retries.
        healthy_ = false;
        reason_ = "engine health " + url_ + " did not answer: " + r.error().message;
      } else {
        unanswered_since_.reset();
        healthy_ = false;
        reason_ = was_ready ? "engine health " + url_ + " stopped answering: " + r.error().message
                            : "waiting for the engine's health endpoint " + url_ + " (" +
                                  r.error().message + ")";
        if (was_ready && ++failures_after_ready >= 3) {
          fatal_ = true;
          log::error(kComp, "{}", reason_);
        }
      }
      if (fatal_) return;
      cv_.wait_for(lk, milliseconds(r.ok() || r.error().code != Errc::timeout ? 1000 : 0),
                   [this] { return stopped_ || exit_status_.has_value(); });
    }
  }

  int rank_;
  std::string command_, health_url_, url_, log_path_, pgid_file_, api_url_, model_;
  int slots_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  pid_t pid_ = -1;
  bool running_ = false;
  bool stopped_ = false;
  bool healthy_ = false;
  bool fatal_ = false;
  std::string reason_ = "waiting for the engine's health endpoint";
  std::optional<int> exit_status_;
  std::string exit_tail_;
  std::optional<Clock::time_point> unanswered_since_;
  std::thread reaper_, poller_;
};
}  // namespace

std::unique_ptr<Backend> make_exec_backend(const RingConfig& cfg, int rank) {
  return std::make_unique<ExecBackend>(cfg, rank);
}

}  // namespace spark::daemon
