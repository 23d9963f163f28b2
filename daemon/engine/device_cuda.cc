// The CUDA device: plain C++ over the kernels' device entry points (kernels/*.h, which take
// void* streams and need no CUDA headers here). Weights, activations and (by default) the
// KV cache are BF16; every product accumulates in fp32 (cuBLASLt or the kernels' own decode
// GEMV), norms and softmax in fp32. All work goes on one stream owned by the device; the
// host waits only where it must read results (logits, sampled ids) or reuse a buffer.
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <map>
#include <string_view>
#include <utility>

#include "core/log.h"
#include "core/strings.h"
#include "daemon/engine/collective.h"
#include "daemon/engine/device.h"
#include "kernels/bias.h"
#include "kernels/cuda_runtime.h"
#include "kernels/cuda_stream.h"
#include "kernels/device_copy.h"
#include "kernels/embedding.h"
#include "kernels/fill.h"
#include "kernels/fp8.h"
#include "kernels/launch.h"
#include "kernels/matmul.h"
#include "kernels/mla.h"
#include "kernels/moe.h"
#include "kernels/paged_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/sampler.h"
#include "kernels/swiglu.h"

namespace spark::engine {

namespace {

kernels::DType kdt(ElemType t) {
  return t == ElemType::bf16       ? kernels::DType::bf16
         : t == ElemType::fp8_e4m3 ? kernels::DType::e4m3
                                   : kernels::DType::f32;
}

// The own matrix kernel's 16-byte loads need 16-byte aligned operands.
// The value of environment variable `name` among `choices` (the first one's where it is
// unset); another value is Errc::config naming the variable, the value and the choices.
Result<int> env_choice(const char* name,
                       std::initializer_list<std::pair<std::string_view, int>> choices) {
  const char* v = std::getenv(name);
  if (!v) return choices.begin()->second;
  std::string list;
  size_t i = 0;
  for (const auto& [word, value] : choices) {
    if (word == v) return value;
    list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + std::string(word);
    ++i;
  }
  return make_error(Errc::config, fmt::format("{}={}: must be {}", name, v, list));
}

bool aligned16(const Buffer& b) {
  return reinterpret_cast<uintptr_t>(b.data()) % 16 == 0;
}

Status need(ElemType got, ElemType want, const char* what) {
  if (got != want)
    return make_error(Errc::internal, fmt::format("cuda device: {} is {}, expected {}", what,
                                                  elem_name(got), elem_name(want)));
  return Status::Ok();
}

// Step metadata lives in one device buffer of int32 sections, packed for the step's own
// token, chunk and row counts (tables at the capacity's row width), so begin_step() copies
// only what the step uses (a few KiB at decode, not the capacity's hundreds). A graph is
// captured for one bucket, whose counts fix the offsets, so it replays after begin_step()
// rewrites them.
struct MetaLayout {
  size_t cap_tokens = 0, cap_chunks = 0, cap_width = 0;
  size_t tokens = 0, positions = 0, slots = 0, query_start = 0, seq_lens = 0, tables = 0, rows = 0,
         wslots = 0, wtables = 0, used = 0, total = 0;
  // The sections for a step of T tokens, C chunks and R logit rows, and with `windows` the
  // windowed layers' slots and tables (StepLayout); `used` ints in all.
  void place(size_t T, size_t C, size_t R, bool windows) {
    size_t at = 0;
    auto take = [&](size_t n) {
      size_t o = at;
      at += (n + 31) / 32 * 32;  // 128-byte aligned sections
      return o;
    };
    tokens = take(T);
    positions = take(T);
    slots = take(T);
    query_start = take(C + 1);
    seq_lens = take(C);
    tables = take(C * cap_width);
    rows = take(R);
    wslots = windows ? take(T) : 0;
    wtables = windows ? take(C * cap_width) : 0;
    used = at;
  }
  void compute() {
    place(cap_tokens, cap_chunks, cap_tokens, true);
    total = used;
  }
};

class CudaDevice final : public Device {
 public:
  static Result<std::shared_ptr<Device>> open(int ordinal, const CudaDeviceOptions& opts) {
    // SPARK_CUDA_SHORT_ATTENTION=N: the short-context decode attention only for contexts up
    // to N positions (0: never), to measure it or to rule it out. The settings are checked
    // first, so a bad value is an error with or without a GPU.
    int short_cap = -1;
    if (const char* sa = std::getenv("SPARK_CUDA_SHORT_ATTENTION")) {
      auto n = parse_i64(sa);
      if (!n || *n < 0)
        return make_error(Errc::config,
                          fmt::format("SPARK_CUDA_SHORT_ATTENTION={}: not a count of positions "
                                      "(0 turns the short-context attention off)",
                                      sa));
      short_cap = static_cast<int>(std::min<int64_t>(*n, 1 << 30));
    }
    // SPARK_CUDA_PDL=0 turns programmatic dependent launch off (to measure what it saves, or
    // to rule it out); SPARK_CUDA_NORM_IN_PRODUCT=0 runs the layer's norms as their own pass
    // at decode rows too (the same comparison). Each is 0 or 1; anything else is an error.
    // SPARK_CUDA_FALLBACKS=1 runs the pre-Hopper paths (no thread-block clusters, no
    // programmatic launch) on any GPU, so an sm_90 GPU shows what an sm_80 one runs.
    bool pdl_on = true, norm_in_products = true;
    for (auto [name, on] : {std::pair<const char*, bool*>{"SPARK_CUDA_PDL", &pdl_on},
                            {"SPARK_CUDA_NORM_IN_PRODUCT", &norm_in_products}}) {
      const char* v = std::getenv(name);
      if (!v) continue;
      if (std::string_view(v) != "0" && std::string_view(v) != "1")
        return make_error(Errc::config,
                          fmt::format("{}={}: must be 0 (off) or 1 (on, the default)", name, v));
      *on = std::string_view(v) == "1";
    }
    if (const char* v = std::getenv("SPARK_CUDA_FALLBACKS")) {
      if (std::string_view(v) != "0" && std::string_view(v) != "1")
        return make_error(Errc::config,
                          fmt::format("SPARK_CUDA_FALLBACKS={}: must be 0 (the GPU's own paths, "
                                      "the default) or 1 (the pre-Hopper paths)",
                                      v));
      kernels::set_cuda_fallbacks(std::string_view(v) == "1");
    }
    // SPARK_CUDA_MOE_FORM=grouped runs the MoE experts' grouped form at every row count (the
    // decode form's rows too), to compare the two or rule one out; auto (the default) takes
    // the decode form up to 8 rows, with gpt-oss's MXFP4 experts on the fp32 kernels at one
    // row and the tensor-core kernels from two (to 32), FP8 experts likewise, bf16 experts on
    // them from 5 rows to 8;
    // decode-mma takes the tensor-core kernels at every row count up to 32, decode-fp32 the
    // fp32 ones up to 8 rows.
    auto moe_form =
        env_choice("SPARK_CUDA_MOE_FORM",
                   {{"auto", 0}, {"grouped", 2}, {"decode-mma", 3}, {"decode-fp32", 4}});
    if (!moe_form) return moe_form.error();
    // SPARK_CUDA_FP8_PREFILL picks how FP8 weights' products of more than decode rows run:
    // auto (the default) on the FP8 tensor cores where cuBLASLt has them (Hopper), else
    // through bf16 tiles of the dequantized weight; tensor-core requires the tensor cores (a
    // product they cannot take fails, naming it); dequant takes the bf16 tiles everywhere.
    auto fp8_prefill =
        env_choice("SPARK_CUDA_FP8_PREFILL", {{"auto", 0}, {"tensor-core", 1}, {"dequant", 2}});
    if (!fp8_prefill) return fp8_prefill.error();
    // SPARK_CUDA_MLA_SCALAR=1 runs latent attention's scalar fp32 kernel where the tensor-core
    // one would run (a bf16 cache at DeepSeek-V3's widths), to compare the two or rule it out.
    bool mla_scalar = false;
    if (const char* v = std::getenv("SPARK_CUDA_MLA_SCALAR")) {
      if (std::string_view(v) != "0" && std::string_view(v) != "1")
        return make_error(Errc::config,
                          fmt::format("SPARK_CUDA_MLA_SCALAR={}: must be 0 (the tensor-core "
                                      "attention where it fits, the default) or 1 (the scalar "
                                      "kernel)",
                                      v));
      mla_scalar = std::string_view(v) == "1";
    }
    // SPARK_CUDA_MLA_SPLITS=N: latent attention's decode over at most N ranges of the context
    // (1 to kMlaMaxSplits), where mla_splits would take more, to compare the two.
    int mla_split_cap = 0;
    if (const char* v = std::getenv("SPARK_CUDA_MLA_SPLITS")) {
      auto n = parse_i64(v);
      if (!n || *n < 1 || *n > kernels::kMlaMaxSplits)
        return make_error(Errc::config,
                          fmt::format("SPARK_CUDA_MLA_SPLITS={}: not a count of context ranges "
                                      "from 1 to {}",
                                      v, kernels::kMlaMaxSplits));
      mla_split_cap = static_cast<int>(*n);
    }
    SPARK_TRY(kernels::cuda_device_count().status());
    SPARK_TRY(kernels::cuda_select_device(ordinal));
    auto lim = kernels::cuda_device_limits(ordinal);
    if (!lim) return lim.error();
    auto d = std::shared_ptr<CudaDevice>(new CudaDevice());
    d->lim_ = *lim;
    d->proc_root_ = opts.proc_root;
    d->info_.kind = "cuda";
    d->info_.ordinal = ordinal;
    d->info_.sm = lim->cc_major * 10 + lim->cc_minor;
    d->info_.unified_memory = lim->integrated;
    d->info_.gpu_uuid = lim->uuid;
    d->info_.total_bytes = lim->total_memory;
    auto w = choose_weights_placement(opts.weights, *lim);
    if (!w) return w.error();
    d->info_.weights = *w;
    log::info("engine",
              "{}: integrated {}, maps host memory {}, pageable memory access {} (through the "
              "host's page tables {}), host register {} (read-only {}): weights {} "
              "(WEIGHTS_PLACEMENT={})",
              kernels::describe_device(*lim), lim->integrated, lim->can_map_host_memory,
              lim->pageable_memory_access, lim->pageable_uses_host_pages,
              lim->host_register_supported, lim->read_only_host_register,
              weights_placement_name(*w), weights_placement_name(opts.weights));
    d->info_.name = fmt::format("{} ({:.1f} GiB{})", kernels::describe_device(*lim),
                                static_cast<double>(lim->total_memory) / (1ull << 30),
                                lim->integrated ? ", unified memory" : "");
    auto s = kernels::cuda_stream_create();
    if (!s) return s.error();
    d->stream_ = *s;
    auto mm = kernels::Matmul::create();
    if (!mm) return mm.error();
    d->mm_ = std::move(*mm);
    // programmatic dependent launch needs sm_90
    d->pdl_ = kernels::cuda_hopper_paths(lim->cc_major, kernels::cuda_fallbacks()) && pdl_on;
    d->norm_in_products_ = norm_in_products;
    d->fold_norms_ = opts.fold_norms;
    d->short_cap_ = short_cap;
    d->moe_form_ = *moe_form;
    d->fp8_prefill_ = *fp8_prefill;
    d->mla_scalar_ = mla_scalar;
    d->mla_split_cap_ = mla_split_cap;
    return std::shared_ptr<Device>(d);
  }

