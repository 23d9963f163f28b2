#include "daemon/engine/model.h"

#include <cblas.h>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>

#include "core/log.h"
#include "daemon/engine/checkpoint.h"
#include "kernels/paged_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace spark::engine {

void set_blas_threads(int n) {
  openblas_set_num_threads(n);
}

void linear(const float* x, const float* w, const float* b, float* y, int rows, int in, int out) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out, in, 1.0f, x, in, w, in, 0.0f, y,
              out);
  if (b)
    for (int r = 0; r < rows; ++r)
      for (int o = 0; o < out; ++o)
        y[static_cast<size_t>(r) * static_cast<size_t>(out) + static_cast<size_t>(o)] += b[o];
}

namespace {

// MemAvailable in bytes, 0 when /proc/meminfo cannot be read.
uint64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return kb << 10;
  }
  return 0;
}

}  // namespace

// The weights are read in two passes: the first (dry) only checks every tensor's shape
// against config.json and adds up what this rank will hold, so that a damaged
// config.json or checkpoint is refused, and a model that cannot fit is named, before
// anything is allocated; the second reads.
struct Model::LoadPass {
  bool dry = true;
  uint64_t bytes = 0;  // fp32 bytes this rank holds after the load
  const std::atomic<bool>* cancel = nullptr;
};

// Reads tensor `name` of full shape `shape` (slice `s`) into a new vector.
Status Model::read_into(LoadPass& pass, const Checkpoint& ck, const std::string& name,
                        const std::vector<int64_t>& shape, const Slice& s,
                        std::vector<float>* out) {
  if (pass.cancel && pass.cancel->load())
    return make_error(Errc::precondition, "loading stopped: sparkd is shutting down");
  const int64_t R = shape.empty() ? 1 : shape[0];
  int64_t C = 1;
  for (size_t i = 1; i < shape.size(); ++i) C *= shape[i];
  const int64_t rows = s.rows < 0 ? R - s.row0 : s.rows;
  const int64_t cols = s.cols < 0 ? C - s.col0 : s.cols;
  if (pass.dry) {
    const TensorInfo* t = ck.find(name);
    // Missing or of another shape: read() names it before it touches the destination.
    if (!t || t->shape != shape) return ck.read(name, shape, s, nullptr);
    pass.bytes += static_cast<uint64_t>(rows * cols) * sizeof(float);
    return Status::Ok();
  }
  out->assign(static_cast<size_t>(rows * cols), 0.0f);
  return ck.read(name, shape, s, out->data());
}

Result<std::unique_ptr<Model>> Model::load(const std::string& dir, int rank, int world,
                                           LoadReport* report) {
  auto cfg = load_model_config(dir);
  if (!cfg) return cfg.error();
  std::unique_ptr<Model> m(new Model());
  m->cfg_ = std::move(*cfg);
  m->rank_ = rank;
  m->world_ = world;
  const auto& c = m->cfg_;
  if (world < 1 || rank < 0 || rank >= world)
    return make_error(Errc::internal, fmt::format("rank {} of world {} is invalid", rank, world));
  if (c.num_heads % world || c.num_kv_heads % world || c.intermediate_size % world)
    return make_error(
        Errc::config,
        fmt::format(
            "{}: tensor parallel size {} must divide num_attention_heads ({}), num_key_value_heads "
            "({}) and intermediate_size ({}) — choose a TP size that divides them",
            dir, world, c.num_heads, c.num_kv_heads, c.intermediate_size));
  m->nh_ = c.num_heads / world;
  m->nkv_ = c.num_kv_heads / world;
  m->inter_ = c.intermediate_size / world;
  m->inv_freq_ = kernels::rope_inv_freq(c.head_dim, c.rope_theta, c.rope);
  SPARK_TRY(m->load_weights(dir, report));
  return m;
}

