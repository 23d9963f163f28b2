// The real sparkd binary: started with env/examples/local.env on a free port, polled on
// /health, stopped with SIGTERM (also in the middle of a slowed weight load); a bad cluster
// file fails cleanly with file:line.
#include <doctest/doctest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/http_client.h"
#include "core/strings.h"
#include "daemon/engine/safetensors.h"
#include "support/spawn.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;

namespace {

const std::string kLocalEnv = std::string(SPARK_SOURCE_DIR) + "/env/examples/local.env";

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Polls /health until it answers (any status) or the deadline passes.
std::optional<HttpReply> poll_health(int port, std::chrono::milliseconds limit) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    HttpCall c;
    c.port = static_cast<uint16_t>(port);
    c.target = "/health";
    c.timeout = 1000ms;
    auto r = http_call(c);
    if (r.ok()) return *r;
    std::this_thread::sleep_for(50ms);
  }
  return std::nullopt;
}

// Polls /health until the daemon has left its starting and loading states (each passes through
// several reasons: "starting", "starting the native engine", "loading the model", ...): the
// reason is then the load's outcome. How long the failed load takes depends on the machine's
// load, so the test waits for the state, not for a time.
std::optional<HttpReply> poll_health_settled(int port, std::chrono::milliseconds limit) {
  auto end = std::chrono::steady_clock::now() + limit;
  std::optional<HttpReply> last;
  while (std::chrono::steady_clock::now() < end) {
    last = poll_health(port, std::chrono::duration_cast<std::chrono::milliseconds>(
                                 end - std::chrono::steady_clock::now()));
    if (!last) return last;
    auto j = nlohmann::json::parse(last->body, nullptr, false);
    std::string state = j.is_object() ? j.value("state", std::string()) : std::string();
    if (state != "starting" && state != "loading") return last;
    std::this_thread::sleep_for(50ms);
  }
  return last;
}

// Name, size and mtime of every file under `dir`, for "nothing was written there".
std::map<std::string, std::string> files_of(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::end(it); it.increment(ec)) {
    std::error_code e2;
    const auto size = it->is_regular_file(e2) ? it->file_size(e2) : 0;
    out[std::filesystem::relative(it->path(), dir).string()] =
        std::to_string(size) + "@" +
        std::to_string(it->last_write_time(e2).time_since_epoch().count());
  }
  return out;
}

size_t lines_of(const std::string& path) {
  const std::string s = slurp(path);
  return static_cast<size_t>(std::count(s.begin(), s.end(), '\n'));
}

}  // namespace

TEST_CASE("e2e sparkd: local ring answers /health, SIGTERM exits 0 and removes its pidfile") {
  test::TempDir dir("sparkd-e2e");
  int port = test::free_port();
  std::string pidfile = dir / "run/sparkd.pid";
  std::string logfile = dir / "logs/sparkd-rank0.log";
  test::Child d({SPARKD_BIN, "--config", kLocalEnv, "--rank", "0", "--port", std::to_string(port),
                 "--pidfile", pidfile, "--log-file", logfile},
                {{"STATE_DIR", dir.path()}, {"MODEL_PATH", dir / "no-model"}}, dir / "out.txt");
  auto h = poll_health_settled(port, 30s);
  REQUIRE_MESSAGE(h.has_value(), "sparkd never answered; output:\n"
                                     << slurp(dir / "out.txt") << slurp(logfile));
  CHECK(h->status == 200);
  auto j = nlohmann::json::parse(h->body);
  CHECK(j["live"] == true);
  CHECK(j["rank"] == 0);
  CHECK(j["world_size"] == 1);
  CHECK(j["model"] == "demo");
  CHECK(j.contains("uptime_s"));
  CHECK(j.contains("requests_in_flight"));
  CHECK(j["slots"].contains("total"));
  // No model at MODEL_PATH: never ready, and it says why (api_*_test.cc serve a real one).
  CHECK(j["ready"] == false);
  CHECK_MESSAGE(j["state"] == "fatal", h->body);
  CHECK_MESSAGE(j["reason"].get<std::string>().find("native engine") != std::string::npos, h->body);
  HttpCall strict;
  strict.port = static_cast<uint16_t>(port);
  strict.target = "/health?strict";
  CHECK(http_call(strict)->status == 503);
  CHECK(trim(slurp(pidfile)) == std::to_string(d.pid()));
  CHECK(slurp(logfile).find("listening on 127.0.0.1:" + std::to_string(port)) != std::string::npos);

  d.signal(SIGTERM);
  auto st = d.wait_for(10s);
  REQUIRE_MESSAGE(st.has_value(), "sparkd did not exit within 10 s of SIGTERM");
  CHECK(WIFEXITED(*st));
  CHECK(WEXITSTATUS(*st) == 0);
  CHECK_FALSE(std::filesystem::exists(pidfile));
  CHECK(slurp(logfile).find("SIGTERM") != std::string::npos);
}