  ~CudaDevice() override {
    graph_clear();
    for (auto& [p, e] : copy_events_) kernels::cuda_event_destroy(e);
    for (auto& q : queued_) free_events_.push_back(q.event);
    if (stream_) {
      (void)kernels::cuda_stream_synchronize(stream_);
      kernels::cuda_stream_destroy(stream_);
    }
    for (void* e : free_events_) kernels::cuda_event_destroy(e);
  }

  const DeviceInfo& info() const override { return info_; }
  ElemType compute_type() const override { return ElemType::bf16; }
  // FP8 weights stay FP8 (kernels/fp8.h's products, the FP8 experts) and MXFP4 experts
  // packed (the expert launch's MXFP4 forms).
  bool keeps_fp8() const override { return true; }
  bool keeps_mxfp4() const override { return true; }
  void* stream() const { return stream_; }

  // auto: in place where host memory is the device's own (integrated, and the driver maps
  // page-locked host memory for it); elsewhere device memory, which is faster than reading
  // across the bus. host-mapped asked of a GPU that cannot map host memory is refused here,
  // at start.
  static Result<WeightsPlacement> choose_weights_placement(WeightsPlacement want,
                                                           const kernels::DeviceLimits& l) {
    if (want == WeightsPlacement::automatic)
      return l.integrated && l.can_map_host_memory ? WeightsPlacement::host_mapped
                                                   : WeightsPlacement::device;
    if (want == WeightsPlacement::host_mapped && !l.can_map_host_memory)
      return make_error(Errc::unsupported,
                        fmt::format("WEIGHTS_PLACEMENT=host-mapped: {} cannot map page-locked "
                                    "host memory (canMapHostMemory is 0) — set "
                                    "WEIGHTS_PLACEMENT=device or auto",
                                    kernels::describe_device(l)));
    return want;
  }

  // The weights of host-mapped placement: one page-locked allocation, its buffers views of it.
  struct MappedArena {
    kernels::MappedHostMemory m;
    size_t bytes = 0;
    ~MappedArena() { kernels::cuda_host_free(m.host); }
  };

  Result<std::vector<Buffer>> alloc_weights(
      const std::vector<std::pair<ElemType, size_t>>& sizes) override {
    if (info_.weights != WeightsPlacement::host_mapped) return Device::alloc_weights(sizes);
    constexpr size_t kAlign = 256;  // as cudaMalloc's, so products pick the same algorithms
    size_t total = 0;
    for (const auto& [type, numel] : sizes)
      total += (elem_bytes(type, numel) + kAlign - 1) / kAlign * kAlign;
    auto m = kernels::cuda_host_alloc_mapped(total);
    if (!m)
      return make_error(m.error().code,
                        fmt::format("{}: host-mapped weights ({} MiB): {} — free host memory or "
                                    "set WEIGHTS_PLACEMENT=device",
                                    info_.name, total >> 20, m.error().message));
    auto arena = std::make_shared<MappedArena>();
    arena->m = *m;
    arena->bytes = total;
    arenas_.push_back(arena);
    std::vector<Buffer> out;
    out.reserve(sizes.size());
    size_t at = 0;
    for (const auto& [type, numel] : sizes) {
      out.emplace_back(arena, static_cast<char*>(arena->m.device) + at, numel, type);
      at += (elem_bytes(type, numel) + kAlign - 1) / kAlign * kAlign;
    }
    return out;
  }

  void* host_address(const Buffer& b) const override {
    const auto* p = static_cast<const char*>(b.data());
    for (const auto& w : arenas_) {
      auto a = w.lock();
      if (!a) continue;
      const auto* dev = static_cast<const char*>(a->m.device);
      if (p >= dev && p + b.bytes() <= dev + a->bytes)
        return static_cast<char*>(a->m.host) + (p - dev);
    }
    return nullptr;
  }

  Result<Buffer> alloc(ElemType type, size_t numel) override {
    auto p = kernels::cuda_malloc(std::max<size_t>(elem_bytes(type, numel), 1));
    if (!p) return make_error(p.error().code, fmt::format("{}: {}", info_.name, p.error().message));
    return Buffer(std::shared_ptr<void>(*p, kernels::cuda_free), *p, numel, type);
  }

  Status upload(const Buffer& dst, const void* src, DType src_type) override {
    kernels::set_programmatic_launch(false);  // until the next step: dst may be a weight
    const size_t n = dst.numel();
    if (n == 0) return Status::Ok();
    const bool same = (dst.type() == ElemType::bf16 && src_type == DType::bf16) ||
                      (dst.type() == ElemType::f32 && src_type == DType::f32) ||
                      (dst.type() == ElemType::fp8_e4m3 && src_type == DType::f8_e4m3) ||
                      ((dst.type() == ElemType::mxfp4_e2m1 || dst.type() == ElemType::u8) &&
                       src_type == DType::u8);
    if (same) {
      // Asynchronous: staging_ready(src) waits for this copy, so the caller's next read
      // (into its other staging buffer) overlaps it.
      void*& ev = copy_events_[src];
      if (!ev) {
        auto e = kernels::cuda_event_create();
        if (!e) return e.error();
        ev = *e;
      }
      SPARK_TRY(kernels::cuda_memcpy_async(dst.data(), src, dst.bytes(), stream_));
      return kernels::cuda_event_record(ev, stream_);
    }
    SPARK_TRY(kernels::cuda_stream_synchronize(stream_));  // staging may hold pending copies
    // Widen on the host to fp32 (F16 and BF16 sources into fp32 destinations), or copy fp32
    // up and round to bf16 on the device.
    const float* f = nullptr;
    if (src_type == DType::f32) {
      f = static_cast<const float*>(src);
    } else if (src_type == DType::bf16 || src_type == DType::f16) {
      widen_.resize(n);
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i)
        widen_[i] = src_type == DType::bf16 ? bf16_to_float(s[i]) : f16_to_float(s[i]);
      f = widen_.data();
    } else {
      return make_error(Errc::unsupported,
                        fmt::format("cuda device: cannot load {} into {}", dtype_name(src_type),
                                    elem_name(dst.type())));
    }
    if (dst.type() == ElemType::f32) {
      SPARK_TRY(kernels::cuda_memcpy_async(dst.data(), f, n * 4, stream_));
      return kernels::cuda_stream_synchronize(stream_);
    }
    if (convert_.numel() < n) {
      auto b = alloc(ElemType::f32, std::max(n, preferred_staging_bytes() / 4));
      if (!b) return b.error();
      convert_ = *b;
    }
    SPARK_TRY(kernels::cuda_memcpy_async(convert_.data(), f, n * 4, stream_));
    SPARK_TRY(kernels::cuda_f32_to_bf16(convert_.as<float>(), dst.data(), n, stream_));
    return kernels::cuda_stream_synchronize(stream_);
  }

  Result<Buffer> host_staging(size_t bytes) override {
    auto p = kernels::cuda_host_alloc(bytes);
    if (!p) return p.error();
    return Buffer(std::shared_ptr<void>(*p, kernels::cuda_host_free), *p, bytes / 4, ElemType::f32);
  }

  size_t preferred_staging_bytes() const override { return 64u << 20; }

  Status staging_ready(const void* src) override {
    auto it = copy_events_.find(src);
    if (it == copy_events_.end()) return Status::Ok();
    return kernels::cuda_event_synchronize(it->second);
  }

  Status zero(const Buffer& dst) override {
    return kernels::cuda_memset_async(dst.data(), 0, dst.bytes(), stream_);
  }

  Status copy_to_host(const Buffer& src, void* dst, size_t bytes) override {
    SPARK_TRY(kernels::cuda_memcpy_async(dst, src.data(), std::min(bytes, src.bytes()), stream_));
    return kernels::cuda_stream_synchronize(stream_);
  }

  Status fill_random(const Buffer& dst, uint64_t seed, float scale, float offset) override {
    if (dst.type() != ElemType::f32 && dst.type() != ElemType::bf16)
      return make_error(Errc::internal, "cuda device: a random fill of an integer buffer");
    kernels::set_programmatic_launch(false);
    return kernels::fill_random_cuda_device(dst.data(), kdt(dst.type()), dst.numel(), seed, scale,
                                            offset, stream_);
  }

  Status to_host(const Buffer& src, float* dst, size_t n) override {
    n = std::min(n, src.numel());
    if (src.type() == ElemType::f32) {
      SPARK_TRY(kernels::cuda_memcpy_async(dst, src.data(), n * 4, stream_));
      return kernels::cuda_stream_synchronize(stream_);
    }
    std::vector<uint16_t> tmp(n);
    SPARK_TRY(kernels::cuda_memcpy_async(tmp.data(), src.data(), n * 2, stream_));
    SPARK_TRY(kernels::cuda_stream_synchronize(stream_));
    for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(tmp[i]);
    return Status::Ok();
  }

  Result<uint64_t> available_bytes() override {
    // On unified memory the GPU's allocations come out of the host's RAM, and the host
    // freezes when that runs out: MemAvailable is the number that matters there.
    if (info_.unified_memory) return device_memory_available(true, 0, proc_root_);
    auto m = kernels::cuda_mem_info();
    if (!m) return m.error();
    return device_memory_available(false, m->free_bytes, proc_root_);
  }

