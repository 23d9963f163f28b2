#include "daemon/engine/shard_plan.h"

#include <fmt/format.h>

#include "daemon/engine/family.h"
#include "kernels/fp8.h"

namespace spark::engine {

uint64_t ShardPlan::held_bytes(int matrix_bytes, int vector_bytes, bool fp8_kept,
                               bool mxfp4_kept) const {
  uint64_t n = 0;
  for (const auto& d : dests) {
    if ((d.fp8 && fp8_kept) || (d.mxfp4 && mxfp4_kept)) {
      n += d.packed_bytes();
      continue;
    }
    const int b = d.kind == DestKind::matrix ? matrix_bytes
                  : d.kind == DestKind::f32  ? 4
                                             : vector_bytes;
    n += static_cast<uint64_t>(d.numel) * static_cast<uint64_t>(b);
  }
  return n;
}

Result<ShardPlan> make_shard_plan(const ModelConfig& c, int rank, int world,
                                  const std::string& where) {
  PlanOptions o;
  o.rank = rank;
  o.world = world;
  return make_shard_plan(c, o, where);
}

Result<ShardPlan> make_shard_plan(const ModelConfig& c, const PlanOptions& o,
                                  const std::string& where) {
  if (o.world < 1 || o.rank < 0 || o.rank >= o.world)
    return make_error(Errc::internal,
                      fmt::format("rank {} of world {} is invalid", o.rank, o.world));
  for (const auto& f : family_table()) {
    if (f.family != c.family) continue;
    auto p = f.plan(c, o, where);
    if (!p) return p;
    if (c.weights.fp8()) {
      SPARK_TRY(check_fp8_blocks(c, *p, where));
      mark_fp8_dests(c, &*p);
    }
    return p;
  }
  return make_error(Errc::internal, fmt::format("no shard plan for {}", c.architecture));
}

bool is_projection(WeightRole r) {
  switch (r) {
    case WeightRole::wq:
    case WeightRole::wk:
    case WeightRole::wv:
    case WeightRole::wo:
    case WeightRole::w_gate_up:
    case WeightRole::w_down:
    case WeightRole::experts_gate_up:
    case WeightRole::experts_down:
    case WeightRole::shared_gate_up:
    case WeightRole::shared_down:
    case WeightRole::wq_a:
    case WeightRole::wkv_a:
    case WeightRole::wkv_b:
      return true;
    default:
      return false;
  }
}

Status check_fp8_blocks(const ModelConfig& c, const ShardPlan& p, const std::string& where) {
  const int64_t bn = c.weights.block_n, bk = c.weights.block_k;
  for (const auto& r : p.reads) {
    if (!is_projection(r.role) || r.shape.size() != 2 || c.weights.is_not_converted(r.tensor))
      continue;
    const int64_t N = r.shape[0], K = r.shape[1];
    const int64_t r0 = r.slice.row0, r1 = r0 + r.rows, c0 = r.slice.col0, c1 = c0 + r.cols;
    auto cuts = [](int64_t a, int64_t b, int64_t full, int64_t blk) {
      return a % blk != 0 || (b % blk != 0 && b != full);
    };
    if (!cuts(r0, r1, N, bn) && !cuts(c0, c1, K, bk)) continue;
    return make_error(
        Errc::config,
        fmt::format("{}: {} ranks would cut FP8 scale blocks: rank {} holds rows [{}, {}) and "
                    "columns [{}, {}) of {} [{}, {}], which are not whole {}x{} blocks — use a "
                    "tensor-parallel size that splits the heads and intermediate sizes into "
                    "multiples of {}{}",
                    where, p.world, p.rank, r0, r1, c0, c1, r.tensor, N, K, bn, bk, bn,
                    c.is_moe() ? " (or EXPERT_PARALLEL=ep for the experts)" : ""));
  }
  return Status::Ok();
}

void mark_fp8_dests(const ModelConfig& c, ShardPlan* p) {
  constexpr int64_t kBlock = 128;
  std::vector<bool> no(p->dests.size());
  for (size_t i = 0; i < p->dests.size(); ++i) {
    auto& d = p->dests[i];
    d.fp8 = false;
    d.cols = 0;
    d.scale_row_shift = 7;
    no[i] = d.kind != DestKind::matrix || d.role == WeightRole::wkv_b || !is_projection(d.role);
  }
  auto dest_of = [&](const ShardRead& r) -> int {
    for (size_t i = 0; i < p->dests.size(); ++i)
      if (p->dests[i].layer == r.layer && p->dests[i].role == r.role) return static_cast<int>(i);
    return -1;
  };
  for (const auto& r : p->reads) {
    const int i = dest_of(r);
    if (i < 0 || no[static_cast<size_t>(i)]) continue;
    auto& d = p->dests[static_cast<size_t>(i)];
    if (r.mxfp4 || r.shape.size() != 2 || c.weights.is_not_converted(r.tensor) || r.cols <= 0 ||
        r.slice.col0 % kBlock != 0 || r.dst_offset % static_cast<size_t>(r.cols) != 0 ||
        (d.cols && d.cols != r.cols)) {
      no[static_cast<size_t>(i)] = true;
      continue;
    }
    d.cols = r.cols;
    if ((static_cast<int64_t>(r.dst_offset) / r.cols) % kBlock != 0 || r.slice.row0 % kBlock != 0)
      d.scale_row_shift = 0;
  }
  for (size_t i = 0; i < p->dests.size(); ++i) {
    auto& d = p->dests[i];
    if (no[i] || d.cols == 0) continue;
    d.fp8 = true;
    const size_t rows = d.numel / static_cast<size_t>(d.cols);
    d.scale_rows = rows == 0 ? 0 : ((rows - 1) >> d.scale_row_shift) + 1;
    // Each scale row padded to a multiple of 4 blocks (zeros): the FP8 tensor-core product
    // (cuBLASLt's 128 x 128 block scales) reads the rows with that stride.
    d.scale_ld = kernels::fp8_tc_scale_ld(static_cast<size_t>(d.cols));
  }
}

Result<ShardPlan> start_plan(const ModelConfig& c, const PlanOptions& o, const std::string& where) {
  const int world = o.world, rank = o.rank;
  if (c.num_heads % world || c.num_kv_heads % world)
    return make_error(
        Errc::config,
        fmt::format("{}: tensor parallel size {} must divide num_attention_heads ({}) and "
                    "num_key_value_heads ({}) — choose a TP size that divides them",
                    where, world, c.num_heads, c.num_kv_heads));
  ShardPlan p;
  p.rank = rank;
  p.world = world;
  p.heads = c.num_heads / world;
  p.kv_heads = c.num_kv_heads / world;
  p.vocab_parallel = world > 1 && c.vocab_size % world == 0;
  p.vocab = p.vocab_parallel ? c.vocab_size / world : c.vocab_size;
  p.vocab0 = p.vocab_parallel ? rank * p.vocab : 0;
  return p;
}

void PlanBuilder::dest(int layer, WeightRole role, size_t numel, DestKind kind) {
  p_->dests.push_back({layer, role, numel, kind == DestKind::matrix, kind});
}

void PlanBuilder::read(std::string name, std::vector<int64_t> shape, Slice s, int layer,
                       WeightRole role, size_t off) {
  const int64_t R = shape.empty() ? 1 : shape[0];
  int64_t C = 1;
  for (size_t i = 1; i < shape.size(); ++i) C *= shape[i];
  ShardRead r;
  r.tensor = std::move(name);
  r.shape = std::move(shape);
  r.slice = s;
  r.rows = s.rows < 0 ? R - s.row0 : s.rows;
  r.cols = s.cols < 0 ? C - s.col0 : s.cols;
  r.layer = layer;
  r.role = role;
  r.dst_offset = off;
  p_->reads.push_back(std::move(r));
}

void PlanBuilder::embedding_and_head(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const ShardPlan& p = *p_;
  dest(-1, WeightRole::embed, static_cast<size_t>(V * H), DestKind::matrix);
  read("model.embed_tokens.weight", {V, H}, Slice{}, -1, WeightRole::embed);
  dest(-1, WeightRole::final_norm, static_cast<size_t>(H), DestKind::vector);
  read("model.norm.weight", {H}, Slice{}, -1, WeightRole::final_norm);
  if (!c.tie_word_embeddings) {
    dest(-1, WeightRole::lm_head, static_cast<size_t>(p.vocab) * static_cast<size_t>(H),
         DestKind::matrix);
    read("lm_head.weight", {V, H}, Slice{p.vocab0, p.vocab, 0, -1}, -1, WeightRole::lm_head);
  }
}

void PlanBuilder::attention(const ModelConfig& c, int l) {
  const ShardPlan& p = *p_;
  const int64_t H = c.hidden_size, hd = c.head_dim, NH = c.num_heads, NKV = c.num_kv_heads;
  const int64_t qw = p.heads * hd, kw = p.kv_heads * hd;
  const Slice q_rows{p.rank * qw, qw, 0, -1};
  const Slice kv_rows{p.rank * kw, kw, 0, -1};
  const Slice o_cols{0, -1, p.rank * qw, qw};
  const Slice all;
  auto sz = [](int64_t a, int64_t b = 1) { return static_cast<size_t>(a * b); };
  const std::string pre = fmt::format("model.layers.{}.", l);
  dest(l, WeightRole::in_norm, sz(H), DestKind::vector);
  read(pre + "input_layernorm.weight", {H}, all, l, WeightRole::in_norm);
  dest(l, WeightRole::post_norm, sz(H), DestKind::vector);
  read(pre + "post_attention_layernorm.weight", {H}, all, l, WeightRole::post_norm);
  dest(l, WeightRole::wq, sz(qw, H), DestKind::matrix);
  read(pre + "self_attn.q_proj.weight", {NH * hd, H}, q_rows, l, WeightRole::wq);
  dest(l, WeightRole::wk, sz(kw, H), DestKind::matrix);
  read(pre + "self_attn.k_proj.weight", {NKV * hd, H}, kv_rows, l, WeightRole::wk);
  dest(l, WeightRole::wv, sz(kw, H), DestKind::matrix);
  read(pre + "self_attn.v_proj.weight", {NKV * hd, H}, kv_rows, l, WeightRole::wv);
  dest(l, WeightRole::wo, sz(H, qw), DestKind::matrix);
  read(pre + "self_attn.o_proj.weight", {H, NH * hd}, o_cols, l, WeightRole::wo);
  if (c.qkv_bias) {
    dest(l, WeightRole::bq, sz(qw), DestKind::vector);
    read(pre + "self_attn.q_proj.bias", {NH * hd}, q_rows, l, WeightRole::bq);
    dest(l, WeightRole::bk, sz(kw), DestKind::vector);
    read(pre + "self_attn.k_proj.bias", {NKV * hd}, kv_rows, l, WeightRole::bk);
    dest(l, WeightRole::bv, sz(kw), DestKind::vector);
    read(pre + "self_attn.v_proj.bias", {NKV * hd}, kv_rows, l, WeightRole::bv);
  }
  if (c.o_bias) {
    dest(l, WeightRole::bo, sz(H), DestKind::vector);
    read(pre + "self_attn.o_proj.bias", {H}, all, l, WeightRole::bo);
  }
  if (c.qk_norm == QkNorm::per_head) {
    dest(l, WeightRole::q_norm, sz(hd), DestKind::vector);
    read(pre + "self_attn.q_norm.weight", {hd}, all, l, WeightRole::q_norm);
    dest(l, WeightRole::k_norm, sz(hd), DestKind::vector);
    read(pre + "self_attn.k_norm.weight", {hd}, all, l, WeightRole::k_norm);
  } else if (c.qk_norm == QkNorm::per_layer) {
    // One norm over all heads' q (and k): each rank holds its heads' share of the weight.
    dest(l, WeightRole::q_norm, sz(qw), DestKind::vector);
    read(pre + "self_attn.q_norm.weight", {NH * hd}, q_rows, l, WeightRole::q_norm);
    dest(l, WeightRole::k_norm, sz(kw), DestKind::vector);
    read(pre + "self_attn.k_norm.weight", {NKV * hd}, kv_rows, l, WeightRole::k_norm);
  }
}

void PlanBuilder::mla_attention(const ModelConfig& c, int l) {
  const ShardPlan& p = *p_;
  const auto& m = c.mla;
  const int64_t H = c.hidden_size, NH = c.num_heads, nh = p.heads, h0 = p.rank * p.heads;
  const int64_t qk = m.qk_head_dim(), kvb = m.qk_nope + m.v_head_dim, V = m.v_head_dim;
  const int64_t qr = m.q_lora_rank, kr = m.kv_lora_rank, kw = m.cache_width();
  const Slice all;
  auto sz = [](int64_t a, int64_t b = 1) { return static_cast<size_t>(a * b); };
  const std::string pre = fmt::format("model.layers.{}.", l), at = pre + "self_attn.";
  dest(l, WeightRole::in_norm, sz(H), DestKind::vector);
  read(pre + "input_layernorm.weight", {H}, all, l, WeightRole::in_norm);
  dest(l, WeightRole::post_norm, sz(H), DestKind::vector);
  read(pre + "post_attention_layernorm.weight", {H}, all, l, WeightRole::post_norm);
  dest(l, WeightRole::wq, sz(nh * qk, qr > 0 ? qr : H), DestKind::matrix);
  if (qr > 0) {
    dest(l, WeightRole::wq_a, sz(qr, H), DestKind::matrix);
    read(at + "q_a_proj.weight", {qr, H}, all, l, WeightRole::wq_a);
    dest(l, WeightRole::q_a_norm, sz(qr), DestKind::vector);
    read(at + "q_a_layernorm.weight", {qr}, all, l, WeightRole::q_a_norm);
    read(at + "q_b_proj.weight", {NH * qk, qr}, Slice{h0 * qk, nh * qk, 0, -1}, l, WeightRole::wq);
  } else {
    read(at + "q_proj.weight", {NH * qk, H}, Slice{h0 * qk, nh * qk, 0, -1}, l, WeightRole::wq);
  }
  dest(l, WeightRole::wkv_a, sz(kw, H), DestKind::matrix);
  read(at + "kv_a_proj_with_mqa.weight", {kw, H}, all, l, WeightRole::wkv_a);
  dest(l, WeightRole::kv_a_norm, sz(kr), DestKind::vector);
  read(at + "kv_a_layernorm.weight", {kr}, all, l, WeightRole::kv_a_norm);
  dest(l, WeightRole::wkv_b, sz(nh * kvb, kr), DestKind::matrix);
  read(at + "kv_b_proj.weight", {NH * kvb, kr}, Slice{h0 * kvb, nh * kvb, 0, -1}, l,
       WeightRole::wkv_b);
  dest(l, WeightRole::wo, sz(H, nh * V), DestKind::matrix);
  read(at + "o_proj.weight", {H, NH * V}, Slice{0, -1, h0 * V, nh * V}, l, WeightRole::wo);
}

void PlanBuilder::gated_mlp(const std::string& pre, const char* gate, const char* up,
                            const char* down, int64_t H, int64_t I, int64_t i0, int64_t n, int l,
                            WeightRole gu_role, WeightRole down_role, bool bias) {
  // gate and up fused into one [2n][hidden] matrix: one product, then SwiGLU reads each row
  // as [gate | up] (the layout of kernels/swiglu.h).
  const Slice rows{i0, n, 0, -1};
  const Slice cols{0, -1, i0, n};
  auto sz = [](int64_t a, int64_t b = 1) { return static_cast<size_t>(a * b); };
  dest(l, gu_role, sz(2 * n, H), DestKind::matrix);
  read(pre + gate + ".weight", {I, H}, rows, l, gu_role);
  read(pre + up + ".weight", {I, H}, rows, l, gu_role, sz(n, H));
  dest(l, down_role, sz(H, n), DestKind::matrix);
  read(pre + down + ".weight", {H, I}, cols, l, down_role);
  if (bias) {
    dest(l, WeightRole::b_gate_up, sz(2 * n), DestKind::vector);
    read(pre + gate + ".bias", {I}, rows, l, WeightRole::b_gate_up);
    read(pre + up + ".bias", {I}, rows, l, WeightRole::b_gate_up, sz(n));
    dest(l, WeightRole::b_down, sz(H), DestKind::vector);
    read(pre + down + ".bias", {H}, Slice{}, l, WeightRole::b_down);
  }
}

}  // namespace spark::engine