TEST_CASE(
    "e2e sparkd: SIGHUP reopens the log (logrotate) and sparkd serves on; files are "
    "0750/0640 under umask 000") {
  test::TempDir dir("sparkd-hup");
  int port = test::free_port();
  std::string pidfile = dir / "state/run/sparkd.pid";
  std::string logfile = dir / "state/logs/sparkd-rank0.log";
  // The widest umask: what sparkd creates must still be private to its user and group.
  mode_t old_mask = ::umask(0);
  test::Child d({SPARKD_BIN, "--config", kLocalEnv, "--rank", "0", "--port", std::to_string(port),
                 "--pidfile", pidfile, "--log-file", logfile},
                {{"STATE_DIR", dir.path()}, {"MODEL_PATH", dir / "no-model"}}, dir / "out.txt");
  ::umask(old_mask);
  auto h = poll_health(port, 10s);
  REQUIRE_MESSAGE(h.has_value(), "sparkd never answered; output:\n"
                                     << slurp(dir / "out.txt") << slurp(logfile));
  auto mode = [](const std::string& p) {
    struct stat st {};
    REQUIRE(::stat(p.c_str(), &st) == 0);
    return st.st_mode & 07777;
  };
  CHECK(mode(dir / "state/logs") == 0750);
  CHECK(mode(dir / "state/run") == 0750);
  CHECK(mode(logfile) == 0640);
  CHECK(mode(pidfile) == 0640);
  // logrotate's way: move the log away, then SIGHUP.
  std::filesystem::rename(logfile, logfile + ".1");
  d.signal(SIGHUP);
  bool reopened = false;
  for (int i = 0; i < 500 && !reopened; ++i) {  // bounded: the signal reaches the daemon
    reopened = slurp(logfile).find("SIGHUP received; log file reopened") != std::string::npos;
    if (!reopened) std::this_thread::sleep_for(20ms);
  }
  CHECK(reopened);
  CHECK(mode(logfile) == 0640);
  CHECK(d.running());
  auto again = poll_health(port, 10s);
  REQUIRE(again.has_value());
  CHECK(again->status == 200);
  d.signal(SIGTERM);
  auto st = d.wait_for(10s);
  REQUIRE(st.has_value());
  CHECK(WIFEXITED(*st));
  CHECK(WEXITSTATUS(*st) == 0);
  // Lines after the rotation go to the new file, none to the old.
  CHECK(slurp(logfile).find("SIGTERM") != std::string::npos);
  CHECK(slurp(logfile + ".1").find("SIGTERM") == std::string::npos);
}

namespace {
// The receiving end of systemd's notify protocol: a datagram socket bound at a path, as
// systemd binds the one it names in NOTIFY_SOCKET.
struct NotifySocket {
  int fd = -1;
  explicit NotifySocket(const std::string& path) {
    fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    REQUIRE(path.size() < sizeof(a.sun_path));
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  }
  ~NotifySocket() { ::close(fd); }
  // The next datagram, or "" when none comes within `limit`.
  std::string next(std::chrono::milliseconds limit) const {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(limit.count())) != 1) return {};
    char buf[4096];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }
};

bool has_line(const std::string& msg, const std::string& line) {
  return ("\n" + msg + "\n").find("\n" + line + "\n") != std::string::npos;
}
}  // namespace