  Status begin_step(const StepLayout& st) override {
    kernels::set_programmatic_launch(pdl_);
    step_ = st;
    const size_t T = static_cast<size_t>(st.tokens_n()), C = static_cast<size_t>(st.chunks_n()),
                 W = static_cast<size_t>(st.table_width);
    SPARK_TRY(grow_meta(T, C, W));
    const bool windows = !st.window_tables.empty();
    if (windows && (st.window_slots.size() != T || st.window_tables.size() != C * W))
      return make_error(Errc::internal,
                        fmt::format("cuda device: a step of {} tokens and {} chunks has {} window "
                                    "slots and {} window table entries",
                                    T, C, st.window_slots.size(), st.window_tables.size()));
    meta_.place(T, C, st.logit_rows.size(), windows);
    // Two host copies, used in turn: the previous step's copy may not have run yet when a
    // step is queued behind it (queues_steps); the one before it has, since at most two
    // steps are in flight.
    meta_turn_ ^= 1;
    const Buffer& mh = meta_host_[meta_turn_];
    auto* h = mh.as<int32_t>();
    std::memcpy(h + meta_.tokens, st.tokens.data(), T * 4);
    std::memcpy(h + meta_.positions, st.positions.data(), T * 4);
    std::memcpy(h + meta_.slots, st.slots.data(), T * 4);
    std::memcpy(h + meta_.query_start, st.chunk_begin.data(), (C + 1) * 4);
    std::memcpy(h + meta_.seq_lens, st.chunk_len.data(), C * 4);
    // Tables at the capacity's row width, so the kernels' stride is fixed for a graph.
    for (size_t c = 0; c < C; ++c) {
      std::memcpy(h + meta_.tables + c * meta_.cap_width, st.block_tables.data() + c * W, W * 4);
      std::memset(h + meta_.tables + c * meta_.cap_width + W, 0, (meta_.cap_width - W) * 4);
    }
    std::memcpy(h + meta_.rows, st.logit_rows.data(), st.logit_rows.size() * 4);
    if (windows) {
      std::memcpy(h + meta_.wslots, st.window_slots.data(), T * 4);
      for (size_t c = 0; c < C; ++c) {
        std::memcpy(h + meta_.wtables + c * meta_.cap_width, st.window_tables.data() + c * W,
                    W * 4);
        std::memset(h + meta_.wtables + c * meta_.cap_width + W, 0, (meta_.cap_width - W) * 4);
      }
    }
    max_query_len_ = 0;
    max_seq_len_ = 0;
    for (size_t c = 0; c < C; ++c) {
      max_query_len_ = std::max(max_query_len_, st.chunk_begin[c + 1] - st.chunk_begin[c]);
      max_seq_len_ = std::max(max_seq_len_, st.chunk_len[c]);
    }
    if (st.max_seq_len_bound > 0) max_seq_len_ = std::max(max_seq_len_, st.max_seq_len_bound);
    return kernels::cuda_memcpy_async(meta_dev_.data(), mh.data(), meta_.used * 4, stream_);
  }

  Status embed(const Buffer& table, const Buffer& x, int dim) override {
    SPARK_TRY(need(table.type(), ElemType::bf16, "the embedding table"));
    const size_t D = static_cast<size_t>(dim);
    return kernels::embedding_cuda_device(kernels::DType::bf16, table.data(), table.numel() / D, D,
                                          dev_i32(meta_.tokens), step_.tokens.size(), x.data(),
                                          stream_);
  }

  Status rmsnorm(const Buffer& x, const Buffer& w, const Buffer& y, int rows, int dim,
                 float eps) override {
    return kernels::add_rmsnorm_cuda_device(kernels::DType::bf16, x.data(), nullptr, w.data(),
                                            y.data(), static_cast<size_t>(rows),
                                            static_cast<size_t>(dim), eps, stream_);
  }

  Status add_rmsnorm(const Buffer& x, const Buffer& delta, const Buffer& bias, const Buffer& w,
                     const Buffer& y, int rows, int dim, float eps) override {
    // The bias joins delta (or x, without one) first.
    if (!bias.empty())
      SPARK_TRY(kernels::bias_add_cuda_device(
          kernels::DType::bf16, delta.empty() ? x.data() : delta.data(), bias.data(),
          static_cast<size_t>(rows), static_cast<size_t>(dim), stream_));
    if (w.empty()) {
      if (delta.empty()) return Status::Ok();
      return make_error(Errc::internal, "add_rmsnorm on CUDA: a residual add without a norm");
    }
    return kernels::add_rmsnorm_cuda_device(
        kernels::DType::bf16, x.data(), delta.empty() ? nullptr : delta.data(), w.data(), y.data(),
        static_cast<size_t>(rows), static_cast<size_t>(dim), eps, stream_);
  }

  Status linear(const Buffer& x, const Buffer& w, const Buffer& b, const Buffer& y, int rows,
                int in, int out) override {
    if (w.type() == ElemType::fp8_e4m3) return fp8_product(x, w, b, y, rows, in, out, false, false);
    return mm_->run(product(x, w, b, y, rows, in, out), stream_);
  }

  // Weight rows an FP8 prefill product dequantizes at a time (bf16, into fp8_ws_): the
  // products of a tile write its output columns, so the workspace stays 32 MiB whatever
  // the matrix.
  static constexpr size_t kFp8TileElems = size_t{16} << 20;

  // What the bf16 and the FP8 products' arguments share for y = x * w^T (+ b): the input,
  // the output, the sizes and the bias (the weight is each one's own).
  template <typename Args>
  static void product_fields(const Buffer& x, const Buffer& b, const Buffer& y, int rows, int in,
                             int out, Args* a) {
    a->a = x.data();
    a->lda = static_cast<size_t>(in);
    a->out = y.data();
    a->out_dtype = kdt(y.type());
    a->ldo = static_cast<size_t>(out);
    a->m = static_cast<size_t>(rows);
    a->n = static_cast<size_t>(out);
    a->k = static_cast<size_t>(in);
    a->bias = b.empty() ? nullptr : b.data();
  }

  // The decode kernel's arguments for y = x * w^T (+ b) over FP8 w.
  static Result<kernels::Fp8MatmulArgs> fp8_args(const Buffer& x, const Buffer& w, const Buffer& b,
                                                 const Buffer& y, int rows, int in, int out) {
    auto fw = fp8_weight(w);
    if (!fw) return fw.error();
    kernels::Fp8MatmulArgs a;
    product_fields(x, b, y, rows, in, out, &a);
    a.w = *fw;
    return a;
  }
  // Whether an FP8 decode product normalises its input itself (the norm's weight read in
  // the product, as the own bf16 kernel does: FP8 weights are never folded).
  bool fp8_norm_in_product(const PreNorm& in, int rows) const {
    return norm_in_products_ && static_cast<size_t>(rows) <= kernels::kFp8GemvMaxRows &&
           !in.folded && in.delta->empty() && in.bias->empty() && in.w->type() == ElemType::bf16 &&
           aligned16(*in.w) && aligned16(*in.x);
  }

  // y = x * w^T (+ b) (+ y with accumulate) over FP8 weights kept as stored: decode rows in
  // one pass over the FP8 bytes (kernels/fp8.h), with SwiGLU in its epilogue when asked
  // (w then holds [gate | up], 2 * out rows); more rows on the FP8 tensor cores where they
  // take the product (fp8_tc_product), else through bf16 tiles of the dequantized weight
  // and the bf16 product (the tile's rounding to bf16 is the bound on the difference from
  // the exact product).
  // With `norm`, the decode product runs over RMSNorm(x) computed inside. Launched as the
  // step's other kernels are, with programmatic launch where the step has it: both kernels
  // wait for the kernel ahead before they read what it writes or write what it reads.
  Status fp8_product(const Buffer& x, const Buffer& w, const Buffer& b, const Buffer& y, int rows,
                     int in, int out, bool accumulate, bool swiglu, const PreNorm* norm = nullptr) {
    auto fw = fp8_weight(w);
    if (!fw) return fw.error();
    if (static_cast<size_t>(rows) <= kernels::kFp8GemvMaxRows) {
      auto a = fp8_args(x, w, b, y, rows, in, out);
      if (!a) return a.error();
      a->accumulate = accumulate;
      a->swiglu = swiglu;
      if (norm) a->norm_w = norm->w->data(), a->norm_eps = norm->eps;
      return kernels::fp8_gemv_cuda_device(*a, stream_);
    }
    if (swiglu)
      return make_error(Errc::internal, "cuda device: an FP8 SwiGLU product above decode rows");
    if (fp8_prefill_ != 2) {
      auto tc = fp8_tc_product(x, *fw, b, y, rows, in, out, accumulate);
      if (!tc) return tc.error();
      if (*tc) return Status::Ok();
      if (fp8_prefill_ == 1)
        return make_error(Errc::unsupported,
                          fmt::format("SPARK_CUDA_FP8_PREFILL=tensor-core: the FP8 tensor cores "
                                      "cannot take the product of {} rows over an FP8 weight of "
                                      "{} x {} on {} (cuBLASLt's block-scaled FP8 runs on "
                                      "Hopper; the weight's scales must be 128 x 128 blocks); "
                                      "unset it to use the dequantized path",
                                      rows, out, in, info_.name));
    }
    const size_t K = static_cast<size_t>(in), N = static_cast<size_t>(out);
    const size_t tile = std::max<size_t>(1, std::min(N, kFp8TileElems / std::max<size_t>(K, 1)));
    if (fp8_ws_.numel() < tile * K) {
      SPARK_TRY(kernels::cuda_stream_synchronize(stream_));
      auto t = alloc(ElemType::bf16, tile * K);
      if (!t) return t.error();
      fp8_ws_ = *t;
    }
    for (size_t n0 = 0; n0 < N; n0 += tile) {
      const size_t n = std::min(tile, N - n0);
      SPARK_TRY(kernels::fp8_dequantize_cuda_device(*fw, n0, n, K, fp8_ws_.data(), K, stream_));
      kernels::MatmulArgs a = product(x, fp8_ws_, b, y, rows, in, out);
      a.n = n;
      a.out = static_cast<char*>(y.data()) + n0 * elem_size(y.type());
      a.bias = b.empty() ? nullptr : static_cast<const char*>(b.data()) + n0 * elem_size(b.type());
      a.accumulate = accumulate;
      SPARK_TRY(mm_->run(a, stream_));
    }
    return Status::Ok();
  }

