#include "daemon/engine/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>

#include "core/log.h"
#include "core/strings.h"
#include "daemon/engine/checkpoint.h"
#include "kernels/fp8.h"
#include "kernels/rope.h"

namespace spark::engine {

Result<std::unique_ptr<Model>> Model::load(const std::string& dir, int rank, int world,
                                           LoadReport* report) {
  return load(dir, rank, world, make_cpu_device(), report);
}

Result<std::unique_ptr<Model>> Model::load(const std::string& dir, int rank, int world,
                                           std::shared_ptr<Device> device, LoadReport* report) {
  auto cfg = load_model_config(dir);
  if (!cfg) return cfg.error();
  std::unique_ptr<Model> m(new Model());
  m->cfg_ = std::move(*cfg);
  m->rank_ = rank;
  m->world_ = world;
  m->device_ = device ? std::move(device) : make_cpu_device();
  PlanOptions po;
  po.rank = rank;
  po.world = world;
  po.placement = report ? report->expert_placement : plan::MoeSplit::automatic;
  auto plan = make_shard_plan(m->cfg_, po, dir);
  if (!plan) return plan.error();
  m->plan_ = std::move(*plan);
  const auto& c = m->cfg_;
  const double af = hf::rope_attention_factor(c.rope);
  m->attn_factor_sq_ = af * af;
  m->attn_factor_ = af;
  // Partial rotary: the frequencies of the rotated dimensions only.
  m->inv_freq_ = kernels::rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope);
  auto inv = m->device_->alloc(ElemType::f32, m->inv_freq_.size());
  if (!inv) return inv.error();
  m->inv_freq_dev_ = *inv;
  SPARK_TRY(m->device_->upload(m->inv_freq_dev_, m->inv_freq_.data(), DType::f32));
  SPARK_TRY(m->load_weights(dir, report));
  const size_t H = static_cast<size_t>(m->cfg_.hidden_size);
  m->head_ = !m->lm_head_.empty() ? m->lm_head_
                                  : m->embed_.view(static_cast<size_t>(m->plan_.vocab0) * H,
                                                   static_cast<size_t>(m->plan_.vocab) * H);
  return m;
}

Result<std::unique_ptr<Model>> Model::synthetic(const ModelConfig& cfg, int rank, int world,
                                                std::shared_ptr<Device> device, uint64_t seed,
                                                LoadReport* report) {
  std::unique_ptr<Model> m(new Model());
  m->cfg_ = cfg;
  m->rank_ = rank;
  m->world_ = world;
  m->device_ = device ? std::move(device) : make_cpu_device();
  PlanOptions po;
  po.rank = rank;
  po.world = world;
  po.placement = report ? report->expert_placement : plan::MoeSplit::automatic;
  auto plan = make_shard_plan(cfg, po, "synthetic " + cfg.architecture);
  if (!plan) return plan.error();
  m->plan_ = std::move(*plan);
  const double af = hf::rope_attention_factor(cfg.rope);
  m->attn_factor_sq_ = af * af;
  m->attn_factor_ = af;
  m->inv_freq_ = kernels::rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope);
  auto inv = m->device_->alloc(ElemType::f32, m->inv_freq_.size());
  if (!inv) return inv.error();
  m->inv_freq_dev_ = *inv;
  SPARK_TRY(m->device_->upload(m->inv_freq_dev_, m->inv_freq_.data(), DType::f32));
  const auto t0 = std::chrono::steady_clock::now();
  SPARK_TRY(m->fill_synthetic(seed));
  const size_t H = static_cast<size_t>(cfg.hidden_size);
  m->head_ = !m->lm_head_.empty() ? m->lm_head_
                                  : m->embed_.view(static_cast<size_t>(m->plan_.vocab0) * H,
                                                   static_cast<size_t>(m->plan_.vocab) * H);
  if (report) {
    uint64_t held = 0;
    for (const auto& d : m->plan_.dests) {
      const Buffer* w = m->weight(d.layer, d.role);
      held += w->bytes() + (w->scales() ? w->scales()->scales.bytes() : 0);
    }
    report->weight_bytes = held;
    report->device = m->device_->info().name;
    report->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return m;
}

Status Model::fill_synthetic(uint64_t seed) {
  Device& dev = *device_;
  const auto& c = cfg_;
  // An FP8 config's projections are FP8 as a checkpoint's would be (on a device that keeps
  // FP8), their scales after the plan's destinations.
  // MXFP4 experts likewise packed (on a device that keeps MXFP4), their scales as bytes.
  const auto fp8 = [&](const ShardDest& d) { return d.fp8 && dev.keeps_fp8(); };
  const auto mx = [&](const ShardDest& d) { return d.mxfp4 && dev.keeps_mxfp4(); };
  const auto kept = [&](const ShardDest& d) { return fp8(d) || mx(d); };
  std::vector<std::pair<ElemType, size_t>> sizes;
  for (const auto& d : plan_.dests)
    sizes.emplace_back(fp8(d)                       ? ElemType::fp8_e4m3
                       : mx(d)                      ? ElemType::mxfp4_e2m1
                       : d.kind == DestKind::matrix ? dev.compute_type()
                       : d.kind == DestKind::f32    ? ElemType::f32
                                                    : dev.vector_type(),
                       d.numel);
  for (const auto& d : plan_.dests)
    if (kept(d))
      sizes.emplace_back(mx(d) ? ElemType::u8 : ElemType::f32, d.scale_rows * d.scale_ld);
  layers_.assign(static_cast<size_t>(c.num_layers), Layer{});
  auto bufs = dev.alloc_weights(sizes);
  if (!bufs) return bufs.error();
  // FP8 values: 1 MiB of random codes of magnitude [0.5, 2) (e4m3 exponents 6 and 7, either
  // sign), repeated; each block's scale then sets the weights' range. MXFP4: 1 MiB of random
  // bytes (any two e2m1 codes: root mean square about 2.9), the scales a power of two near
  // the range a bf16 matrix of that width gets.
  std::vector<uint8_t> pattern(size_t{1} << 20), packed(pattern.size());
  uint64_t st = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t k = 0; k < pattern.size(); ++k) {
    st ^= st << 13, st ^= st >> 7, st ^= st << 17;
    pattern[k] = static_cast<uint8_t>((st & 0x80) | (0x30 + (st >> 8 & 0x0f)));
    packed[k] = static_cast<uint8_t>(st >> 24);
  }
  size_t next_scales = plan_.dests.size();
  // The input width of each matrix (its variance 1/width keeps activations in range).
  auto width = [&](WeightRole r) -> double {
    switch (r) {
      case WeightRole::wo:
        return plan_.heads * (c.is_mla() ? c.mla.v_head_dim : c.head_dim);
      case WeightRole::wq:
        return c.is_mla() && c.mla.q_lora_rank > 0 ? c.mla.q_lora_rank : c.hidden_size;
      case WeightRole::wkv_b:
        return c.mla.kv_lora_rank;
      case WeightRole::w_down:
        return plan_.inter;
      case WeightRole::experts_down:
        return plan_.expert_inter;
      case WeightRole::shared_down:
        return plan_.shared_inter;
      default:
        return c.hidden_size;
    }
  };
  for (size_t i = 0; i < plan_.dests.size(); ++i) {
    const auto& d = plan_.dests[i];
    *weight(d.layer, d.role) = (*bufs)[i];
    float scale = 0.1f, offset = 0.f;  // biases
    if (d.kind == DestKind::matrix)
      scale = d.role == WeightRole::embed
                  ? 1.0f
                  : static_cast<float>(std::sqrt(3.0 / std::max(width(d.role), 1.0)));
    else if (d.role == WeightRole::in_norm || d.role == WeightRole::post_norm ||
             d.role == WeightRole::final_norm || d.role == WeightRole::q_norm ||
             d.role == WeightRole::k_norm || d.role == WeightRole::q_a_norm ||
             d.role == WeightRole::kv_a_norm)
      scale = 0.1f, offset = 1.0f;
    if (!kept(d)) {
      SPARK_TRY(dev.fill_random((*bufs)[i], seed * 1000003u + i, scale, offset));
      continue;
    }
    const Buffer& w = (*bufs)[i];
    auto bs = std::make_shared<BlockScales>();
    bs->scales = (*bufs)[next_scales++];
    bs->ld = d.scale_ld;
    bs->row_shift = d.scale_row_shift;
    bs->base = w.data();
    bs->cols = static_cast<size_t>(d.cols);
    if (mx(d)) {
      const size_t per = 2 * packed.size();  // values a pattern holds
      for (size_t at = 0; at < w.numel(); at += per)
        SPARK_TRY(dev.upload(w.view(at, per), packed.data(), DType::u8));
      // uniform(-scale, scale) has root mean square scale / sqrt(3).
      const int e = static_cast<int>(std::lround(std::log2(scale / std::sqrt(3.0) / 2.93)));
      std::vector<uint8_t> sc(bs->scales.numel());
      for (size_t k = 0; k < sc.size(); ++k)
        sc[k] = static_cast<uint8_t>(
            std::clamp(127 + e - static_cast<int>(pattern[k % pattern.size()] & 1), 0, 254));
      SPARK_TRY(dev.upload(bs->scales, sc.data(), DType::u8));
      SPARK_TRY(dev.synchronize());  // sc leaves scope
    } else {
      for (size_t at = 0; at < w.numel(); at += pattern.size())
        SPARK_TRY(dev.upload(w.view(at, pattern.size()), pattern.data(), DType::f8_e4m3));
      SPARK_TRY(dev.fill_random(bs->scales, seed * 1000003u + i, scale / 2, scale));
    }
    weight(d.layer, d.role)->set_scales(std::move(bs));
  }
  return dev.synchronize();
}

