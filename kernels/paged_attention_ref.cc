#include <fmt/format.h>

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

void paged_kv_write_slots_ref(const PagedKVLayer& kv, const int32_t* slots, size_t n_tokens,
                              const float* k, size_t k_stride, const float* v, size_t v_stride,
                              DType store) {
  const size_t row = static_cast<size_t>(kv.n_kv_heads) * static_cast<size_t>(kv.head_dim);
  for (size_t t = 0; t < n_tokens; ++t) {
    if (slots[t] < 0) continue;
    const size_t off = static_cast<size_t>(slots[t]) * row;
    for (size_t i = 0; i < row; ++i) {
      kv.k[off + i] = round_to(store, k[t * k_stride + i]);
      kv.v[off + i] = round_to(store, v[t * v_stride + i]);
    }
  }
}

size_t attention_decode_workspace_bytes(int n_seqs, int n_heads, int head_dim, int max_seq_len) {
  const size_t splits = attention_decode_splits(max_seq_len);
  if (splits <= 1 || n_seqs <= 0) return 0;
  // Per (sequence, head, split): the partial output (head_dim floats), its max and its sum.
  return static_cast<size_t>(n_seqs) * static_cast<size_t>(n_heads) * splits *
         (static_cast<size_t>(head_dim) + 2) * sizeof(float);
}

Status attention_check_args(const AttentionBatch& b, bool decode) {
  auto bad = [&](std::string m) {
    return make_error(Errc::usage,
                      fmt::format("attention_{}: {}", decode ? "decode" : "prefill", m));
  };
  const auto& kv = b.kv;
  if (kv.head_dim <= 0 || kv.head_dim % 8 != 0 || kv.head_dim > 256)
    return bad(fmt::format("head_dim {} must be a multiple of 8 in [8, 256]", kv.head_dim));
  if (kv.n_kv_heads <= 0 || b.n_heads <= 0 || b.n_heads % kv.n_kv_heads != 0)
    return bad(fmt::format("n_heads {} must be a positive multiple of n_kv_heads {}", b.n_heads,
                           kv.n_kv_heads));
  if (kv.block_size <= 0) return bad(fmt::format("block_size {} must be > 0", kv.block_size));
  if (b.n_seqs < 0) return bad(fmt::format("n_seqs {} must be >= 0", b.n_seqs));
  if (b.n_seqs == 0) return Status::Ok();
  if (!b.q || !b.out || !kv.k || !kv.v || !b.block_tables || !b.seq_lens ||
      (!decode && !b.query_start))
    return bad("null pointer among q, out, kv.k, kv.v, block_tables, seq_lens, query_start");
  const size_t row = static_cast<size_t>(b.n_heads) * static_cast<size_t>(kv.head_dim);
  if (b.q_stride < row || b.out_stride < row)
    return bad(fmt::format("q_stride {} and out_stride {} must be >= n_heads * head_dim = {}",
                           b.q_stride, b.out_stride, row));
  if (b.max_seq_len <= 0 || b.max_blocks_per_seq <= 0 ||
      static_cast<int64_t>(b.max_blocks_per_seq) * kv.block_size < b.max_seq_len)
    return bad(
        fmt::format("max_seq_len {} must be > 0 and fit max_blocks_per_seq {} x block_size {}",
                    b.max_seq_len, b.max_blocks_per_seq, kv.block_size));
  if (!decode && b.max_query_len <= 0)
    return bad(fmt::format("max_query_len {} must be > 0", b.max_query_len));
  if (!(b.scale > 0) || !std::isfinite(b.scale))
    return bad(fmt::format("scale {} must be finite and > 0", b.scale));
  if (b.window < 0) return bad(fmt::format("window {} must be >= 0", b.window));
  if (decode) {
    const size_t need =
        attention_decode_workspace_bytes(b.n_seqs, b.n_heads, kv.head_dim, b.max_seq_len);
    if (need > 0 && (!b.workspace || b.workspace_bytes < need))
      return bad(
          fmt::format("workspace of {} bytes is less than the {} bytes needed "
                      "(attention_decode_workspace_bytes)",
                      b.workspace ? b.workspace_bytes : 0, need));
  }
  return Status::Ok();
}

}  // namespace spark::kernels