  // y = x * w^T (+ b) (+ y) of more than decode rows on the FP8 tensor cores: x's rows
  // quantized per 128 columns into fp8_ws_ (as many rows a pass as its 32 MiB hold, a
  // multiple of kFp8TcRowAlign) and multiplied there by cuBLASLt's block-scaled FP8 product;
  // the last rows short of that multiple (at most 3) by the decode kernel. False (nothing
  // written) where the tensor cores cannot take it: the weight's or the buffers' layout, or
  // no algorithm on this GPU.
  Result<bool> fp8_tc_product(const Buffer& x, const kernels::Fp8Weight& w, const Buffer& b,
                              const Buffer& y, int rows, int in, int out, bool accumulate) {
    const size_t M = static_cast<size_t>(rows), K = static_cast<size_t>(in),
                 N = static_cast<size_t>(out);
    if (x.type() != ElemType::bf16 || y.type() != ElemType::bf16 ||
        (!b.empty() && (b.type() != ElemType::bf16 || !aligned16(b))) ||
        !kernels::fp8_tc_weight_ok(w, K) || N % 8 != 0 || !aligned16(x) || !aligned16(y))
      return false;
    const size_t tc_rows = M / kernels::kFp8TcRowAlign * kernels::kFp8TcRowAlign;
    const size_t blocks = (K + kernels::kFp8BlockK - 1) / kernels::kFp8BlockK;
    const size_t ws_bytes = kFp8TileElems * 2;
    // Codes, then (from a 256-byte boundary) the scales of each pass's rows.
    size_t pass = (ws_bytes - 256) / (K + 4 * blocks);
    pass = std::min(tc_rows, pass / kernels::kFp8TcRowAlign * kernels::kFp8TcRowAlign);
    if (pass == 0) return false;
    if (fp8_ws_.numel() < kFp8TileElems) {
      SPARK_TRY(kernels::cuda_stream_synchronize(stream_));
      auto t = alloc(ElemType::bf16, kFp8TileElems);
      if (!t) return t.error();
      fp8_ws_ = *t;
    }
    auto* ws = static_cast<uint8_t*>(fp8_ws_.data());
    for (size_t r0 = 0; r0 < tc_rows; r0 += pass) {
      const size_t m = std::min(pass, tc_rows - r0);
      kernels::Fp8Rows q;
      q.q = ws, q.ldq = K;
      q.scales = reinterpret_cast<float*>(ws + (m * K + 255) / 256 * 256), q.scale_ld = m;
      SPARK_TRY(kernels::fp8_quantize_rows_cuda_device(
          static_cast<const char*>(x.data()) + r0 * K * 2, K, m, K, q, stream_));
      kernels::Fp8TcArgs a;
      a.a = q.q, a.lda = K, a.a_scales = q.scales, a.w = w;
      a.out = static_cast<char*>(y.data()) + r0 * N * 2, a.ldo = N;
      a.m = m, a.n = N, a.k = K;
      a.bias = b.empty() ? nullptr : b.data();
      a.accumulate = accumulate;
      Status st = mm_->run_fp8(a, stream_);
      if (!st.ok() && st.error().code == Errc::unsupported && r0 == 0) return false;
      SPARK_TRY(st);
    }
    if (tc_rows < M) {
      kernels::Fp8MatmulArgs a;
      product_fields(x, b, y, rows, in, out, &a);
      a.w = w;
      a.a = static_cast<const char*>(x.data()) + tc_rows * K * 2;
      a.out = static_cast<char*>(y.data()) + tc_rows * N * 2;
      a.m = M - tc_rows;
      a.accumulate = accumulate;
      SPARK_TRY(kernels::fp8_gemv_cuda_device(a, stream_));
    }
    return true;
  }

  static kernels::MatmulArgs product(const Buffer& x, const Buffer& w, const Buffer& b,
                                     const Buffer& y, int rows, int in, int out) {
    kernels::MatmulArgs a;
    product_fields(x, b, y, rows, in, out, &a);
    a.w = w.data();
    a.ldw = static_cast<size_t>(in);
    return a;
  }

  // The own kernel's arguments for a group of products over x, when it takes them as one
  // launch (bf16 outputs, aligned operands, weights small enough for its rate to beat
  // separate products at these rows); false otherwise.
  bool own_group(const Buffer& x, const LinearPart* parts, int n, int rows, int in,
                 kernels::MatmulArgs* a) const {
    if (n < 1 || n > kernels::kMatmulMaxGroup || in % 8 != 0 || !aligned16(x)) return false;
    size_t total = 0;
    for (int i = 0; i < n; ++i) {
      if (parts[i].y->type() != ElemType::bf16 || parts[i].w->type() != ElemType::bf16 ||
          !aligned16(*parts[i].w))
        return false;
      total += static_cast<size_t>(parts[i].out) * static_cast<size_t>(in);
    }
    if (!kernels::matmul_group_prefers_own(static_cast<size_t>(rows), total)) return false;
    for (int i = 0; i < n; ++i) {
      a[i] = product(x, *parts[i].w, *parts[i].b, *parts[i].y, rows, in, parts[i].out);
      a[i].backend = kernels::MatmulBackend::own;
    }
    return true;
  }

  // FP8 parts at decode rows: one launch of the FP8 kernel for all of them, over x or (with
  // `norm`) over RMSNorm(x) computed inside. False where that does not apply.
  // The FP8 decode products' arguments of a group (false: not FP8 decode products).
  Result<bool> fp8_group_args(const Buffer& x, const LinearPart* parts, int n, int rows, int in,
                              const PreNorm* norm, kernels::Fp8MatmulArgs* a) {
    if (n < 1 || static_cast<size_t>(n) > kernels::kFp8GemvMaxGroup ||
        static_cast<size_t>(rows) > kernels::kFp8GemvMaxRows)
      return false;
    for (int i = 0; i < n; ++i) {
      if (parts[i].w->type() != ElemType::fp8_e4m3) return false;
      auto r = fp8_args(x, *parts[i].w, *parts[i].b, *parts[i].y, rows, in, parts[i].out);
      if (!r) return r.error();
      a[i] = *r;
      if (norm) a[i].norm_w = norm->w->data(), a[i].norm_eps = norm->eps;
    }
    return true;
  }
  Result<bool> fp8_group(const Buffer& x, const LinearPart* parts, int n, int rows, int in,
                         const PreNorm* norm) {
    kernels::Fp8MatmulArgs a[kernels::kFp8GemvMaxGroup];
    auto f = fp8_group_args(x, parts, n, rows, in, norm, a);
    if (!f || !*f) return f;
    SPARK_TRY(kernels::fp8_gemv_group_cuda_device(a, n, stream_));
    return true;
  }

  Status linear_group(const Buffer& x, const LinearPart* parts, int n, int rows, int in) override {
    auto f = fp8_group(x, parts, n, rows, in, nullptr);
    if (!f) return f.error();
    if (*f) return Status::Ok();
    // Decode rows: one launch of the own kernel for all parts (the q, k, v projections).
    kernels::MatmulArgs a[kernels::kMatmulMaxGroup];
    if (!own_group(x, parts, n, rows, in, a)) return Device::linear_group(x, parts, n, rows, in);
    return kernels::matmul_own_group_cuda_device(a, n, stream_);
  }

  // Whether the own kernel normalises inside the products: the streaming form at 1-2 rows,
  // the tensor-core form up to 8 with the norm's weight folded into the products' (the
  // residual add already done: a norm with an add first needs the whole row before any
  // product starts, which is the separate pass).
  bool norm_in_product(const PreNorm& in, int rows) const {
    const bool form_takes =
        rows <= 2 || (in.folded && static_cast<size_t>(rows) <= kernels::kMatmulQkvRopeMaxRows);
    return norm_in_products_ && form_takes && in.delta->empty() && in.bias->empty() &&
           in.w->type() == ElemType::bf16 && aligned16(*in.w) && aligned16(*in.x);
  }
  // The products' input for `in`: x itself with the norm set in each product, or the
  // separate pass's output.
  Result<const Buffer*> product_input(const PreNorm& in, int rows, int dim, kernels::MatmulArgs* a,
                                      int n) {
    if (!norm_in_product(in, rows)) {
      SPARK_TRY(pre_norm(in, rows, dim));
      for (int i = 0; i < n; ++i) a[i].a = in.normed->data();
      return in.normed;
    }
    for (int i = 0; i < n; ++i) {
      a[i].a = in.x->data();
      a[i].norm_w = in.folded ? nullptr : in.w->data();
      a[i].norm_unit = in.folded;
      a[i].norm_eps = in.eps;
    }
    return in.x;
  }

  // Folded norm weights: measured in the layer chain (bench/kernels, --only layer) 115.2 us
  // against 120.4 with the weight read and multiplied inside the products. Not with the
  // norms as their own pass (SPARK_CUDA_NORM_IN_PRODUCT=0); the model leaves weights read in
  // place from a mapped file as they are.
  bool folds_norm_weights() const override { return norm_in_products_ && fold_norms_; }
  Status fold_norm_weight(const Buffer& w, const Buffer& norm_w, int cols) override {
    SPARK_TRY(need(w.type(), ElemType::bf16, "a weight to fold a norm into"));
    SPARK_TRY(need(norm_w.type(), ElemType::bf16, "a norm weight"));
    const size_t C = static_cast<size_t>(cols);
    if (C == 0 || w.numel() % C != 0 || norm_w.numel() != C)
      return make_error(Errc::internal,
                        fmt::format("cuda device: folding a norm of {} into a weight of {} "
                                    "elements of rows of {}",
                                    norm_w.numel(), w.numel(), cols));
    kernels::set_programmatic_launch(false);
    return kernels::rmsnorm_fold_weight_cuda_device(
        static_cast<kernels::bf16_bits*>(w.data()), w.numel() / C, C,
        static_cast<const kernels::bf16_bits*>(norm_w.data()), stream_);
  }

