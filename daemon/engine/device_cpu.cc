// The CPU device: fp32 everywhere, matrix products on OpenBLAS, everything else through the
// reference twins in kernels/ (which accumulate in double where it matters).
#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <vector>

#include "daemon/engine/collective.h"
#include "daemon/engine/device.h"
#include "daemon/engine/model.h"
#include "daemon/engine/weight_format.h"
#include "kernels/bf16.h"
#include "kernels/fill.h"
#include "kernels/mla.h"
#include "kernels/moe.h"
#include "kernels/paged_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/sampler.h"
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

float* f32(const Buffer& b) {
  return b.as<float>();
}
const float* f32_or_null(const Buffer& b) {
  return b.empty() ? nullptr : b.as<float>();
}

Status need_f32(const Buffer& b, const char* what) {
  if (b.type() != ElemType::f32)
    return make_error(Errc::internal, fmt::format("cpu device: {} is {}, the CPU computes in fp32",
                                                  what, elem_name(b.type())));
  return Status::Ok();
}

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(bool sampling) : sampling_(sampling) {
    info_.kind = "cpu";
    info_.name = fmt::format("cpu (fp32, OpenBLAS {} threads)", openblas_get_num_threads());
  }
  const DeviceInfo& info() const override { return info_; }
  ElemType compute_type() const override { return ElemType::f32; }
  bool keeps_fp8() const override { return true; }
  bool keeps_mxfp4() const override { return true; }

  Result<Buffer> alloc(ElemType type, size_t numel) override {
    const size_t bytes = std::max<size_t>(elem_bytes(type, numel), 1);
    void* p = std::malloc(bytes);
    if (!p)
      return make_error(Errc::resource,
                        fmt::format("cpu device: cannot allocate {} MiB", bytes >> 20));
    return Buffer(std::shared_ptr<void>(p, std::free), p, numel, type);
  }

  Status upload(const Buffer& dst, const void* src, DType src_type) override {
    const size_t n = dst.numel();
    if ((dst.type() == ElemType::fp8_e4m3 && src_type == DType::f8_e4m3) ||
        ((dst.type() == ElemType::mxfp4_e2m1 || dst.type() == ElemType::u8) &&
         src_type == DType::u8)) {
      std::memcpy(dst.data(), src, dst.bytes());
      return Status::Ok();
    }
    if (dst.type() == ElemType::f32) {
      float* out = f32(dst);
      switch (src_type) {
        case DType::f32:
          std::memcpy(out, src, n * 4);
          return Status::Ok();
        case DType::bf16: {
          const auto* s = static_cast<const uint16_t*>(src);
          for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(s[i]);
          return Status::Ok();
        }
        case DType::f16: {
          const auto* s = static_cast<const uint16_t*>(src);
          for (size_t i = 0; i < n; ++i) out[i] = f16_to_float(s[i]);
          return Status::Ok();
        }
        default:
          break;
      }
    }
    return make_error(Errc::unsupported, fmt::format("cpu device: cannot load {} into {}",
                                                     dtype_name(src_type), elem_name(dst.type())));
  }

  Result<Buffer> host_staging(size_t bytes) override {
    auto b = alloc(ElemType::f32, (bytes + 3) / 4);
    if (!b) return b.error();
    return *b;
  }

  size_t preferred_staging_bytes() const override { return 4u << 20; }

  Status zero(const Buffer& dst) override {
    if (dst.bytes()) std::memset(dst.data(), 0, dst.bytes());
    return Status::Ok();
  }

  Status copy_to_host(const Buffer& src, void* dst, size_t bytes) override {
    std::memcpy(dst, src.data(), std::min(bytes, src.bytes()));
    return Status::Ok();
  }

  Status fill_random(const Buffer& dst, uint64_t seed, float scale, float offset) override {
    SPARK_TRY(need_f32(dst, "a random fill"));
    kernels::fill_random_ref(dst.data(), kernels::DType::f32, dst.numel(), seed, scale, offset);
    return Status::Ok();
  }

  Status to_host(const Buffer& src, float* dst, size_t n) override {
    SPARK_TRY(need_f32(src, "to_host"));
    std::memcpy(dst, src.data(), std::min(n, src.numel()) * sizeof(float));
    return Status::Ok();
  }

  Result<uint64_t> available_bytes() override { return host_mem_available(); }

  Status begin_step(const StepLayout& step) override {
    step_ = step;
    return Status::Ok();
  }

  Status embed(const Buffer& table, const Buffer& x, int dim) override {
    const size_t H = static_cast<size_t>(dim);
    for (size_t t = 0; t < step_.tokens.size(); ++t)
      std::memcpy(f32(x) + t * H, f32(table) + static_cast<size_t>(step_.tokens[t]) * H,
                  H * sizeof(float));
    return Status::Ok();
  }

  Status rmsnorm(const Buffer& x, const Buffer& w, const Buffer& y, int rows, int dim,
                 float eps) override {
    kernels::rmsnorm_ref(f32(x), f32(w), f32(y), static_cast<size_t>(rows),
                         static_cast<size_t>(dim), eps);
    return Status::Ok();
  }

  Status add_rmsnorm(const Buffer& x, const Buffer& delta, const Buffer& bias, const Buffer& w,
                     const Buffer& y, int rows, int dim, float eps) override {
    const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(dim);
    float* xs = f32(x);
    const float* b = f32_or_null(bias);
    if (!delta.empty()) {
      const float* d = f32(delta);
      for (size_t i = 0; i < n; ++i) xs[i] += d[i] + (b ? b[i % static_cast<size_t>(dim)] : 0.0f);
    } else if (b) {
      for (size_t i = 0; i < n; ++i) xs[i] += b[i % static_cast<size_t>(dim)];
    }
    if (!w.empty()) return rmsnorm(x, w, y, rows, dim, eps);
    return Status::Ok();
  }

  Status linear(const Buffer& x, const Buffer& w, const Buffer& b, const Buffer& y, int rows,
                int in, int out) override {
    auto wf = weights_f32(w, static_cast<size_t>(out), static_cast<size_t>(in), &wide_);
    if (!wf) return wf.error();
    engine::linear(f32(x), *wf, f32_or_null(b), f32(y), rows, in, out);
    return Status::Ok();
  }

  Status rope_qk(const Buffer& q, const Buffer& k, int heads, int kv_heads, int head_dim,
                 const Buffer& inv_freq, const Buffer& q_norm, const Buffer& k_norm,
                 float eps) override {
    const size_t T = step_.tokens.size(), hd = static_cast<size_t>(head_dim);
    if (!q_norm.empty())
      kernels::rmsnorm_ref(f32(q), f32(q_norm), f32(q), T * static_cast<size_t>(heads), hd, eps);
    if (!k_norm.empty())
      kernels::rmsnorm_ref(f32(k), f32(k_norm), f32(k), T * static_cast<size_t>(kv_heads), hd, eps);
    const int rot = static_cast<int>(inv_freq.numel()) * 2;  // partial rotary: fewer pairs
    kernels::rope_apply_ref(f32(q), T, heads, head_dim, step_.positions.data(), f32(inv_freq), rot);
    kernels::rope_apply_ref(f32(k), T, kv_heads, head_dim, step_.positions.data(), f32(inv_freq),
                            rot);
    return Status::Ok();
  }

  Status kv_write(const KVLayerView& kv, const Buffer& k, const Buffer& v) override {
    SPARK_TRY(host_f32_kv(kv));
    const size_t kw = static_cast<size_t>(kv.n_kv_heads) * static_cast<size_t>(kv.head_dim);
    // By slot: a windowed layer's own pool has its own; -1 (a token whose shared blocks hold
    // its K/V already) is skipped.
    const auto& slots = kv.windowed ? step_.window_slots : step_.slots;
    if (slots.size() != step_.tokens.size())
      return make_error(Errc::internal,
                        fmt::format("cpu device: {} {}slots for a step of {} tokens", slots.size(),
                                    kv.windowed ? "window " : "", step_.tokens.size()));
    // KV_DTYPE=fp8: each value rounded to e4m3 as the GPU stores it, kept in the fp32 pool.
    kernels::paged_kv_write_slots_ref(paged(kv), slots.data(), slots.size(), f32(k), kw, f32(v), kw,
                                      kv.fp8_values ? kernels::DType::e4m3 : kernels::DType::f32);
    return Status::Ok();
  }

  Status attention(const KVLayerView& kv, const Buffer& q, const Buffer& out, int heads,
                   float scale, int window) override {
    return attention_sinks(kv, q, out, heads, scale, window, Buffer());
  }

  Status attention_sinks(const KVLayerView& kv, const Buffer& q, const Buffer& out, int heads,
                         float scale, int window, const Buffer& sinks) override {
    SPARK_TRY(host_f32_kv(kv));
    const auto p = paged(kv);
    const size_t qw = static_cast<size_t>(heads) * static_cast<size_t>(kv.head_dim);
    for (int c = 0; c < step_.chunks_n(); ++c) {
      const size_t t0 = static_cast<size_t>(step_.chunk_begin[static_cast<size_t>(c)]);
      const size_t n = static_cast<size_t>(step_.chunk_begin[static_cast<size_t>(c) + 1]) - t0;
      kernels::paged_attention_ref(p, table(c, kv.windowed), step_.positions.data() + t0, n, heads,
                                   f32(q) + t0 * qw, f32(out) + t0 * qw, scale, window,
                                   sinks.empty() ? nullptr : sinks.as<float>());
    }
    return Status::Ok();
  }

  Status mla_attention(const KVLayerView& kv, const Buffer& q, const Buffer& kv_a,
                       const Buffer& kv_norm, const Buffer& kv_b, const Buffer& inv_freq,
                       const Buffer& out, const MlaArgs& a) override {
    SPARK_TRY(host_f32_kv(kv));
    if (kv.v != nullptr || kv.n_kv_heads != 1 || kv.head_dim != a.latent + a.rope)
      return make_error(
          Errc::internal,
          fmt::format("cpu device: latent attention needs a latent cache of rows "
                      "of {} (got {} x {}{})",
                      a.latent + a.rope, kv.n_kv_heads, kv.head_dim, kv.v ? " with a V pool" : ""));
    if (static_cast<int>(inv_freq.numel()) * 2 != a.rope)
      return make_error(Errc::internal,
                        fmt::format("cpu device: {} RoPE frequencies for qk_rope_head_dim {}",
                                    inv_freq.numel(), a.rope));
    const auto p = paged(kv);
    const kernels::MlaShape s = mla_shape(a);
    const size_t W = static_cast<size_t>(a.latent + a.rope);
    const size_t qw = static_cast<size_t>(a.heads) * static_cast<size_t>(a.nope + a.rope);
    const size_t ow = static_cast<size_t>(a.heads) * static_cast<size_t>(a.v_dim);
    // Every chunk's rows are written before any attends: a chunk reads only its own.
    for (int c = 0; c < step_.chunks_n(); ++c) {
      const size_t t0 = static_cast<size_t>(step_.chunk_begin[static_cast<size_t>(c)]);
      const size_t n = static_cast<size_t>(step_.chunk_begin[static_cast<size_t>(c) + 1]) - t0;
      kernels::mla_kv_write_ref(p, table(c), step_.positions.data() + t0, n, f32(kv_a) + t0 * W,
                                f32(kv_norm), a.eps, f32(inv_freq), s);
    }
    for (int c = 0; c < step_.chunks_n(); ++c) {
      const size_t t0 = static_cast<size_t>(step_.chunk_begin[static_cast<size_t>(c)]);
      const size_t n = static_cast<size_t>(step_.chunk_begin[static_cast<size_t>(c) + 1]) - t0;
      kernels::mla_attention_ref(p, table(c), step_.positions.data() + t0, n, f32(q) + t0 * qw,
                                 f32(kv_b), f32(inv_freq), f32(out) + t0 * ow, s);
    }
    return Status::Ok();
  }

  Status swiglu(const Buffer& gate_up, const Buffer& y, int rows, int dim) override {
    kernels::swiglu_ref(f32(gate_up), f32(y), static_cast<size_t>(rows), static_cast<size_t>(dim));
    return Status::Ok();
  }

  Status moe_route(const Buffer& logits, const Buffer& bias, const MoeRoute& r, const Buffer& ids,
                   const Buffer& weights, int rows, float* margin) override {
    kernels::MoeRouteArgs a;
    a.experts = r.experts;
    a.top_k = r.top_k;
    a.sigmoid = r.sigmoid;
    a.norm_topk = r.norm_topk;
    a.n_group = r.n_group;
    a.topk_group = r.topk_group;
    a.scaling = r.scaling;
    SPARK_TRY(kernels::moe_route_check(a));
    SPARK_TRY(need_f32(logits, "the router logits"));
    kernels::moe_route_ref(f32(logits), f32_or_null(bias), a, static_cast<size_t>(rows),
                           ids.as<int32_t>(), f32(weights), margin);
    return Status::Ok();
  }

  // Each held expert's rows are gathered and multiplied as one product (OpenBLAS), in
  // ascending expert order as transformers sums them; then the shared experts.
  Status moe_experts(const Buffer& x, const Buffer& ids, const Buffer& weights, const MoeExperts& e,
                     const Buffer& out, int rows) override {
    const size_t H = static_cast<size_t>(e.hidden), I = static_cast<size_t>(e.inter);
    const size_t R = static_cast<size_t>(rows), K = static_cast<size_t>(e.top_k);
    // The sum in its own buffer, then into out (which may be the residual stream).
    sum_.assign(R * H, 0.0f);
    float* o = sum_.data();
    const int32_t* id = ids.as<int32_t>();
    const float* w = f32(weights);
    std::vector<int> who;
    std::vector<float> wt;
    for (int le = 0; le < e.experts; ++le) {
      const int32_t ex = e.expert0 + le;
      who.clear();
      wt.clear();
      for (size_t r = 0; r < R; ++r)
        for (size_t j = 0; j < K; ++j)
          if (id[r * K + j] == ex) {
            who.push_back(static_cast<int>(r));
            wt.push_back(w[r * K + j]);
          }
      if (who.empty()) continue;
      const int n = static_cast<int>(who.size());
      gather_.resize(static_cast<size_t>(n) * H);
      for (int i = 0; i < n; ++i)
        std::memcpy(gather_.data() + static_cast<size_t>(i) * H,
                    f32(x) + static_cast<size_t>(who[static_cast<size_t>(i)]) * H, H * 4);
      auto gu = weights_f32(e.gate_up->view(static_cast<size_t>(le) * 2 * I * H, 2 * I * H), 2 * I,
                            H, &wide_);
      if (!gu) return gu.error();
      auto dn = weights_f32(e.down->view(static_cast<size_t>(le) * H * I, H * I), H, I, &wide2_);
      if (!dn) return dn.error();
      if (e.plain()) {
        SPARK_TRY(mlp(gather_.data(), *gu, *dn, n, e.hidden, e.inter));
      } else {
        const bool gb = e.gate_up_bias && !e.gate_up_bias->empty();
        const bool db = e.down_bias && !e.down_bias->empty();
        mlp_gptoss(gather_.data(), *gu,
                   gb ? f32(*e.gate_up_bias) + static_cast<size_t>(le) * 2 * I : nullptr, *dn,
                   db ? f32(*e.down_bias) + static_cast<size_t>(le) * H : nullptr, n, e);
      }
      for (int i = 0; i < n; ++i) {
        float* dst = o + static_cast<size_t>(who[static_cast<size_t>(i)]) * H;
        const float* y = y_.data() + static_cast<size_t>(i) * H;
        const float s = wt[static_cast<size_t>(i)];
        for (size_t c = 0; c < H; ++c) dst[c] += s * y[c];
      }
    }
    if (e.shared_inter > 0) {
      const size_t S = static_cast<size_t>(e.shared_inter);
      auto gu = weights_f32(*e.shared_gate_up, 2 * S, H, &wide_);
      if (!gu) return gu.error();
      auto dn = weights_f32(*e.shared_down, H, S, &wide2_);
      if (!dn) return dn.error();
      SPARK_TRY(mlp(f32(x), *gu, *dn, rows, e.hidden, e.shared_inter));
      for (size_t i = 0; i < R * H; ++i) o[i] += y_[i];
    }
    float* dst = f32(out);
    for (size_t i = 0; i < R * H; ++i) dst[i] = e.accumulate ? dst[i] + o[i] : o[i];
    return Status::Ok();
  }

  Status rmsnorm_across(Collective& comm, const Buffer& x, const Buffer& w, int rows, int dim,
                        int total_dim, float eps) override {
    const size_t D = static_cast<size_t>(dim);
    std::vector<float> ss(static_cast<size_t>(rows));
    float* xs = f32(x);
    for (size_t r = 0; r < ss.size(); ++r) {
      double s = 0;
      for (size_t i = 0; i < D; ++i) s += static_cast<double>(xs[r * D + i]) * xs[r * D + i];
      ss[r] = static_cast<float>(s);
    }
    if (comm.world_size() > 1) SPARK_TRY(comm.all_reduce_sum(ss.data(), ss.size()));
    const float* wv = f32(w);
    for (size_t r = 0; r < ss.size(); ++r) {
      const double inv = 1.0 / std::sqrt(static_cast<double>(ss[r]) / total_dim + eps);
      for (size_t i = 0; i < D; ++i)
        xs[r * D + i] = static_cast<float>(xs[r * D + i] * inv) * wv[i];
    }
    return Status::Ok();
  }

  Status gather_logit_rows(const Buffer& x, const Buffer& y, int dim) override {
    const size_t H = static_cast<size_t>(dim);
    for (size_t r = 0; r < step_.logit_rows.size(); ++r)
      std::memcpy(f32(y) + r * H, f32(x) + static_cast<size_t>(step_.logit_rows[r]) * H,
                  H * sizeof(float));
    return Status::Ok();
  }

  Status all_reduce(Collective& comm, const Buffer& x) override {
    return comm.all_reduce_sum(f32(x), x.numel());
  }

  Status all_gather_columns(Collective& comm, const Buffer& local, const Buffer& scratch,
                            const Buffer& out, int rows, int cols) override {
    const size_t C = static_cast<size_t>(cols), R = static_cast<size_t>(rows);
    const size_t W = static_cast<size_t>(comm.world_size());
    if (rows == 1) return comm.all_gather(f32(local), f32(out), C * 4);
    SPARK_TRY(comm.all_gather(f32(local), f32(scratch), R * C * 4));
    const float* g = f32(scratch);
    float* o = f32(out);
    for (size_t w = 0; w < W; ++w)
      for (size_t r = 0; r < R; ++r) std::memcpy(o + r * W * C + w * C, g + (w * R + r) * C, C * 4);
    return Status::Ok();
  }

  Status synchronize() override { return Status::Ok(); }

  bool samples_on_device() const override { return sampling_; }
  bool queues_steps() const override { return sampling_; }

  // The draws are made at once (the CPU computes in order); queueing keeps them until read.
  Status sample_queue(const Buffer& logits, int vocab,
                      const std::vector<kernels::SampleParams>& params,
                      const std::vector<PenaltyHistory>& history) override {
    if (!sampling_) return Device::sample_queue(logits, vocab, params, history);
    SPARK_TRY(need_f32(logits, "the logits"));
    if (queued_.size() >= 2)
      return make_error(Errc::internal, "cpu device: two draws are queued already");
    const size_t V = static_cast<size_t>(vocab);
    if (logits.numel() < params.size() * V)
      return make_error(Errc::internal, "cpu device: fewer logit rows than sampling parameters");
    std::vector<kernels::SampleResult> res(params.size());
    std::vector<uint8_t> seen(V, 0);
    std::vector<int32_t> counts(V, 0);
    for (size_t r = 0; r < params.size(); ++r) {
      std::fill(seen.begin(), seen.end(), 0);
      std::fill(counts.begin(), counts.end(), 0);
      if (r < history.size() && history[r].n > 0)
        kernels::sample_state_build_ref(seen.data(), counts.data(), vocab, history[r].tokens,
                                        history[r].n, history[r].out_start);
      res[r] = kernels::sample_ref(f32(logits) + r * V, vocab, params[r], seen.data(),
                                   counts.data(), r < history.size() ? history[r].mask : nullptr);
    }
    queued_.push_back(std::move(res));
    last_drawn_ = queued_.back();
    return Status::Ok();
  }

  Status sample_wait(std::vector<kernels::SampleResult>* out) override {
    if (!sampling_) return Device::sample_wait(out);
    if (queued_.empty()) return make_error(Errc::internal, "cpu device: no draws are queued");
    *out = std::move(queued_.front());
    queued_.pop_front();
    return Status::Ok();
  }

  Status feed_drawn_tokens(int n) override {
    if (!sampling_) return Device::feed_drawn_tokens(n);
    if (n < 0 || static_cast<size_t>(n) > last_drawn_.size() ||
        static_cast<size_t>(n) > step_.tokens.size())
      return make_error(Errc::internal,
                        fmt::format("cpu device: {} tokens to feed, {} drawn, a step of {}", n,
                                    last_drawn_.size(), step_.tokens.size()));
    for (int i = 0; i < n; ++i)
      step_.tokens[static_cast<size_t>(i)] = last_drawn_[static_cast<size_t>(i)].token;
    return Status::Ok();
  }

 private:
  static Status host_f32_kv(const KVLayerView& kv) {
    if (kv.type != ElemType::f32)
      return make_error(Errc::internal,
                        fmt::format("cpu device: the KV cache is {}, the CPU needs fp32 pools",
                                    elem_name(kv.type)));
    return Status::Ok();
  }
  static kernels::PagedKVLayer paged(const KVLayerView& kv) {
    kernels::PagedKVLayer p;
    p.k = static_cast<float*>(kv.k);
    p.v = static_cast<float*>(kv.v);
    p.block_size = kv.block_size;
    p.n_kv_heads = kv.n_kv_heads;
    p.head_dim = kv.head_dim;
    return p;
  }
  const int32_t* table(int c, bool windowed = false) const {
    return (windowed ? step_.window_tables : step_.block_tables).data() +
           static_cast<size_t>(c) * static_cast<size_t>(step_.table_width);
  }

  // y_[n][hidden] = down(swiglu(gate_up(x))) for n rows of x (a gated SiLU MLP).
  Status mlp(const float* x, const float* gu, const float* dn, int n, int hidden, int inter) {
    const size_t N = static_cast<size_t>(n), I = static_cast<size_t>(inter);
    gu_.resize(N * 2 * I);
    act_.resize(N * I);
    y_.resize(N * static_cast<size_t>(hidden));
    engine::linear(x, gu, nullptr, gu_.data(), n, hidden, 2 * inter);
    kernels::swiglu_ref(gu_.data(), act_.data(), N, I);
    engine::linear(act_.data(), dn, nullptr, y_.data(), n, inter, hidden);
    return Status::Ok();
  }

  // One gpt-oss expert over n gathered rows: [gate, up] interleaved (or not) with biases,
  // the clamped activation, the down product and its bias, into y_.
  void mlp_gptoss(const float* x, const float* gu, const float* gub, const float* dn,
                  const float* db, int n, const MoeExperts& e) {
    const size_t N = static_cast<size_t>(n), I = static_cast<size_t>(e.inter),
                 H = static_cast<size_t>(e.hidden);
    gu_.resize(N * 2 * I);
    act_.resize(N * I);
    y_.resize(N * H);
    engine::linear(x, gu, gub, gu_.data(), n, e.hidden, 2 * e.inter);
    for (size_t r = 0; r < N; ++r)
      for (size_t i = 0; i < I; ++i) {
        const float* row = gu_.data() + r * 2 * I;
        float g = e.interleaved ? row[2 * i] : row[i];
        float u = e.interleaved ? row[2 * i + 1] : row[I + i];
        float a;
        if (e.swiglu_limit > 0.f) {
          g = std::min(g, e.swiglu_limit);
          u = std::clamp(u, -e.swiglu_limit, e.swiglu_limit);
          a = (u + 1.f) * (g / (1.f + std::exp(-e.swiglu_alpha * g)));
        } else {
          a = u * (g / (1.f + std::exp(-g)));
        }
        act_[r * I + i] = a;
      }
    engine::linear(act_.data(), dn, db, y_.data(), n, e.inter, e.hidden);
  }

  // The weights of a product as floats: an fp32 matrix as it is; an FP8 or MXFP4 matrix
  // ([rows][cols] of whole rows, kept as stored) widened into `scratch` (exact: each value
  // times its block scale fits a float), one matrix at a time, so the sums are those of the
  // widened model's.
  static Result<const float*> weights_f32(const Buffer& w, size_t rows, size_t cols,
                                          std::vector<float>* scratch) {
    if (w.type() == ElemType::f32) return static_cast<const float*>(w.as<float>());
    if (w.type() == ElemType::mxfp4_e2m1) {  // MXFP4 experts: exact in float too
      auto m = mxfp4_weight(w);
      if (!m) return m.error();
      scratch->resize(rows * cols);
      if (!widen_mxfp4(m->blocks, static_cast<int64_t>(m->ldb), m->scales,
                       static_cast<int64_t>(m->lds), static_cast<int64_t>(rows), 0,
                       static_cast<int64_t>(cols), scratch->data()))
        return make_error(Errc::integrity, "an MXFP4 expert holds a NaN scale (0xff)");
      return static_cast<const float*>(scratch->data());
    }
    auto f = fp8_weight(w);
    if (!f) return f.error();
    static const std::vector<float> lut = [] {
      std::vector<float> t(256);
      for (int i = 0; i < 256; ++i)
        t[static_cast<size_t>(i)] = fp8_e4m3_to_float(static_cast<uint8_t>(i));
      return t;
    }();
    scratch->resize(rows * cols);
    for (size_t r = 0; r < rows; ++r) {
      const uint8_t* q = f->q + r * f->ldq;
      const float* sc = f->scales + (r >> f->row_shift) * f->scale_ld;
      float* o = scratch->data() + r * cols;
      for (size_t c = 0; c < cols; ++c) o[c] = lut[q[c]] * sc[c / kernels::kFp8BlockK];
    }
    return static_cast<const float*>(scratch->data());
  }

  DeviceInfo info_;
  StepLayout step_;
  std::vector<float> gather_, gu_, act_, y_, sum_;  // moe_experts' scratch
  std::vector<float> wide_, wide2_;                 // FP8 weights widened for a product
  bool sampling_ = false;
  std::deque<std::vector<kernels::SampleResult>> queued_;
  std::vector<kernels::SampleResult> last_drawn_;
};

}  // namespace

std::shared_ptr<Device> make_cpu_device() {
  return std::make_shared<CpuDevice>(false);
}

std::shared_ptr<Device> make_cpu_device_sampling() {
  return std::make_shared<CpuDevice>(true);
}

}  // namespace spark::engine
