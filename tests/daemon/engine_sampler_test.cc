// Sampling: greedy, seeds, top-k/top-p/min-p supports and frequencies, penalties, logprobs.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <set>

#include "daemon/engine/sampler.h"

using namespace spark;
using namespace spark::engine;

namespace {
// Logits whose softmax is exactly `probs` (plus tiny tail tokens when `tail` > 0).
std::vector<float> logits_for(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}
std::map<int32_t, int> histogram(SamplingParams p, const std::vector<float>& logits, int draws) {
  p.seed = 1234;
  Sampler s(p, static_cast<int>(logits.size()), {}, 0);
  std::map<int32_t, int> h;
  for (int i = 0; i < draws; ++i) ++h[s.sample(logits.data()).token];
  return h;
}
}  // namespace

TEST_CASE("sampler: greedy picks the argmax, lowest id on ties") {
  SamplingParams p;
  p.temperature = 0;
  std::vector<float> l = {0.1f, 2.0f, -1.0f, 2.0f};
  Sampler s(p, 4, {}, 0);
  CHECK(s.sample(l.data()).token == 1);
  CHECK(s.sample(l.data()).token == 1);
}

TEST_CASE("sampler: the same seed gives the same tokens, another seed other tokens") {
  std::vector<float> l(50);
  for (size_t i = 0; i < l.size(); ++i) l[i] = static_cast<float>(std::sin(static_cast<double>(i)));
  auto run = [&](uint64_t seed, uint64_t stream) {
    SamplingParams p;
    p.seed = seed;
    Sampler s(p, 50, {}, stream);
    std::vector<int32_t> out;
    for (int i = 0; i < 40; ++i) out.push_back(s.sample(l.data()).token);
    return out;
  };
  CHECK(run(7, 0) == run(7, 0));
  CHECK(run(7, 0) != run(8, 0));
  CHECK(run(7, 0) != run(7, 1));  // choices of one request differ
}

TEST_CASE("sampler: frequencies follow the softmax; top-k, top-p and min-p cut the support") {
  const std::vector<double> probs = {0.5, 0.3, 0.15, 0.05};
  auto l = logits_for(probs);
  SamplingParams p;
  auto h = histogram(p, l, 20000);
  for (int i = 0; i < 4; ++i)
    CHECK(h[i] / 20000.0 == doctest::Approx(probs[static_cast<size_t>(i)]).epsilon(0.1));
  p.top_k = 2;
  h = histogram(p, l, 5000);
  CHECK(h.size() == 2);
  CHECK(h[0] / 5000.0 == doctest::Approx(0.5 / 0.8).epsilon(0.05));
  p.top_k = 0;
  p.top_p = 0.7f;  // 0.5 < 0.7 <= 0.8: two tokens
  h = histogram(p, l, 5000);
  CHECK(h.size() == 2);
  p.top_p = 0.4f;
  CHECK(histogram(p, l, 500).size() == 1);
  p.top_p = 1;
  p.min_p = 0.5f;  // keep p >= 0.25
  CHECK(histogram(p, l, 5000).size() == 2);
  p.min_p = 0.2f;  // keep p >= 0.1
  CHECK(histogram(p, l, 5000).size() == 3);
  p.min_p = 0;
  p.temperature = 0.05f;  // very cold: almost always the top token
  h = histogram(p, l, 2000);
  CHECK(h[0] > 1990);
  p.temperature = 1;
  p.top_k = 1;  // top_k 1 is greedy
  CHECK(histogram(p, l, 200) == std::map<int32_t, int>{{0, 200}});
}

TEST_CASE("sampler: repetition, presence and frequency penalties") {
  std::vector<float> l = {3.0f, 2.9f, 1.0f};
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 1.2f;  // token 0 is in the prompt: 3.0 / 1.2 = 2.5 < 2.9
  Sampler a(p, 3, {0}, 0);
  CHECK(a.sample(l.data()).token == 1);
  SamplingParams q;
  q.temperature = 0;
  q.frequency_penalty = 0.06f;
  Sampler b(q, 3, {}, 0);
  // 0 (3.0), then 0 again (3.0-0.06 > 2.9), then 2.88 < 2.9 -> 1.
  CHECK(b.sample(l.data()).token == 0);
  CHECK(b.sample(l.data()).token == 0);
  CHECK(b.sample(l.data()).token == 1);
  SamplingParams r;
  r.temperature = 0;
  r.presence_penalty = 0.5f;
  Sampler c(r, 3, {}, 0);
  CHECK(c.sample(l.data()).token == 0);
  CHECK(c.sample(l.data()).token == 1);
  CHECK(c.sample(l.data()).token == 0);  // both penalised once: 2.5 vs 2.4
}

TEST_CASE("sampler: logprobs are the model's log-softmax, top_logprobs sorted") {
  auto l = logits_for({0.5, 0.3, 0.15, 0.05});
  for (auto& v : l) v += 7.0f;  // shift-invariant
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = true;
  p.top_logprobs = 3;
  Sampler s(p, 4, {}, 0);
  auto out = s.sample(l.data());
  CHECK(out.token == 0);
  CHECK(out.logprob == doctest::Approx(std::log(0.5)).epsilon(1e-5));
  REQUIRE(out.top.size() == 3);
  CHECK(out.top[0].token == 0);
  CHECK(out.top[1].token == 1);
  CHECK(out.top[2].token == 2);
  CHECK(out.top[2].logprob == doctest::Approx(std::log(0.15)).epsilon(1e-5));
}

TEST_CASE("sampler: parameter validation names the field") {
  SamplingParams p;
  CHECK(validate(p, 100).ok());
  p.top_logprobs = 21;
  auto st = validate(p, 100);
  CHECK(st.code() == Errc::usage);
  CHECK(st.message().find("top_logprobs") != std::string::npos);
  p = {};
  p.top_p = 0;
  CHECK_FALSE(validate(p, 100).ok());
  p = {};
  p.temperature = -1;
  CHECK_FALSE(validate(p, 100).ok());
  p = {};
  p.stop_token_ids = {100};
  CHECK_FALSE(validate(p, 100).ok());
  p = {};
  p.n = 0;
  CHECK_FALSE(validate(p, 100).ok());
}