TEST_CASE(
    "e2e sparkd: systemd's notify protocol: READY=1 once /health says ready (never before), "
    "STOPPING=1 at SIGTERM") {
  test::TempDir dir("sparkd-notify");
  const std::string sock = dir / "notify.sock";
  NotifySocket ns(sock);
  {
    // No model: never ready, so no READY=1, only STOPPING=1 when it stops.
    int port = test::free_port();
    test::Child d(
        {SPARKD_BIN, "--config", kLocalEnv, "--rank", "0", "--port", std::to_string(port),
         "--log-file", dir / "none.log"},
        {{"STATE_DIR", dir / "none"}, {"MODEL_PATH", dir / "no-model"}, {"NOTIFY_SOCKET", sock}},
        dir / "none.out");
    auto end = std::chrono::steady_clock::now() + 20s;
    std::string reason;
    while (std::chrono::steady_clock::now() < end &&
           reason.find("native engine") == std::string::npos) {
      auto h = poll_health(port, 2s);
      if (h) reason = nlohmann::json::parse(h->body, nullptr, false).value("reason", "");
    }
    REQUIRE_MESSAGE(reason.find("native engine") != std::string::npos, slurp(dir / "none.log"));
    d.signal(SIGTERM);
    REQUIRE(d.wait_for(10s).has_value());
    std::string all;
    for (std::string m; !(m = ns.next(200ms)).empty();) all += m + "\n";
    CHECK_FALSE(has_line(all, "READY=1"));
    CHECK(has_line(all, "STOPPING=1"));
  }
  auto [st, out] = test::run_capture({SPARKCTL_BIN, "demo-model", dir / "model"}, {}, 60s);
  REQUIRE_MESSAGE(st == 0, out);
  int port = test::free_port();
  test::Child d({SPARKD_BIN, "--config", kLocalEnv, "--rank", "0", "--port", std::to_string(port),
                 "--log-file", dir / "sparkd.log"},
                {{"STATE_DIR", dir / "state"},
                 {"MODEL_PATH", dir / "model"},
                 {"PROBE_PROMPT", "a"},
                 {"NOTIFY_SOCKET", sock}},
                dir / "out.txt");
  std::string msg;
  auto end = std::chrono::steady_clock::now() + 90s;
  while (std::chrono::steady_clock::now() < end && !has_line(msg, "READY=1")) msg = ns.next(1000ms);
  REQUIRE_MESSAGE(has_line(msg, "READY=1"), slurp(dir / "sparkd.log") << slurp(dir / "out.txt"));
  // Sent after /health turned ready: it says so now.
  auto h = poll_health(port, 5s);
  REQUIRE(h.has_value());
  CHECK(h->status == 200);
  CHECK(nlohmann::json::parse(h->body)["ready"] == true);
  d.signal(SIGTERM);
  REQUIRE(d.wait_for(20s).has_value());
  std::string rest;
  for (std::string m; !(m = ns.next(200ms)).empty();) rest += m + "\n";
  CHECK_FALSE(has_line(rest, "READY=1"));  // once
  CHECK(has_line(rest, "STOPPING=1"));
}

TEST_CASE("e2e sparkd: a bad cluster file exits non-zero with file:line, no crash") {
  test::TempDir dir("sparkd-e2e-bad");
  std::string bad = dir.write("bad.env", "RING_NAME=t\nAPI_PORT=99999\nNODE0_SSH=local\n");
  auto [st, out] = test::run_capture({SPARKD_BIN, "--config", bad}, {}, 10s);
  REQUIRE(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 3);  // exit_code(Errc::config)
  CHECK(out.find("bad.env:2") != std::string::npos);
  auto [st2, out2] = test::run_capture({SPARKD_BIN, "--config", dir / "absent.env"}, {}, 10s);
  REQUIRE(WIFEXITED(st2));
  CHECK(WEXITSTATUS(st2) != 0);
  CHECK(out2.find("absent.env") != std::string::npos);
  auto [st3, out3] = test::run_capture({SPARKD_BIN, "--config", kLocalEnv, "--rank", "5"}, {}, 10s);
  REQUIRE(WIFEXITED(st3));
  CHECK(WEXITSTATUS(st3) == 2);
  CHECK(out3.find("outside the ring") != std::string::npos);
}

TEST_CASE("e2e sparkd: a second sparkd on the same pidfile is refused") {
  test::TempDir dir("sparkd-e2e-pid");
  int port = test::free_port();
  std::string pidfile = dir / "sparkd.pid";
  test::Child d(
      {SPARKD_BIN, "--config", kLocalEnv, "--port", std::to_string(port), "--pidfile", pidfile}, {},
      dir / "out.txt");
  REQUIRE(poll_health(port, 10s).has_value());
  auto [st, out] = test::run_capture({SPARKD_BIN, "--config", kLocalEnv, "--port",
                                      std::to_string(test::free_port()), "--pidfile", pidfile},
                                     {}, 10s);
  REQUIRE(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 11);  // exit_code(Errc::busy)
  CHECK(out.find(std::to_string(d.pid())) != std::string::npos);
  d.signal(SIGINT);
  auto s = d.wait_for(10s);
  REQUIRE(s.has_value());
  CHECK(WEXITSTATUS(*s) == 0);
}

