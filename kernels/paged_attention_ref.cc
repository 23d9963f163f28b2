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
                         float* out, float scale, int window, const float* sinks) {
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
      if (sinks) mx = std::max(mx, static_cast<double>(sinks[h]));
      double sum = sinks ? std::exp(static_cast<double>(sinks[h]) - mx) : 0.0;
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

size_t attention_decode_partitioned_workspace_bytes(int n_seqs, int n_heads, int head_dim,
                                                    int max_seq_len) {
  const size_t splits = attention_decode_splits(max_seq_len);
  if (splits <= 1 || n_seqs <= 0) return 0;
  // Per (sequence, head, split): the partial output (head_dim floats), its max and its sum.
  return static_cast<size_t>(n_seqs) * static_cast<size_t>(n_heads) * splits *
         (static_cast<size_t>(head_dim) + 2) * sizeof(float);
}

size_t attention_decode_workspace_bytes(int n_seqs, int n_heads, int head_dim, int max_seq_len) {
  if (n_seqs <= 0 || n_heads <= 0) return 0;
  // One KV-head block per sequence gives the most split slots (any KV head count has fewer).
  const size_t cap = static_cast<size_t>(attention_decode_split_cap(n_seqs, 1, max_seq_len));
  const size_t pairs = static_cast<size_t>(n_seqs) * static_cast<size_t>(n_heads);
  const size_t counters = (pairs + 63) / 64 * 64 * sizeof(int32_t);
  return counters + pairs * cap * (static_cast<size_t>(head_dim) + 2) * sizeof(float);
}

void attention_decode_split_ref(const PagedKVLayer& kv, const int32_t* block_table, int ctx,
                                int n_heads, const float* q, float* out, float scale, int window,
                                int cap, const float* sinks) {
  const int hd = kv.head_dim;
  const int group = n_heads / kv.n_kv_heads;
  const size_t HD = static_cast<size_t>(hd);
  const DecodeSplitPlan plan = attention_decode_plan(ctx, window, cap);
  if (plan.used == 0) {
    std::fill(out, out + static_cast<size_t>(n_heads) * HD, 0.f);
    return;
  }
  // Scores in the log2 domain (q pre-scaled by log2 e), as the kernel keeps them.
  const float qscale = scale * 1.4426950408889634f;
  std::vector<float> m(static_cast<size_t>(plan.used)), l(m.size()), o(m.size() * HD), s;
  for (int h = 0; h < n_heads; ++h) {
    const int kvh = h / group;
    const float* qv = q + static_cast<size_t>(h) * HD;
    for (int sp = 0; sp < plan.used; ++sp) {
      const int lo = plan.first + sp * plan.chunk, hi = std::min(ctx, lo + plan.chunk);
      s.assign(static_cast<size_t>(hi - lo), 0.f);
      float mx = -INFINITY;
      for (int p = lo; p < hi; ++p) {
        const float* kr = kv.k + slot_offset(kv, block_table, p, kvh);
        float dot = 0;
        for (int i = 0; i < hd; ++i) dot += qv[i] * qscale * kr[i];
        s[static_cast<size_t>(p - lo)] = dot;
        mx = std::max(mx, dot);
      }
      float sum = 0;
      float* os = o.data() + static_cast<size_t>(sp) * HD;
      std::fill(os, os + HD, 0.f);
      for (int p = lo; p < hi; ++p) {
        const float e = std::exp2(s[static_cast<size_t>(p - lo)] - mx);
        sum += e;
        const float* vr = kv.v + slot_offset(kv, block_table, p, kvh);
        for (int i = 0; i < hd; ++i) os[i] += e * vr[i];
      }
      m[static_cast<size_t>(sp)] = mx, l[static_cast<size_t>(sp)] = sum;
    }
    const float M = *std::max_element(m.begin(), m.end());
    float L = 0;
    for (int sp = 0; sp < plan.used; ++sp)
      L += l[static_cast<size_t>(sp)] * std::exp2(m[static_cast<size_t>(sp)] - M);
    // The merged denominator gets the head's sink once (attention_norm_factor's formula).
    float norm = 1.f / L;
    if (sinks) {
      const float k2 = sinks[h] * 1.4426950408889634f, r = std::max(M, k2);
      const float a = std::exp2(M - r);
      norm = a / (L * a + std::exp2(k2 - r));
    }
    float* oh = out + static_cast<size_t>(h) * HD;
    for (int i = 0; i < hd; ++i) {
      float acc = 0;
      for (int sp = 0; sp < plan.used; ++sp)
        acc += o[static_cast<size_t>(sp) * HD + static_cast<size_t>(i)] *
               std::exp2(m[static_cast<size_t>(sp)] - M);
      oh[i] = acc * norm;
    }
  }
}

Status attention_check_args(const AttentionBatch& b, bool decode) {
  return attention_check_args(
      b, decode,
      decode ? attention_decode_workspace_bytes(b.n_seqs, b.n_heads, b.kv.head_dim, b.max_seq_len)
             : 0);
}

Status attention_check_args(const AttentionBatch& b, bool decode, size_t decode_workspace_need) {
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
  if (b.dtype == DType::e4m3)
    return bad("q and out must be f32 or bf16 (fp8 is a KV cache type only)");
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
    const size_t need = decode_workspace_need;
    if (need > 0 && (!b.workspace || b.workspace_bytes < need))
      return bad(
          fmt::format("workspace of {} bytes is less than the {} bytes needed "
                      "for these bounds",
                      b.workspace ? b.workspace_bytes : 0, need));
  }
  return Status::Ok();
}

}  // namespace spark::kernels
