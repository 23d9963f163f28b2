// The layer recipe over the device, composed of shared blocks: attention (grouped-query heads,
// biases, per-head or whole-projection q/k norms, partial rotary, a sliding window; or latent
// attention over a latent cache, DeepSeek-V3), a dense
// gated MLP, and a mixture-of-experts block (router, top-k experts, shared experts). Which
// block a layer runs is the config's (ModelConfig::moe's layer map); the families'
// files (family_*.cc) decide the config and the weights.
#include <fmt/format.h>

#include <cmath>

#include "daemon/engine/model.h"

namespace spark::engine {

namespace {
Buffer rows_of(const Buffer& b, int T, size_t width) {
  return b.view(0, static_cast<size_t>(T) * width);
}
}  // namespace

Status Model::residual_product(Collective& comm, int T, const Buffer& in, const Buffer& w,
                               const Buffer& b, int in_w, const Buffer& norm_w, bool folded,
                               Device::PreNorm* pre) {
  // The residual stream x: at one rank the product adds itself into it in its epilogue
  // (linear_add), so the norm after it needs no add and a device can normalise inside the
  // next product; across ranks the product's all-reduce comes first, and the norm's pass
  // adds the reduced sum (and the bias).
  Device& dev = *device_;
  const int H = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_eps);
  if (comm.world_size() == 1) {
    SPARK_TRY(dev.linear_add(in, w, b, sv_.o, sv_.x, T, in_w, H));
    *pre = {&sv_.x, &sv_.none, &sv_.none, &norm_w, &sv_.h, eps, folded};
    return Status::Ok();
  }
  SPARK_TRY(dev.linear(in, w, sv_.none, sv_.o, T, in_w, H));
  SPARK_TRY(dev.all_reduce(comm, sv_.o));
  *pre = {&sv_.x, &sv_.o, &b, &norm_w, &sv_.h, eps, folded};
  return Status::Ok();
}

Device::MlaArgs Model::mla_args() const {
  const auto& c = cfg_;
  const auto& m = c.mla;
  Device::MlaArgs a;
  a.heads = plan_.heads;
  a.nope = m.qk_nope;
  a.rope = m.qk_rope;
  a.v_dim = m.v_head_dim;
  a.latent = m.kv_lora_rank;
  a.interleave = m.rope_interleave;
  // YaRN scales cos and sin of the rotated part alone; mscale_all_dim scales the softmax.
  a.rope_factor = static_cast<float>(attn_factor_);
  a.eps = static_cast<float>(c.rms_eps);
  a.scale = static_cast<float>(mla_softmax_mscale_sq(c.rope) /
                               std::sqrt(static_cast<double>(m.qk_head_dim())));
  return a;
}

Status Model::mla_attention_block(int l, KVCache& cache, Collective& comm, int T,
                                  Device::PreNorm* pre) {
  const auto& c = cfg_;
  const auto& m = c.mla;
  Device& dev = *device_;
  const auto& L = layers_[static_cast<size_t>(l)];
  const int H = c.hidden_size, nh = plan_.heads, qk = m.qk_head_dim();
  const float eps = static_cast<float>(c.rms_eps);
  // The normalised row feeds q (through the LoRA pair, or q_proj) and kv_a.
  SPARK_TRY(dev.pre_norm(*pre, T, H));
  const Buffer& h = *pre->normed;
  if (m.q_lora_rank > 0) {
    const int qr = m.q_lora_rank;
    // q_a's rows, then their norm beside them (the CUDA norm refuses to write over its input).
    const size_t n = static_cast<size_t>(T) * static_cast<size_t>(qr);
    const Buffer qa = mla_qa_.view(0, n), qn = mla_qa_.view(n, n);
    SPARK_TRY(dev.linear(h, L.wq_a, sv_.none, qa, T, H, qr));
    SPARK_TRY(dev.rmsnorm(qa, L.q_a_norm, qn, T, qr, eps));
    SPARK_TRY(dev.linear(qn, L.wq, sv_.none, sv_.q, T, qr, nh * qk));
  } else {
    SPARK_TRY(dev.linear(h, L.wq, sv_.none, sv_.q, T, H, nh * qk));
  }
  const Buffer kv_a = rows_of(mla_kv_, T, static_cast<size_t>(m.cache_width()));
  SPARK_TRY(dev.linear(h, L.wkv_a, sv_.none, kv_a, T, H, m.cache_width()));
  SPARK_TRY(dev.mla_attention(cache.view(l), sv_.q, kv_a, L.kv_a_norm, L.wkv_b, inv_freq_dev_,
                              sv_.att, mla_args()));
  return residual_product(comm, T, sv_.att, L.wo, sv_.none, nh * m.v_head_dim, L.post_norm,
                          L.post_folded, pre);
}