Buffer* Model::weight(int layer, WeightRole role) {
  if (layer < 0) {
    switch (role) {
      case WeightRole::embed:
        return &embed_;
      case WeightRole::final_norm:
        return &final_norm_;
      case WeightRole::lm_head:
        return &lm_head_;
      default:
        return nullptr;
    }
  }
  auto& L = layers_[static_cast<size_t>(layer)];
  switch (role) {
    case WeightRole::in_norm:
      return &L.in_norm;
    case WeightRole::post_norm:
      return &L.post_norm;
    case WeightRole::q_norm:
      return &L.q_norm;
    case WeightRole::k_norm:
      return &L.k_norm;
    case WeightRole::wq:
      return &L.wq;
    case WeightRole::wk:
      return &L.wk;
    case WeightRole::wv:
      return &L.wv;
    case WeightRole::wo:
      return &L.wo;
    case WeightRole::bq:
      return &L.bq;
    case WeightRole::bk:
      return &L.bk;
    case WeightRole::bv:
      return &L.bv;
    case WeightRole::bo:
      return &L.bo;
    case WeightRole::w_gate_up:
      return &L.w_gate_up;
    case WeightRole::w_down:
      return &L.w_down;
    case WeightRole::b_gate_up:
      return &L.b_gate_up;
    case WeightRole::b_down:
      return &L.b_down;
    case WeightRole::router:
      return &L.router;
    case WeightRole::router_bias:
      return &L.router_bias;
    case WeightRole::experts_gate_up:
      return &L.experts_gate_up;
    case WeightRole::experts_down:
      return &L.experts_down;
    case WeightRole::shared_gate_up:
      return &L.shared_gate_up;
    case WeightRole::shared_down:
      return &L.shared_down;
    case WeightRole::sinks:
      return &L.sinks;
    case WeightRole::router_b:
      return &L.router_b;
    case WeightRole::experts_gate_up_b:
      return &L.experts_gate_up_b;
    case WeightRole::experts_down_b:
      return &L.experts_down_b;
    case WeightRole::wq_a:
      return &L.wq_a;
    case WeightRole::q_a_norm:
      return &L.q_a_norm;
    case WeightRole::wkv_a:
      return &L.wkv_a;
    case WeightRole::kv_a_norm:
      return &L.kv_a_norm;
    case WeightRole::wkv_b:
      return &L.wkv_b;
    default:
      return nullptr;
  }
}