  Status linear_group_rope_kv_write(const PreNorm& x, const LinearPart* qkv, int rows, int in,
                                    int heads, int kv_heads, int head_dim, const Buffer& inv_freq,
                                    const Buffer& q_norm, const Buffer& k_norm, float eps,
                                    const KVLayerView& kv) override {
    // Decode rows (up to 8): the input norm inside the products, and without per-head norms
    // RoPE and the KV write in their epilogue (two launches fewer per layer); otherwise the
    // norm's pass, the products, then rope_kv_write.
    // FP8 q/k/v: one launch of the FP8 kernel with the norm inside it, and RoPE and the KV
    // write in its epilogue where it takes them as the bf16 one does (whole rotary; per-head
    // norms at 1-2 rows); else RoPE and the KV write after it.
    const bool head_norms = !q_norm.empty() || !k_norm.empty();
    const bool epilogue_takes =
        static_cast<size_t>(rows) <= kernels::kMatmulQkvRopeMaxRows &&
        inv_freq.numel() * 2 == static_cast<size_t>(head_dim) &&
        (!head_norms || kernels::matmul_qkv_rope_head_norms(static_cast<size_t>(rows),
                                                            static_cast<size_t>(head_dim)));
    if (qkv[0].w->type() == ElemType::fp8_e4m3 && fp8_norm_in_product(x, rows)) {
      kernels::Fp8MatmulArgs a[3];
      auto f = fp8_group_args(*x.x, qkv, 3, rows, in, &x, a);
      if (!f) return f.error();
      if (*f && epilogue_takes)
        return kernels::fp8_qkv_rope_cuda_device(
            a,
            rope_kv_args(*qkv[0].y, *qkv[1].y, *qkv[2].y, heads, kv_heads, head_dim, inv_freq,
                         q_norm, k_norm, eps, kv),
            stream_);
      if (*f) {
        SPARK_TRY(kernels::fp8_gemv_group_cuda_device(a, 3, stream_));
        return rope_kv_write(*qkv[0].y, *qkv[1].y, *qkv[2].y, heads, kv_heads, head_dim, inv_freq,
                             q_norm, k_norm, eps, kv);
      }
    }
    kernels::MatmulArgs a[3];
    if (static_cast<size_t>(rows) > kernels::kMatmulQkvRopeMaxRows ||
        !own_group(*x.x, qkv, 3, rows, in, a))
      return Device::linear_group_rope_kv_write(x, qkv, rows, in, heads, kv_heads, head_dim,
                                                inv_freq, q_norm, k_norm, eps, kv);
    SPARK_TRY(product_input(x, rows, in, a, 3).status());
    // Partial rotary (fewer frequencies than head_dim / 2) runs the RoPE kernel after the
    // products, and so do per-head norms (Qwen3) where the epilogue cannot take them (more
    // than 2 rows, a head_dim other than 32, 64 or 128, no clusters): the epilogue rotates
    // whole heads only, and sums a head's squares across a cluster of blocks.
    if (!epilogue_takes) {
      SPARK_TRY(kernels::matmul_own_group_cuda_device(a, 3, stream_));
      return rope_kv_write(*qkv[0].y, *qkv[1].y, *qkv[2].y, heads, kv_heads, head_dim, inv_freq,
                           q_norm, k_norm, eps, kv);
    }
    return kernels::matmul_qkv_rope_cuda_device(
        a,
        rope_kv_args(*qkv[0].y, *qkv[1].y, *qkv[2].y, heads, kv_heads, head_dim, inv_freq, q_norm,
                     k_norm, eps, kv),
        stream_);
  }

  Status linear_swiglu(const PreNorm& x, const Buffer& w, const Buffer& b, const Buffer& gate_up,
                       const Buffer& y, int rows, int in, int inter) override {
    // SwiGLU in the product's epilogue (and the norm inside it, see norm_in_product) where
    // the own kernel is the faster product; where cuBLASLt is, the norm's pass, its product
    // and a separate SwiGLU.
    // Up to 8 rows with the norm inside, the own kernel always: alone cuBLASLt's product is
    // a few us faster (28672 x 4096 at 8 rows: 56.6 us against 60.1), but with the norm's
    // pass and SwiGLU beside it the layer's chain is slower (bench/kernels, "layer8": 141.2
    // us a layer against 134.0).
    if (w.type() == ElemType::fp8_e4m3) {
      // Decode rows: the norm inside the FP8 product, with SwiGLU in its epilogue.
      if (fp8_norm_in_product(x, rows) && y.type() == ElemType::bf16)
        return fp8_product(*x.x, w, b, y, rows, in, inter, false, true, &x);
      // Otherwise the norm's pass, then the FP8 product.
      SPARK_TRY(pre_norm(x, rows, in));
      if (static_cast<size_t>(rows) <= kernels::kFp8GemvMaxRows && y.type() == ElemType::bf16)
        return fp8_product(*x.normed, w, b, y, rows, in, inter, false, true);
      SPARK_TRY(fp8_product(*x.normed, w, b, gate_up, rows, in, 2 * inter, false, false));
      return swiglu(gate_up, y, rows, inter);
    }
    const bool own = norm_in_product(x, rows) ||
                     mm_->choose(static_cast<size_t>(rows), 2 * static_cast<size_t>(inter),
                                 static_cast<size_t>(in)) == kernels::MatmulBackend::own;
    if (!own || in % 8 != 0 || y.type() != ElemType::bf16 || !aligned16(*x.x) ||
        !aligned16(*x.normed) || !aligned16(w))
      return Device::linear_swiglu(x, w, b, gate_up, y, rows, in, inter);
    kernels::MatmulArgs a = product(*x.x, w, b, y, rows, in, inter);
    a.swiglu = true;
    SPARK_TRY(product_input(x, rows, in, &a, 1).status());
    return kernels::matmul_own_cuda_device(a, stream_);
  }

  Status linear_add(const Buffer& x, const Buffer& w, const Buffer& b, const Buffer& scratch,
                    const Buffer& y, int rows, int in, int out) override {
    // The product's epilogue adds it (and the bias) into y: the own kernel reads y's old
    // values before its product ends, cuBLASLt with beta = 1.
    (void)scratch;
    if (w.type() == ElemType::fp8_e4m3) return fp8_product(x, w, b, y, rows, in, out, true, false);
    kernels::MatmulArgs a = product(x, w, b, y, rows, in, out);
    a.accumulate = true;
    return mm_->run(a, stream_);
  }

  kernels::RopeArgs rope_args(const Buffer& q, const Buffer& k, int heads, int kv_heads,
                              int head_dim, const Buffer& inv_freq, const Buffer& q_norm,
                              const Buffer& k_norm, float eps) {
    kernels::RopeArgs r;
    r.dtype = kernels::DType::bf16;
    r.q = q.data();
    r.q_stride = static_cast<size_t>(heads) * static_cast<size_t>(head_dim);
    r.n_heads = heads;
    r.k = k.data();
    r.k_stride = static_cast<size_t>(kv_heads) * static_cast<size_t>(head_dim);
    r.n_kv_heads = kv_heads;
    r.head_dim = head_dim;
    r.n_tokens = step_.tokens.size();
    r.positions = dev_i32(meta_.positions);
    r.inv_freq = inv_freq.as<float>();
    r.rotary_dim = static_cast<int>(inv_freq.numel() * 2);
    r.q_norm = q_norm.empty() ? nullptr : q_norm.data();
    r.k_norm = k_norm.empty() ? nullptr : k_norm.data();
    r.norm_eps = eps;
    return r;
  }

  Status rope_qk(const Buffer& q, const Buffer& k, int heads, int kv_heads, int head_dim,
                 const Buffer& inv_freq, const Buffer& q_norm, const Buffer& k_norm,
                 float eps) override {
    return kernels::rope_cuda_device(
        rope_args(q, k, heads, kv_heads, head_dim, inv_freq, q_norm, k_norm, eps), stream_);
  }

  Status rope_kv_write(const Buffer& q, const Buffer& k, const Buffer& v, int heads, int kv_heads,
                       int head_dim, const Buffer& inv_freq, const Buffer& q_norm,
                       const Buffer& k_norm, float eps, const KVLayerView& kv) override {
    return kernels::rope_cuda_device(
        rope_kv_args(q, k, v, heads, kv_heads, head_dim, inv_freq, q_norm, k_norm, eps, kv),
        stream_);
  }

  kernels::RopeArgs rope_kv_args(const Buffer& q, const Buffer& k, const Buffer& v, int heads,
                                 int kv_heads, int head_dim, const Buffer& inv_freq,
                                 const Buffer& q_norm, const Buffer& k_norm, float eps,
                                 const KVLayerView& kv) {
    kernels::RopeArgs r = rope_args(q, k, heads, kv_heads, head_dim, inv_freq, q_norm, k_norm, eps);
    const kernels::PagedKVDevice p = paged(kv);
    r.k_cache = p.k;
    r.v_cache = p.v;
    r.cache_dtype = p.dtype;
    r.cache_slots = static_cast<long long>(p.num_blocks) * p.block_size;
    r.slots = slots_for(kv);
    r.v = v.data();
    r.v_stride = static_cast<size_t>(kv_heads) * static_cast<size_t>(head_dim);
    return r;
  }

  Status kv_write(const KVLayerView& kv, const Buffer& k, const Buffer& v) override {
    const size_t kw = static_cast<size_t>(kv.n_kv_heads) * static_cast<size_t>(kv.head_dim);
    return kernels::paged_kv_write_cuda_device(paged(kv), slots_for(kv), step_.tokens.size(),
                                               kernels::DType::bf16, k.data(), kw, v.data(), kw,
                                               stream_);
  }

  // The attention kernels' view of this step: its queries, the layer's cache and tables.
  kernels::AttentionBatch attention_batch(const KVLayerView& kv, const Buffer& q, const Buffer& out,
                                          int heads, float scale, int window) {
    kernels::AttentionBatch b;
    b.dtype = kernels::DType::bf16;
    b.q = q.data();
    b.q_stride = static_cast<size_t>(heads) * static_cast<size_t>(kv.head_dim);
    b.out = out.data();
    b.out_stride = b.q_stride;
    b.n_heads = heads;
    b.kv = paged(kv);
    b.block_tables = tables_for(kv);
    b.max_blocks_per_seq = static_cast<int>(meta_.cap_width);
    b.seq_lens = dev_i32(meta_.seq_lens);
    b.query_start = dev_i32(meta_.query_start);
    b.n_seqs = step_.chunks_n();
    b.n_tokens = step_.tokens.size();
    b.max_query_len = max_query_len_;
    b.max_seq_len = max_seq_len_;
    b.scale = scale;
    b.window = window;
    return b;
  }

  Status attention(const KVLayerView& kv, const Buffer& q, const Buffer& out, int heads,
                   float scale, int window) override {
    return run_attention(attention_batch(kv, q, out, heads, scale, window));
  }

  // Prefill and mixed steps run the prefill kernel; decode-only steps the short-context
  // kernel or split-K (on the tensor cores where it takes the shape), as their bounds
  // choose. Every path honours b.sinks.
  Status run_attention(kernels::AttentionBatch b) {
    if (!step_.decode_only()) return kernels::attention_prefill_cuda_device(b, stream_);
    SPARK_TRY(grow_attn_ws(kernels::attention_decode_workspace_bytes(b.n_seqs, b.n_heads,
                                                                     b.kv.head_dim, max_seq_len_)));
    b.workspace = attn_ws_.data();
    b.workspace_bytes = attn_ws_.bytes();
    // Split-K on the tensor cores for groups of 4 heads and more where it takes the cache
    // (their scores cost the register kernel most); else the register kernel.
    const bool tc = kernels::attention_decode_tc_fits(b.kv.dtype, b.kv.head_dim) &&
                    b.n_heads >= 4 * b.kv.n_kv_heads;
    if (short_cap_ >= 0 && max_seq_len_ > short_cap_)
      b.decode_variant = tc ? 4 : 2;  // split-K only
    else if (tc && !kernels::attention_decode_short_takes(b))
      b.decode_variant = 4;
    // A decode step's rows before each query were written by earlier steps; its own row by
    // the RoPE/KV write just ahead.
    b.history_ready = true;
    return kernels::attention_decode_cuda_device(b, stream_);
  }

