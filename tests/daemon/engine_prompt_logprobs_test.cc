// Prompt logprobs (what /v1/completions with echo and logprobs reports): the engine scores
// every prompt token after the first with the log-softmax of the logits the model gives it
// after the tokens before it. Checked against the model fed the prompt one token at a time
// (a separate, plain forward pass per position), with the prompt prefilled in chunks beside
// other requests, with its blocks in the prefix cache, for n = 2 and for max_tokens 0 (the
// prompt alone: no token drawn, finish "length"). The same on a device that draws (the CPU
// device's sampling twin, which queues decode steps as CUDA does): a step holding such a
// prompt brings its logits to the host, and a request decoding beside it gets the tokens
// it gets alone. On CUDA ("cuda engine"), the scores equal the CPU device's within the
// bf16 bound. TP=2 is in engine_control_plane_test.cc.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>

#include "daemon/engine/engine.h"
#include "daemon/engine/random_checkpoint.h"
#include "support/gpu.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::engine;

namespace {

std::vector<int32_t> prompt_of(int n, int salt, int vocab) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 37 + salt * 101 + 11) % (vocab - 3) + 3);
  return p;
}

// The reference: the prompt decoded one token at a time; position i's logits score token
// i + 1 (log-softmax in double, the `top` largest by id on ties).
struct Scored {
  std::vector<double> logprob;               // prompt tokens 1..
  std::vector<std::vector<int32_t>> top_id;  // their alternatives
  std::vector<std::vector<double>> top_lp;
};
Scored reference(Model& m, const std::vector<int32_t>& prompt, int top) {
  const auto& c = m.config();
  KVCache cache(c.num_layers, 64, 16, m.local_kv_heads(), c.head_dim);
  std::vector<int32_t> table(64);
  for (int i = 0; i < 64; ++i) table[static_cast<size_t>(i)] = i;
  LocalCollective one;
  Scored s;
  std::vector<float> logits;
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    SeqChunk ch{&prompt[i], 1, static_cast<int>(i), table.data(), true};
    REQUIRE(m.forward({ch}, cache, one, &logits).ok());
    REQUIRE(logits.size() == static_cast<size_t>(c.vocab_size));
    double mx = -INFINITY, sum = 0;
    for (float l : logits) mx = std::max(mx, static_cast<double>(l));
    for (float l : logits) sum += std::exp(static_cast<double>(l) - mx);
    const double lse = mx + std::log(sum);
    s.logprob.push_back(logits[static_cast<size_t>(prompt[i + 1])] - lse);
    std::vector<int32_t> ids(logits.size());
    for (size_t k = 0; k < ids.size(); ++k) ids[k] = static_cast<int32_t>(k);
    std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
      return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
    });
    ids.resize(static_cast<size_t>(top));
    std::vector<double> lps;
    for (int32_t id : ids) lps.push_back(logits[static_cast<size_t>(id)] - lse);
    s.top_id.push_back(ids);
    s.top_lp.push_back(lps);
  }
  return s;
}

void check_scores(const std::vector<Sample>& got, const std::vector<int32_t>& prompt,
                  const Scored& want, int top) {
  REQUIRE(got.size() == prompt.size() - 1);
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].token == prompt[i + 1]);
    CHECK(got[i].logprob == doctest::Approx(want.logprob[i]).epsilon(1e-4));
    REQUIRE(got[i].top.size() == static_cast<size_t>(top));
    for (int k = 0; k < top; ++k) {
      CHECK(got[i].top[static_cast<size_t>(k)].token == want.top_id[i][static_cast<size_t>(k)]);
      CHECK(got[i].top[static_cast<size_t>(k)].logprob ==
            doctest::Approx(want.top_lp[i][static_cast<size_t>(k)]).epsilon(1e-4));
    }
  }
}

struct Fixture {
  test::TempDir dir;
  Fixture() {
    auto cfg = small_config(Family::llama);
    cfg.eos_token_ids = {};
    REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::f32, 13, 1}).ok());
  }
  std::unique_ptr<Model> model(std::shared_ptr<Device> device = nullptr) {
    auto m = device ? Model::load(dir.path(), 0, 1, device) : Model::load(dir.path(), 0, 1);
    REQUIRE(m.ok());
    return std::move(*m);
  }
  std::unique_ptr<Engine> engine(EngineOptions o, std::shared_ptr<Device> device = nullptr) {
    auto e = Engine::start(model(std::move(device)), std::make_shared<LocalCollective>(), o);
    REQUIRE_MESSAGE(e.ok(), (e.ok() ? std::string() : e.error().message));
    return std::move(*e);
  }
};

SamplingParams scoring(int top, int max_tokens) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  p.logprobs = true;
  p.prompt_logprobs = top;
  return p;
}

}  // namespace

