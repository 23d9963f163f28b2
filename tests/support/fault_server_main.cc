// spark_fault_server: a TEST FIXTURE standing in for an external engine (ENGINE=exec) so the
// lifecycle can be tested without one. It serves GET /health on 127.0.0.1:--port and
// misbehaves on demand after --after:
//   healthy       200 {"ok":true} forever
//   slow-start    503 {"loading"} until --after from the first GET /health, then healthy
//   crash         healthy until --after, then exits with status 3
//   hang          healthy until --after, then /health never answers
//   fatal-health  healthy until --after, then 500 {"fatal":true,"reason":"injected fault"}
// --watch-pid PID exits when PID is gone (so a killed sparkd leaves nothing behind);
// --ignore-term ignores SIGTERM (to test the SIGKILL escalation).
// POST /v1/completions answers {"choices":[{"text": --completion}]} (default " Paris.") while
// healthy, so the readiness probe has something real to check.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/strings.h"
#include "daemon/http_server.h"

using namespace spark;
using namespace spark::daemon;
using Clock = std::chrono::steady_clock;

namespace {
std::atomic<bool> g_stop{false};
void on_term(int) {
  g_stop = true;
}
}  // namespace

int main(int argc, char** argv) {
  int port = 0;
  std::string mode = "healthy";
  uint64_t after_ms = 0;
  long watch_pid = 0;
  bool ignore_term = false;
  std::string completion = " Paris.";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "fault_server: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--port")
      port = std::atoi(next().c_str());
    else if (a == "--mode")
      mode = next();
    else if (a == "--after") {
      std::string why;
      auto v = parse_duration_ms(next(), &why);
      if (!v) {
        std::fprintf(stderr, "fault_server: --after: %s\n", why.c_str());
        return 2;
      }
      after_ms = *v;
    } else if (a == "--watch-pid")
      watch_pid = std::atol(next().c_str());
    else if (a == "--ignore-term")
      ignore_term = true;
    else if (a == "--completion")
      completion = next();
    else {
      std::fprintf(stderr, "fault_server: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (mode != "healthy" && mode != "slow-start" && mode != "crash" && mode != "hang" &&
      mode != "fatal-health") {
    std::fprintf(stderr, "fault_server: unknown mode %s\n", mode.c_str());
    return 2;
  }
  ::signal(SIGTERM, ignore_term ? SIG_IGN : on_term);
  ::signal(SIGINT, on_term);
  ::signal(SIGPIPE, SIG_IGN);
  auto t0 = Clock::now();
  auto fault_now = [&] { return Clock::now() - t0 >= std::chrono::milliseconds(after_ms); };
  // slow-start counts from the first /health request, not from the start of this process:
  // its caller then sees "loading" at least once however slowly this process came up (under
  // qemu, on a loaded machine), so a test of the loading state asserts a cause, not a race.
  std::mutex first_mu;
  std::optional<Clock::time_point> first_health;
  auto loading = [&](bool is_health) {
    std::lock_guard lk(first_mu);
    if (!first_health) {
      if (!is_health) return true;
      first_health = Clock::now();
    }
    return Clock::now() - *first_health < std::chrono::milliseconds(after_ms);
  };

  ServerOptions o;
  o.port = static_cast<uint16_t>(port);
  o.server_name = "spark_fault_server";
  HttpServer s(o);
  std::mutex mu;
  std::vector<Responder> parked;
  s.route_async("GET", "/health", [&](const Request&, Responder r) {
    bool fault = fault_now();
    if (mode == "slow-start" && loading(true)) {
      return r.send(Response::json(503, {{"status", "loading"}}));
    }
    if (mode == "hang" && fault) {
      std::lock_guard lk(mu);
      parked.push_back(r);
      return;
    }
    if (mode == "fatal-health" && fault) {
      return r.send(Response::json(500, {{"fatal", true}, {"reason", "injected fault"}}));
    }
    r.send(Response::json(200, {{"ok", true}, {"mode", mode}}));
  });
  s.route("POST", "/v1/completions", [&](const Request& req) {
    auto j = nlohmann::json::parse(req.body);
    if (!j.contains("prompt")) throw_http(Errc::usage, "no prompt");
    if (mode == "slow-start" && loading(false))
      return Response::json(503, {{"error", {{"message", "loading"}}}});
    return Response::json(
        200,
        {{"object", "text_completion"},
         {"choices", nlohmann::json::array(
                         {{{"index", 0}, {"text", completion}, {"finish_reason", "length"}}})}});
  });
  Status st = s.start();
  if (!st.ok()) {
    std::fprintf(stderr, "fault_server: %s\n", st.message().c_str());
    return 1;
  }
  std::printf("fault_server: mode %s on port %d, pid %d\n", mode.c_str(), s.port(), ::getpid());
  std::fflush(stdout);
  while (!g_stop) {
    if (mode == "crash" && fault_now()) {
      std::printf("fault_server: crashing as asked (mode crash)\n");
      std::fflush(stdout);
      std::_Exit(3);
    }
    if (watch_pid > 0 && ::kill(static_cast<pid_t>(watch_pid), 0) != 0) {
      std::printf("fault_server: watched pid %ld is gone; exiting\n", watch_pid);
      std::fflush(stdout);
      std::_Exit(0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::printf("fault_server: SIGTERM; exiting\n");
  std::fflush(stdout);
  std::_Exit(0);
}
