#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <vector>

#include "kernels/philox.h"
#include "kernels/sampler.h"
#include "kernels/sampler_core.h"

namespace spark::kernels {

Status sample_check_params(const SampleParams& p, int vocab) {
  auto bad = [](std::string m) { return make_error(Errc::usage, "sampler: " + std::move(m)); };
  if (vocab <= 0) return bad(fmt::format("vocab {} must be > 0", vocab));
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    return bad(fmt::format("temperature {} must be finite and >= 0", p.temperature));
  if (!(p.top_p > 0 && p.top_p <= 1))
    return bad(fmt::format("top_p {} must be in (0, 1]", p.top_p));
  if (!(p.min_p >= 0 && p.min_p <= 1))
    return bad(fmt::format("min_p {} must be in [0, 1]", p.min_p));
  if (!(p.repetition_penalty > 0) || !std::isfinite(p.repetition_penalty))
    return bad(fmt::format("repetition_penalty {} must be finite and > 0", p.repetition_penalty));
  if (!std::isfinite(p.presence_penalty) || !std::isfinite(p.frequency_penalty))
    return bad("presence_penalty and frequency_penalty must be finite");
  if (p.top_logprobs < 0 || p.top_logprobs > kSampleMaxTop)
    return bad(fmt::format("top_logprobs {} must be in [0, {}]", p.top_logprobs, kSampleMaxTop));
  return Status::Ok();
}

size_t sample_workspace_bytes(int rows, int vocab) {
  if (rows <= 0 || vocab <= 0) return 0;
  const size_t R = static_cast<size_t>(rows), V = static_cast<size_t>(vocab);
  const size_t chunks = (V + kSampleMinChunk - 1) / kSampleMinChunk;
  // Header and partials, then z, candidates and top candidates (4 bytes each per token);
  // at least the previous kernel's rows x vocab x 8.
  return R * (kSampleHeadBytes + chunks * kSamplePartialBytes) + R * V * 12 + 256;
}

void sample_state_update_ref(uint8_t* seen, int32_t* counts, int32_t token) {
  if (seen) seen[token] = 1;
  if (counts) ++counts[token];
}

void sample_state_build_ref(uint8_t* seen, int32_t* counts, int vocab, const int32_t* tokens, int n,
                            int out_start) {
  std::fill(seen, seen + vocab, uint8_t{0});
  std::fill(counts, counts + vocab, 0);
  for (int i = 0; i < n; ++i) {
    const int32_t t = tokens[i];
    if (t < 0 || t >= vocab) continue;
    seen[t] = 1;
    if (i >= out_start) ++counts[t];
  }
}

void argmax_ref(const float* x, size_t rows, size_t dim, int32_t* out) {
  for (size_t r = 0; r < rows; ++r) {
    const float* v = x + r * dim;
    size_t best = 0;
    for (size_t i = 1; i < dim; ++i)
      if (v[i] > v[best] || (std::isnan(v[best]) && !std::isnan(v[i]))) best = i;
    out[r] = static_cast<int32_t>(best);
  }
}

namespace {

// Logprobs of the raw logits: log-sum-exp in double, the top alternatives by value (ties:
// the lowest id).
double raw_lse(const float* logits, size_t V) {
  const float mx = *std::max_element(logits, logits + V);
  double sum = 0;
  for (size_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  return mx + std::log(sum);
}

void raw_top(const float* logits, size_t V, int k_want, double lse, SampleResult* out) {
  std::vector<int32_t> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  const size_t k = std::min(V, static_cast<size_t>(k_want));
  std::partial_sort(idx.begin(), idx.begin() + static_cast<ptrdiff_t>(k), idx.end(),
                    [&](int32_t a, int32_t b) {
                      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                    });
  out->n_top = static_cast<int32_t>(k);
  for (size_t i = 0; i < k; ++i) {
    out->top_ids[i] = idx[i];
    out->top_logprobs[i] = static_cast<float>(logits[idx[i]] - lse);
  }
}

std::vector<float> penalized(const float* logits, size_t V, const SampleParams& p,
                             const uint8_t* seen, const int32_t* counts) {
  std::vector<float> z(V);
  for (size_t i = 0; i < V; ++i)
    z[i] = sample_penalize(logits[i], p, seen ? seen[i] : 0, counts ? counts[i] : 0);
  return z;
}

size_t greedy_pick(const std::vector<float>& z) {
  size_t chosen = 0;
  for (size_t i = 1; i < z.size(); ++i)
    if (z[i] > z[chosen]) chosen = i;
  return chosen;
}

// Gumbel-max over the tokens `keep` admits; ties: the lowest id; none kept: token 0.
template <class Keep>
size_t gumbel_pick(const std::vector<float>& z, const SampleParams& p, Keep keep) {
  size_t chosen = 0;
  double best = -INFINITY;
  bool any = false;
  for (size_t i = 0; i < z.size(); ++i) {
    if (!keep(i)) continue;
    const double s = sample_score(z[i], p, static_cast<uint32_t>(i));
    if (!any || s > best) best = s, chosen = i, any = true;
  }
  return chosen;
}

}  // namespace

SampleResult sample_ref(const float* logits, int vocab, const SampleParams& p, const uint8_t* seen,
                        const int32_t* counts, const uint32_t* mask) {
  const size_t V = static_cast<size_t>(vocab);
  SampleResult out;
  const bool want_lp = p.logprobs != 0 || p.top_logprobs > 0;
  const double lse = want_lp ? raw_lse(logits, V) : 0;
  if (p.top_logprobs > 0) raw_top(logits, V, p.top_logprobs, lse, &out);

  std::vector<float> z = penalized(logits, V, p, seen, counts);
  size_t chosen = 0;
  if (p.temperature == 0.0f) {
    for (size_t i = 0; i < V; ++i) z[i] = sample_masked(z[i], mask, static_cast<int>(i));
    chosen = greedy_pick(z);
  } else {
    for (size_t i = 0; i < V; ++i)
      z[i] = sample_masked(sample_temper(z[i], p.temperature), mask, static_cast<int>(i));
    const float zmax = *std::max_element(z.begin(), z.end());
    // top-k: every value >= the k-th largest.
    float k_floor = -INFINITY;
    std::vector<float> work;
    if (sample_has_k(p, vocab)) {
      work = z;
      std::nth_element(work.begin(), work.begin() + (p.top_k - 1), work.end(),
                       std::greater<float>());
      k_floor = work[static_cast<size_t>(p.top_k) - 1];
    }
    // top-p over the top-k set, on integer masses: the largest t whose {z >= t} holds
    // top_p of the set's mass.
    float p_floor = -INFINITY;
    if (sample_has_p(p)) {
      work.clear();
      for (float v : z)
        if (v >= k_floor) work.push_back(v);
      std::sort(work.begin(), work.end(), std::greater<float>());
      uint64_t total = 0;
      for (float v : work) total += sample_mass_q(v, zmax);
      const double target = static_cast<double>(p.top_p) * static_cast<double>(total);
      uint64_t cum = 0;
      p_floor = work.back();
      for (float v : work) {
        cum += sample_mass_q(v, zmax);
        if (static_cast<double>(cum) >= target) {
          p_floor = v;
          break;
        }
      }
    }
    chosen = gumbel_pick(
        z, p, [&](size_t i) { return sample_keep(z[i], zmax, k_floor, p_floor, p.min_p); });
  }
  out.token = static_cast<int32_t>(chosen);
  if (want_lp) out.logprob = static_cast<float>(logits[chosen] - lse);
  return out;
}

SampleResult sample_prefilter_ref(const float* logits, int vocab, const SampleParams& p,
                                  const uint8_t* seen, const int32_t* counts,
                                  SamplePrefilterStats* stats, const uint32_t* mask) {
  const size_t V = static_cast<size_t>(vocab);
  SampleResult out;
  SamplePrefilterStats st;
  const bool want_lp = p.logprobs != 0 || p.top_logprobs > 0;
  const double lse = want_lp ? raw_lse(logits, V) : 0;
  // The top alternatives: the candidates are the raw logits' bins up to sample_top_bin.
  if (p.top_logprobs > 0) {
    const float lmax = *std::max_element(logits, logits + V);
    std::vector<uint32_t> lc(kSampleBins, 0);
    for (size_t i = 0; i < V; ++i) ++lc[static_cast<size_t>(sample_bin(logits[i], lmax))];
    const int lb = sample_top_bin(lc.data(), std::min(vocab, p.top_logprobs));
    std::vector<float> cand;
    std::vector<int32_t> ids;
    for (size_t i = 0; i < V; ++i)
      if (sample_bin(logits[i], lmax) <= lb)
        cand.push_back(logits[i]), ids.push_back(static_cast<int32_t>(i));
    st.raw_candidates = cand.size();
    SampleResult t;
    raw_top(cand.data(), cand.size(), std::min(vocab, p.top_logprobs), lse, &t);
    out.n_top = t.n_top;
    for (int i = 0; i < t.n_top; ++i)
      out.top_ids[i] = ids[static_cast<size_t>(t.top_ids[i])],
      out.top_logprobs[i] = t.top_logprobs[i];
  }
  std::vector<float> z = penalized(logits, V, p, seen, counts);
  size_t chosen = 0;
  if (p.temperature == 0.0f) {
    for (size_t i = 0; i < V; ++i) z[i] = sample_masked(z[i], mask, static_cast<int>(i));
    chosen = greedy_pick(z);
  } else {
    for (size_t i = 0; i < V; ++i)
      z[i] = sample_masked(sample_temper(z[i], p.temperature), mask, static_cast<int>(i));
    const float zmax = *std::max_element(z.begin(), z.end());
    std::vector<uint32_t> count(kSampleBins, 0);
    std::vector<uint64_t> mass(kSampleBins, 0);
    for (size_t i = 0; i < V; ++i) {
      const auto b = static_cast<size_t>(sample_bin(z[i], zmax));
      ++count[b];
      mass[b] += sample_mass_q(z[i], zmax);
    }
    const SamplePlan pl = sample_plan(p, vocab, count.data(), mass.data());
    // Candidates sorted as the device sorts them: value descending, then id ascending.
    std::vector<std::pair<float, int32_t>> cand;
    for (size_t i = 0; i < V; ++i) {
      const int b = sample_bin(z[i], zmax);
      if (b >= pl.b0 && b <= pl.b1) cand.emplace_back(z[i], static_cast<int32_t>(i));
    }
    std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    st.candidates = cand.size();
    st.sure = 0;
    const int n = static_cast<int>(cand.size());
    const SampleFloors f = sample_floors(
        p, vocab, pl, n, [&](int j) { return cand[static_cast<size_t>(j)].first; },
        [&](int j) { return sample_mass_q(cand[static_cast<size_t>(j)].first, zmax); });
    st.k_floor = f.k_floor, st.p_floor = f.p_floor;
    std::vector<uint8_t> in_cand(V, 0);
    for (const auto& c : cand) in_cand[static_cast<size_t>(c.second)] = 1;
    for (size_t i = 0; i < V; ++i) st.sure += sample_bin(z[i], zmax) < pl.b0;
    chosen = gumbel_pick(z, p, [&](size_t i) {
      const int b = sample_bin(z[i], zmax);
      if (b < pl.b0) return sample_keep(z[i], zmax, -INFINITY, -INFINITY, p.min_p);
      return in_cand[i] != 0 && sample_keep(z[i], zmax, f.k_floor, f.p_floor, p.min_p);
    });
  }
  out.token = static_cast<int32_t>(chosen);
  if (want_lp) out.logprob = static_cast<float>(logits[chosen] - lse);
  if (stats) *stats = st;
  return out;
}

}  // namespace spark::kernels
