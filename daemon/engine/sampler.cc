#include "daemon/engine/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>

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
  if (p.prompt_logprobs < -1 || p.prompt_logprobs > kMaxTopLogprobs)
    return bad(fmt::format("prompt_logprobs {} must be -1 (off) or in [0, {}]", p.prompt_logprobs,
                           kMaxTopLogprobs));
  if (p.max_tokens < 0) return bad(fmt::format("max_tokens {} must not be negative", p.max_tokens));
  if (p.n < 1 || p.n > kMaxChoices)
    return bad(fmt::format("n {} must be in [1, {}]", p.n, kMaxChoices));
  if (p.top_logprobs < 0 || p.top_logprobs > kMaxTopLogprobs)
    return bad(fmt::format("top_logprobs {} must be in [0, {}]", p.top_logprobs, kMaxTopLogprobs));
  for (auto t : p.stop_token_ids)
    if (t < 0 || t >= vocab_size)
      return bad(fmt::format("stop token id {} is outside the vocabulary [0, {})", t, vocab_size));
  if (p.constraint &&
      (!p.constraint->grammar || !p.constraint->trie || p.constraint->trie->vocab() > vocab_size))
    return bad(fmt::format(
        "the output constraint's vocabulary ({} ids) does not fit the model's "
        "({} ids)",
        p.constraint && p.constraint->trie ? p.constraint->trie->vocab() : 0, vocab_size));
  return Status::Ok();
}

Sample score_token(const float* logits, int vocab_size, int32_t token, int top) {
  double mx = -INFINITY;
  for (int i = 0; i < vocab_size; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0;
  for (int i = 0; i < vocab_size; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  Sample s;
  s.token = token;
  s.logprob = static_cast<float>(static_cast<double>(logits[token]) - lse);
  top = std::clamp(top, 0, vocab_size);
  if (top > 0) {
    std::vector<int32_t> ids(static_cast<size_t>(vocab_size));
    for (int i = 0; i < vocab_size; ++i) ids[static_cast<size_t>(i)] = i;
    std::partial_sort(ids.begin(), ids.begin() + top, ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int i = 0; i < top; ++i) {
      const int32_t id = ids[static_cast<size_t>(i)];
      s.top.push_back({id, static_cast<float>(static_cast<double>(logits[id]) - lse)});
    }
  }
  return s;
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
    : p_(p),
      vocab_(vocab_size),
      seen_(static_cast<size_t>(vocab_size), 0),
      counts_(static_cast<size_t>(vocab_size), 0),
      stream_(stream) {
  for (auto t : prompt)
    if (t >= 0 && t < vocab_size) seen_[static_cast<size_t>(t)] = 1;
  // Without a seed, a fresh one per sequence; with one, the seed itself (mixed, so nearby
  // seeds give unrelated keys) and the choice index as the stream.
  const uint64_t base =
      p.seed ? *p.seed
             : (static_cast<uint64_t>(std::random_device{}()) << 32 | std::random_device{}());
  seed_ = mix(base);
  if (p.constraint) matcher_ = std::make_unique<grammar::Matcher>(*p.constraint);
}

const uint32_t* Sampler::mask() const {
  if (!matcher_) return nullptr;
  if (mask_step_ != static_cast<int64_t>(step_)) {
    mask_.assign((static_cast<size_t>(vocab_) + 31) / 32, 0u);
    allowed_ = matcher_->fill_mask(mask_.data());
    mask_step_ = step_;
  }
  return mask_.data();
}

kernels::SampleParams Sampler::next_params(uint32_t ahead) const {
  kernels::SampleParams k;
  k.temperature = p_.temperature;
  k.top_k = p_.top_k > 0 ? p_.top_k : 0;
  k.top_p = p_.top_p;
  k.min_p = p_.min_p;
  k.repetition_penalty = p_.repetition_penalty;
  k.presence_penalty = p_.presence_penalty;
  k.frequency_penalty = p_.frequency_penalty;
  k.top_logprobs = p_.top_logprobs;
  k.logprobs = p_.logprobs || p_.top_logprobs > 0 ? 1 : 0;
  k.seed = seed_;
  k.request = stream_;
  k.step = step_ + ahead;
  // Top-k over at least every allowed id keeps them all: off, so that the masked ids (-inf)
  // never decide the floor.
  if (matcher_ && ahead == 0 && mask() && k.top_k >= allowed_) k.top_k = 0;
  return k;
}

void Sampler::record(int32_t token) {
  if (token < 0 || token >= vocab_) return;
  kernels::sample_state_update_ref(seen_.data(), counts_.data(), token);
  if (matcher_) matcher_->accept(token);  // a drawn token is one the mask allowed
  ++step_;
}

Sample Sampler::sample(const float* logits) {
  const kernels::SampleParams k = next_params();
  const kernels::SampleResult r =
      kernels::sample_ref(logits, vocab_, k, seen_.data(), counts_.data(), mask());
  Sample out;
  out.token = r.token;
  if (k.logprobs) out.logprob = r.logprob;
  for (int i = 0; i < r.n_top; ++i) out.top.push_back({r.top_ids[i], r.top_logprobs[i]});
  record(r.token);
  return out;
}

}  // namespace spark::engine
