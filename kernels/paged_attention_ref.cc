#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/paged_attention.h"

namespace spark::kernels {
namespace {

inline size_t slot_offset(const PagedKVLayer& kv, const int32_t* block_table, int32_t pos,
                          int kvh) {
  const int32_t block = block_table[pos / kv.block_size];
  const int32_t in_block = pos % kv.block_size;
  return ((static_cast<size_t>(block) * static_cast<size_t>(kv.block_size) +
           static_cast<size_t>(in_block)) *
              static_cast<size_t>(kv.n_kv_heads) +
          static_cast<size_t>(kvh)) *
         static_cast<size_t>(kv.head_dim);
}

}  // namespace

void paged_kv_write_ref(const PagedKVLayer& kv, const int32_t* block_table,
                        const int32_t* positions, size_t n_tokens, const float* k, const float* v) {
  const size_t row = static_cast<size_t>(kv.n_kv_heads) * static_cast<size_t>(kv.head_dim);
  for (size_t t = 0; t < n_tokens; ++t) {
    const size_t off = slot_offset(kv, block_table, positions[t], 0);
    std::copy(k + t * row, k + (t + 1) * row, kv.k + off);
    std::copy(v + t * row, v + (t + 1) * row, kv.v + off);
  }
}

void paged_attention_ref(const PagedKVLayer& kv, const int32_t* block_table,
                         const int32_t* positions, size_t n_tokens, int n_heads, const float* q,
                         float* out, float scale, int window) {
  const int hd = kv.head_dim;
  const int group = n_heads / kv.n_kv_heads;
  std::vector<double> scores;
  std::vector<double> acc(static_cast<size_t>(hd));
  for (size_t t = 0; t < n_tokens; ++t) {
    const int32_t pos = positions[t];
    const int32_t first = window > 0 ? std::max(0, pos - window + 1) : 0;
    scores.resize(static_cast<size_t>(pos - first + 1));
    for (int h = 0; h < n_heads; ++h) {
      const int kvh = h / group;
      const float* qv =
          q + (t * static_cast<size_t>(n_heads) + static_cast<size_t>(h)) * static_cast<size_t>(hd);
      double mx = -INFINITY;
      for (int32_t p = first; p <= pos; ++p) {
        const float* kr = kv.k + slot_offset(kv, block_table, p, kvh);
        float dot = 0;
        for (int i = 0; i < hd; ++i) dot += qv[i] * kr[i];
        const double s = static_cast<double>(dot) * scale;
        scores[static_cast<size_t>(p - first)] = s;
        mx = std::max(mx, s);
      }
      double sum = 0;
      for (auto& s : scores) {
        s = std::exp(s - mx);
        sum += s;
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int32_t p = first; p <= pos; ++p) {
        const float* vr = kv.v + slot_offset(kv, block_table, p, kvh);
        const double w = scores[static_cast<size_t>(p - first)] / sum;
        for (int i = 0; i < hd; ++i) acc[static_cast<size_t>(i)] += w * vr[i];
      }
      float* o = out + (t * static_cast<size_t>(n_heads) + static_cast<size_t>(h)) *
                           static_cast<size_t>(hd);
      for (int i = 0; i < hd; ++i) o[i] = static_cast<float>(acc[static_cast<size_t>(i)]);
    }
  }
}

}  // namespace spark::kernels