Status Model::attention_block(int l, KVCache& cache, Collective& comm, int T,
                              Device::PreNorm* pre) {
  if (cfg_.is_mla()) return mla_attention_block(l, cache, comm, T, pre);
  const auto& c = cfg_;
  Device& dev = *device_;
  const auto& L = layers_[static_cast<size_t>(l)];
  const int H = c.hidden_size, hd = c.head_dim;
  const int nh = plan_.heads, nkv = plan_.kv_heads;
  const int qw = nh * hd, kw = nkv * hd;
  const float eps = static_cast<float>(c.rms_eps);
  // YaRN scales cos and sin by its attention factor: every q.k by its square.
  const float scale = static_cast<float>(attn_factor_sq_ / std::sqrt(static_cast<double>(hd)));
  const Device::LinearPart qkv[] = {
      {&L.wq, &L.bq, &sv_.q, qw}, {&L.wk, &L.bk, &sv_.k, kw}, {&L.wv, &L.bv, &sv_.v, kw}};
  const KVLayerView kv = cache.view(l);
  if (c.qk_norm == QkNorm::per_layer) {
    // The norm spans every head of the projection: the ranks' sums of squares meet first.
    SPARK_TRY(dev.pre_norm(*pre, T, H));
    SPARK_TRY(dev.linear_group(*pre->normed, qkv, 3, T, H));
    SPARK_TRY(dev.rmsnorm_across(comm, sv_.q, L.q_norm, T, qw, c.num_heads * hd, eps));
    SPARK_TRY(dev.rmsnorm_across(comm, sv_.k, L.k_norm, T, kw, c.num_kv_heads * hd, eps));
    SPARK_TRY(dev.rope_kv_write(sv_.q, sv_.k, sv_.v, nh, nkv, hd, inv_freq_dev_, sv_.none, sv_.none,
                                eps, kv));
  } else {
    SPARK_TRY(dev.linear_group_rope_kv_write(*pre, qkv, T, H, nh, nkv, hd, inv_freq_dev_, L.q_norm,
                                             L.k_norm, eps, kv));
  }
  if (c.attn_sinks)
    SPARK_TRY(dev.attention_sinks(kv, sv_.q, sv_.att, nh, scale, c.window_of(l), L.sinks));
  else
    SPARK_TRY(dev.attention(kv, sv_.q, sv_.att, nh, scale, c.window_of(l)));
  return residual_product(comm, T, sv_.att, L.wo, L.bo, qw, L.post_norm, L.post_folded, pre);
}

Status Model::mlp_block(int l, Collective& comm, int T, const Buffer& next_norm, bool next_folded,
                        Device::PreNorm* pre) {
  const auto& L = layers_[static_cast<size_t>(l)];
  const int H = cfg_.hidden_size, inter = plan_.inter;
  SPARK_TRY(device_->linear_swiglu(*pre, L.w_gate_up, L.b_gate_up, sv_.gu, sv_.act, T, H, inter));
  return residual_product(comm, T, sv_.act, L.w_down, L.b_down, inter, next_norm, next_folded, pre);
}

Status Model::moe_block(int l, Collective& comm, int T, const Buffer& next_norm, bool next_folded,
                        Device::PreNorm* pre) {
  const auto& c = cfg_;
  const auto& m = c.moe;
  Device& dev = *device_;
  const auto& L = layers_[static_cast<size_t>(l)];
  const int H = c.hidden_size, E = m.experts, K = m.top_k;
  // The normalised row feeds the router, every chosen expert and the shared experts.
  SPARK_TRY(dev.pre_norm(*pre, T, H));
  const Buffer& h = *pre->normed;
  const Buffer logits = rows_of(router_logits_, T, static_cast<size_t>(E));
  const Buffer ids = rows_of(moe_ids_, T, static_cast<size_t>(K));
  const Buffer wts = rows_of(moe_weights_, T, static_cast<size_t>(K));
  SPARK_TRY(dev.linear(h, L.router, m.router_bias ? L.router_b : sv_.none, logits, T, H, E));
  Device::MoeRoute r;
  r.experts = E;
  r.top_k = K;
  r.sigmoid = m.score == RouterScore::sigmoid;
  r.norm_topk = m.norm_topk;
  r.n_group = m.n_group;
  r.topk_group = m.topk_group;
  r.scaling = static_cast<float>(m.routed_scaling);
  if (record_margins_) {
    std::vector<float> mg(static_cast<size_t>(2 * T));
    SPARK_TRY(dev.moe_route(logits, L.router_bias, r, ids, wts, T, mg.data()));
    for (int t = 0; t < T; ++t)
      margins_.push_back(
          {l, t, mg[static_cast<size_t>(2 * t)], mg[static_cast<size_t>(2 * t + 1)]});
  } else {
    SPARK_TRY(dev.moe_route(logits, L.router_bias, r, ids, wts, T));
  }
  if (route_recorder_) {
    std::vector<int32_t> host(static_cast<size_t>(T) * static_cast<size_t>(K));
    SPARK_TRY(dev.copy_to_host(ids, host.data(), host.size() * sizeof(int32_t)));
    route_recorder_(l, host.data(), T, K);
  }
  Device::MoeExperts e;
  e.gate_up = &L.experts_gate_up;
  e.down = &L.experts_down;
  e.expert0 = plan_.expert0;
  e.experts = plan_.experts;
  e.inter = plan_.expert_inter;
  e.hidden = H;
  e.top_k = K;
  e.shared_gate_up = &L.shared_gate_up;
  e.shared_down = &L.shared_down;
  e.shared_inter = plan_.shared_inter;
  e.gate_up_bias = &L.experts_gate_up_b;
  e.down_bias = &L.experts_down_b;
  e.interleaved = m.interleaved;
  e.swiglu_limit = m.swiglu_limit;
  e.swiglu_alpha = m.swiglu_alpha;
  const float eps = static_cast<float>(c.rms_eps);
  if (comm.world_size() == 1) {  // added into the residual stream by the expert products
    e.accumulate = true;
    SPARK_TRY(dev.moe_experts(h, ids, wts, e, sv_.x, T));
    *pre = {&sv_.x, &sv_.none, &sv_.none, &next_norm, &sv_.h, eps, next_folded};
    return Status::Ok();
  }
  SPARK_TRY(dev.moe_experts(h, ids, wts, e, sv_.o, T));
  SPARK_TRY(dev.all_reduce(comm, sv_.o));
  *pre = {&sv_.x, &sv_.o, &sv_.none, &next_norm, &sv_.h, eps, next_folded};
  return Status::Ok();
}

