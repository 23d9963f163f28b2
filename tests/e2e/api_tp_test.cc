// Tensor parallel through sparkd: two real sparkd ranks on loopback with the native engine
// on the demo model build their Gloo mesh from the daemon's rendezvous (rank 0 publishes the
// store address through `share`), pass the readiness probe together, and answer a greedy
// chat completion with the same text as a one-rank sparkd.
#include <doctest/doctest.h>
#include <signal.h>

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/http_client.h"
#include "support/spawn.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct NativeRing {
  test::TempDir& dir;
  std::string name;
  int world;
  int api_port = test::free_port();
  int rdzv_port = test::free_port();
  std::vector<std::unique_ptr<test::Child>> ranks;

  NativeRing(test::TempDir& d, std::string n, int w, const std::string& extra = "")
      : dir(d), name(std::move(n)), world(w) {
    std::string gpus = world == 1 ? "0" : "0,1";
    std::string cfg =
        dir.write(name + ".env", "RING_NAME=" + name + "\nMODEL=demo\nMODEL_PATH=" + dir / "model" +
                                     "\nSLOTS=2\nCONTEXT_LEN=256\n" + extra +
                                     "JOIN_TIMEOUT=60s\nSHUTDOWN_GRACE=5s\n"
                                     "NODE0_SSH=local\nNODE0_FABRIC_IP=127.0.0.1\n"
                                     "NODE0_GPUS=" +
                                     gpus + "\n");
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> argv = {SPARKD_BIN,
                                       "--config",
                                       cfg,
                                       "--rank",
                                       std::to_string(r),
                                       "--rdzv-port",
                                       std::to_string(rdzv_port),
                                       "--log-file",
                                       log(r)};
      if (r == 0) {
        argv.push_back("--port");
        argv.push_back(std::to_string(api_port));
      }
      ranks.push_back(std::make_unique<test::Child>(
          argv, std::map<std::string, std::string>{{"STATE_DIR", dir / (name + "-state")}},
          dir / (name + "-out.txt")));
    }
  }
  ~NativeRing() {
    for (auto& c : ranks) c->signal(SIGTERM);
    for (auto& c : ranks)
      if (!c->wait_for(15s)) c->signal(SIGKILL);
  }
  std::string log(int r) const { return dir / (name + "-rank" + std::to_string(r) + ".log"); }
  std::string logs() const {
    std::string s;
    for (int r = 0; r < world; ++r) s += "--- rank " + std::to_string(r) + "\n" + slurp(log(r));
    return s + slurp(dir / (name + "-out.txt"));
  }
  Result<HttpReply> call(const std::string& method, const std::string& target,
                         const std::string& body = "") const {
    HttpCall c;
    c.method = method;
    c.port = static_cast<uint16_t>(api_port);
    c.target = target;
    c.body = body;
    c.timeout = 60000ms;
    return http_call(c);
  }
  json health() const {
    auto r = call("GET", "/health");
    if (!r.ok()) return json::object();
    return json::parse(r->body, nullptr, false);
  }
  bool wait_ready(std::chrono::seconds limit) const {
    auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      auto h = health();
      if (h.is_object() && h.value("state", "") == "ready") return true;
      if (h.is_object() && h.value("state", "") == "fatal") return false;
      std::this_thread::sleep_for(100ms);
    }
    return false;
  }
};

}  // namespace