Status Model::load_weights(const std::string& dir, LoadReport* report) {
  const auto t0 = std::chrono::steady_clock::now();
  auto ck = Checkpoint::open(dir);
  if (!ck) return ck.error();
  LoadPass pass;
  pass.cancel = report ? report->cancel : nullptr;
  SPARK_TRY(load_pass(pass, *ck, dir));
  if (uint64_t avail = mem_available(); avail > 0 && pass.bytes > avail)
    return make_error(Errc::resource,
                      fmt::format("{}: rank {} would hold {} MiB of weights (fp32) but "
                                  "MemAvailable is {} MiB; use more ranks or a smaller model",
                                  dir, rank_, pass.bytes >> 20, avail >> 20));
  layers_.clear();
  pass.dry = false;
  SPARK_TRY(load_pass(pass, *ck, dir));
  ck->drop_page_cache();
  if (report) {
    report->bytes_read = ck->bytes_read();
    uint64_t n = embed_.size() + lm_head_.size() + final_norm_.size();
    for (const auto& L : layers_)
      for (const auto* v :
           {&L.in_norm, &L.post_norm, &L.q_norm, &L.k_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.bq,
            &L.bk, &L.bv, &L.bo, &L.w_gate_up, &L.w_down, &L.b_gate_up, &L.b_down})
        n += v->size();
    report->weight_bytes = n * sizeof(float);
    report->files = ck->files();
    report->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return Status::Ok();
}

Status Model::load_pass(LoadPass& pass, const Checkpoint& ckr, const std::string& dir) {
  const Checkpoint* ck = &ckr;
  auto read_into = [&](const Checkpoint& c, const std::string& name,
                       const std::vector<int64_t>& shape, const Slice& s, std::vector<float>* out) {
    return Model::read_into(pass, c, name, shape, s, out);
  };
  const auto& c = cfg_;
  const int64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim, I = c.intermediate_size;
  const int64_t NH = c.num_heads, NKV = c.num_kv_heads;
  const Slice all;
  SPARK_TRY(read_into(*ck, "model.embed_tokens.weight", {V, H}, all, &embed_));
  SPARK_TRY(read_into(*ck, "model.norm.weight", {H}, all, &final_norm_));
  if (!c.tie_word_embeddings) {
    if (!ck->find("lm_head.weight"))
      return make_error(
          Errc::integrity,
          fmt::format("{}: lm_head.weight is missing and tie_word_embeddings is false", dir));
    SPARK_TRY(read_into(*ck, "lm_head.weight", {V, H}, all, &lm_head_));
  }
  const Slice q_rows{rank_ * nh_ * hd, nh_ * hd, 0, -1};
  const Slice kv_rows{rank_ * nkv_ * hd, nkv_ * hd, 0, -1};
  const Slice o_cols{0, -1, rank_ * nh_ * hd, nh_ * hd};
  const Slice mlp_rows{rank_ * inter_, inter_, 0, -1};
  const Slice down_cols{0, -1, rank_ * inter_, inter_};
  layers_.resize(static_cast<size_t>(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    auto& L = layers_[static_cast<size_t>(l)];
    const std::string p = fmt::format("model.layers.{}.", l);
    SPARK_TRY(read_into(*ck, p + "input_layernorm.weight", {H}, all, &L.in_norm));
    SPARK_TRY(read_into(*ck, p + "post_attention_layernorm.weight", {H}, all, &L.post_norm));
    SPARK_TRY(read_into(*ck, p + "self_attn.q_proj.weight", {NH * hd, H}, q_rows, &L.wq));
    SPARK_TRY(read_into(*ck, p + "self_attn.k_proj.weight", {NKV * hd, H}, kv_rows, &L.wk));
    SPARK_TRY(read_into(*ck, p + "self_attn.v_proj.weight", {NKV * hd, H}, kv_rows, &L.wv));
    SPARK_TRY(read_into(*ck, p + "self_attn.o_proj.weight", {H, NH * hd}, o_cols, &L.wo));
    if (c.qkv_bias) {
      SPARK_TRY(read_into(*ck, p + "self_attn.q_proj.bias", {NH * hd}, q_rows, &L.bq));
      SPARK_TRY(read_into(*ck, p + "self_attn.k_proj.bias", {NKV * hd}, kv_rows, &L.bk));
      SPARK_TRY(read_into(*ck, p + "self_attn.v_proj.bias", {NKV * hd}, kv_rows, &L.bv));
    }
    if (c.o_bias) SPARK_TRY(read_into(*ck, p + "self_attn.o_proj.bias", {H}, all, &L.bo));
    if (c.qk_norm) {
      SPARK_TRY(read_into(*ck, p + "self_attn.q_norm.weight", {hd}, all, &L.q_norm));
      SPARK_TRY(read_into(*ck, p + "self_attn.k_norm.weight", {hd}, all, &L.k_norm));
    }
    // gate and up fused into one [2*inter][hidden] matrix: one product, then SwiGLU reads
    // each row as [gate | up] (the layout of kernels/swiglu.h).
    {
      std::vector<float> g, u;
      SPARK_TRY(read_into(*ck, p + "mlp.gate_proj.weight", {I, H}, mlp_rows, &g));
      SPARK_TRY(read_into(*ck, p + "mlp.up_proj.weight", {I, H}, mlp_rows, &u));
      L.w_gate_up = std::move(g);
      L.w_gate_up.insert(L.w_gate_up.end(), u.begin(), u.end());
    }
    SPARK_TRY(read_into(*ck, p + "mlp.down_proj.weight", {H, I}, down_cols, &L.w_down));
    if (c.mlp_bias) {
      std::vector<float> g, u;
      SPARK_TRY(read_into(*ck, p + "mlp.gate_proj.bias", {I}, mlp_rows, &g));
      SPARK_TRY(read_into(*ck, p + "mlp.up_proj.bias", {I}, mlp_rows, &u));
      L.b_gate_up = std::move(g);
      L.b_gate_up.insert(L.b_gate_up.end(), u.begin(), u.end());
      SPARK_TRY(read_into(*ck, p + "mlp.down_proj.bias", {H}, all, &L.b_down));
    }
  }
  return Status::Ok();
}

Status Model::forward(const std::vector<SeqChunk>& chunks, KVCache& cache, Collective& comm,
                      std::vector<float>* logits, bool all_logits) {
  const auto& c = cfg_;
  const int H = c.hidden_size, hd = c.head_dim, V = c.vocab_size;
  const float eps = static_cast<float>(c.rms_eps);
  size_t T = 0;
  for (const auto& ch : chunks) T += static_cast<size_t>(ch.n);
  if (T == 0) {
    if (logits) logits->clear();
    return Status::Ok();
  }
  const size_t qw = static_cast<size_t>(nh_ * hd), kw = static_cast<size_t>(nkv_ * hd);
  x_.resize(T * static_cast<size_t>(H));
  h_.resize(T * static_cast<size_t>(H));
  o_.resize(T * static_cast<size_t>(H));
  q_.resize(T * qw);
  att_.resize(T * qw);
  k_.resize(T * kw);
  v_.resize(T * kw);
  gate_up_.resize(T * 2 * static_cast<size_t>(inter_));
  act_.resize(T * static_cast<size_t>(inter_));
  pos_.resize(T);
  {
    size_t t = 0;
    for (const auto& ch : chunks) {
      for (int i = 0; i < ch.n; ++i, ++t) {
        const int32_t tok = ch.tokens[i];
        if (tok < 0 || tok >= V)
          return make_error(Errc::usage,
                            fmt::format("token id {} is outside the vocabulary [0, {})", tok, V));
        if (ch.start_pos + i >= c.max_position)
          return make_error(Errc::usage,
                            fmt::format("position {} is beyond max_position_embeddings {}",
                                        ch.start_pos + i, c.max_position));
        pos_[t] = ch.start_pos + i;
        std::copy(embed_.begin() + static_cast<ptrdiff_t>(tok) * H,
                  embed_.begin() + static_cast<ptrdiff_t>(tok + 1) * H,
                  x_.begin() + static_cast<ptrdiff_t>(t) * H);
      }
    }
  }
  const int Ti = static_cast<int>(T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int l = 0; l < c.num_layers; ++l) {
    const auto& L = layers_[static_cast<size_t>(l)];
    kernels::rmsnorm_ref(x_.data(), L.in_norm.data(), h_.data(), T, static_cast<size_t>(H), eps);
    linear(h_.data(), L.wq.data(), L.bq.empty() ? nullptr : L.bq.data(), q_.data(), Ti, H,
           static_cast<int>(qw));
    linear(h_.data(), L.wk.data(), L.bk.empty() ? nullptr : L.bk.data(), k_.data(), Ti, H,
           static_cast<int>(kw));
    linear(h_.data(), L.wv.data(), L.bv.empty() ? nullptr : L.bv.data(), v_.data(), Ti, H,
           static_cast<int>(kw));
    if (c.qk_norm) {
      kernels::rmsnorm_ref(q_.data(), L.q_norm.data(), q_.data(), T * static_cast<size_t>(nh_),
                           static_cast<size_t>(hd), eps);
      kernels::rmsnorm_ref(k_.data(), L.k_norm.data(), k_.data(), T * static_cast<size_t>(nkv_),
                           static_cast<size_t>(hd), eps);
    }
    kernels::rope_apply_ref(q_.data(), T, nh_, hd, pos_.data(), inv_freq_.data());
    kernels::rope_apply_ref(k_.data(), T, nkv_, hd, pos_.data(), inv_freq_.data());
    auto kv = cache.layer(l);
    size_t t = 0;
    for (const auto& ch : chunks) {
      const size_t n = static_cast<size_t>(ch.n);
      kernels::paged_kv_write_ref(kv, ch.block_table, pos_.data() + t, n, k_.data() + t * kw,
                                  v_.data() + t * kw);
      kernels::paged_attention_ref(kv, ch.block_table, pos_.data() + t, n, nh_, q_.data() + t * qw,
                                   att_.data() + t * qw, scale, c.sliding_window);
      t += n;
    }
    linear(att_.data(), L.wo.data(), nullptr, o_.data(), Ti, static_cast<int>(qw), H);
    SPARK_TRY(comm.all_reduce_sum(o_.data(), o_.size()));
    for (size_t i = 0; i < o_.size(); ++i)
      x_[i] += o_[i] + (L.bo.empty() ? 0.0f : L.bo[i % static_cast<size_t>(H)]);
    kernels::rmsnorm_ref(x_.data(), L.post_norm.data(), h_.data(), T, static_cast<size_t>(H), eps);
    linear(h_.data(), L.w_gate_up.data(), L.b_gate_up.empty() ? nullptr : L.b_gate_up.data(),
           gate_up_.data(), Ti, H, 2 * inter_);
    kernels::swiglu_ref(gate_up_.data(), act_.data(), T, static_cast<size_t>(inter_));
    linear(act_.data(), L.w_down.data(), nullptr, o_.data(), Ti, inter_, H);
    SPARK_TRY(comm.all_reduce_sum(o_.data(), o_.size()));
    for (size_t i = 0; i < o_.size(); ++i)
      x_[i] += o_[i] + (L.b_down.empty() ? 0.0f : L.b_down[i % static_cast<size_t>(H)]);
  }
  if (!logits) return Status::Ok();  // a tensor-parallel worker: rank 0 samples
  // Final norm and lm_head only for the rows whose logits are wanted.
  std::vector<size_t> rows;
  {
    size_t t = 0;
    for (const auto& ch : chunks) {
      if (all_logits) {
        for (int i = 0; i < ch.n; ++i) rows.push_back(t + static_cast<size_t>(i));
      } else if (ch.want_logits && ch.n > 0) {
        rows.push_back(t + static_cast<size_t>(ch.n) - 1);
      }
      t += static_cast<size_t>(ch.n);
    }
  }
  const size_t R = rows.size();
  std::vector<float> sel(R * static_cast<size_t>(H));
  for (size_t r = 0; r < R; ++r)
    kernels::rmsnorm_ref(x_.data() + rows[r] * static_cast<size_t>(H), final_norm_.data(),
                         sel.data() + r * static_cast<size_t>(H), 1, static_cast<size_t>(H), eps);
  logits->resize(R * static_cast<size_t>(V));
  if (R > 0)
    linear(sel.data(), lm_head_.empty() ? embed_.data() : lm_head_.data(), nullptr, logits->data(),
           static_cast<int>(R), H, V);
  return Status::Ok();
}

}  // namespace spark::engine