  Status mla_attention(const KVLayerView& kv, const Buffer& q, const Buffer& kv_a,
                       const Buffer& kv_norm, const Buffer& kv_b, const Buffer& inv_freq,
                       const Buffer& out, const MlaArgs& a) override {
    SPARK_TRY(need(q.type(), ElemType::bf16, "latent attention's q"));
    SPARK_TRY(need(kv_a.type(), ElemType::bf16, "latent attention's kv_a"));
    SPARK_TRY(need(kv_norm.type(), ElemType::bf16, "kv_a_layernorm"));
    SPARK_TRY(need(kv_b.type(), ElemType::bf16, "kv_b_proj"));
    SPARK_TRY(need(out.type(), ElemType::bf16, "latent attention's output"));
    if (static_cast<int>(inv_freq.numel()) * 2 != a.rope)
      return make_error(Errc::internal,
                        fmt::format("cuda device: {} RoPE frequencies for qk_rope_head_dim {}",
                                    inv_freq.numel(), a.rope));
    kernels::MlaCudaArgs m;
    m.s = mla_shape(a);
    m.eps = a.eps;
    m.q = q.data();
    m.kv_a = kv_a.data();
    m.kv_norm = kv_norm.data();
    m.kv_b = kv_b.data();
    m.inv_freq = inv_freq.as<float>();
    m.out = out.data();
    m.kv = paged(kv);
    m.block_tables = dev_i32(meta_.tables);
    m.max_blocks_per_seq = static_cast<int>(meta_.cap_width);
    m.positions = dev_i32(meta_.positions);
    m.slots = dev_i32(meta_.slots);
    m.query_start = dev_i32(meta_.query_start);
    m.n_seqs = step_.chunks_n();
    m.n_tokens = step_.tokens.size();
    m.max_seq_len = std::max(max_seq_len_, 1);
    m.splits = kernels::mla_splits(m.max_seq_len, step_.decode_only(), m.n_tokens, m.s.heads,
                                   lim_.sm_count);
    // (The cap only lowers the ranges, so the reserve below still covers the workspace.)
    if (mla_split_cap_ > 0) m.splits = std::min(m.splits, mla_split_cap_);
    SPARK_TRY(grow_mla_ws(kernels::mla_workspace_bytes(m.n_tokens, m.s, m.splits)));
    m.workspace = mla_ws_.data();
    m.workspace_bytes = mla_ws_.bytes();
    m.scalar_attention = mla_scalar_;
    return kernels::mla_cuda_device(m, stream_);
  }

  Status reserve_mla(int tokens, int seqs, int max_seq_len, const MlaArgs& a) override {
    const kernels::MlaShape s = mla_shape(a);
    const size_t T = static_cast<size_t>(std::max(tokens, 0)),
                 S = static_cast<size_t>(std::max(seqs, 0));
    // Prefill runs one range per token; decode steps split their contexts.
    return grow_mla_ws(
        std::max(kernels::mla_workspace_reserve(T, s, max_seq_len, false, lim_.sm_count),
                 kernels::mla_workspace_reserve(S, s, max_seq_len, true, lim_.sm_count)));
  }

  // gpt-oss: each head's learned sink joins the softmax's denominator, on every path
  // attention() takes (prefill, mixed, short-context and split-K decode).
  Status attention_sinks(const KVLayerView& kv, const Buffer& q, const Buffer& out, int heads,
                         float scale, int window, const Buffer& sinks) override {
    kernels::AttentionBatch b = attention_batch(kv, q, out, heads, scale, window);
    if (!sinks.empty()) {
      SPARK_TRY(need(sinks.type(), ElemType::f32, "attention sinks"));
      if (sinks.numel() != static_cast<size_t>(heads))
        return make_error(
            Errc::internal,
            fmt::format("cuda device: {} attention sinks for {} heads", sinks.numel(), heads));
      b.sinks = sinks.as<float>();
    }
    return run_attention(b);
  }

  Status swiglu(const Buffer& gate_up, const Buffer& y, int rows, int dim) override {
    return kernels::swiglu_bf16_cuda_device(gate_up.as<kernels::bf16_bits>(),
                                            y.as<kernels::bf16_bits>(), static_cast<size_t>(rows),
                                            static_cast<size_t>(dim), stream_);
  }

  static kernels::MoeRouteArgs route_args(const MoeRoute& r) {
    kernels::MoeRouteArgs a;
    a.experts = r.experts;
    a.top_k = r.top_k;
    a.sigmoid = r.sigmoid;
    a.norm_topk = r.norm_topk;
    a.n_group = r.n_group;
    a.topk_group = r.topk_group;
    a.scaling = r.scaling;
    return a;
  }

  Status moe_route(const Buffer& logits, const Buffer& bias, const MoeRoute& r, const Buffer& ids,
                   const Buffer& weights, int rows, float* margin) override {
    SPARK_TRY(need(logits.type(), ElemType::f32, "the router logits"));
    const kernels::MoeRouteArgs a = route_args(r);
    if (!bias.empty()) SPARK_TRY(need(bias.type(), ElemType::f32, "the router's correction bias"));
    SPARK_TRY(kernels::moe_route_cuda_device(
        logits.as<float>(), bias.empty() ? nullptr : bias.as<float>(), a, static_cast<size_t>(rows),
        ids.as<int32_t>(), weights.as<float>(), stream_));
    if (!margin) return Status::Ok();
    // Near-tie reports (tests): the margins of the same logits, from the twin on the host.
    const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(r.experts);
    std::vector<float> lg(n), bs(static_cast<size_t>(r.experts));
    SPARK_TRY(to_host(logits, lg.data(), n));
    if (!bias.empty()) SPARK_TRY(to_host(bias, bs.data(), bs.size()));
    std::vector<int32_t> hid(static_cast<size_t>(rows) * static_cast<size_t>(r.top_k));
    std::vector<float> hw(hid.size());
    kernels::moe_route_ref(lg.data(), bias.empty() ? nullptr : bs.data(), a,
                           static_cast<size_t>(rows), hid.data(), hw.data(), margin);
    return Status::Ok();
  }

  Status moe_experts(const Buffer& x, const Buffer& ids, const Buffer& weights, const MoeExperts& e,
                     const Buffer& out, int rows) override {
    SPARK_TRY(need(x.type(), ElemType::bf16, "the experts' input"));
    kernels::MoeExpertsArgs a;
    a.x = x.data();
    a.ids = ids.as<int32_t>();
    a.weights = weights.as<float>();
    a.rows = rows;
    a.top_k = e.top_k;
    a.hidden = e.hidden;
    a.gate_up = e.gate_up->data();
    a.down = e.down->data();
    a.expert0 = e.expert0;
    a.experts = e.experts;
    a.inter = e.inter;
    a.shared_inter = e.shared_inter;
    a.shared_gate_up = e.shared_inter > 0 ? e.shared_gate_up->data() : nullptr;
    a.shared_down = e.shared_inter > 0 ? e.shared_down->data() : nullptr;
    // FP8 experts kept as stored: their bytes and block scales (kernels/fp8.h's layout over
    // the stacked matrices).
    auto fp8 = [](const Buffer* w, kernels::Fp8Weight* f) -> Status {
      if (!w || w->type() != ElemType::fp8_e4m3) return Status::Ok();
      auto r = fp8_weight(*w);
      if (!r) return r.error();
      *f = *r;
      return Status::Ok();
    };
    SPARK_TRY(fp8(e.gate_up, &a.gate_up_fp8));
    SPARK_TRY(fp8(e.down, &a.down_fp8));
    if (e.shared_inter > 0) {
      SPARK_TRY(fp8(e.shared_gate_up, &a.shared_gate_up_fp8));
      SPARK_TRY(fp8(e.shared_down, &a.shared_down_fp8));
    }
    // MXFP4 experts kept packed: their bytes and e8m0 scales (kernels/mxfp4.h's layout over
    // the stacked matrices).
    if (e.gate_up->type() == ElemType::mxfp4_e2m1 || e.down->type() == ElemType::mxfp4_e2m1) {
      auto gu = mxfp4_weight(*e.gate_up);
      if (!gu) return gu.error();
      auto dn = mxfp4_weight(*e.down);
      if (!dn) return dn.error();
      a.gate_up_mx4 = *gu;
      a.down_mx4 = *dn;
    }
    if ((a.gate_up_fp8.q == nullptr) != (a.down_fp8.q == nullptr) ||
        (a.shared_gate_up_fp8.q == nullptr) != (a.shared_down_fp8.q == nullptr))
      return make_error(Errc::unsupported,
                        "cuda device: an expert's gate/up and down products must both be FP8 "
                        "or both be bf16");
    // gpt-oss's experts: the held experts' biases (bf16, the device's vector type), the
    // interleaved gate/up and the clamped activation; the kernels check the constants.
    auto bias = [&](const Buffer* b, size_t per, const char* what, const void** dst) -> Status {
      if (!b || b->empty()) return Status::Ok();
      SPARK_TRY(need(b->type(), ElemType::bf16, what));
      const size_t want = static_cast<size_t>(e.experts) * per;
      if (b->numel() < want)
        return make_error(Errc::internal,
                          fmt::format("cuda device: {} holds {} values, {} experts need {}", what,
                                      b->numel(), e.experts, want));
      *dst = b->data();
      return Status::Ok();
    };
    SPARK_TRY(bias(e.gate_up_bias, 2 * static_cast<size_t>(e.inter), "the experts' gate/up bias",
                   &a.gate_up_bias));
    SPARK_TRY(
        bias(e.down_bias, static_cast<size_t>(e.hidden), "the experts' down bias", &a.down_bias));
    a.interleaved = e.interleaved;
    a.swiglu_limit = e.swiglu_limit;
    a.swiglu_alpha = e.swiglu_alpha;
    a.out = out.data();
    a.accumulate = e.accumulate;
    a.form = moe_form_;
    SPARK_TRY(grow_moe_ws(kernels::moe_experts_workspace_bytes(rows, e.top_k, e.hidden, e.inter,
                                                               e.shared_inter, e.experts)));
    a.workspace = moe_ws_.data();
    a.workspace_bytes = moe_ws_.bytes();
    return kernels::moe_experts_cuda_device(a, stream_);
  }