TEST_CASE(
    "e2e api TP: two native sparkd ranks serve the same greedy text as one, and the same "
    "text cut at a stop string and sampled with a seed (n=2)") {
  test::TempDir dir("api-tp");
  auto [st, out] =
      test::run_capture({SPARKCTL_BIN, "demo-model", dir / "model"}, {}, std::chrono::seconds(60));
  REQUIRE_MESSAGE(st == 0, out);
  json req = {{"messages", json::array({{{"role", "user"}, {"content", "The capital of France"}}})},
              {"max_tokens", 16},
              {"temperature", 0},
              {"ignore_eos", true}};
  std::string one, two;
  json stopped_one, sampled_one;
  json sampled = req;
  sampled["temperature"] = 0.9;
  sampled["top_p"] = 0.9;
  sampled["seed"] = 31;
  sampled["n"] = 2;
  json stop_req = req;
  std::string stop;
  auto post = [](const NativeRing& r, const json& body) {
    auto a = r.call("POST", "/v1/chat/completions", body.dump());
    REQUIRE(a.ok());
    REQUIRE_MESSAGE(a->status == 200, a->body);
    return json::parse(a->body);
  };
  {
    NativeRing r(dir, "tp1", 1);
    REQUIRE_MESSAGE(r.wait_ready(60s), r.logs());
    one = post(r, req)["choices"][0]["message"]["content"].get<std::string>();
    // A stop string from the middle of the greedy text: the rank 0 API layer finds it and
    // cancels the request, which the workers learn from the next step plan.
    REQUIRE(one.size() >= 8);
    stop = one.substr(one.size() / 2, 2);
    stop_req["stop"] = json::array({stop});
    stopped_one = post(r, stop_req)["choices"][0];
    sampled_one = post(r, sampled)["choices"];
  }
  CAPTURE(stop);
  CHECK(stopped_one["message"]["content"] == one.substr(0, one.find(stop)));
  CHECK(stopped_one["finish_reason"] == "stop");
  NativeRing r(dir, "tp2", 2);
  REQUIRE_MESSAGE(r.wait_ready(90s), r.logs());
  auto h = r.health();
  CHECK(h["world_size"] == 2);
  CHECK(h["ranks_alive"] == 2);
  CHECK(h["probe"]["status"] == "passed");
  auto b = r.call("POST", "/v1/chat/completions", req.dump());
  REQUIRE(b.ok());
  REQUIRE_MESSAGE(b->status == 200, b->body);
  auto j = json::parse(b->body);
  two = j["choices"][0]["message"]["content"].get<std::string>();
  CHECK(j["usage"]["completion_tokens"] == 16);
  CHECK(one == two);
  auto stopped_two = post(r, stop_req)["choices"][0];
  CHECK(stopped_two["message"]["content"] == stopped_one["message"]["content"]);
  CHECK(stopped_two["finish_reason"] == "stop");
  auto sampled_two = post(r, sampled)["choices"];
  REQUIRE(sampled_two.size() == 2);
  CHECK(sampled_two[0]["message"]["content"] == sampled_one[0]["message"]["content"]);
  CHECK(sampled_two[1]["message"]["content"] == sampled_one[1]["message"]["content"]);
  CHECK(r.health()["state"] == "ready");  // the ranks stayed in step (no divergence)
  CHECK(slurp(r.log(1)).find("engine native started") != std::string::npos);
}

TEST_CASE(
    "e2e api TP: a rank killed with a request in its step: rank 0 is fatal within "
    "HEARTBEAT_TIMEOUT and the request fails with the reason") {
  test::TempDir dir("api-tp-kill");
  auto [st, out] =
      test::run_capture({SPARKCTL_BIN, "demo-model", dir / "model"}, {}, std::chrono::seconds(60));
  REQUIRE_MESSAGE(st == 0, out);
  NativeRing r(dir, "kill", 2, "HEARTBEAT_INTERVAL=200ms\nHEARTBEAT_TIMEOUT=2s\n");
  REQUIRE_MESSAGE(r.wait_ready(90s), r.logs());
  // Rank 1 stopped first: the request's step cannot finish without it, so the request is
  // in flight when rank 1 dies, whatever the machine's load.
  r.ranks[1]->signal(SIGSTOP);
  json req = {{"messages", json::array({{{"role", "user"}, {"content", "The capital of France"}}})},
              {"max_tokens", 64},
              {"temperature", 0}};
  Result<HttpReply> reply = make_error(Errc::internal, "not sent");
  std::thread t([&] { reply = r.call("POST", "/v1/chat/completions", req.dump()); });
  std::this_thread::sleep_for(300ms);
  r.ranks[1]->signal(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  t.join();
  INFO(r.logs());
  REQUIRE(reply.ok());
  INFO("reply: " << reply->status << " " << reply->body);
  CHECK(reply->status >= 500);
  // What failed, in the words of the collective or the control plane.
  CHECK((reply->body.find("Gloo") != std::string::npos ||
         reply->body.find("rank 1") != std::string::npos));
  bool fatal = false;
  while (!fatal && std::chrono::steady_clock::now() - killed < 2500ms) {
    fatal = r.health().value("state", "") == "fatal";
    if (!fatal) std::this_thread::sleep_for(50ms);
  }
  CHECK(fatal);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  MESSAGE("fatal " << s << " s after the kill; the request: " << reply->status << " "
                   << reply->body);
  CHECK(s < 2.5);  // HEARTBEAT_TIMEOUT, and a little for the poll
}
