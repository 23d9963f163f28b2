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
  // The penalised, tempered logits of every row and their probability mass (fp32 each).
  return rows <= 0 || vocab <= 0 ? 0 : static_cast<size_t>(rows) * static_cast<size_t>(vocab) * 8;
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

SampleResult sample_ref(const float* logits, int vocab, const SampleParams& p, const uint8_t* seen,
                        const int32_t* counts) {
  const size_t V = static_cast<size_t>(vocab);
  SampleResult out;
  // Logprobs of the raw logits.
  const bool want_lp = p.logprobs != 0 || p.top_logprobs > 0;
  double lse = 0;
  if (want_lp) {
    float mx = *std::max_element(logits, logits + V);
    double sum = 0;
    for (size_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
    lse = mx + std::log(sum);
    if (p.top_logprobs > 0) {
      std::vector<int32_t> idx(V);
      std::iota(idx.begin(), idx.end(), 0);
      const size_t k = std::min(V, static_cast<size_t>(p.top_logprobs));
      std::partial_sort(idx.begin(), idx.begin() + static_cast<ptrdiff_t>(k), idx.end(),
                        [&](int32_t a, int32_t b) {
                          return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                        });
      out.n_top = static_cast<int32_t>(k);
      for (size_t i = 0; i < k; ++i) {
        out.top_ids[i] = idx[i];
        out.top_logprobs[i] = static_cast<float>(logits[idx[i]] - lse);
      }
    }
  }

  std::vector<float> z(V);
  for (size_t i = 0; i < V; ++i)
    z[i] = sample_penalize(logits[i], p, seen ? seen[i] : 0, counts ? counts[i] : 0);

  size_t chosen = 0;
  if (p.temperature == 0.0f) {
    for (size_t i = 1; i < V; ++i)
      if (z[i] > z[chosen]) chosen = i;
  } else {
    for (auto& v : z) v = sample_temper(v, p.temperature);
    const float zmax = *std::max_element(z.begin(), z.end());
    // top-k: every value >= the k-th largest.
    float k_floor = -INFINITY;
    std::vector<float> work;
    if (p.top_k > 0 && static_cast<size_t>(p.top_k) < V) {
      work = z;
      std::nth_element(work.begin(), work.begin() + (p.top_k - 1), work.end(),
                       std::greater<float>());
      k_floor = work[static_cast<size_t>(p.top_k) - 1];
    }
    // top-p over the top-k distribution: the largest t whose {z >= t} holds top_p of it.
    float p_floor = -INFINITY;
    if (p.top_p < 1.0f) {
      work.clear();
      for (float v : z)
        if (v >= k_floor) work.push_back(v);
      std::sort(work.begin(), work.end(), std::greater<float>());
      double total = 0;
      for (float v : work) total += sample_mass(v, zmax);
      const double target = static_cast<double>(p.top_p) * total;
      double cum = 0;
      p_floor = work.back();
      for (float v : work) {
        cum += sample_mass(v, zmax);
        if (cum >= target) {
          p_floor = v;
          break;
        }
      }
    }
    double best = -INFINITY;
    bool any = false;
    for (size_t i = 0; i < V; ++i) {
      if (!sample_keep(z[i], zmax, k_floor, p_floor, p.min_p)) continue;
      const double s = sample_score(z[i], p, static_cast<uint32_t>(i));
      if (!any || s > best) best = s, chosen = i, any = true;
    }
  }
  out.token = static_cast<int32_t>(chosen);
  if (want_lp) out.logprob = static_cast<float>(logits[chosen] - lse);
  return out;
}

}  // namespace spark::kernels