namespace {

// An FP8 weight's scale tensor: [ceil(N / block_n)][ceil(K / block_k)].
std::vector<int64_t> fp8_scale_shape(const ShardRead& r, const WeightFormat& wf) {
  return {(r.shape[0] + wf.block_n - 1) / wf.block_n, (r.shape[1] + wf.block_k - 1) / wf.block_k};
}

// What the file stores for read `r` is something the loader can widen into its destination:
// F8_E4M3 only where config.json declares FP8 block scales, only for a matrix, and with its
// scale tensor present in the right shape and type; never F8_E5M2.
Status check_stored_format(const Checkpoint& ck, const ShardRead& r, const TensorInfo& t,
                           const WeightFormat& wf, const std::string& dir) {
  if (t.dtype == DType::f8_e5m2)
    return make_error(
        Errc::unsupported,
        fmt::format("{}: tensor \"{}\" is stored as F8_E5M2; the engine reads "
                    "FP8 weights as e4m3{}",
                    dir, r.tensor, wf.fp8() ? " (quantization_config declares e4m3)" : ""));
  if (t.dtype != DType::f8_e4m3) return Status::Ok();
  if (!wf.fp8())
    return make_error(Errc::integrity,
                      fmt::format("{}: tensor \"{}\" is stored as F8_E4M3 but config.json has "
                                  "no FP8 quantization_config (its scales would be unknown)",
                                  dir, r.tensor));
  if (r.shape.size() != 2 || !is_projection(r.role))
    return make_error(Errc::integrity,
                      fmt::format("{}: tensor \"{}\" is stored as F8_E4M3 but it is not a "
                                  "projection's weight matrix",
                                  dir, r.tensor));
  const std::string sname = fp8_scale_name(r.tensor);
  if (!ck.find(sname))
    return make_error(
        Errc::integrity,
        fmt::format("{}: FP8 tensor \"{}\" has no scale tensor \"{}\"", dir, r.tensor, sname));
  auto st = ck.lookup(sname, fp8_scale_shape(r, wf));
  if (!st)
    return make_error(st.error().code,
                      fmt::format("{} (the {}x{} block scales of \"{}\")", st.error().message,
                                  wf.block_n, wf.block_k, r.tensor));
  if ((*st)->dtype != DType::f32 && (*st)->dtype != DType::bf16)
    return make_error(Errc::integrity,
                      fmt::format("{}: scale tensor \"{}\" is {}; FP8 block scales are F32 or "
                                  "BF16",
                                  dir, sname, dtype_name((*st)->dtype)));
  return Status::Ok();
}

// The scale rows [sr0, sr1) of FP8 read `r` (scols wide, as stored) are ones the engine
// can use: a NaN, infinite, zero or negative scale (or, with ue8m0 scales, one that is not
// a power of two) in the columns the read covers fails the load naming the tensor and block.
Status check_fp8_scales(const ShardRead& r, const WeightFormat& wf,
                        const std::vector<float>& scales, int64_t sr0, int64_t sr1, int64_t scols,
                        const std::string& dir) {
  const int64_t sc0 = r.slice.col0 / wf.block_k, sc1 = (r.slice.col0 + r.cols - 1) / wf.block_k + 1;
  for (int64_t i = sr0; i < sr1; ++i)
    for (int64_t j = sc0; j < sc1; ++j) {
      const float v = scales[static_cast<size_t>((i - sr0) * scols + j)];
      int e = 0;
      const bool bad =
          !std::isfinite(v) || v <= 0.f || (wf.ue8m0_scales && std::frexp(v, &e) != 0.5f);
      if (bad)
        return make_error(
            Errc::integrity,
            fmt::format("{}: block [{}][{}] of \"{}\" is {}: an FP8 block scale must be a "
                        "finite positive number{}",
                        dir, i, j, fp8_scale_name(r.tensor), v,
                        wf.ue8m0_scales ? " and a power of two (scale_fmt ue8m0)" : ""));
    }
  return Status::Ok();
}

// Reads FP8 slice `r` chunk by chunk with the scale rows each chunk covers, widens it into
// a staging buffer as floats (exact: every e4m3 value times a float scale fits a float) and
// uploads that into `dst`, converted there into the device's type (a device that does not
// keep FP8 as stored, or a matrix it keeps widened). The scales are checked on the way.
Status load_fp8(const Checkpoint& ck, const ShardRead& r, const WeightFormat& wf, Device& dev,
                const Buffer& dst, const Buffer* stage, int* turn, const std::string& dir) {
  const std::string sname = fp8_scale_name(r.tensor);
  const auto sshape = fp8_scale_shape(r, wf);
  const int64_t scols = sshape[1];
  const int64_t per = std::max<int64_t>(
      1, static_cast<int64_t>(stage[0].bytes() / (static_cast<size_t>(r.cols) * sizeof(float))));
  if (static_cast<size_t>(r.cols) * sizeof(float) > stage[0].bytes())
    return make_error(Errc::internal, fmt::format("a row of {} ({} floats) exceeds the {}-byte "
                                                  "staging buffer",
                                                  r.tensor, r.cols, stage[0].bytes()));
  std::vector<uint8_t> raw(static_cast<size_t>(std::min(per, r.rows) * r.cols));
  std::vector<float> scales;
  for (int64_t r0 = 0; r0 < r.rows; r0 += per) {
    const int64_t n = std::min(per, r.rows - r0);
    const int64_t row0 = r.slice.row0 + r0;
    Slice s = r.slice;
    s.row0 = row0;
    s.rows = n;
    s.cols = r.cols;
    SPARK_TRY(ck.read_raw(r.tensor, r.shape, s, raw.data()));
    const int64_t sr0 = row0 / wf.block_n, sr1 = (row0 + n - 1) / wf.block_n + 1;
    scales.resize(static_cast<size_t>((sr1 - sr0) * scols));
    SPARK_TRY(ck.read(sname, sshape, Slice{sr0, sr1 - sr0, 0, -1}, scales.data()));
    SPARK_TRY(check_fp8_scales(r, wf, scales, sr0, sr1, scols, dir));
    const Buffer& buf = stage[*turn];
    *turn ^= 1;
    SPARK_TRY(dev.staging_ready(buf.data()));
    widen_fp8_block(raw.data(), n, r.cols, row0, r.slice.col0, scales.data(), sr0, scols,
                    wf.block_n, wf.block_k, buf.as<float>());
    const size_t off = r.dst_offset + static_cast<size_t>(r0 * r.cols);
    SPARK_TRY(dev.upload(dst.view(off, static_cast<size_t>(n * r.cols)), buf.data(), DType::f32));
  }
  return Status::Ok();
}

// Reads FP8 slice `r` into `dst`, an FP8 matrix kept as stored: its bytes as they are (into
// place where `in_place` is the host address of its destination, else through the staging
// buffers), and its block scales, checked, into `scales` (the destination's host copy,
// f.scale_ld wide, uploaded once the matrix is whole; ShardDest::fp8 says how they are kept).
Status load_fp8_kept(const Checkpoint& ck, const ShardRead& r, const WeightFormat& wf,
                     const ShardDest& f, Device& dev, const Buffer& dst, char* in_place,
                     const Buffer* stage, int* turn, std::vector<float>& scales,
                     const std::string& dir) {
  const std::string sname = fp8_scale_name(r.tensor);
  const auto sshape = fp8_scale_shape(r, wf);
  const int64_t scols = sshape[1];
  const int64_t sr0 = r.slice.row0 / wf.block_n, sr1 = (r.slice.row0 + r.rows - 1) / wf.block_n + 1;
  std::vector<float> src(static_cast<size_t>((sr1 - sr0) * scols));
  SPARK_TRY(ck.read(sname, sshape, Slice{sr0, sr1 - sr0, 0, -1}, src.data()));
  SPARK_TRY(check_fp8_scales(r, wf, src, sr0, sr1, scols, dir));
  const int64_t sc0 = r.slice.col0 / wf.block_k;
  const int64_t drow0 = static_cast<int64_t>(r.dst_offset) / f.cols;
  const size_t blocks = static_cast<size_t>((f.cols + wf.block_k - 1) / wf.block_k);
  for (int64_t i = 0; i < r.rows; ++i) {  // each destination scale row from its source row
    const int64_t d = (drow0 + i) >> f.scale_row_shift, s = (r.slice.row0 + i) / wf.block_n - sr0;
    for (size_t j = 0; j < blocks; ++j)  // (the row's padding stays zero)
      scales[static_cast<size_t>(d) * f.scale_ld + j] =
          src[static_cast<size_t>(s * scols + sc0) + j];
  }
  Slice s = r.slice;
  s.cols = r.cols;
  if (in_place) return ck.read_raw(r.tensor, r.shape, s, in_place);
  const int64_t per =
      std::max<int64_t>(1, static_cast<int64_t>(stage[0].bytes() / static_cast<size_t>(r.cols)));
  for (int64_t r0 = 0; r0 < r.rows; r0 += per) {
    const int64_t n = std::min(per, r.rows - r0);
    s.row0 = r.slice.row0 + r0;
    s.rows = n;
    const Buffer& buf = stage[*turn];
    *turn ^= 1;
    SPARK_TRY(dev.staging_ready(buf.data()));
    SPARK_TRY(ck.read_raw(r.tensor, r.shape, s, buf.data()));
    const size_t off = r.dst_offset + static_cast<size_t>(r0 * r.cols);
    SPARK_TRY(
        dev.upload(dst.view(off, static_cast<size_t>(n * r.cols)), buf.data(), DType::f8_e4m3));
  }
  return Status::Ok();
}

// Which of the plan's destinations keep FP8 as stored (ShardDest::fp8, on a device that
// keeps FP8 (Device::keeps_fp8), where the file stores every read of it as F8_E4M3; the
// rest are widened), and each read's destination.
Result<std::vector<bool>> fp8_dests(const ShardPlan& plan, const Device& dev, const Checkpoint& ck,
                                    std::vector<size_t>* read_dest) {
  std::vector<bool> keep(plan.dests.size());
  std::map<std::pair<int, WeightRole>, size_t> index;
  for (size_t i = 0; i < plan.dests.size(); ++i) {
    index[{plan.dests[i].layer, plan.dests[i].role}] = i;
    keep[i] = plan.dests[i].fp8 && dev.keeps_fp8();
  }
  read_dest->assign(plan.reads.size(), 0);
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    const auto& r = plan.reads[i];
    auto it = index.find({r.layer, r.role});
    if (it == index.end())
      return make_error(Errc::internal,
                        fmt::format("the plan reads {} into no destination", r.tensor));
    const size_t d = (*read_dest)[i] = it->second;
    if (!keep[d]) continue;
    auto t = ck.lookup(r.tensor, r.shape);
    if (!t) return t.error();
    if ((*t)->dtype != DType::f8_e4m3) keep[d] = false;
  }
  return keep;
}

// MXFP4's scale tensor beside its blocks ("X_blocks" -> "X_scales").
std::string mxfp4_scale_name(const std::string& blocks) {
  return blocks.substr(0, blocks.size() - 7) + "_scales";
}

// An MXFP4 read's blocks are U8 [E][R][C/32][16] with their scales U8 [E][R][C/32] beside.
Status check_mxfp4(const Checkpoint& ck, const ShardRead& r, const TensorInfo& t,
                   const std::string& dir) {
  if (t.dtype != DType::u8)
    return make_error(Errc::integrity, fmt::format("{}: MXFP4 blocks \"{}\" are {}, not U8", dir,
                                                   r.tensor, dtype_name(t.dtype)));
  const std::string sname = mxfp4_scale_name(r.tensor);
  if (!ck.find(sname))
    return make_error(Errc::integrity, fmt::format("{}: MXFP4 blocks \"{}\" have no scales "
                                                   "\"{}\"",
                                                   dir, r.tensor, sname));
  auto st = ck.lookup(sname, {r.shape[0], r.shape[1], r.mx_cols / 32});
  if (!st) return st.error();
  if ((*st)->dtype != DType::u8)
    return make_error(Errc::integrity, fmt::format("{}: MXFP4 scales \"{}\" are {}, not U8 "
                                                   "(e8m0)",
                                                   dir, sname, dtype_name((*st)->dtype)));
  return Status::Ok();
}

