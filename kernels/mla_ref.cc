#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/mla.h"

namespace spark::kernels {

void mla_rope_ref(float* x, int rope, int pos, const float* inv_freq, bool interleave,
                  float factor) {
  const int half = rope / 2;
  for (int i = 0; i < half; ++i) {
    const float a = static_cast<float>(pos) * inv_freq[i];
    const float c = std::cos(a) * factor, s = std::sin(a) * factor;
    float* x0 = interleave ? x + 2 * i : x + i;
    float* x1 = interleave ? x + 2 * i + 1 : x + i + half;
    const float a0 = *x0, a1 = *x1;
    *x0 = a0 * c - a1 * s;
    *x1 = a1 * c + a0 * s;
  }
}

namespace {

float* row_of(const PagedKVLayer& kv, const int32_t* block_table, int pos, size_t width) {
  const int b = block_table[pos / kv.block_size];
  const size_t slot = static_cast<size_t>(b) * static_cast<size_t>(kv.block_size) +
                      static_cast<size_t>(pos % kv.block_size);
  return kv.k + slot * width;
}

}  // namespace

void mla_kv_write_ref(const PagedKVLayer& kv, const int32_t* block_table, const int32_t* positions,
                      size_t n, float* kv_a, const float* norm, float eps, const float* inv_freq,
                      const MlaShape& s) {
  const size_t L = static_cast<size_t>(s.latent), W = L + static_cast<size_t>(s.rope);
  for (size_t t = 0; t < n; ++t) {
    float* r = kv_a + t * W;
    double ss = 0;
    for (size_t i = 0; i < L; ++i) ss += static_cast<double>(r[i]) * r[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(L) + eps));
    for (size_t i = 0; i < L; ++i) r[i] = r[i] * inv * norm[i];
    mla_rope_ref(r + L, s.rope, positions[t], inv_freq, s.interleave, s.rope_factor);
    std::copy(r, r + W, row_of(kv, block_table, positions[t], W));
  }
}

void mla_attention_ref(const PagedKVLayer& kv, const int32_t* block_table, const int32_t* positions,
                       size_t n, float* q, const float* kv_b, const float* inv_freq, float* out,
                       const MlaShape& s) {
  const size_t L = static_cast<size_t>(s.latent), R = static_cast<size_t>(s.rope), W = L + R,
               N = static_cast<size_t>(s.nope), Vd = static_cast<size_t>(s.v_dim);
  const size_t qk = N + R, per_head = (N + Vd) * L;
  std::vector<double> q_lat(L), ctx(L), scores;
  std::vector<const float*> rows;
  for (size_t t = 0; t < n; ++t) {
    const int pos = positions[t];
    rows.resize(static_cast<size_t>(pos) + 1);
    for (int j = 0; j <= pos; ++j) rows[static_cast<size_t>(j)] = row_of(kv, block_table, j, W);
    scores.resize(rows.size());
    for (int h = 0; h < s.heads; ++h) {
      float* qh = q + (t * static_cast<size_t>(s.heads) + static_cast<size_t>(h)) * qk;
      mla_rope_ref(qh + N, s.rope, pos, inv_freq, s.interleave, s.rope_factor);
      const float* wk = kv_b + static_cast<size_t>(h) * per_head;  // [nope][latent]
      const float* wv = wk + N * L;                                // [v_dim][latent]
      // q_nope into the latent space: q_lat = q_nope W_UK.
      std::fill(q_lat.begin(), q_lat.end(), 0.0);
      for (size_t i = 0; i < N; ++i) {
        const double a = qh[i];
        const float* w = wk + i * L;
        for (size_t c = 0; c < L; ++c) q_lat[c] += a * w[c];
      }
      double mx = -INFINITY;
      for (size_t j = 0; j < rows.size(); ++j) {
        const float* r = rows[j];
        double d = 0;
        for (size_t c = 0; c < L; ++c) d += q_lat[c] * r[c];
        for (size_t i = 0; i < R; ++i) d += static_cast<double>(qh[N + i]) * r[L + i];
        scores[j] = d * s.scale;
        mx = std::max(mx, scores[j]);
      }
      double sum = 0;
      for (auto& e : scores) sum += (e = std::exp(e - mx));
      std::fill(ctx.begin(), ctx.end(), 0.0);
      for (size_t j = 0; j < rows.size(); ++j) {
        const double p = scores[j] / sum;
        const float* r = rows[j];
        for (size_t c = 0; c < L; ++c) ctx[c] += p * r[c];
      }
      // The latent context out through the head's values: out = ctx W_UV^T.
      float* o = out + (t * static_cast<size_t>(s.heads) + static_cast<size_t>(h)) * Vd;
      for (size_t v = 0; v < Vd; ++v) {
        const float* w = wv + v * L;
        double d = 0;
        for (size_t c = 0; c < L; ++c) d += ctx[c] * w[c];
        o[v] = static_cast<float>(d);
      }
    }
  }
}

}  // namespace spark::kernels

namespace spark::kernels {

int mla_splits(int max_seq_len, bool decode, size_t n_tokens, int heads, int sm_count) {
  if (!decode || max_seq_len <= kMlaMinRange) return 1;
  const size_t groups = heads > 32 ? static_cast<size_t>((heads + 63) / 64) : 1;
  const size_t per_sm = heads <= 16 ? 2 : 1;
  const size_t blocks = static_cast<size_t>(std::max(sm_count, 1)) * per_sm;
  const size_t per_token = groups * std::max<size_t>(n_tokens, 1);
  const size_t want = (blocks + per_token - 1) / per_token;
  const size_t by_len = static_cast<size_t>((max_seq_len + kMlaMinRange - 1) / kMlaMinRange);
  return static_cast<int>(
      std::max<size_t>(1, std::min({want, by_len, static_cast<size_t>(kMlaMaxSplits)})));
}

size_t mla_workspace_reserve(size_t n_tokens, const MlaShape& s, int max_seq_len, bool decode,
                             int sm_count) {
  size_t most = 0;
  for (size_t n = decode ? 1 : n_tokens; n <= n_tokens; ++n)
    most = std::max(
        most, mla_workspace_bytes(n, s, mla_splits(max_seq_len, decode, n, s.heads, sm_count)));
  return most;
}

size_t mla_workspace_bytes(size_t n_tokens, const MlaShape& s, int splits) {
  const size_t rows = n_tokens * static_cast<size_t>(std::max(s.heads, 0));
  const size_t q = (rows * static_cast<size_t>(std::max(s.latent + s.rope, 0)) + 3) / 4 * 4;
  const size_t part = rows * static_cast<size_t>(std::max(splits, 1)) *
                      static_cast<size_t>(std::max(s.latent + kMlaPartHead, 0));
  // The tensor-core attention's bf16 copy of the latent queries after them.
  const size_t q16 = rows * static_cast<size_t>(std::max(s.latent + s.rope, 0)) * 2;
  return (q + part) * sizeof(float) + q16;
}

}  // namespace spark::kernels
