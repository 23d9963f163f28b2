#include "daemon/engine/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace spark::engine {

Status validate(const SamplingParams& p, int vocab_size) {
  auto bad = [](std::string m) { return make_error(Errc::usage, std::move(m)); };
  if (!(p.temperature >= 0 && p.temperature <= 100))
    return bad(fmt::format("temperature {} must be in [0, 100]", p.temperature));
  if (p.top_k < -1 || p.top_k > vocab_size)
    return bad(fmt::format("top_k {} must be -1, 0 or in [1, {}]", p.top_k, vocab_size));
  if (!(p.top_p > 0 && p.top_p <= 1))
    return bad(fmt::format("top_p {} must be in (0, 1]", p.top_p));
  if (!(p.min_p >= 0 && p.min_p <= 1))
    return bad(fmt::format("min_p {} must be in [0, 1]", p.min_p));
  if (!(p.repetition_penalty > 0 && p.repetition_penalty <= 10))
    return bad(fmt::format("repetition_penalty {} must be in (0, 10]", p.repetition_penalty));
  if (!(p.presence_penalty >= -2 && p.presence_penalty <= 2))
    return bad(fmt::format("presence_penalty {} must be in [-2, 2]", p.presence_penalty));
  if (!(p.frequency_penalty >= -2 && p.frequency_penalty <= 2))
    return bad(fmt::format("frequency_penalty {} must be in [-2, 2]", p.frequency_penalty));
  if (p.max_tokens < 1) return bad(fmt::format("max_tokens {} must be at least 1", p.max_tokens));
  if (p.n < 1 || p.n > kMaxChoices)
    return bad(fmt::format("n {} must be in [1, {}]", p.n, kMaxChoices));
  if (p.top_logprobs < 0 || p.top_logprobs > kMaxTopLogprobs)
    return bad(fmt::format("top_logprobs {} must be in [0, {}]", p.top_logprobs, kMaxTopLogprobs));
  for (auto t : p.stop_token_ids)
    if (t < 0 || t >= vocab_size)
      return bad(fmt::format("stop token id {} is outside the vocabulary [0, {})", t, vocab_size));
  return Status::Ok();
}

namespace {
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

Sampler::Sampler(const SamplingParams& p, int vocab_size, const std::vector<int32_t>& prompt,
                 uint64_t stream)
    : p_(p), vocab_(vocab_size), seen_(static_cast<size_t>(vocab_size), 0) {
  for (auto t : prompt)
    if (t >= 0 && t < vocab_size) seen_[static_cast<size_t>(t)] = 1;
  const uint64_t base =
      p.seed ? *p.seed
             : (static_cast<uint64_t>(std::random_device{}()) << 32 | std::random_device{}());
  rng_.seed(mix(base ^ mix(stream + 1)));
}

double Sampler::uniform() {
  return static_cast<double>(rng_() >> 11) * (1.0 / 9007199254740992.0);
}

Sample Sampler::sample(const float* logits) {
  const size_t V = static_cast<size_t>(vocab_);
  Sample out;
  const bool want_lp = p_.logprobs || p_.top_logprobs > 0;
  double lse = 0;  // log-sum-exp of the model's logits
  if (want_lp) {
    float mx = *std::max_element(logits, logits + V);
    double sum = 0;
    for (size_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(logits[i] - mx));
    lse = mx + std::log(sum);
    if (p_.top_logprobs > 0) {
      idx_.resize(V);
      std::iota(idx_.begin(), idx_.end(), 0);
      const size_t k = std::min(V, static_cast<size_t>(p_.top_logprobs));
      std::partial_sort(idx_.begin(), idx_.begin() + static_cast<ptrdiff_t>(k), idx_.end(),
                        [&](int32_t a, int32_t b) {
                          return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                        });
      for (size_t i = 0; i < k; ++i)
        out.top.push_back({idx_[i], static_cast<float>(logits[idx_[i]] - lse)});
    }
  }

  // Penalties on a working copy.
  std::vector<float> z(logits, logits + V);
  if (p_.repetition_penalty != 1.0f)
    for (size_t i = 0; i < V; ++i)
      if (seen_[i]) z[i] = z[i] > 0 ? z[i] / p_.repetition_penalty : z[i] * p_.repetition_penalty;
  if (p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f)
    for (const auto& [tok, cnt] : out_counts_)
      z[static_cast<size_t>(tok)] -=
          p_.presence_penalty + p_.frequency_penalty * static_cast<float>(cnt);

  int32_t chosen = 0;
  if (p_.temperature == 0.0f) {
    chosen = static_cast<int32_t>(std::max_element(z.begin(), z.end()) -
                                  z.begin());  // first max wins ties
  } else {
    for (auto& v : z) v /= p_.temperature;
    // Candidates sorted by logit, descending (stable by id for determinism).
    idx_.resize(V);
    std::iota(idx_.begin(), idx_.end(), 0);
    size_t keep = V;
    auto cmp = [&](int32_t a, int32_t b) {
      return z[static_cast<size_t>(a)] > z[static_cast<size_t>(b)] ||
             (z[static_cast<size_t>(a)] == z[static_cast<size_t>(b)] && a < b);
    };
    if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < V) {
      keep = static_cast<size_t>(p_.top_k);
      std::partial_sort(idx_.begin(), idx_.begin() + static_cast<ptrdiff_t>(keep), idx_.end(), cmp);
    } else {
      std::sort(idx_.begin(), idx_.end(), cmp);
    }
    const float zmax = z[static_cast<size_t>(idx_[0])];
    std::vector<double> prob(keep);
    double total = 0;
    for (size_t i = 0; i < keep; ++i)
      total += (prob[i] = std::exp(static_cast<double>(z[static_cast<size_t>(idx_[i])] - zmax)));
    for (auto& pr : prob) pr /= total;
    if (p_.top_p < 1.0f) {
      double cum = 0;
      size_t n = 0;
      while (n < keep) {
        cum += prob[n++];
        if (cum >= p_.top_p) break;
      }
      keep = std::max<size_t>(1, n);
    }
    if (p_.min_p > 0.0f) {
      const double floor_p = p_.min_p * prob[0];
      size_t n = 1;
      while (n < keep && prob[n] >= floor_p) ++n;
      keep = n;
    }
    double mass = 0;
    for (size_t i = 0; i < keep; ++i) mass += prob[i];
    double u = uniform() * mass;
    chosen = idx_[keep - 1];
    for (size_t i = 0; i < keep; ++i) {
      u -= prob[i];
      if (u < 0) {
        chosen = idx_[i];
        break;
      }
    }
  }
  out.token = chosen;
  if (want_lp) out.logprob = static_cast<float>(logits[chosen] - lse);
  seen_[static_cast<size_t>(chosen)] = 1;
  ++out_counts_[chosen];
  return out;
}

}  // namespace spark::engine