  Status reserve_moe(int rows, int top_k, int hidden, int inter, int shared_inter,
                     int experts) override {
    return grow_moe_ws(
        kernels::moe_experts_workspace_bytes(rows, top_k, hidden, inter, shared_inter, experts));
  }

  Status rmsnorm_across(Collective& comm, const Buffer& x, const Buffer& w, int rows, int dim,
                        int total_dim, float eps) override {
    SPARK_TRY(need(x.type(), ElemType::bf16, "a norm's input"));
    if (ss_.numel() < static_cast<size_t>(rows)) {
      SPARK_TRY(kernels::cuda_stream_synchronize(stream_));
      graph_clear();
      auto b = alloc(ElemType::f32, std::max<size_t>(static_cast<size_t>(rows), 64));
      if (!b) return b.error();
      ss_ = *b;
    }
    const size_t R = static_cast<size_t>(rows), D = static_cast<size_t>(dim);
    SPARK_TRY(kernels::row_sumsq_cuda_device(x.data(), R, D, ss_.as<float>(), stream_));
    if (comm.world_size() > 1)
      SPARK_TRY(comm.all_reduce_sum_device(ss_.data(), R, DType::f32, stream_));
    return kernels::rows_rms_scale_cuda_device(x.data(), w.data(), ss_.as<float>(), R, D,
                                               static_cast<float>(total_dim), eps, stream_);
  }

  Status gather_logit_rows(const Buffer& x, const Buffer& y, int dim) override {
    // A gather of rows is an embedding lookup whose table is x.
    const size_t D = static_cast<size_t>(dim);
    return kernels::embedding_cuda_device(kernels::DType::bf16, x.data(), x.numel() / D, D,
                                          dev_i32(meta_.rows), step_.logit_rows.size(), y.data(),
                                          stream_);
  }

  Status all_reduce(Collective& comm, const Buffer& x) override {
    if (comm.world_size() == 1) return Status::Ok();
    return comm.all_reduce_sum_device(
        x.data(), x.numel(), x.type() == ElemType::bf16 ? DType::bf16 : DType::f32, stream_);
  }

  Status all_gather_columns(Collective& comm, const Buffer& local, const Buffer& scratch,
                            const Buffer& out, int rows, int cols) override {
    SPARK_TRY(need(local.type(), ElemType::f32, "the logits slice"));
    const size_t C = static_cast<size_t>(cols), R = static_cast<size_t>(rows);
    const size_t W = static_cast<size_t>(comm.world_size());
    if (rows == 1) return comm.all_gather_device(local.data(), out.data(), C, DType::f32, stream_);
    SPARK_TRY(comm.all_gather_device(local.data(), scratch.data(), R * C, DType::f32, stream_));
    // Rank w's [R][C] block goes to columns [w * C, (w + 1) * C) of every row.
    for (size_t w = 0; w < W; ++w)
      SPARK_TRY(kernels::device_copy_2d_async(out.as<float>() + w * C, W * C * 4,
                                              scratch.as<float>() + w * R * C, C * 4, C * 4, R,
                                              stream_));
    return Status::Ok();
  }

  Status synchronize() override { return kernels::cuda_stream_synchronize(stream_); }

  Status reserve_step(int tokens, int chunks, int width, int max_seq_len, int heads,
                      int head_dim) override {
    SPARK_TRY(grow_meta(static_cast<size_t>(tokens), static_cast<size_t>(chunks),
                        static_cast<size_t>(width)));
    return grow_attn_ws(
        kernels::attention_decode_workspace_bytes(chunks, heads, head_dim, max_seq_len));
  }

  bool supports_graphs() const override { return true; }

  int decode_short_context(int seqs, int heads, int kv_heads, int head_dim,
                           ElemType kv) const override {
    const int bound =
        kernels::attention_decode_short_bound(seqs, heads, kv_heads, head_dim, kdt(kv));
    return short_cap_ >= 0 ? std::min(bound, short_cap_) : bound;
  }

  Status graph_begin() override { return kernels::cuda_graph_begin_capture(stream_); }

  Status graph_end(uint64_t key) override {
    auto g = kernels::cuda_graph_end_capture(stream_);
    if (!g) return g.error();
    auto it = graphs_.find(key);
    if (it != graphs_.end()) kernels::cuda_graph_destroy(it->second);
    graphs_[key] = *g;
    return Status::Ok();
  }

  Result<bool> graph_launch(uint64_t key) override {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) return false;
    SPARK_TRY(kernels::cuda_graph_launch(it->second, stream_));
    return true;
  }

  bool samples_on_device() const override { return true; }
  bool queues_steps() const override { return true; }

  Status sample_queue(const Buffer& logits, int vocab,
                      const std::vector<kernels::SampleParams>& params,
                      const std::vector<PenaltyHistory>& history) override {
    if (queued_.size() >= 2)
      return make_error(Errc::internal, "cuda device: two draws are queued already");
    const int rows = static_cast<int>(params.size());
    const size_t pbytes = params.size() * sizeof(kernels::SampleParams);
    const size_t rbytes = params.size() * sizeof(kernels::SampleResult);
    const size_t wbytes = kernels::sample_workspace_bytes(rows, vocab);
    if (sample_rows_ < rows || sample_ws_.bytes() < wbytes) {
      auto pd = alloc(ElemType::i32, (pbytes + 3) / 4);
      auto rd = alloc(ElemType::i32, (rbytes + 3) / 4);
      auto ws = alloc(ElemType::i32, (wbytes + 3) / 4 + 1);
      Result<Buffer> ph[2] = {host_staging(pbytes + rbytes + 64),
                              host_staging(pbytes + rbytes + 64)};
      if (!pd || !rd || !ph[0] || !ph[1] || !ws)
        return make_error(Errc::resource, "cuda device: no memory for the sampler's buffers");
      SPARK_TRY(kernels::cuda_stream_synchronize(stream_));  // queued draws keep their buffers
      sample_params_ = *pd;
      sample_results_ = *rd;
      sample_host_[0] = *ph[0];
      sample_host_[1] = *ph[1];
      sample_ws_ = *ws;
      sample_rows_ = rows;
    }
    Queued q;
    q.rows = rows;
    // The other host buffer than the draws still queued (if any) use.
    sample_turn_ ^= 1;
    q.host = sample_host_[sample_turn_];
    if (!free_events_.empty()) {
      q.event = free_events_.back();
      free_events_.pop_back();
    } else {
      auto e = kernels::cuda_event_create();
      if (!e) return e.error();
      q.event = *e;
    }
    auto* host = static_cast<char*>(q.host.data());
    if (rows > 0) {
      std::memcpy(host, params.data(), pbytes);
      SPARK_TRY(kernels::cuda_memcpy_async(sample_params_.data(), host, pbytes, stream_));
      kernels::SampleBatch b;
      b.logits_dtype = kdt(logits.type());
      b.logits = logits.data();
      b.logits_stride = static_cast<size_t>(vocab);
      b.vocab = vocab;
      b.rows = rows;
      b.params = static_cast<const kernels::SampleParams*>(sample_params_.data());
      b.update_state = false;
      bool penalties = false, masked = false;
      for (const auto& h : history) penalties = penalties || h.n > 0, masked = masked || h.mask;
      if (penalties) SPARK_TRY(penalty_state(vocab, history, &b));
      if (masked) SPARK_TRY(mask_rows(vocab, history, &b));
      b.results = static_cast<kernels::SampleResult*>(sample_results_.data());
      b.workspace = sample_ws_.data();
      b.workspace_bytes = sample_ws_.bytes();
      SPARK_TRY(kernels::sample_cuda_device(b, stream_));
      SPARK_TRY(kernels::cuda_memcpy_async(host + pbytes, sample_results_.data(), rbytes, stream_));
    }
    SPARK_TRY(kernels::cuda_event_record(q.event, stream_));
    last_drawn_ = sample_results_;
    last_drawn_rows_ = rows;
    queued_.push_back(std::move(q));
    return Status::Ok();
  }

  Status sample_wait(std::vector<kernels::SampleResult>* out) override {
    if (queued_.empty()) return make_error(Errc::internal, "cuda device: no draws are queued");
    Queued q = std::move(queued_.front());
    queued_.pop_front();
    Status st = kernels::cuda_event_synchronize(q.event);
    free_events_.push_back(q.event);
    SPARK_TRY(st);
    const size_t pbytes = static_cast<size_t>(q.rows) * sizeof(kernels::SampleParams);
    out->resize(static_cast<size_t>(q.rows));
    if (q.rows > 0)
      std::memcpy(out->data(), static_cast<const char*>(q.host.data()) + pbytes,
                  out->size() * sizeof(kernels::SampleResult));
    return Status::Ok();
  }

  Status feed_drawn_tokens(int n) override {
    if (n < 0 || n > last_drawn_rows_ || static_cast<size_t>(n) > step_.tokens.size())
      return make_error(Errc::internal,
                        fmt::format("cuda device: {} tokens to feed, {} drawn, a step of {}", n,
                                    last_drawn_rows_, step_.tokens.size()));
    if (n == 0) return Status::Ok();
    // The token field of each result row into the step's token section (after the step's
    // metadata copy, before its kernels: stream order).
    return kernels::device_copy_2d_async(
        meta_dev_.as<int32_t>() + meta_.tokens, 4,
        static_cast<const char*>(last_drawn_.data()) + offsetof(kernels::SampleResult, token),
        sizeof(kernels::SampleResult), 4, static_cast<size_t>(n), stream_);
  }