Status Model::run_layers(const StepLayout& st, KVCache& cache, Collective& comm, bool want) {
  const auto& c = cfg_;
  Device& dev = *device_;
  const int H = c.hidden_size, hd = c.head_dim, V = c.vocab_size;
  const int T = st.tokens_n();
  const size_t qw = static_cast<size_t>(plan_.heads * hd),
               kw = static_cast<size_t>(plan_.kv_heads * hd);
  const size_t Hz = static_cast<size_t>(H), inter = static_cast<size_t>(plan_.inter);
  sv_.x = rows_of(x_, T, Hz);
  sv_.h = rows_of(h_, T, Hz);
  sv_.o = rows_of(o_, T, Hz);
  sv_.q = rows_of(q_, T, qw);
  sv_.att = rows_of(att_, T, c.is_mla() ? static_cast<size_t>(plan_.heads * c.mla.v_head_dim) : qw);
  sv_.k = rows_of(k_, T, kw);
  sv_.v = rows_of(v_, T, kw);
  sv_.gu = rows_of(gate_up_, T, 2 * inter);
  sv_.act = rows_of(act_, T, inter);
  if (record_margins_) margins_.clear();

  SPARK_TRY(dev.embed(embed_, sv_.x, H));
  Device::PreNorm pre{&sv_.x,       &sv_.none,
                      &sv_.none,    &layers_[0].in_norm,
                      &sv_.h,       static_cast<float>(c.rms_eps),
                      norms_folded_};
  for (int l = 0; l < c.num_layers; ++l) {
    SPARK_TRY(attention_block(l, cache, comm, T, &pre));
    // After the last layer, the final norm.
    const bool last = l + 1 == c.num_layers;
    const Buffer& next = last ? final_norm_ : layers_[static_cast<size_t>(l) + 1].in_norm;
    const bool next_folded = !last && norms_folded_;
    if (c.moe.is_moe(l))
      SPARK_TRY(moe_block(l, comm, T, next, next_folded, &pre));
    else
      SPARK_TRY(mlp_block(l, comm, T, next, next_folded, &pre));
  }
  SPARK_TRY(dev.pre_norm(pre, T, H));
  if (!want) return Status::Ok();  // a worker beside a replicated lm_head: rank 0 samples
  const int R = static_cast<int>(st.logit_rows.size());
  if (R == 0) return Status::Ok();
  const size_t Rz = static_cast<size_t>(R);
  const Buffer sel = sel_.view(0, Rz * Hz), lg = logits_.view(0, Rz * static_cast<size_t>(V));
  SPARK_TRY(dev.gather_logit_rows(sv_.h, sel, H));
  if (!plan_.vocab_parallel) return dev.linear(sel, head_, sv_.none, lg, R, H, V);
  const int Vs = plan_.vocab;
  const Buffer mine = logits_local_.view(0, Rz * static_cast<size_t>(Vs));
  SPARK_TRY(dev.linear(sel, head_, sv_.none, mine, R, H, Vs));
  return dev.all_gather_columns(comm, mine, gathered_.view(0, Rz * static_cast<size_t>(V)), lg, R,
                                Vs);
}

}  // namespace spark::engine