TEST_CASE("engine: prompt logprobs equal the log-softmax of a token-by-token forward pass") {
  Fixture f;
  auto m = f.model();
  const int V = m->config().vocab_size;
  const auto prompt = prompt_of(37, 1, V);
  const Scored want = reference(*m, prompt, 3);
  EngineOptions o;
  o.slots = 3;
  o.max_batch_tokens = 8;  // the prompt prefills in chunks, beside another request
  auto eng = f.engine(o);

  SUBCASE("chunked prefill beside another request; then with the prompt in the prefix cache") {
    std::mutex mu;
    std::condition_variable cv;
    int open = 0;
    GenerateRequest g{prompt_of(20, 2, V), scoring(-1, 6), [&](const TokenEvent& e) {
                        std::lock_guard<std::mutex> lk(mu);
                        CHECK_FALSE(e.has_prompt_logprobs);  // not asked for: none computed
                        if (e.request_done) --open;
                        cv.notify_all();
                      }};
    g.params.prompt_logprobs = -1;
    open = 1;
    REQUIRE(eng->submit(std::move(g)).ok());
    auto r = generate_blocking(*eng, prompt, scoring(3, 4));
    REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
    check_scores(r->prompt_logprobs[0], prompt, want, 3);
    CHECK(r->tokens[0].size() == 4);
    {
      std::unique_lock<std::mutex> lk(mu);
      REQUIRE(cv.wait_for(lk, std::chrono::seconds(30), [&] { return open == 0; }));
    }
    // The same prompt again: its blocks are cached, but scores need every position computed.
    auto plain = generate_blocking(*eng, prompt, scoring(-1, 2));
    REQUIRE(plain.ok());
    CHECK(plain->cached_prompt_tokens > 0);  // a request without them does use the cache
    auto again = generate_blocking(*eng, prompt, scoring(3, 2));
    REQUIRE(again.ok());
    CHECK(again->cached_prompt_tokens == 0);
    check_scores(again->prompt_logprobs[0], prompt, want, 3);
  }

  SUBCASE("max_tokens 0: the prompt's scores, no token, finish length") {
    auto r = generate_blocking(*eng, prompt, scoring(0, 0));
    REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
    CHECK(r->tokens[0].empty());
    CHECK(r->finish[0] == FinishReason::length);
    check_scores(r->prompt_logprobs[0], prompt, want, 0);
  }

  SUBCASE("n = 2: each choice has the prompt's scores") {
    auto p = scoring(2, 3);
    p.n = 2;
    auto r = generate_blocking(*eng, prompt, p);
    REQUIRE(r.ok());
    check_scores(r->prompt_logprobs[0], prompt, want, 2);
    check_scores(r->prompt_logprobs[1], prompt, want, 2);
  }

  SUBCASE("a one-token prompt has nothing to score; max_tokens 0 without scores is accepted") {
    auto r = generate_blocking(*eng, {prompt[0]}, scoring(1, 1));
    REQUIRE(r.ok());
    CHECK(r->prompt_logprobs[0].empty());
    CHECK(r->tokens[0].size() == 1);
    auto none = generate_blocking(*eng, prompt, scoring(-1, 0));
    REQUIRE(none.ok());
    CHECK(none->tokens[0].empty());
    CHECK(none->finish[0] == FinishReason::length);
  }

  SUBCASE("bad prompt_logprobs is a usage error naming it") {
    auto bad = generate_blocking(*eng, prompt, scoring(21, 1));
    REQUIRE_FALSE(bad.ok());
    CHECK(bad.error().message.find("prompt_logprobs") != std::string::npos);
  }
}

namespace {

// Submits `prompt` with `p` and returns a handle to wait on: the tokens the request drew.
struct Pending {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  bool done = false;
  std::vector<int32_t> wait() {
    std::unique_lock<std::mutex> lk(mu);
    REQUIRE(cv.wait_for(lk, std::chrono::seconds(60), [&] { return done; }));
    return tokens;
  }
};
std::shared_ptr<Pending> submit(Engine& eng, std::vector<int32_t> prompt, SamplingParams p) {
  auto out = std::make_shared<Pending>();
  GenerateRequest g{std::move(prompt), p, [out](const TokenEvent& e) {
                      std::lock_guard<std::mutex> lk(out->mu);
                      if (e.token >= 0) out->tokens.push_back(e.token);
                      if (e.request_done) out->done = true;
                      out->cv.notify_all();
                    }};
  auto id = eng.submit(std::move(g));
  REQUIRE_MESSAGE(id.ok(), (id.ok() ? std::string() : id.error().message));
  return out;
}

}  // namespace