// Reads MXFP4 read `r` (one expert's rows, whole rows at a time with their scales), widens the
// columns it holds into a staging buffer as floats (exact) and uploads them into `dst`.
Status load_mxfp4(const Checkpoint& ck, const ShardRead& r, Device& dev, const Buffer& dst,
                  const Buffer* stage, int* turn, const std::string& dir) {
  const std::string sname = mxfp4_scale_name(r.tensor);
  const int64_t C = r.mx_cols, row_bytes = C / 2, row_scales = C / 32;
  const std::vector<int64_t> sshape = {r.shape[0], r.shape[1], row_scales};
  if (static_cast<size_t>(r.cols) * sizeof(float) > stage[0].bytes())
    return make_error(Errc::internal, fmt::format("a row of {} ({} floats) exceeds the {}-byte "
                                                  "staging buffer",
                                                  r.tensor, r.cols, stage[0].bytes()));
  const int64_t per = std::max<int64_t>(
      1, static_cast<int64_t>(stage[0].bytes() / (static_cast<size_t>(r.cols) * sizeof(float))));
  std::vector<uint8_t> raw(static_cast<size_t>(std::min(per, r.rows) * row_bytes));
  std::vector<uint8_t> sc(static_cast<size_t>(std::min(per, r.rows) * row_scales));
  for (int64_t r0 = 0; r0 < r.rows; r0 += per) {
    const int64_t n = std::min(per, r.rows - r0);
    const int64_t row = r.mx_row0 + r0;
    SPARK_TRY(ck.read_raw(r.tensor, r.shape, Slice{r.mx_expert, 1, row * row_bytes, n * row_bytes},
                          raw.data()));
    SPARK_TRY(ck.read_raw(sname, sshape, Slice{r.mx_expert, 1, row * row_scales, n * row_scales},
                          sc.data()));
    const Buffer& buf = stage[*turn];
    *turn ^= 1;
    SPARK_TRY(dev.staging_ready(buf.data()));
    if (!widen_mxfp4(raw.data(), row_bytes, sc.data(), row_scales, n, r.mx_col0, r.cols,
                     buf.as<float>()))
      return make_error(Errc::integrity,
                        fmt::format("{}: \"{}\" holds 0xff (NaN) for expert {}, rows [{}, {}): "
                                    "an MXFP4 scale must be a power of two",
                                    dir, sname, r.mx_expert, row, row + n));
    const size_t off = r.dst_offset + static_cast<size_t>(r0 * r.cols);
    SPARK_TRY(dev.upload(dst.view(off, static_cast<size_t>(n * r.cols)), buf.data(), DType::f32));
  }
  return Status::Ok();
}

// Reads MXFP4 read `r` (one expert's rows [mx_row0, mx_row0 + rows), value columns [mx_col0,
// mx_col0 + cols)) into `dst`, an MXFP4 matrix kept packed: its bytes as stored (straight
// into place where `in_place` is the host address of its destination and the read is of
// whole rows, else through the staging buffers) and its e8m0 scales, checked, into `scales`
// (the destination's host copy, f.scale_ld a row, uploaded once the matrix is whole).
Status load_mxfp4_kept(const Checkpoint& ck, const ShardRead& r, const ShardDest& f, Device& dev,
                       const Buffer& dst, char* in_place, const Buffer* stage, int* turn,
                       std::vector<uint8_t>& scales, const std::string& dir) {
  const std::string sname = mxfp4_scale_name(r.tensor);
  const int64_t C = r.mx_cols, row_bytes = C / 2, row_scales = C / 32;
  const std::vector<int64_t> sshape = {r.shape[0], r.shape[1], row_scales};
  const int64_t c0 = r.mx_col0 / 32, nc = r.cols / 32, out_row = r.cols / 2;
  if (r.mx_col0 % 32 != 0 || r.cols % 32 != 0 || f.cols != r.cols ||
      r.dst_offset % static_cast<size_t>(r.cols) != 0)
    return make_error(Errc::internal,
                      fmt::format("{}: columns [{}, +{}) of \"{}\" are not whole 32-value blocks "
                                  "of rows of {}",
                                  dir, r.mx_col0, r.cols, r.tensor, f.cols));
  std::vector<uint8_t> sc(static_cast<size_t>(r.rows * row_scales));
  SPARK_TRY(ck.read_raw(sname, sshape,
                        Slice{r.mx_expert, 1, r.mx_row0 * row_scales, r.rows * row_scales},
                        sc.data()));
  const int64_t drow0 = static_cast<int64_t>(r.dst_offset) / r.cols;
  for (int64_t i = 0; i < r.rows; ++i)
    for (int64_t j = 0; j < nc; ++j) {
      const uint8_t v = sc[static_cast<size_t>(i * row_scales + c0 + j)];
      if (v == 0xff)
        return make_error(Errc::integrity,
                          fmt::format("{}: \"{}\" holds 0xff (NaN) for expert {}, row {}, block "
                                      "{}: an MXFP4 scale must be a power of two",
                                      dir, sname, r.mx_expert, r.mx_row0 + i, c0 + j));
      scales[static_cast<size_t>((drow0 + i) * nc + j)] = v;
    }
  const bool whole = r.mx_col0 == 0 && r.cols == C;
  if (in_place && whole)
    return ck.read_raw(r.tensor, r.shape,
                       Slice{r.mx_expert, 1, r.mx_row0 * row_bytes, r.rows * row_bytes}, in_place);
  if (static_cast<size_t>(row_bytes) > stage[0].bytes())
    return make_error(Errc::internal, fmt::format("a row of {} ({} bytes) exceeds the {}-byte "
                                                  "staging buffer",
                                                  r.tensor, row_bytes, stage[0].bytes()));
  // Whole rows are read; a rank's share of the columns is then copied out of them.
  const int64_t per =
      std::max<int64_t>(1, static_cast<int64_t>(stage[0].bytes() / static_cast<size_t>(row_bytes)));
  std::vector<uint8_t> raw(whole ? 0 : static_cast<size_t>(std::min(per, r.rows) * row_bytes));
  for (int64_t r0 = 0; r0 < r.rows; r0 += per) {
    const int64_t n = std::min(per, r.rows - r0);
    const Slice s{r.mx_expert, 1, (r.mx_row0 + r0) * row_bytes, n * row_bytes};
    const size_t off = r.dst_offset + static_cast<size_t>(r0 * r.cols);
    if (whole) {
      const Buffer& buf = stage[*turn];
      *turn ^= 1;
      SPARK_TRY(dev.staging_ready(buf.data()));
      SPARK_TRY(ck.read_raw(r.tensor, r.shape, s, buf.data()));
      SPARK_TRY(dev.upload(dst.view(off, static_cast<size_t>(n * r.cols)), buf.data(), DType::u8));
      continue;
    }
    SPARK_TRY(ck.read_raw(r.tensor, r.shape, s, raw.data()));
    char* out = in_place ? in_place + r0 * out_row : nullptr;
    const Buffer& buf = stage[*turn];
    if (!out) {
      *turn ^= 1;
      SPARK_TRY(dev.staging_ready(buf.data()));
      out = static_cast<char*>(buf.data());
    }
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(out + i * out_row, raw.data() + i * row_bytes + r.mx_col0 / 2,
                  static_cast<size_t>(out_row));
    if (!in_place)
      SPARK_TRY(dev.upload(dst.view(off, static_cast<size_t>(n * r.cols)), buf.data(), DType::u8));
  }
  return Status::Ok();
}

}  // namespace