TEST_CASE("e2e sparkd: SIGTERM during a slow weight load stops it at the next tensor, exit 0") {
  // Slow by cause, not by luck: a fault-injection shim (tests/fault/fault_inject_slow_read.cc)
  // makes every read of a weight file take a second and logs each one before it waits, so
  // the SIGTERM provably lands while the loader is reading tensors, far from done.
  test::TempDir dir("sparkd-e2e-slowload");
  auto [mst, mout] = test::run_capture({SPARKCTL_BIN, "demo-model", dir / "model"}, {}, 60s);
  REQUIRE_MESSAGE(mst == 0, mout);
  size_t tensors = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir / "model"))
    if (e.path().extension() == ".safetensors") {
      auto f = engine::SafetensorsFile::open(e.path().string());
      REQUIRE(f.ok());
      tensors += f->header().tensors.size();
    }
  REQUIRE(tensors >= 8);
  const auto model_before = files_of(dir / "model");
  const std::string reads = dir / "reads.log", pidfile = dir / "run/sparkd.pid",
                    logfile = dir / "logs/sparkd-rank0.log";
  int port = test::free_port();
  test::Child d({SPARKD_BIN, "--config", kLocalEnv, "--rank", "0", "--port", std::to_string(port),
                 "--pidfile", pidfile, "--log-file", logfile},
                {{"STATE_DIR", dir / "state"},
                 {"MODEL_PATH", dir / "model"},
                 {"RDZV_PORT", std::to_string(test::free_port())},
                 {"LD_PRELOAD", FAULT_INJECT_SLOW_READ},
                 {"SPARK_FAULT_SLOW_READ_MS", "1000"},
                 {"SPARK_FAULT_SLOW_READ_LOG", reads}},
                dir / "out.txt");
  // The loader is at a known point: past the headers, reading tensor data (> 3 reads).
  nlohmann::json h;
  for (auto end = std::chrono::steady_clock::now() + 60s;
       std::chrono::steady_clock::now() < end && lines_of(reads) < 4;)
    std::this_thread::sleep_for(50ms);
  REQUIRE_MESSAGE(lines_of(reads) >= 4, "the load never reached the weights:\n"
                                            << slurp(dir / "out.txt") << slurp(logfile));
  auto hr = poll_health(port, 10s);
  REQUIRE(hr.has_value());
  h = nlohmann::json::parse(hr->body, nullptr, false);
  CHECK(h.value("state", "") == "loading");

  const size_t at_signal = lines_of(reads);
  const auto t0 = std::chrono::steady_clock::now();
  d.signal(SIGTERM);
  auto st = d.wait_for(20s);
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  REQUIRE_MESSAGE(st.has_value(), "sparkd did not exit within 20 s of SIGTERM during a load");
  const size_t at_exit = lines_of(reads);
  MESSAGE("SIGTERM after " << at_signal << " slowed reads (the checkpoint has " << tensors
                           << " tensors); exited after " << took.count() << " ms and "
                           << at_exit - at_signal << " more read(s)");
  CHECK(WIFEXITED(*st));
  CHECK(WEXITSTATUS(*st) == 0);
  // It gave up at the next tensor: at most the read in flight finished and one more began
  // (the loader checks between tensors), not the rest of the checkpoint.
  CHECK(at_exit - at_signal <= 1);
  CHECK(at_exit + 3 < tensors);
  const std::string log = slurp(logfile);
  INFO("sparkd's log:\n" << log);
  CHECK(log.find("signal SIGTERM received") != std::string::npos);
  CHECK(log.find("loading stopped: sparkd is shutting down") != std::string::npos);
  CHECK(log.find("]: stopped") != std::string::npos);
  // Nothing left behind: no pidfile, the port closed, the model untouched.
  CHECK_FALSE(std::filesystem::exists(pidfile));
  HttpCall c;
  c.port = static_cast<uint16_t>(port);
  c.target = "/health";
  c.timeout = 1000ms;
  CHECK_FALSE(http_call(c).ok());
  CHECK(files_of(dir / "model") == model_before);
}
