// The engine's overlapped decode (a step queued behind the running one, fed its draws on the
// device), run on the CPU device that draws through the sampler's twin and queues steps:
// the same tokens, logprobs and finish reasons as the host sampler and as the same device
// without overlap, with sequences ending under a queued step (stop ids, lengths, cancel),
// penalties (never queued ahead), seeds and n > 1.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/model_plan.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/random_checkpoint.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::engine;

namespace {

std::vector<int32_t> prompt_of(int n, int salt, int vocab) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 29 + salt * 83 + 5) % (vocab - 3) + 3);
  return p;
}

struct Fixture {
  test::TempDir dir;
  Fixture() {
    auto cfg = small_config(Family::llama);
    cfg.eos_token_ids = {};
    REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::f32, 23, 1}).ok());
  }
  // kind: "host" (the CPU device, host sampler), "device" (draws on the device, no
  // overlap), "overlap" (draws on the device, steps queued ahead).
  std::unique_ptr<Engine> engine(const std::string& kind, EngineOptions o = {}) {
    auto m = Model::load(dir.path(), 0, 1,
                         kind == "host" ? make_cpu_device() : make_cpu_device_sampling());
    REQUIRE(m.ok());
    o.overlap_decode = kind == "overlap";
    auto e = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), o);
    REQUIRE_MESSAGE(e.ok(), (e.ok() ? std::string() : e.error().message));
    return std::move(*e);
  }
};

struct Outcome {
  std::vector<std::vector<int32_t>> tokens;  // per choice
  std::vector<std::vector<float>> logprobs;
  std::vector<std::vector<int32_t>> top_ids;  // the first alternative of each token
  std::vector<int> finish;
  bool operator==(const Outcome&) const = default;
};

// Submits every request at once and waits for all of them.
std::vector<Outcome> run_all(Engine& eng, const std::vector<std::vector<int32_t>>& prompts,
                             const std::vector<SamplingParams>& params) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    int done = 0;
    std::vector<Outcome> out;
  } sh;
  sh.out.resize(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int n = params[i].n;
    sh.out[i].tokens.resize(static_cast<size_t>(n));
    sh.out[i].logprobs.resize(static_cast<size_t>(n));
    sh.out[i].top_ids.resize(static_cast<size_t>(n));
    sh.out[i].finish.assign(static_cast<size_t>(n), -1);
    auto id = eng.submit({prompts[i], params[i], [&sh, i](const TokenEvent& e) {
                            std::lock_guard<std::mutex> lk(sh.mu);
                            Outcome& o = sh.out[i];
                            const auto c = static_cast<size_t>(e.choice);
                            if (e.token >= 0) {
                              o.tokens[c].push_back(e.token);
                              o.logprobs[c].push_back(e.logprob);
                              o.top_ids[c].push_back(
                                  e.top_logprobs.empty() ? -1 : e.top_logprobs[0].token);
                            }
                            if (e.finish != FinishReason::none)
                              o.finish[c] = static_cast<int>(e.finish);
                            if (e.request_done) {
                              ++sh.done;
                              sh.cv.notify_all();
                            }
                          }});
    REQUIRE(id.ok());
  }
  std::unique_lock<std::mutex> lk(sh.mu);
  REQUIRE(sh.cv.wait_for(lk, std::chrono::seconds(120),
                         [&] { return sh.done == static_cast<int>(prompts.size()); }));
  return sh.out;
}

SamplingParams greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  return p;
}

}  // namespace