Status Model::load_weights(const std::string& dir, LoadReport* report) {
  const auto t0 = std::chrono::steady_clock::now();
  auto ck = Checkpoint::open(dir);
  if (!ck) return ck.error();
  const auto& c = cfg_;
  Device& dev = *device_;
  const std::atomic<bool>* cancel = report ? report->cancel : nullptr;
  if (!c.tie_word_embeddings && !ck->find("lm_head.weight"))
    return make_error(
        Errc::integrity,
        fmt::format("{}: lm_head.weight is missing and tie_word_embeddings is false", dir));
  // Before anything is allocated: every tensor the plan reads exists with the shape
  // config.json implies (a damaged config.json or checkpoint is refused by name), and what
  // this rank will hold fits in what its device has free.
  uint64_t need = 0;
  for (const auto& r : plan_.reads) {
    auto t = ck->lookup(r.tensor, r.shape);
    if (!t) return t.error();
    if (r.mxfp4)
      SPARK_TRY(check_mxfp4(*ck, r, **t, dir));
    else
      SPARK_TRY(check_stored_format(*ck, r, **t, c.weights, dir));
  }
  // FP8 matrices stay FP8 on a device whose products take them (fp8_dests: every read of
  // the matrix stored F8_E4M3 in whole 128-column blocks); their scales are allocated after
  // the plan's destinations, in the same allocation.
  std::vector<size_t> read_dest;
  auto f8 = fp8_dests(plan_, dev, *ck, &read_dest);
  if (!f8) return f8.error();
  // MXFP4 experts stay packed on a device whose expert products take them (their tensors
  // are U8, checked above), their scales likewise after the destinations.
  std::vector<bool> mx(plan_.dests.size());
  for (size_t i = 0; i < plan_.dests.size(); ++i) mx[i] = plan_.dests[i].mxfp4 && dev.keeps_mxfp4();
  std::vector<std::pair<ElemType, size_t>> sizes;
  for (size_t i = 0; i < plan_.dests.size(); ++i) {
    const auto& d = plan_.dests[i];
    sizes.emplace_back((*f8)[i]                     ? ElemType::fp8_e4m3
                       : mx[i]                      ? ElemType::mxfp4_e2m1
                       : d.kind == DestKind::matrix ? dev.compute_type()
                       : d.kind == DestKind::f32    ? ElemType::f32
                                                    : dev.vector_type(),
                       d.numel);
    need += elem_bytes(sizes.back().first, d.numel);
  }
  for (size_t i = 0; i < plan_.dests.size(); ++i)
    if ((*f8)[i] || mx[i]) {
      sizes.emplace_back(mx[i] ? ElemType::u8 : ElemType::f32,
                         plan_.dests[i].scale_rows * plan_.dests[i].scale_ld);
      need += plan_.dests[i].scale_bytes();
    }
  // Host-mapped weights come out of the host's memory, whatever the GPU has free.
  const bool in_host = dev.info().weights == WeightsPlacement::host_mapped;
  if (auto avail = in_host ? host_mem_available() : dev.available_bytes();
      avail && *avail > 0 && need > *avail)
    return make_error(Errc::resource,
                      fmt::format("{}: rank {} would hold {} MiB of weights on {} but {} MiB "
                                  "are available{}; use more ranks or a smaller model",
                                  dir, rank_, need >> 20, dev.info().name, *avail >> 20,
                                  in_host ? " in host memory (host-mapped weights)" : ""));
  layers_.assign(static_cast<size_t>(c.num_layers), Layer{});
  uint64_t held = 0;
  {
    auto bufs = dev.alloc_weights(sizes);
    if (!bufs)
      return make_error(bufs.error().code, fmt::format("{}: loading weights onto {}: {}", dir,
                                                       dev.info().name, bufs.error().message));
    size_t next = plan_.dests.size();
    for (size_t i = 0; i < plan_.dests.size(); ++i) {
      Buffer& w = *weight(plan_.dests[i].layer, plan_.dests[i].role);
      w = (*bufs)[i];
      held += w.bytes();
      const ShardDest& f = plan_.dests[i];
      if (!(*f8)[i] && !mx[i]) continue;
      auto bs = std::make_shared<BlockScales>();
      bs->scales = (*bufs)[next++];
      bs->ld = f.scale_ld;
      bs->row_shift = f.scale_row_shift;
      bs->base = w.data();
      bs->cols = static_cast<size_t>(f.cols);
      held += bs->scales.bytes();
      w.set_scales(std::move(bs));
    }
  }
  std::vector<std::vector<float>> scales_host(plan_.dests.size());
  std::vector<std::vector<uint8_t>> mx_scales_host(plan_.dests.size());
  for (size_t i = 0; i < plan_.dests.size(); ++i) {
    if ((*f8)[i]) scales_host[i].assign(plan_.dests[i].scale_rows * plan_.dests[i].scale_ld, 0.f);
    if (mx[i]) mx_scales_host[i].assign(plan_.dests[i].scale_rows * plan_.dests[i].scale_ld, 0);
  }
  // A slice whose bytes the destination keeps as stored, in memory the host can write
  // (host-mapped weights), is read from the file straight into its place: no staging, no
  // copy. Every other slice goes from the file into a staging buffer as stored, and from
  // there into its destination (converted on the way when the types differ).
  size_t largest = 0;
  uint64_t total = 0;
  std::vector<char*> in_place(plan_.reads.size(), nullptr);
  for (size_t i = 0; i < plan_.reads.size(); ++i) {
    const auto& r = plan_.reads[i];
    auto t = ck->lookup(r.tensor, r.shape);
    if (!t) return t.error();
    const Buffer* dst = weight(r.layer, r.role);
    const bool kept = dst->type() == ElemType::fp8_e4m3;
    const bool fp8 = (*t)->dtype == DType::f8_e4m3 && !kept;
    const size_t bytes = static_cast<size_t>(r.rows * r.cols) * dtype_size((*t)->dtype);
    total += bytes;
    if (r.mxfp4 && dst->type() == ElemType::mxfp4_e2m1) {  // packed, as stored
      if (auto* p = static_cast<char*>(dev.host_address(*dst)))
        in_place[i] = p + elem_bytes(ElemType::mxfp4_e2m1, r.dst_offset);
      if (!in_place[i] || r.mx_col0 != 0 || r.cols != r.mx_cols)
        largest = std::max(largest, bytes / 2);
      continue;
    }
    if (fp8 || r.mxfp4) {  // widened through the staging buffers, as floats
      largest = std::max(largest, bytes * sizeof(float));
      continue;
    }
    const bool same = (dst->type() == ElemType::bf16 && (*t)->dtype == DType::bf16) ||
                      (dst->type() == ElemType::f32 && (*t)->dtype == DType::f32) || kept;
    if (auto* p = same ? static_cast<char*>(dev.host_address(*dst)) : nullptr)
      in_place[i] = p + elem_bytes(dst->type(), r.dst_offset);
    else
      largest = std::max(largest, bytes);
  }
  const size_t staging_bytes = std::min(largest, dev.preferred_staging_bytes());
  // Two staging buffers, alternated: a file read fills one while the other's copy to the
  // device runs (the CPU device copies synchronously; there they just take turns).
  Buffer stage[2];
  for (auto& b : stage) {
    if (largest == 0) break;  // every slice is read in place
    auto s =
        dev.host_staging(std::max<size_t>(staging_bytes / (dev.info().kind == "cpu" ? 2 : 1), 64));
    if (!s) return s.error();
    b = *s;
  }
  int turn = 0;
  uint64_t done = 0, direct = 0;
  for (size_t i = 0; i < plan_.reads.size(); ++i) {
    const auto& r = plan_.reads[i];
    if (cancel && cancel->load())
      return make_error(Errc::precondition, "loading stopped: sparkd is shutting down");
    const TensorInfo* t = *ck->lookup(r.tensor, r.shape);
    const uint64_t slice_bytes = static_cast<uint64_t>(r.rows * r.cols) * dtype_size(t->dtype);
    if (const size_t md = read_dest[i]; r.mxfp4 && mx[md]) {
      SPARK_TRY(load_mxfp4_kept(*ck, r, plan_.dests[md], dev, *weight(r.layer, r.role), in_place[i],
                                stage, &turn, mx_scales_host[md], dir));
      if (in_place[i]) direct += slice_bytes / 2;
    } else if (r.mxfp4) {
      SPARK_TRY(load_mxfp4(*ck, r, dev, *weight(r.layer, r.role), stage, &turn, dir));
    } else if (const size_t d = read_dest[i]; (*f8)[d]) {
      SPARK_TRY(load_fp8_kept(*ck, r, cfg_.weights, plan_.dests[d], dev, *weight(r.layer, r.role),
                              in_place[i], stage, &turn, scales_host[d], dir));
      if (in_place[i]) direct += slice_bytes;
    } else if (t->dtype == DType::f8_e4m3) {
      SPARK_TRY(load_fp8(*ck, r, cfg_.weights, dev, *weight(r.layer, r.role), stage, &turn, dir));
    } else if (in_place[i]) {
      Slice s = r.slice;
      if (s.cols < 0) s.cols = r.cols;
      SPARK_TRY(ck->read_raw(r.tensor, r.shape, s, in_place[i]));
      direct += slice_bytes;
    } else {
      const size_t row_bytes = static_cast<size_t>(r.cols) * dtype_size(t->dtype);
      const int64_t per = std::max<int64_t>(
          1, static_cast<int64_t>(stage[0].bytes() / std::max<size_t>(row_bytes, 1)));
      if (row_bytes > stage[0].bytes())
        return make_error(Errc::internal,
                          fmt::format("{}: a row of {} ({} bytes) exceeds the {}-byte "
                                      "staging buffer",
                                      dir, r.tensor, row_bytes, stage[0].bytes()));
      Buffer* dst = weight(r.layer, r.role);
      for (int64_t r0 = 0; r0 < r.rows; r0 += per) {
        const int64_t n = std::min(per, r.rows - r0);
        Slice s = r.slice;
        s.row0 += r0;
        s.rows = n;
        if (s.cols < 0) s.cols = r.cols;
        const Buffer& buf = stage[turn];
        turn ^= 1;
        SPARK_TRY(dev.staging_ready(buf.data()));
        SPARK_TRY(ck->read_raw(r.tensor, r.shape, s, buf.data()));
        const size_t off = r.dst_offset + static_cast<size_t>(r0 * r.cols);
        SPARK_TRY(
            dev.upload(dst->view(off, static_cast<size_t>(n * r.cols)), buf.data(), t->dtype));
      }
    }
    // The file's pages of this tensor are read: drop them now rather than after the load,
    // so the page cache does not grow into a second copy of the weights (on unified memory
    // it would come out of the GPU's memory).
    ck->drop_page_cache(r.tensor);
    done += slice_bytes;
    if (report && report->progress) report->progress(done, total);
  }
  // The FP8 matrices' scales, each matrix's at once (one host buffer, reused).
  std::vector<float> sbuf;
  size_t most = 0;
  for (const auto& v : scales_host) most = std::max(most, v.size());
  sbuf.reserve(most);
  for (size_t i = 0; i < plan_.dests.size(); ++i) {
    if (!(*f8)[i]) continue;
    SPARK_TRY(dev.staging_ready(sbuf.data()));
    sbuf.assign(scales_host[i].begin(), scales_host[i].end());
    const Buffer& w = *weight(plan_.dests[i].layer, plan_.dests[i].role);
    SPARK_TRY(dev.upload(w.scales()->scales, sbuf.data(), DType::f32));
  }
  // The MXFP4 experts' scales likewise.
  std::vector<uint8_t> mbuf;
  for (size_t i = 0; i < plan_.dests.size(); ++i) {
    if (!mx[i]) continue;
    SPARK_TRY(dev.staging_ready(mbuf.data()));
    mbuf = mx_scales_host[i];
    const Buffer& w = *weight(plan_.dests[i].layer, plan_.dests[i].role);
    SPARK_TRY(dev.upload(w.scales()->scales, mbuf.data(), DType::u8));
  }
  SPARK_TRY(dev.synchronize());
  ck->drop_page_cache();
  if (!plan_.skipped_prefixes.empty()) {
    size_t n = 0;
    for (const auto& name : ck->tensor_names())
      for (const auto& pre : plan_.skipped_prefixes) n += name.compare(0, pre.size(), pre) == 0;
    log::info("engine",
              "{}: left {} tensors of the multi-token-prediction layer(s) {}* unread "
              "(the engine decodes one token a step)",
              dir, n, join(plan_.skipped_prefixes, "*, "));
  }
  if (dev.folds_norm_weights() && direct == 0) SPARK_TRY(fold_norms(dir));
  if (report) {
    report->bytes_read = ck->bytes_read();
    report->weight_bytes = held;
    report->bytes_in_place = direct;
    report->files = ck->files();
    report->skipped_prefixes = plan_.skipped_prefixes;
    report->skipped_tensors.clear();
    for (const auto& name : ck->tensor_names())
      for (const auto& pre : plan_.skipped_prefixes)
        if (name.compare(0, pre.size(), pre) == 0) report->skipped_tensors.push_back(name);
    report->device = dev.info().name;
    report->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return Status::Ok();
}

// The layer norms' weights folded into the products that read their output, on a device
// whose products then normalise faster (Device::folds_norm_weights); the norms keep a weight
// of ones, for the passes that still run them (prefill, several ranks). The input norm folds
// into q/k/v; the post-attention norm into a dense layer's gate/up (an MoE layer's norm
// output feeds the router and every expert: it stays a pass).
Status Model::fold_norms(const std::string& dir) {
  (void)dir;
  // Latent attention's input norm feeds q_a (or q) and kv_a, products this does not fold.
  if (cfg_.is_mla()) return Status::Ok();
  Device& dev = *device_;
  for (const auto& L : layers_)
    for (const Buffer* b : {&L.in_norm, &L.wq, &L.wk, &L.wv})
      if (b->type() != ElemType::bf16) return Status::Ok();
  const int H = cfg_.hidden_size;
  const std::vector<uint16_t> ones(static_cast<size_t>(H), 0x3f80);  // bf16 1.0
  for (auto& L : layers_) {
    for (const Buffer* w : {&L.wq, &L.wk, &L.wv}) SPARK_TRY(dev.fold_norm_weight(*w, L.in_norm, H));
    SPARK_TRY(dev.upload(L.in_norm, ones.data(), DType::bf16));
    if (!L.w_gate_up.empty() && L.w_gate_up.type() == ElemType::bf16 &&
        L.post_norm.type() == ElemType::bf16) {
      SPARK_TRY(dev.fold_norm_weight(L.w_gate_up, L.post_norm, H));
      SPARK_TRY(dev.upload(L.post_norm, ones.data(), DType::bf16));
      L.post_folded = true;
    }
  }
  SPARK_TRY(dev.synchronize());
  norms_folded_ = true;
  log::info("engine", "the layer norms' weights are folded into the q/k/v and gate/up weights");
  return Status::Ok();
}

// How this rank holds its weight matrices: "bf16" (the compute type), "fp8+bf16" (FP8
// projections kept as stored, the rest widened or stored plain), or "mxfp4+bf16" (MXFP4
// experts kept packed, the rest in the compute type).
std::string Model::weights_held() const {
  const std::string compute = elem_name(device_->compute_type());
  bool fp8 = false, mx = false;
  for (const auto& L : layers_) {
    for (const Buffer* b : {&L.wq, &L.wo, &L.w_gate_up, &L.w_down, &L.experts_gate_up})
      fp8 = fp8 || b->type() == ElemType::fp8_e4m3;
    mx = mx || L.experts_gate_up.type() == ElemType::mxfp4_e2m1;
  }
  return fp8 ? "fp8+" + compute : mx ? "mxfp4+" + compute : compute;
}

nlohmann::json Model::describe() const {
  const auto& c = cfg_;
  const ParamCount pc = count_params(c);
  nlohmann::json j = {
      {"architecture", c.architecture},
      {"layers", c.num_layers},
      {"hidden_size", c.hidden_size},
      {"vocab_size", c.vocab_size},
      {"parameters", pc.total},
      {"active_parameters", pc.active},
      {"weights", weights_held()},
      {"checkpoint_format", c.weights.fp8() || c.weights.mxfp4() ? c.weights.describe()
                            : c.torch_dtype.empty()              ? std::string("plain")
                                                                 : c.torch_dtype},
      {"tensor_parallel", world_},
      {"rank", rank_}};
  if (c.is_moe()) {
    const auto& m = c.moe;
    j["experts"] = {{"routed", m.experts},
                    {"per_token", m.top_k},
                    {"moe_layers", m.moe_layers()},
                    {"expert_intermediate_size", m.expert_inter},
                    {"shared_intermediate_size", m.shared_inter},
                    {"router", m.score == RouterScore::sigmoid ? "sigmoid" : "softmax"},
                    {"groups", m.n_group},
                    {"split", plan::moe_split_name(plan_.placement)},
                    {"split_reason", plan_.placement_reason},
                    {"held", {plan_.expert0, plan_.expert0 + plan_.experts}},
                    {"held_intermediate_size", plan_.expert_inter}};
    if (m.mtp_layers) j["skipped_mtp_layers"] = m.mtp_layers;
  }
  if (c.is_mla())
    j["latent_attention"] = {
        {"q_lora_rank", c.mla.q_lora_rank},  {"kv_lora_rank", c.mla.kv_lora_rank},
        {"qk_nope_head_dim", c.mla.qk_nope}, {"qk_rope_head_dim", c.mla.qk_rope},
        {"v_head_dim", c.mla.v_head_dim},    {"cache_values_per_token", c.mla.cache_width()}};
  return j;
}

namespace {
// Layers with a window, in a model that also has full-attention layers (those keep the
// shared blocks that prefix caching reuses); empty when none can be kept apart.
std::vector<bool> windowed_layers(const ModelConfig& c) {
  if (c.is_mla()) return {};
  std::vector<bool> w(static_cast<size_t>(c.num_layers), false);
  int n = 0;
  for (int l = 0; l < c.num_layers; ++l)
    if (c.window_of(l) > 0) {
      w[static_cast<size_t>(l)] = true;
      ++n;
    }
  if (n == 0 || n == c.num_layers) return {};
  return w;
}
}  // namespace

Result<std::unique_ptr<KVCache>> Model::make_kv_cache(int num_blocks, int block_size, ElemType type,
                                                      int window_blocks) const {
  const auto w = window_blocks > 0 ? windowed_layers(cfg_) : std::vector<bool>();
  if (window_blocks > 0 && w.empty())
    return make_error(
        Errc::internal,
        fmt::format("KV cache: {} has no sliding-window layers to keep apart", cfg_.architecture));
  return KVCache::create(*device_, type, cfg_.num_layers, num_blocks, block_size,
                         kv_shape(cfg_, plan_.kv_heads), w, window_blocks);
}

uint64_t Model::kv_block_bytes(ElemType type, int block_size, bool windowed_apart) const {
  const auto w = windowed_apart ? windowed_layers(cfg_) : std::vector<bool>();
  const int layers = cfg_.num_layers - static_cast<int>(std::count(w.begin(), w.end(), true));
  return KVCache::block_bytes(type, layers, block_size, kv_shape(cfg_, plan_.kv_heads));
}

uint64_t Model::kv_window_block_bytes(ElemType type, int block_size) const {
  const auto w = windowed_layers(cfg_);
  return KVCache::block_bytes(type, static_cast<int>(std::count(w.begin(), w.end(), true)),
                              block_size, kv_shape(cfg_, plan_.kv_heads));
}

int Model::window_ring_blocks(int block_size, int step_tokens) const {
  const auto w = windowed_layers(cfg_);
  if (w.empty() || block_size < 1) return 0;
  int window = 0;
  for (int l = 0; l < cfg_.num_layers; ++l) window = std::max(window, cfg_.window_of(l));
  // Position p lands in slot p mod (ring blocks x block_size) of the ring (logical block
  // p / bs is ring entry (p / bs) mod n, offset p mod bs): a circular buffer. A step's first
  // query reads back to window - 1 positions before it and its last token is step_tokens - 1
  // after it, so window + step_tokens - 1 consecutive positions must not share a slot.
  const int64_t span = static_cast<int64_t>(window) + std::max(step_tokens, 1) - 1;
  return static_cast<int>((span + block_size - 1) / block_size);
}

int Model::window_recompute_tokens() const {
  const auto w = windowed_layers(cfg_);
  int n = 0;
  for (int l = 0; l < cfg_.num_layers; ++l)
    if (!w.empty() && w[static_cast<size_t>(l)]) n += cfg_.window_of(l) - 1;
  return n;
}

Status Model::reserve(int tokens, int logit_rows) {
  Device& dev = *device_;
  const ElemType at = dev.compute_type();
  const size_t H = static_cast<size_t>(cfg_.hidden_size), hd = static_cast<size_t>(cfg_.head_dim);
  const size_t qw = static_cast<size_t>(plan_.heads) * hd,
               kw = static_cast<size_t>(plan_.kv_heads) * hd;
  const size_t I = static_cast<size_t>(plan_.inter), V = static_cast<size_t>(cfg_.vocab_size);
  auto grow = [&](Buffer& b, ElemType t, size_t n) -> Status {
    auto a = dev.alloc(t, n);
    if (!a) return a.error();
    b = *a;
    return Status::Ok();
  };
  if (tokens > cap_tokens_) {
    const size_t T = static_cast<size_t>(tokens);
    SPARK_TRY(grow(x_, at, T * H));
    SPARK_TRY(grow(h_, at, T * H));
    SPARK_TRY(grow(o_, at, T * H));
    SPARK_TRY(grow(q_, at, T * qw));
    const size_t aw =
        cfg_.is_mla() ? static_cast<size_t>(plan_.heads) * static_cast<size_t>(cfg_.mla.v_head_dim)
                      : qw;
    SPARK_TRY(grow(att_, at, T * std::max(qw, aw)));
    if (cfg_.is_mla()) {
      // Twice: q_a's rows, then their norm (a CUDA norm does not write over its input).
      SPARK_TRY(grow(mla_qa_, at, 2 * T * static_cast<size_t>(std::max(cfg_.mla.q_lora_rank, 1))));
      SPARK_TRY(grow(mla_kv_, at, T * static_cast<size_t>(cfg_.mla.cache_width())));
    }
    SPARK_TRY(grow(k_, at, T * kw));
    SPARK_TRY(grow(v_, at, T * kw));
    SPARK_TRY(grow(gate_up_, at, T * 2 * I));
    SPARK_TRY(grow(act_, at, T * I));
    if (cfg_.is_moe()) {
      const size_t E = static_cast<size_t>(cfg_.moe.experts),
                   K = static_cast<size_t>(cfg_.moe.top_k);
      SPARK_TRY(grow(router_logits_, ElemType::f32, T * E));
      SPARK_TRY(grow(moe_ids_, ElemType::i32, T * K));
      SPARK_TRY(grow(moe_weights_, ElemType::f32, T * K));
    }
    cap_tokens_ = tokens;
  }
  if (logit_rows > cap_rows_) {
    const size_t R = static_cast<size_t>(logit_rows);
    SPARK_TRY(grow(sel_, at, R * H));
    SPARK_TRY(grow(logits_, ElemType::f32, R * V));
    if (plan_.vocab_parallel) {
      SPARK_TRY(grow(logits_local_, ElemType::f32, R * static_cast<size_t>(plan_.vocab)));
      SPARK_TRY(grow(gathered_, ElemType::f32, R * V));
    }
    cap_rows_ = logit_rows;
  }
  return Status::Ok();
}

Status Model::forward(const std::vector<SeqChunk>& chunks, KVCache& cache, Collective& comm,
                      std::vector<float>* logits, bool all_logits) {
  const auto& c = cfg_;
  const int V = c.vocab_size;
  if (cache.device_kind() != device_->info().kind)
    return make_error(Errc::internal,
                      fmt::format("the KV cache is on the {} but the model is on {}",
                                  cache.device_kind(), device_->info().name));
  StepLayout& st = step_;
  st.tokens.clear();
  st.positions.clear();
  st.chunk_begin.assign(1, 0);
  st.chunk_len.clear();
  st.block_tables.clear();
  st.logit_rows.clear();
  st.slots.clear();
  st.window_tables.clear();
  st.window_slots.clear();
  st.table_width = 0;
  st.max_seq_len_bound = 0;
  for (const auto& ch : chunks)
    st.table_width = std::max(st.table_width,
                              (ch.start_pos + ch.n + cache.block_size() - 1) / cache.block_size());
  for (const auto& ch : chunks) {
    if (ch.n <= 0) continue;
    for (int i = 0; i < ch.n; ++i) {
      const int32_t tok = feed_rows_ > 0 ? 0 : ch.tokens[i];  // fed: drawn on the device
      if (tok < 0 || tok >= V)
        return make_error(Errc::usage,
                          fmt::format("token id {} is outside the vocabulary [0, {})", tok, V));
      if (ch.start_pos + i >= c.max_position)
        return make_error(Errc::usage,
                          fmt::format("position {} is beyond max_position_embeddings {}",
                                      ch.start_pos + i, c.max_position));
      if (all_logits || ch.all_logits)
        st.logit_rows.push_back(static_cast<int32_t>(st.tokens.size()));
      st.tokens.push_back(tok);
      st.positions.push_back(ch.start_pos + i);
    }
    if (!all_logits && !ch.all_logits && ch.want_logits)
      st.logit_rows.push_back(static_cast<int32_t>(st.tokens.size()) - 1);
    st.chunk_begin.push_back(static_cast<int32_t>(st.tokens.size()));
    st.chunk_len.push_back(ch.start_pos + ch.n);
    const int bs = cache.block_size();
    for (int i = 0; i < ch.n; ++i) {
      const int pos = ch.start_pos + i;
      st.slots.push_back(pos < ch.write_from ? -1 : ch.block_table[pos / bs] * bs + pos % bs);
    }
    const int nb = (ch.start_pos + ch.n + bs - 1) / bs;
    st.block_tables.insert(st.block_tables.end(), ch.block_table, ch.block_table + nb);
    st.block_tables.resize(st.block_tables.size() + static_cast<size_t>(st.table_width - nb), 0);
    if (cache.window_blocks() > 0) {
      if (!ch.ring || ch.ring_n < 1)
        return make_error(Errc::internal,
                          "forward: the cache keeps windowed layers apart but a chunk has no ring");
      for (int i = 0; i < ch.n; ++i) {
        const int pos = ch.start_pos + i;
        st.window_slots.push_back(ch.ring[(pos / bs) % ch.ring_n] * bs + pos % bs);
      }
      for (int b = 0; b < st.table_width; ++b)
        st.window_tables.push_back(b < nb ? ch.ring[b % ch.ring_n] : 0);
    }
  }
  if (st.tokens.empty()) {
    if (logits) logits->clear();
    return Status::Ok();
  }
  const int R = logits ? static_cast<int>(st.logit_rows.size()) : 0;
  // Whether logits are computed, and whether the step replays a graph, follow from the step
  // plan and the collective alone, so every rank of a ring decides alike and issues the same
  // collectives (a vocab-parallel lm_head gathers on every rank).
  const bool want = logits != nullptr || plan_.vocab_parallel;
  const int rows = want ? static_cast<int>(st.logit_rows.size()) : 0;
  if (graphs_ && !route_recorder_ && st.decode_only() && st.tokens_n() <= graph_max_batch_ &&
      graph_max_batch_ < (1 << 15) && st.table_width <= graph_width_ &&
      (comm.world_size() == 1 || comm.device_calls_capturable()) &&
      static_cast<int>(st.logit_rows.size()) == st.tokens_n()) {
    SPARK_TRY(run_graph(cache, comm, want));
  } else {
    SPARK_TRY(reserve(st.tokens_n(), rows));
    SPARK_TRY(device_->begin_step(st));
    if (feed_rows_ > 0) SPARK_TRY(device_->feed_drawn_tokens(feed_rows_));
    SPARK_TRY(run_layers(st, cache, comm, want));
  }
  if (!logits) return device_->synchronize();
  if (sample_out_) {  // forward_sample: the draws come back, not the logits
    if (static_cast<size_t>(R) != sample_params_->size())
      return make_error(Errc::internal,
                        fmt::format("forward_sample: {} logit rows but {} sampling parameters", R,
                                    sample_params_->size()));
    logits->clear();
    if (sample_queue_only_)
      return device_->sample_queue(logits_, V, *sample_params_, *sample_history_);
    return device_->sample(logits_, V, *sample_params_, *sample_history_, sample_out_);
  }
  logits->resize(static_cast<size_t>(R) * static_cast<size_t>(V));
  if (R > 0) SPARK_TRY(device_->to_host(logits_, logits->data(), logits->size()));
  return device_->synchronize();
}

Status Model::forward_sample(const std::vector<SeqChunk>& chunks, KVCache& cache, Collective& comm,
                             const std::vector<kernels::SampleParams>& params,
                             std::vector<kernels::SampleResult>* results,
                             const std::vector<Device::PenaltyHistory>& history) {
  std::vector<float> unused;
  sample_params_ = &params;
  sample_history_ = &history;
  sample_out_ = results;
  Status st = forward(chunks, cache, comm, &unused, false);
  sample_params_ = nullptr;
  sample_history_ = nullptr;
  sample_out_ = nullptr;
  return st;
}

Status Model::queue_sample(const std::vector<SeqChunk>& chunks, KVCache& cache, Collective& comm,
                           const std::vector<kernels::SampleParams>& params, bool feed,
                           const std::vector<Device::PenaltyHistory>& history) {
  if (!device_->queues_steps())
    return make_error(Errc::internal, "queue_sample: the device does not queue steps");
  int rows = 0;
  for (const auto& ch : chunks) {
    if (feed && (ch.n != 1 || !ch.want_logits))
      return make_error(Errc::internal, "queue_sample: a fed step is one token per chunk");
    rows += ch.want_logits ? 1 : 0;
  }
  if (feed && !history.empty())
    return make_error(Errc::internal, "queue_sample: a fed step has no penalties");
  std::vector<float> unused;
  std::vector<kernels::SampleResult> ignored;
  sample_params_ = &params;
  sample_history_ = &history;
  sample_out_ = &ignored;
  sample_queue_only_ = true;
  feed_rows_ = feed ? rows : 0;
  Status st = forward(chunks, cache, comm, &unused, false);
  sample_params_ = nullptr;
  sample_history_ = nullptr;
  sample_out_ = nullptr;
  sample_queue_only_ = false;
  feed_rows_ = 0;
  return st;
}

Status Model::wait_sample(std::vector<kernels::SampleResult>* results) {
  return device_->sample_wait(results);
}

Status Model::prepare(int tokens, int seqs, int max_context, int block_size, bool graphs) {
  const int width = (max_context + block_size - 1) / block_size;
  int bucket = 1;
  while (bucket < seqs) bucket *= 2;
  const int cap = std::max(tokens, bucket);
  SPARK_TRY(reserve(cap, std::max(seqs, bucket)));
  // A step has one chunk per running sequence (at most `seqs`, padded to the bucket).
  SPARK_TRY(device_->reserve_step(cap, bucket, width, max_context, plan_.heads, cfg_.head_dim));
  if (cfg_.is_mla()) SPARK_TRY(device_->reserve_mla(cap, bucket, max_context, mla_args()));
  if (cfg_.is_moe())
    SPARK_TRY(device_->reserve_moe(cap, cfg_.moe.top_k, cfg_.hidden_size, plan_.expert_inter,
                                   plan_.shared_inter, plan_.experts));
  graphs_ = graphs && device_->supports_graphs();
  graph_max_batch_ = bucket;
  graph_max_context_ = max_context;
  graph_width_ = width;
  device_->graph_clear();
  return Status::Ok();
}

Status Model::run_graph(KVCache& cache, Collective& comm, bool want) {
  // Pad the step to its bucket: padding rows write no KV (slot -1) and attend to position 0
  // of block 0 (finite: pools start zeroed); their logits are computed and ignored.
  StepLayout st = step_;
  const int real = st.tokens_n();
  int B = 1;
  while (B < real) B *= 2;
  st.table_width = graph_width_;
  std::vector<int32_t> tables(static_cast<size_t>(B) * static_cast<size_t>(graph_width_), 0);
  for (int c = 0; c < real; ++c)
    std::copy_n(step_.block_tables.begin() + static_cast<ptrdiff_t>(c) * step_.table_width,
                step_.table_width, tables.begin() + static_cast<ptrdiff_t>(c) * graph_width_);
  st.block_tables = std::move(tables);
  if (!step_.window_tables.empty()) {
    std::vector<int32_t> wt(static_cast<size_t>(B) * static_cast<size_t>(graph_width_), 0);
    for (int c = 0; c < real; ++c)
      std::copy_n(step_.window_tables.begin() + static_cast<ptrdiff_t>(c) * step_.table_width,
                  step_.table_width, wt.begin() + static_cast<ptrdiff_t>(c) * graph_width_);
    st.window_tables = std::move(wt);
    st.window_slots.resize(static_cast<size_t>(B), -1);
  }
  for (int i = real; i < B; ++i) {
    st.tokens.push_back(0);
    st.positions.push_back(0);
    st.slots.push_back(-1);
    st.chunk_begin.push_back(i + 1);
    st.chunk_len.push_back(1);
  }
  st.logit_rows.resize(static_cast<size_t>(B));
  for (int i = 0; i < B; ++i) st.logit_rows[static_cast<size_t>(i)] = i;
  // Two graphs per bucket: one for contexts the device's short-context attention takes
  // (captured with that bound), one for the rest (the step buffers' bound).
  const KVLayerView kv0 = cache.view(0);
  const int short_ctx = std::min(
      device_->decode_short_context(B, plan_.heads, kv0.n_kv_heads, kv0.head_dim, kv0.type),
      graph_max_context_);
  const bool short_class = short_ctx > 0 && *std::max_element(step_.chunk_len.begin(),
                                                              step_.chunk_len.end()) <= short_ctx;
  st.max_seq_len_bound = short_class ? short_ctx : graph_max_context_;
  // The graph reads the KV pools of the cache it was captured with: key on both. The pools
  // are 256-byte aligned, buckets below 2^15.
  const uint64_t key = (static_cast<uint64_t>(reinterpret_cast<uintptr_t>(kv0.k)) >> 8 << 16) |
                       (static_cast<uint64_t>(B) << 1) | (short_class ? 1u : 0u);
  SPARK_TRY(device_->begin_step(st));
  if (feed_rows_ > 0) SPARK_TRY(device_->feed_drawn_tokens(feed_rows_));
  auto hit = device_->graph_launch(key);
  if (!hit) return hit.error();
  if (*hit) {
    ++graph_replays_;
    return Status::Ok();
  }
  // First step of this bucket: run it eagerly (library handles pick their algorithms, so
  // nothing allocates under capture), then capture the same work for the next steps.
  // The eager run computes this step's results; the capture only records.
  SPARK_TRY(run_layers(st, cache, comm, want));
  SPARK_TRY(device_->synchronize());
  Status cap = device_->graph_begin();
  if (cap.ok()) {
    Status body = run_layers(st, cache, comm, want);
    Status end = device_->graph_end(key);
    cap = body.ok() ? end : body;
  }
  // The ranks agree (on the host) before any replays: a graph on one rank and eager steps
  // on another would issue different collectives.
  float failed = cap.ok() ? 0.0f : 1.0f;
  if (comm.world_size() > 1) SPARK_TRY(comm.all_reduce_sum(&failed, 1));
  if (failed > 0) {
    log::warn("engine",
              "CUDA graph capture of a {}-sequence decode step failed on {} rank(s) ({}); "
              "decode steps run eagerly from now on",
              B, static_cast<int>(failed), cap.ok() ? "another rank's capture" : cap.message());
    graphs_ = false;
    device_->graph_clear();
    return device_->synchronize();
  }
  ++graph_captures_;
  return Status::Ok();
}

}  // namespace spark::engine
