#pragma once
// Rows and parameter mixes for the sampler's tests (the CPU twin's staged path and the
// device kernels): shapes the pre-filter treats differently.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/sampler.h"

namespace spark::test {

/// Kinds of logit rows: spread (normal), flat (every value equal: one bin holds the whole
/// row), ties (a handful of distinct values), peaked (one token far above the rest),
/// masked (most -inf), all_masked (every value -inf), wide (a range of 200: most tokens in
/// the last bin).
inline const char* kSampleRowKinds[] = {"spread", "flat",     "ties", "peaked",
                                        "masked", "all -inf", "wide"};
inline constexpr int kSampleRowKindCount = 7;

inline std::vector<float> sample_row(std::mt19937& rng, int V, int kind) {
  std::vector<float> l(static_cast<size_t>(V));
  std::normal_distribution<float> nd(0, 3);
  std::uniform_int_distribution<int> small(0, 4);
  std::uniform_real_distribution<float> wide(-100, 100);
  for (auto& v : l) {
    switch (kind) {
      case 0:
        v = nd(rng);
        break;
      case 1:
        v = 1.5f;
        break;
      case 2:
        v = 0.25f * static_cast<float>(small(rng));
        break;
      case 3:
        v = nd(rng) * 0.3f;
        break;
      case 4:
        v = small(rng) == 0 ? nd(rng) : -INFINITY;
        break;
      case 5:
        v = -INFINITY;
        break;
      default:
        v = wide(rng);
        break;
    }
  }
  if (kind == 3 && V > 3) l[static_cast<size_t>(V / 3)] = 12.f;
  if (kind == 4 && V > 0) l[static_cast<size_t>(V - 1)] = 4.f;  // at least one finite
  return l;
}

/// The i-th parameter mix of a list that covers greedy, temperature alone, top-k (1, 50,
/// vocab - 1, vocab), top-p (0.5, 0.9, 0.999), min-p, the penalties and logprobs.
inline kernels::SampleParams sample_mix(int i, int V, uint64_t seed) {
  kernels::SampleParams p;
  p.seed = seed;
  p.request = seed * 31 + static_cast<uint64_t>(i);
  p.step = static_cast<uint32_t>(i * 7);
  const float temps[] = {0.f, 1.f, 0.7f, 2.f, 1.f, 0.3f};
  p.temperature = temps[i % 6];
  const int ks[] = {0, 1, 50, V - 1, V, 0, 5};
  p.top_k = ks[i % 7];
  const float ps[] = {1.f, 0.9f, 0.5f, 0.999f, 1.f};
  p.top_p = ps[i % 5];
  p.min_p = i % 4 == 3 ? 0.05f : 0.f;
  p.repetition_penalty = i % 3 == 1 ? 1.3f : 1.f;
  p.presence_penalty = i % 5 == 2 ? 0.5f : 0.f;
  p.frequency_penalty = i % 5 == 4 ? -0.7f : 0.f;
  p.logprobs = i % 2;
  p.top_logprobs = (i * 3) % 21;
  return p;
}
inline constexpr int kSampleMixCount = 420;  // lcm of the cycles above (6, 7, 5, 4, 3)

}  // namespace spark::test