TEST_CASE("engine overlap: queued steps give the host sampler's tokens, logprobs and ends") {
  Fixture fx;
  const int V = small_config(Family::llama).vocab_size;
  // A stop id taken from the greedy output of prompt 2, so that request stops mid-stream
  // while the step after its stop is already queued.
  int32_t stop_id = -1;
  {
    auto ref = fx.engine("host");
    auto g = generate_blocking(*ref, prompt_of(9, 2, V), greedy(24));
    REQUIRE(g.ok());
    stop_id = g->tokens[0][9];
  }
  std::vector<std::vector<int32_t>> prompts;
  std::vector<SamplingParams> params;
  prompts.push_back(prompt_of(11, 1, V));
  params.push_back(greedy(31));
  prompts.push_back(prompt_of(9, 2, V));
  params.push_back(greedy(24));
  params.back().stop_token_ids = {stop_id};
  prompts.push_back(prompt_of(14, 3, V));
  {
    SamplingParams s;
    s.temperature = 0.9f;
    s.top_p = 0.9f;
    s.top_k = 40;
    s.seed = 7;
    s.n = 2;
    s.max_tokens = 27;
    s.logprobs = true;
    s.top_logprobs = 3;
    params.push_back(s);
  }
  prompts.push_back(prompt_of(6, 4, V));
  {
    SamplingParams s = greedy(13);
    s.repetition_penalty = 1.3f;
    s.frequency_penalty = 0.4f;
    params.push_back(s);
  }
  prompts.push_back(prompt_of(5, 5, V));
  params.push_back(greedy(2));  // ends by length right after its first decode

  EngineOptions o;
  o.slots = 3;  // requests wait for slots: admissions while steps are queued
  o.block_size = 8;
  o.max_batch_tokens = 7;
  std::vector<Outcome> want, got;
  {
    auto ref = fx.engine("host", o);
    want = run_all(*ref, prompts, params);
  }
  CHECK(want[1].finish[0] == static_cast<int>(FinishReason::stop));
  CHECK(want[1].tokens[0].size() < 24);
  for (const std::string kind : {"device", "overlap"}) {
    CAPTURE(kind);
    auto eng = fx.engine(kind, o);
    got = run_all(*eng, prompts, params);
    for (size_t i = 0; i < want.size(); ++i) {
      CAPTURE(i);
      CHECK(got[i].tokens == want[i].tokens);
      CHECK(got[i].finish == want[i].finish);
      // Logprobs within float rounding: the steps' batches differ from run to run (when a
      // request got its slot), and a product over more rows may round its last bits apart.
      REQUIRE(got[i].logprobs.size() == want[i].logprobs.size());
      for (size_t c = 0; c < want[i].logprobs.size(); ++c) {
        REQUIRE(got[i].logprobs[c].size() == want[i].logprobs[c].size());
        for (size_t t = 0; t < want[i].logprobs[c].size(); ++t)
          CHECK(got[i].logprobs[c][t] == doctest::Approx(want[i].logprobs[c][t]).epsilon(1e-4));
      }
      CHECK(got[i].top_ids == want[i].top_ids);
    }
    const auto st = eng->stats();
    CHECK(st.blocks_available == st.blocks_total);
    if (kind == "device") CHECK(st.steps_queued_ahead == 0);
    // One request alone decodes with every step after its first queued ahead: all but the
    // first decode step and the one that reaches the length limit.
    const uint64_t before = st.steps_queued_ahead;
    auto one = generate_blocking(*eng, prompt_of(7, 6, V), greedy(20));
    REQUIRE(one.ok());
    CHECK(one->tokens[0].size() == 20);
    if (kind == "overlap") {
      CHECK(st.steps_queued_ahead > 0);
      CHECK(eng->stats().steps_queued_ahead - before == 18);
    }
  }
}

TEST_CASE("engine overlap: a cancel under a queued step frees the blocks, others go on") {
  Fixture fx;
  const int V = small_config(Family::llama).vocab_size;
  EngineOptions o;
  o.slots = 2;
  o.block_size = 8;
  std::vector<int32_t> want;
  {
    auto ref = fx.engine("host", o);
    auto g = generate_blocking(*ref, prompt_of(8, 2, V), greedy(40));
    REQUIRE(g.ok());
    want = g->tokens[0];
  }
  auto eng = fx.engine("overlap", o);
  std::atomic<int> first_tokens{0};
  std::atomic<int> first_reason{-1};
  // The on_step hook is not used: the cancel lands between steps whenever it comes, and
  // every outcome must hold.
  GenerateRequest long_req{prompt_of(10, 1, V), greedy(4000), [&](const TokenEvent& e) {
                             if (e.token >= 0) ++first_tokens;
                             if (e.request_done) first_reason = static_cast<int>(e.finish);
                           }};
  auto id = eng->submit(std::move(long_req));
  REQUIRE(id.ok());
  Result<BlockingResult> second = Error{};
  std::thread t([&] { second = generate_blocking(*eng, prompt_of(8, 2, V), greedy(40), 60000); });
  for (int i = 0; i < 20000 && first_tokens < 30; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  eng->cancel(*id);
  t.join();
  REQUIRE(second.ok());
  CHECK(second->tokens[0] == want);
  for (int i = 0; i < 5000 && first_reason < 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(first_reason == static_cast<int>(FinishReason::cancelled));
  const auto st = eng->stats();
  CHECK(st.blocks_available == st.blocks_total);
  CHECK(st.steps_queued_ahead > 0);
  // The engine serves on after the cancel: the same request again, the same tokens.
  auto again = generate_blocking(*eng, prompt_of(8, 2, V), greedy(40));
  REQUIRE(again.ok());
  CHECK(again->tokens[0] == want);
}

TEST_CASE("engine overlap: SPARK_OVERLAP_DECODE takes 0 or 1") {
  Fixture fx;
  auto m = Model::load(fx.dir.path(), 0, 1, make_cpu_device_sampling());
  REQUIRE(m.ok());
  setenv("SPARK_OVERLAP_DECODE", "no", 1);
  auto e = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), {});
  unsetenv("SPARK_OVERLAP_DECODE");
  REQUIRE_FALSE(e.ok());
  CHECK(e.error().code == Errc::config);
  CHECK(e.error().message.find("SPARK_OVERLAP_DECODE=no") != std::string::npos);
  setenv("SPARK_OVERLAP_DECODE", "0", 1);
  auto off = fx.engine("overlap");
  unsetenv("SPARK_OVERLAP_DECODE");
  auto r =
      generate_blocking(*off, prompt_of(7, 6, small_config(Family::llama).vocab_size), greedy(10));
  REQUIRE(r.ok());
  CHECK(off->stats().steps_queued_ahead == 0);
}
