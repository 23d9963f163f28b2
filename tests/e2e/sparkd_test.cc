// The real sparkd binary: started with env/examples/local.env on a free port, polled on
// /health, stopped with SIGTERM; a bad cluster file fails cleanly with file:line.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/strings.h"
#include "core/http_client.h"
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

}  // namespace

TEST_CASE("e2e sparkd: local ring answers /health, SIGTERM exits 0 and removes its pidfile") {
  test::TempDir dir("sparkd-e2e");
  int port = test::free_port();
  std::string pidfile = dir / "run/sparkd.pid";
  std::string logfile = dir / "logs/sparkd-rank0.log";
  test::Child d({SPARKD_BIN, "--config", kLocalEnv, "--rank", "0", "--port", std::to_string(port),
                 "--pidfile", pidfile, "--log-file", logfile},
                {{"STATE_DIR", dir.path()}, {"MODEL_PATH", dir / "no-model"}}, dir / "out.txt");
  auto h = poll_health(port, 10s);
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
  CHECK(j["reason"].get<std::string>().find("native engine") != std::string::npos);
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
