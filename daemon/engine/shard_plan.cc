#include "daemon/engine/shard_plan.h"

#include <fmt/format.h>

namespace spark::engine {

Result<ShardPlan> make_shard_plan(const ModelConfig& c, int rank, int world,
                                  const std::string& where) {
  if (world < 1 || rank < 0 || rank >= world)
    return make_error(Errc::internal, fmt::format("rank {} of world {} is invalid", rank, world));
  if (c.num_heads % world || c.num_kv_heads % world || c.intermediate_size % world)
    return make_error(
        Errc::config,
        fmt::format(
            "{}: tensor parallel size {} must divide num_attention_heads ({}), num_key_value_heads "
            "({}) and intermediate_size ({}) — choose a TP size that divides them",
            where, world, c.num_heads, c.num_kv_heads, c.intermediate_size));
  ShardPlan p;
  p.rank = rank;
  p.world = world;
  p.heads = c.num_heads / world;
  p.kv_heads = c.num_kv_heads / world;
  p.inter = c.intermediate_size / world;
  p.vocab_parallel = world > 1 && c.vocab_size % world == 0;
  p.vocab = p.vocab_parallel ? c.vocab_size / world : c.vocab_size;
  p.vocab0 = p.vocab_parallel ? rank * p.vocab : 0;
  const int64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim, I = c.intermediate_size;
  const int64_t NH = c.num_heads, NKV = c.num_kv_heads;
  const int64_t qw = p.heads * hd, kw = p.kv_heads * hd, inter = p.inter;

  auto dest = [&](int layer, WeightRole role, size_t numel, bool matrix) {
    p.dests.push_back({layer, role, numel, matrix});
  };
  auto read = [&](std::string name, std::vector<int64_t> shape, Slice s, int layer, WeightRole role,
                  size_t off = 0) {
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
    p.reads.push_back(std::move(r));
  };
  const Slice all;
  const Slice q_rows{rank * qw, qw, 0, -1};
  const Slice kv_rows{rank * kw, kw, 0, -1};
  const Slice o_cols{0, -1, rank * qw, qw};
  const Slice mlp_rows{rank * inter, inter, 0, -1};
  const Slice down_cols{0, -1, rank * inter, inter};
  auto sz = [](int64_t a, int64_t b = 1) { return static_cast<size_t>(a * b); };

  dest(-1, WeightRole::embed, sz(V, H), true);
  read("model.embed_tokens.weight", {V, H}, all, -1, WeightRole::embed);
  dest(-1, WeightRole::final_norm, sz(H), false);
  read("model.norm.weight", {H}, all, -1, WeightRole::final_norm);
  if (!c.tie_word_embeddings) {
    dest(-1, WeightRole::lm_head, sz(p.vocab, H), true);
    read("lm_head.weight", {V, H}, Slice{p.vocab0, p.vocab, 0, -1}, -1, WeightRole::lm_head);
  }
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string pre = fmt::format("model.layers.{}.", l);
    dest(l, WeightRole::in_norm, sz(H), false);
    read(pre + "input_layernorm.weight", {H}, all, l, WeightRole::in_norm);
    dest(l, WeightRole::post_norm, sz(H), false);
    read(pre + "post_attention_layernorm.weight", {H}, all, l, WeightRole::post_norm);
    dest(l, WeightRole::wq, sz(qw, H), true);
    read(pre + "self_attn.q_proj.weight", {NH * hd, H}, q_rows, l, WeightRole::wq);
    dest(l, WeightRole::wk, sz(kw, H), true);
    read(pre + "self_attn.k_proj.weight", {NKV * hd, H}, kv_rows, l, WeightRole::wk);
    dest(l, WeightRole::wv, sz(kw, H), true);
    read(pre + "self_attn.v_proj.weight", {NKV * hd, H}, kv_rows, l, WeightRole::wv);
    dest(l, WeightRole::wo, sz(H, qw), true);
    read(pre + "self_attn.o_proj.weight", {H, NH * hd}, o_cols, l, WeightRole::wo);
    if (c.qkv_bias) {
      dest(l, WeightRole::bq, sz(qw), false);
      read(pre + "self_attn.q_proj.bias", {NH * hd}, q_rows, l, WeightRole::bq);
      dest(l, WeightRole::bk, sz(kw), false);
      read(pre + "self_attn.k_proj.bias", {NKV * hd}, kv_rows, l, WeightRole::bk);
      dest(l, WeightRole::bv, sz(kw), false);
      read(pre + "self_attn.v_proj.bias", {NKV * hd}, kv_rows, l, WeightRole::bv);
    }
    if (c.o_bias) {
      dest(l, WeightRole::bo, sz(H), false);
      read(pre + "self_attn.o_proj.bias", {H}, all, l, WeightRole::bo);
    }
    if (c.qk_norm) {
      dest(l, WeightRole::q_norm, sz(hd), false);
      read(pre + "self_attn.q_norm.weight", {hd}, all, l, WeightRole::q_norm);
      dest(l, WeightRole::k_norm, sz(hd), false);
      read(pre + "self_attn.k_norm.weight", {hd}, all, l, WeightRole::k_norm);
    }
    // gate and up fused into one [2*inter][hidden] matrix: one product, then SwiGLU reads
    // each row as [gate | up] (the layout of kernels/swiglu.h).
    dest(l, WeightRole::w_gate_up, sz(2 * inter, H), true);
    read(pre + "mlp.gate_proj.weight", {I, H}, mlp_rows, l, WeightRole::w_gate_up);
    read(pre + "mlp.up_proj.weight", {I, H}, mlp_rows, l, WeightRole::w_gate_up, sz(inter, H));
    dest(l, WeightRole::w_down, sz(H, inter), true);
    read(pre + "mlp.down_proj.weight", {H, I}, down_cols, l, WeightRole::w_down);
    if (c.mlp_bias) {
      dest(l, WeightRole::b_gate_up, sz(2 * inter), false);
      read(pre + "mlp.gate_proj.bias", {I}, mlp_rows, l, WeightRole::b_gate_up);
      read(pre + "mlp.up_proj.bias", {I}, mlp_rows, l, WeightRole::b_gate_up, sz(inter));
      dest(l, WeightRole::b_down, sz(H), false);
      read(pre + "mlp.down_proj.bias", {H}, all, l, WeightRole::b_down);
    }
  }
  return p;
}

}  // namespace spark::engine