  // The penalty state of the step's rows ([rows][vocab] seen bytes and counts), built on
  // the device from the rows' token lists: one copy of the lists instead of the state.
  Status penalty_state(int vocab, const std::vector<PenaltyHistory>& history,
                       kernels::SampleBatch* b) {
    const size_t rows = history.size();
    size_t total = 0;
    for (const auto& h : history) total += static_cast<size_t>(std::max(h.n, 0));
    // Host layout: start[rows + 1], out_start[rows], then the tokens.
    const size_t ints = 2 * rows + 1 + total;
    const size_t state = rows * static_cast<size_t>(vocab);
    if (pen_ints_.numel() < ints || pen_seen_.numel() * 4 < state || pen_counts_.numel() < state) {
      SPARK_TRY(kernels::cuda_stream_synchronize(stream_));  // the old buffers may be in use
      auto di = alloc(ElemType::i32, ints * 2);
      auto hi = host_staging(ints * 2 * 4);
      auto ds = alloc(ElemType::i32, (state + 3) / 4);
      auto dc = alloc(ElemType::i32, state);
      if (!di || !hi || !ds || !dc)
        return make_error(Errc::resource,
                          fmt::format("cuda device: no memory for the penalty state of {} rows "
                                      "of {} tokens",
                                      rows, vocab));
      pen_ints_ = *di, pen_host_ = *hi, pen_seen_ = *ds, pen_counts_ = *dc;
    }
    auto* h = pen_host_.as<int32_t>();
    int32_t* start = h;
    int32_t* out_start = h + rows + 1;
    int32_t* toks = h + 2 * rows + 1;
    size_t at = 0;
    for (size_t r = 0; r < rows; ++r) {
      const auto& e = history[r];
      start[r] = static_cast<int32_t>(at);
      out_start[r] = e.out_start;
      if (e.n > 0) std::memcpy(toks + at, e.tokens, static_cast<size_t>(e.n) * 4);
      at += static_cast<size_t>(std::max(e.n, 0));
    }
    start[rows] = static_cast<int32_t>(at);
    SPARK_TRY(kernels::cuda_memcpy_async(pen_ints_.data(), h, ints * 4, stream_));
    const int32_t* d = pen_ints_.as<int32_t>();
    SPARK_TRY(kernels::sample_state_build_cuda_device(
        static_cast<uint8_t*>(pen_seen_.data()), pen_counts_.as<int32_t>(), vocab,
        static_cast<int>(rows), d + 2 * rows + 1, d, d + rows + 1, stream_));
    b->seen = static_cast<uint8_t*>(pen_seen_.data());
    b->counts = pen_counts_.as<int32_t>();
    b->state_row = nullptr;  // row r uses state row r
    return Status::Ok();
  }

  // The rows' allowed-id bitsets (structured outputs) to the device, [rows][words]; a row
  // without a constraint allows every id.
  Status mask_rows(int vocab, const std::vector<PenaltyHistory>& history, kernels::SampleBatch* b) {
    const size_t words = (static_cast<size_t>(vocab) + 31) / 32;
    const size_t n = history.size() * words;
    if (mask_dev_.numel() < n) {
      SPARK_TRY(kernels::cuda_stream_synchronize(stream_));  // the old buffers may be in use
      auto d = alloc(ElemType::i32, n);
      auto h = host_staging(n * 4);
      if (!d || !h)
        return make_error(
            Errc::resource,
            fmt::format("cuda device: no memory for the output masks of {} rows", history.size()));
      mask_dev_ = *d, mask_host_ = *h;
    }
    auto* host = static_cast<uint32_t*>(mask_host_.data());
    for (size_t r = 0; r < history.size(); ++r) {
      if (history[r].mask)
        std::memcpy(host + r * words, history[r].mask, words * 4);
      else
        std::fill(host + r * words, host + (r + 1) * words, ~0u);
    }
    SPARK_TRY(kernels::cuda_memcpy_async(mask_dev_.data(), host, n * 4, stream_));
    b->mask = static_cast<const uint32_t*>(mask_dev_.data());
    b->mask_words = words;
    return Status::Ok();
  }

  void graph_clear() override {
    for (auto& [k, g] : graphs_) kernels::cuda_graph_destroy(g);
    graphs_.clear();
  }

 private:
  CudaDevice() = default;
  const int32_t* dev_i32(size_t off) const { return meta_dev_.as<int32_t>() + off; }
  // A windowed layer's own pool is read and written through the step's window tables.
  const int32_t* slots_for(const KVLayerView& kv) const {
    return dev_i32(kv.windowed ? meta_.wslots : meta_.slots);
  }
  const int32_t* tables_for(const KVLayerView& kv) const {
    return dev_i32(kv.windowed ? meta_.wtables : meta_.tables);
  }

  // Growing a buffer a graph reads would leave the graph pointing at freed memory: every
  // growth drops the graphs (Model::prepare sizes them up front, so steady state never grows).
  Status grow_meta(size_t T, size_t C, size_t W) {
    if (T <= meta_.cap_tokens && C <= meta_.cap_chunks && W <= meta_.cap_width &&
        !meta_dev_.empty())
      return Status::Ok();
    meta_.cap_tokens = std::max(meta_.cap_tokens, T);
    meta_.cap_chunks = std::max(meta_.cap_chunks, C);
    meta_.cap_width = std::max(meta_.cap_width, W);
    meta_.compute();
    SPARK_TRY(kernels::cuda_stream_synchronize(stream_));  // the old buffers may be in use
    graph_clear();
    auto d = alloc(ElemType::i32, meta_.total);
    if (!d) return d.error();
    meta_dev_ = *d;
    for (auto& mh : meta_host_) {
      auto h = host_staging(meta_.total * 4);
      if (!h) return h.error();
      mh = *h;
    }
    return Status::Ok();
  }

  Buffer fp8_ws_;  // an FP8 prefill product's dequantized weight tile (bf16) or quantized rows

  Status grow_moe_ws(size_t need) {
    if (moe_ws_.bytes() >= need) return Status::Ok();
    SPARK_TRY(kernels::cuda_stream_synchronize(stream_));
    graph_clear();
    auto w = alloc(ElemType::i32, (need + 3) / 4);
    if (!w) return w.error();
    moe_ws_ = *w;
    return Status::Ok();
  }

  Status grow_mla_ws(size_t need) {
    if (mla_ws_.bytes() >= need) return Status::Ok();
    SPARK_TRY(kernels::cuda_stream_synchronize(stream_));
    graph_clear();
    auto w = alloc(ElemType::f32, (need + 3) / 4);
    if (!w) return w.error();
    mla_ws_ = *w;
    return Status::Ok();
  }

  Status grow_attn_ws(size_t need) {
    if (attn_ws_.bytes() >= need) return Status::Ok();
    SPARK_TRY(kernels::cuda_stream_synchronize(stream_));
    graph_clear();
    auto w = alloc(ElemType::i32, (need + 3) / 4);
    if (!w) return w.error();
    attn_ws_ = *w;
    // Decode attention's completion counters start at zero; each launch leaves them so.
    return kernels::cuda_memset_async(attn_ws_.data(), 0, attn_ws_.bytes(), stream_);
  }
  static kernels::PagedKVDevice paged(const KVLayerView& kv) {
    kernels::PagedKVDevice p;
    p.k = kv.k;
    p.v = kv.v;
    p.dtype = kdt(kv.type);
    p.block_size = kv.block_size;
    p.n_kv_heads = kv.n_kv_heads;
    p.head_dim = kv.head_dim;
    p.num_blocks = kv.num_blocks;
    return p;
  }

  DeviceInfo info_;
  kernels::DeviceLimits lim_;
  std::string proc_root_ = "/";
  std::vector<std::weak_ptr<MappedArena>> arenas_;  // host-mapped weights, for host_address
  void* stream_ = nullptr;
  std::unique_ptr<kernels::Matmul> mm_;
  bool pdl_ = false;              // programmatic dependent launch for the step's kernels
  bool norm_in_products_ = true;  // decode rows: the layer's norms inside the products
  bool fold_norms_ = true;        // CudaDeviceOptions::fold_norms
  int short_cap_ = -1;  // SPARK_CUDA_SHORT_ATTENTION: short-context attention's cap, -1 none
  StepLayout step_;
  MetaLayout meta_;
  Buffer meta_dev_, meta_host_[2], attn_ws_, convert_, moe_ws_, ss_;
  Buffer mla_ws_;            // latent attention's latent queries and partials
  int moe_form_ = 0;         // SPARK_CUDA_MOE_FORM: 0 auto, 2 grouped, 3 decode-mma, 4 decode-fp32
  int fp8_prefill_ = 0;      // SPARK_CUDA_FP8_PREFILL: 0 auto, 1 tensor-core, 2 dequant
  bool mla_scalar_ = false;  // SPARK_CUDA_MLA_SCALAR: latent attention's scalar kernel only
  int mla_split_cap_ = 0;    // SPARK_CUDA_MLA_SPLITS: latent attention's most ranges, 0 none
  int meta_turn_ = 0;
  std::vector<float> widen_;
  int max_query_len_ = 0, max_seq_len_ = 0;
  std::map<uint64_t, void*> graphs_;
  Buffer sample_params_, sample_results_, sample_host_[2], sample_ws_;
  struct Queued {  // draws queued, not yet read: their buffers and the event after them
    int rows = 0;
    Buffer host;  // its params, then its results
    void* event = nullptr;
  };
  std::deque<Queued> queued_;
  std::vector<void*> free_events_;
  int sample_turn_ = 0;
  Buffer last_drawn_;  // the last queued draws' device results (feed_drawn_tokens)
  int last_drawn_rows_ = 0;
  Buffer pen_ints_, pen_host_, pen_seen_, pen_counts_;  // penalty lists and state
  Buffer mask_dev_, mask_host_;                         // output masks (structured outputs)
  int sample_rows_ = 0;
  std::map<const void*, void*> copy_events_;  // staging buffer -> its last copy's event
};

}  // namespace

Result<std::shared_ptr<Device>> make_cuda_device(int ordinal, const CudaDeviceOptions& opts) {
  return CudaDevice::open(ordinal, opts);
}

Result<std::shared_ptr<Device>> select_device(const std::string& choice, int ordinal,
                                              std::string* fallback_reason,
                                              const CudaDeviceOptions& opts) {
  if (choice == "cpu") return make_cpu_device();
  if (choice != "cuda" && choice != "auto")
    return make_error(Errc::config, fmt::format("DEVICE={} is not one of auto, cpu, cuda", choice));
  // A GPU that is there but that this build's kernels do not run on is an error under
  // DEVICE=auto too: running on the CPU instead would hide a wrong build.
  if (kernels::cuda_device_count()) {
    if (auto lim = kernels::cuda_device_limits(ordinal)) {
      const std::string problem = kernels::cuda_arch_problem(*lim, kernels::cuda_architectures());
      if (!problem.empty())
        return make_error(Errc::unsupported, fmt::format("DEVICE={}: {}", choice, problem));
    }
  }
  auto d = make_cuda_device(ordinal, opts);
  if (d) return d;
  if (d.error().code == Errc::config) return d.error();  // the user's setting, not the GPU
  if (choice == "cuda")
    return make_error(d.error().code,
                      fmt::format("DEVICE=cuda: cannot use CUDA device {}: {} — fix the driver "
                                  "or set DEVICE=cpu",
                                  ordinal, d.error().message));
  if (fallback_reason)
    *fallback_reason = fmt::format("DEVICE=auto chose the CPU: {}", d.error().message);
  return make_cpu_device();
}

}  // namespace spark::engine