TEST_CASE(
    "engine: prompt logprobs on a device that draws (queued decode) equal the host path's; a "
    "request decoding beside them gets its tokens alone") {
  Fixture f;
  auto m = f.model();
  const int V = m->config().vocab_size;
  const auto prompt = prompt_of(37, 1, V);
  const Scored want = reference(*m, prompt, 3);
  EngineOptions o;
  o.slots = 3;
  o.max_batch_tokens = 8;  // the prompt prefills in chunks while the other request decodes
  SamplingParams beside;
  beside.temperature = 0.9f;
  beside.seed = 5;
  beside.max_tokens = 24;
  beside.repetition_penalty = 1.2f;
  std::vector<int32_t> alone;
  {
    auto eng = f.engine(o, make_cpu_device_sampling());
    alone = submit(*eng, prompt_of(5, 3, V), beside)->wait();
    REQUIRE(alone.size() == 24);
  }
  auto eng = f.engine(o, make_cpu_device_sampling());
  auto other = submit(*eng, prompt_of(5, 3, V), beside);
  auto r = generate_blocking(*eng, prompt, scoring(3, 6));
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
  check_scores(r->prompt_logprobs[0], prompt, want, 3);
  CHECK(r->tokens[0].size() == 6);
  CHECK(other->wait() == alone);
  // The scored request's own greedy tokens are the host path's.
  auto host = f.engine(o);
  auto h = generate_blocking(*host, prompt, scoring(3, 6));
  REQUIRE(h.ok());
  CHECK(h->tokens[0] == r->tokens[0]);
}

TEST_CASE("cuda engine: prompt logprobs equal the CPU device's within the bf16 bound") {
  // bf16 weights, activations and KV against the CPU's fp32: the bound of
  // engine_cuda_test.cc (transformers' own bf16 spread), on logprobs (a logit minus the
  // log-sum-exp, both within it).
  constexpr double kBound = 0.25;
  if (test::skip_without_cuda()) return;
  const std::string fixture = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/models/llama";
  REQUIRE(std::filesystem::exists(fixture + "/config.json"));
  auto cuda = make_cuda_device(0);
  REQUIRE_MESSAGE(cuda.ok(), (cuda.ok() ? std::string() : cuda.error().message));
  auto cpu_model = Model::load(fixture, 0, 1);
  REQUIRE(cpu_model.ok());
  const int V = (*cpu_model)->config().vocab_size;
  const auto prompt = prompt_of(45, 1, V);
  const auto other_prompt = prompt_of(6, 4, V);
  EngineOptions o;
  o.slots = 3;
  o.block_size = 8;
  o.max_batch_tokens = 16;  // prefill in chunks beside a decoding request
  auto cpu = Engine::start(std::move(*cpu_model), std::make_shared<LocalCollective>(), o);
  REQUIRE(cpu.ok());
  auto want = generate_blocking(**cpu, prompt, scoring(4, 3));
  REQUIRE(want.ok());
  auto gpu_model = Model::load(fixture, 0, 1, *cuda);
  REQUIRE(gpu_model.ok());
  auto gpu = Engine::start(std::move(*gpu_model), std::make_shared<LocalCollective>(), o);
  REQUIRE_MESSAGE(gpu.ok(), (gpu.ok() ? std::string() : gpu.error().message));
  SamplingParams beside;
  beside.temperature = 0;
  beside.max_tokens = 40;
  beside.ignore_eos = true;
  auto other = submit(**gpu, other_prompt, beside);
  auto got = generate_blocking(**gpu, prompt, scoring(4, 3));
  REQUIRE_MESSAGE(got.ok(), (got.ok() ? std::string() : got.error().message));
  CHECK(other->wait().size() == 40);  // decoded beside the scored prompt, to its length
  const auto& g = got->prompt_logprobs[0];
  const auto& w = want->prompt_logprobs[0];
  REQUIRE(g.size() == prompt.size() - 1);
  REQUIRE(w.size() == g.size());
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    CAPTURE(i);
    CHECK(g[i].token == prompt[i + 1]);
    worst = std::max(worst, std::abs(static_cast<double>(g[i].logprob - w[i].logprob)));
    REQUIRE(g[i].top.size() == 4);
    for (size_t k = 0; k < 4; ++k) {
      CAPTURE(k);
      worst =
          std::max(worst, std::abs(static_cast<double>(g[i].top[k].logprob - w[i].top[k].logprob)));
      // The ids agree except at a bf16 near-tie of the CPU's neighbours.
      const bool near_tie =
          (k > 0 && w[i].top[k - 1].logprob - w[i].top[k].logprob < 2 * kBound) ||
          (k + 1 < 4 && w[i].top[k].logprob - w[i].top[k + 1].logprob < 2 * kBound);
      if (!near_tie) CHECK(g[i].top[k].token == w[i].top[k].token);
    }
  }
  MESSAGE("worst prompt logprob difference, CUDA against the CPU: " << worst);
  CHECK(worst < kBound);
}
