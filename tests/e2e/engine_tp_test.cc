// Tensor parallelism on the CPU: the real spark-engine binary as two processes that talk
// Gloo over loopback gives the same greedy tokens as one process (TP=1). Also: a rank that
// never joins makes rank 0 fail at its deadline with a message naming what is missing.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/strings.h"
#include "daemon/engine/random_checkpoint.h"
#include "support/netns.h"
#include "support/tempdir.h"

extern char** environ;

using namespace spark;
using namespace spark::engine;

namespace {

const std::string kTool = std::string(SPARK_BINARY_DIR) + "/daemon/engine/spark-engine";

struct Proc {
  pid_t pid = -1;
  std::string out, err;
};

Proc spawn(const std::vector<std::string>& args, const std::string& out, const std::string& err) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  Proc p;
  p.out = out;
  p.err = err;
  REQUIRE(posix_spawn(&p.pid, argv[0], &fa, nullptr, argv.data(), environ) == 0);
  posix_spawn_file_actions_destroy(&fa);
  return p;
}

// Exit status, or -1 after killing it at the deadline.
int wait_for(Proc& p, std::chrono::seconds deadline) {
  const auto end = std::chrono::steady_clock::now() + deadline;
  for (;;) {
    int st = 0;
    pid_t r = ::waitpid(p.pid, &st, WNOHANG);
    if (r == p.pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (std::chrono::steady_clock::now() >= end) {
      ::kill(p.pid, SIGKILL);
      ::waitpid(p.pid, &st, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

nlohmann::json last_json(const std::string& path) {
  auto text = read_file(path);
  REQUIRE(text);
  auto lines = split_list(*text, '\n');
  REQUIRE_FALSE(lines.empty());
  return nlohmann::json::parse(lines.back());
}

}  // namespace

TEST_CASE("engine TP: two processes over Gloo give the same greedy tokens as one") {
  REQUIRE_MESSAGE(std::filesystem::exists(kTool), "build the spark-engine target: " << kTool);
  test::TempDir dir;
  auto cfg = small_config(Family::qwen2, 512, 64, 2);  // 4 heads, 2 KV heads, biases: all split
  cfg.eos_token_ids = {};
  REQUIRE(write_random_checkpoint(dir / "model", {cfg, DType::bf16, 21, 2}).ok());
  const std::vector<std::string> common = {
      kTool,          "generate", "--model",
      dir / "model",  "--prompt", "1,17,99,250,3,77,410,12,5,300,301,302,17,18,19,20,21",
      "--max-tokens", "64"};
  auto one = spawn(common, dir / "tp1.out", dir / "tp1.err");
  REQUIRE(wait_for(one, std::chrono::seconds(60)) == 0);
  const std::string store = "127.0.0.1:" + std::to_string(free_port());
  auto with = [&](int rank) {
    auto a = common;
    for (const char* s : {"--tp-size", "2", "--tp-rank"}) a.emplace_back(s);
    a.push_back(std::to_string(rank));
    a.emplace_back("--store");
    a.push_back(store);
    a.emplace_back("--timeout-ms");
    a.emplace_back("20000");
    return a;
  };
  auto r1 = spawn(with(1), dir / "r1.out", dir / "r1.err");
  auto r0 = spawn(with(0), dir / "r0.out", dir / "r0.err");
  const int rc0 = wait_for(r0, std::chrono::seconds(90));
  const int rc1 = wait_for(r1, std::chrono::seconds(30));
  INFO("rank 0 stderr: " << read_file(dir / "r0.err").value_or(""));
  INFO("rank 1 stderr: " << read_file(dir / "r1.err").value_or(""));
  REQUIRE(rc0 == 0);
  REQUIRE(rc1 == 0);
  auto j1 = last_json(dir / "tp1.out");
  auto j2 = last_json(dir / "r0.out");
  auto w = last_json(dir / "r1.out");
  CHECK(j2["tp"] == 2);
  REQUIRE(j1["tokens"][0].size() == 64);
  CHECK(j2["tokens"] == j1["tokens"]);
  CHECK(w["worker"] == "stopped");
  // Each rank read only its slices: less than the whole model.
  CHECK(j2["bytes_read"].get<uint64_t>() < j1["bytes_read"].get<uint64_t>());
  CHECK(w["bytes_read"].get<uint64_t>() < j1["bytes_read"].get<uint64_t>());
}

TEST_CASE(
    "engine TP: a rank that never joins fails rank 0 at its deadline, naming the rendezvous") {
  REQUIRE_MESSAGE(std::filesystem::exists(kTool), "build the spark-engine target: " << kTool);
  test::TempDir dir;
  REQUIRE(
      write_random_checkpoint(dir / "model", {small_config(Family::llama), DType::f32, 1, 1}).ok());
  const std::string store = "127.0.0.1:" + std::to_string(free_port());
  auto r0 = spawn({kTool, "generate", "--model", dir / "model", "--tp-size", "2", "--tp-rank", "0",
                   "--store", store, "--timeout-ms", "1500"},
                  dir / "r0.out", dir / "r0.err");
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = wait_for(r0, std::chrono::seconds(30));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto err = read_file(dir / "r0.err").value_or("");
  INFO("stderr: " << err);
  CHECK(rc != 0);
  CHECK(rc != -1);  // it exited by itself
  CHECK(s < 15.0);
  CHECK(err.find("not set within") != std::string::npos);
  CHECK(err.find("rank 0 of 2") != std::string::npos);
}

TEST_CASE(
    "engine TP: two processes reproduce the Hugging Face greedy tokens of every reference "
    "fixture") {
  REQUIRE_MESSAGE(std::filesystem::exists(kTool), "build the spark-engine target: " << kTool);
  const std::string fixtures = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/models";
  if (!std::filesystem::is_directory(fixtures)) {
    MESSAGE("SKIP: no reference fixtures under " << fixtures);
    return;
  }
  test::TempDir tmp;
  int checked = 0, refused = 0;
  for (const auto& e : std::filesystem::directory_iterator(fixtures)) {
    if (!std::filesystem::exists(e.path() / "reference.json")) continue;
    const std::string name = e.path().filename().string();
    CAPTURE(name);
    auto ref = nlohmann::json::parse(*read_file((e.path() / "reference.json").string()));
    std::string prompt;
    for (const auto& t : ref["prompt_ids"])
      prompt += (prompt.empty() ? "" : ",") + std::to_string(t.get<int>());
    const std::string store = "127.0.0.1:" + std::to_string(free_port());
    auto args = [&](int rank) {
      return std::vector<std::string>{
          kTool,       "generate", "--model",      e.path().string(),
          "--prompt",  prompt,     "--max-tokens", std::to_string(ref["greedy_steps"].get<int>()),
          "--tp-size", "2",        "--tp-rank",    std::to_string(rank),
          "--store",   store,      "--timeout-ms", "20000"};
    };
    auto r1 = spawn(args(1), tmp / (name + ".r1.out"), tmp / (name + ".r1.err"));
    auto r0 = spawn(args(0), tmp / (name + ".r0.out"), tmp / (name + ".r0.err"));
    const int rc0 = wait_for(r0, std::chrono::seconds(90));
    const int rc1 = wait_for(r1, std::chrono::seconds(30));
    const std::string err0 = read_file(tmp / (name + ".r0.err")).value_or("");
    INFO("rank 0 stderr: " << err0);
    if (rc0 != 0 && err0.find("would cut FP8 scale blocks") != std::string::npos) {
      // A tiny FP8 fixture whose heads or widths are one 128-block: two ranks would split
      // its blocks, which the plan refuses on every rank before any weight is read, naming
      // the tensor and the rank's rows.
      CHECK(rc1 != 0);
      CHECK(err0.find("rank 0 holds rows") != std::string::npos);
      CHECK(err0.find(".weight") != std::string::npos);
      MESSAGE(name
              << ": not split over 2 ranks (its FP8 blocks would be cut), refused as it should be");
      ++refused;
      continue;
    }
    REQUIRE(rc0 == 0);
    REQUIRE(rc1 == 0);
    auto out = last_json(tmp / (name + ".r0.out"));
    CHECK(out["tokens"][0] == ref["greedy_ids"]);
    ++checked;
  }
  MESSAGE(checked << " fixtures reproduced over 2 ranks, " << refused << " refused");
  CHECK(checked >= 4);
  CHECK(refused <= 2);  // the two tiny FP8 Qwen3 fixtures, no more
}

TEST_CASE("engine TP: a worker killed mid-generation fails rank 0 with a Gloo error, not a hang") {
  REQUIRE_MESSAGE(std::filesystem::exists(kTool), "build the spark-engine target: " << kTool);
  test::TempDir dir;
  auto cfg = small_config(Family::llama, 512, 128, 4);
  cfg.max_position = 8192;
  cfg.eos_token_ids = {};
  REQUIRE(write_random_checkpoint(dir / "model", {cfg, DType::f32, 9, 1}).ok());
  const std::string store = "127.0.0.1:" + std::to_string(free_port());
  auto args = [&](int rank) {
    return std::vector<std::string>{kTool,       "generate", "--model",      dir / "model",
                                    "--prompt",  "1,2,3",    "--max-tokens", "8000",
                                    "--tp-size", "2",        "--tp-rank",    std::to_string(rank),
                                    "--store",   store,      "--timeout-ms", "5000"};
  };
  auto r1 = spawn(args(1), dir / "r1.out", dir / "r1.err");
  auto r0 = spawn(args(0), dir / "r0.out", dir / "r0.err");
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  int st = 0;
  if (::waitpid(r0.pid, &st, WNOHANG) == r0.pid) {
    wait_for(r1, std::chrono::seconds(10));
    MESSAGE("SKIP: rank 0 finished 8000 tokens within 1.5 s; nothing left to interrupt");
    return;
  }
  ::kill(r1.pid, SIGKILL);
  wait_for(r1, std::chrono::seconds(10));
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = wait_for(r0, std::chrono::seconds(60));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto err = read_file(dir / "r0.err").value_or("");
  INFO("rank 0 stderr: " << err);
  CHECK(rc != 0);
  CHECK(rc != -1);  // exited by itself
  CHECK(s < 30.0);
  // Rank 0 notices in the step's collective (Gloo) or when it writes the next plan.
  const bool gloo =
      err.find("Gloo") != std::string::npos && err.find("rank 0 of 2") != std::string::npos;
  const bool plan = err.find("rank 1 closed its connection to rank 0") != std::string::npos;
  CHECK((gloo || plan));
}

TEST_CASE(
    "engine TP: three processes sampling (seeded, temperature, top-p, n=2) give one "
    "process's tokens and logprobs; the workers draw them and find the plans waiting") {
  REQUIRE_MESSAGE(std::filesystem::exists(kTool), "build the spark-engine target: " << kTool);
  test::TempDir dir;
  auto cfg = small_config(Family::llama, 387, 96, 2);  // 387: lm_head replicated at TP=3
  cfg.num_heads = 12;
  cfg.num_kv_heads = 6;
  cfg.head_dim = 8;
  cfg.intermediate_size = 192;
  cfg.eos_token_ids = {};
  REQUIRE(write_random_checkpoint(dir / "model", {cfg, DType::bf16, 23, 2}).ok());
  const std::vector<std::string> common = {kTool,           "generate",
                                           "--model",       dir / "model",
                                           "--prompt",      "1,17,99,250,3,77,41",
                                           "--max-tokens",  "32",
                                           "--temperature", "0.8",
                                           "--top-p",       "0.9",
                                           "--seed",        "4242",
                                           "--n",           "2",
                                           "--logprobs",    "1"};
  auto one = spawn(common, dir / "tp1.out", dir / "tp1.err");
  REQUIRE(wait_for(one, std::chrono::seconds(60)) == 0);
  const std::string store = "127.0.0.1:" + std::to_string(free_port());
  auto with = [&](int rank) {
    auto a = common;
    for (const char* s : {"--tp-size", "3", "--tp-rank"}) a.emplace_back(s);
    a.push_back(std::to_string(rank));
    a.emplace_back("--store");
    a.push_back(store);
    a.emplace_back("--timeout-ms");
    a.emplace_back("20000");
    return a;
  };
  auto r1 = spawn(with(1), dir / "r1.out", dir / "r1.err");
  auto r2 = spawn(with(2), dir / "r2.out", dir / "r2.err");
  auto r0 = spawn(with(0), dir / "r0.out", dir / "r0.err");
  const int rc0 = wait_for(r0, std::chrono::seconds(90));
  const int rc1 = wait_for(r1, std::chrono::seconds(30));
  const int rc2 = wait_for(r2, std::chrono::seconds(30));
  INFO("rank 0 stderr: " << read_file(dir / "r0.err").value_or(""));
  INFO("rank 1 stderr: " << read_file(dir / "r1.err").value_or(""));
  REQUIRE(rc0 == 0);
  REQUIRE(rc1 == 0);
  REQUIRE(rc2 == 0);
  auto j1 = last_json(dir / "tp1.out");
  auto j3 = last_json(dir / "r0.out");
  REQUIRE(j1["tokens"].size() == 2);
  CHECK(j1["tokens"][0] != j1["tokens"][1]);  // two choices, two streams
  CHECK(j3["tokens"] == j1["tokens"]);
  for (size_t c = 0; c < 2; ++c)
    for (size_t i = 0; i < j1["logprobs"][c].size(); ++i)
      CHECK(std::abs(j3["logprobs"][c][i].get<double>() - j1["logprobs"][c][i].get<double>()) <
            1e-4);
  CHECK(j3["plans_ahead"] == j3["plans_posted"]);
  for (const char* w : {"r1.out", "r2.out"}) {
    auto j = last_json(dir / w);
    CAPTURE(j.dump());
    CHECK(j["worker"] == "stopped");
    CHECK(j["plans"] == j3["plans_posted"]);
    CHECK(j["tokens_drawn"].get<int>() == 64);  // every token of both choices, drawn here
    CHECK(j["digests_checked"].get<int>() > 0);
    CHECK(j["decode_steps"].get<int>() == 31);
    CHECK(j["decode_plans_ready"] == j["decode_steps"]);
  }
}

TEST_CASE("engine gpubench: a bad number is a usage error naming the option, before any GPU work") {
  REQUIRE_MESSAGE(std::filesystem::exists(kTool), "build the spark-engine target: " << kTool);
  test::TempDir dir;
  for (auto [opt, value] : {std::pair<const char*, const char*>{"--b1-runs", "abc"},
                            {"--b1-runs", "0"},
                            {"--decode-only", "2"},
                            {"--max-tokens", "12x"},
                            {"--streams", "8,0"},
                            {"--streams", "8,,32"},
                            {"--streams", "33"},
                            {"--kv-dtype", "fp16"}}) {
    CAPTURE(opt);
    CAPTURE(value);
    auto p = spawn({kTool, "gpubench", "--model", dir / "none", opt, value}, dir / "g.out",
                   dir / "g.err");
    const int rc = wait_for(p, std::chrono::seconds(30));
    auto err = read_file(dir / "g.err").value_or("");
    INFO("stderr: " << err);
    CHECK(rc == 2);  // Errc::usage
    CHECK(err.find(std::string("gpubench ") + opt + " " + value + ":") != std::string::npos);
  }
}

TEST_CASE("engine load: peak memory grows by about the fp32 weights, not weights + file") {
  REQUIRE_MESSAGE(std::filesystem::exists(kTool), "build the spark-engine target: " << kTool);
  test::TempDir dir;
  auto cfg =
      small_config(Family::llama, 8192, 512, 4);  // ~23M parameters: 46 MB BF16 file, 92 MB fp32
  cfg.intermediate_size = 2048;
  REQUIRE(write_random_checkpoint(dir / "model", {cfg, DType::bf16, 2, 2}).ok());
  auto p = spawn({kTool, "generate", "--model", dir / "model", "--max-tokens", "1"}, dir / "out",
                 dir / "err");
  REQUIRE(wait_for(p, std::chrono::seconds(120)) == 0);
  auto j = last_json(dir / "out");
  const double weights = j["weight_bytes"].get<double>();
  const double grew =
      j["peak_rss_after_load"].get<double>() - j["peak_rss_before_load"].get<double>();
  MESSAGE("weights " << weights / 1e6 << " MB, peak RSS grew " << grew / 1e6
                     << " MB while loading");
  CHECK(weights > 80e6);
  CHECK(grew > 0.9 * weights);   // the weights are really resident
  CHECK(grew < weights + 16e6);  // plus a small bounce buffer; a file-sized copy (46 MB) fails this
}

TEST_CASE("engine TP: two ranks in two network namespaces give the same greedy tokens as one") {
  REQUIRE_MESSAGE(std::filesystem::exists(kTool), "build the spark-engine target: " << kTool);
  if (auto why = test::netns_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    std::cout << "SKIP: " << why << "\n";
    return;
  }
  test::TempDir dir;
  auto cfg = small_config(Family::mistral, 512, 64, 2);
  cfg.eos_token_ids = {};
  REQUIRE(write_random_checkpoint(dir / "model", {cfg, DType::f32, 33, 2}).ok());
  const std::string base = kTool + " generate --model " + (dir / "model") +
                           " --prompt 1,9,8,7,6,5,300,301 --max-tokens 64";
  auto one = spawn({kTool, "generate", "--model", dir / "model", "--prompt", "1,9,8,7,6,5,300,301",
                    "--max-tokens", "64"},
                   dir / "tp1.out", dir / "tp1.err");
  REQUIRE(wait_for(one, std::chrono::seconds(60)) == 0);
  auto net = test::NetNs::create({.hosts = 2});
  REQUIRE_MESSAGE(net.ok(), (net.ok() ? std::string() : net.error().message));
  const std::string store = (*net)->ip(0) + ":29551";
  auto cmd = [&](int rank) {
    return base + " --tp-size 2 --tp-rank " + std::to_string(rank) + " --store " + store +
           " --bind " + (*net)->ip(rank) + " --timeout-ms 20000";
  };
  Result<ProcessResult> r1 = Error{};
  std::thread t1([&] { r1 = (*net)->exec_in(1, cmd(1), std::chrono::seconds(90)); });
  auto r0 = (*net)->exec_in(0, cmd(0), std::chrono::seconds(90));
  t1.join();
  REQUIRE(r0.ok());
  REQUIRE(r1.ok());
  INFO("rank 0: " << r0->describe() << " " << r0->err);
  INFO("rank 1: " << r1->describe() << " " << r1->err);
  REQUIRE(r0->success());
  REQUIRE(r1->success());
  auto j1 = last_json(dir / "tp1.out");
  auto j2 = nlohmann::json::parse(split_list(r0->out, '\n').back());
  CHECK(j2["tp"] == 2);
  CHECK(j2["tokens"] == j1["tokens"]);
  CHECK(nlohmann::json::parse(split_list(r1->out, '\n').back())["worker"] == "stopped");
}
