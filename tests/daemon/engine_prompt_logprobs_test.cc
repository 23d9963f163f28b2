// Prompt logprobs (what /v1/completions with echo and logprobs reports): the engine scores
// every prompt token after the first with the log-softmax of the logits the model gives it
// after the tokens before it. Checked against the model fed the prompt one token at a time
// (a separate, plain forward pass per position), with the prompt prefilled in chunks beside
// other requests, with its blocks in the prefix cache, for n = 2 and for max_tokens 0 (the
// prompt alone: no token drawn, finish "length"). TP=2 is in engine_control_plane_test.cc.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>

#include "daemon/engine/engine.h"
#include "daemon/engine/random_checkpoint.h"
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
  std::unique_ptr<Model> model() {
    auto m = Model::load(dir.path(), 0, 1);
    REQUIRE(m.ok());
    return std::move(*m);
  }
  std::unique_ptr<Engine> engine(EngineOptions o) {
    auto e = Engine::start(model(), std::make_shared<LocalCollective>(), o);
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
