#include "daemon/engine/device.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "env/meminfo.h"

namespace spark::engine {

size_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::f32:
    case ElemType::i32:
      return 4;
    case ElemType::bf16:
      return 2;
    case ElemType::fp8_e4m3:
    case ElemType::u8:
      return 1;
    case ElemType::mxfp4_e2m1:
      return 0;
  }
  return 4;
}

size_t elem_bytes(ElemType t, size_t numel) {
  return t == ElemType::mxfp4_e2m1 ? numel / 2 : numel * elem_size(t);
}

const char* elem_name(ElemType t) {
  switch (t) {
    case ElemType::f32:
      return "fp32";
    case ElemType::bf16:
      return "bf16";
    case ElemType::i32:
      return "i32";
    case ElemType::fp8_e4m3:
      return "fp8";
    case ElemType::mxfp4_e2m1:
      return "mxfp4";
    case ElemType::u8:
      return "u8";
  }
  return "?";
}

Buffer Buffer::view(size_t offset, size_t n) const {
  offset = std::min(offset, numel_);
  n = std::min(n, numel_ - offset);
  Buffer b(owner_, static_cast<char*>(data_) + elem_bytes(type_, offset), n, type_);
  b.scales_ = scales_;
  return b;
}

Result<kernels::Fp8Weight> fp8_weight(const Buffer& w) {
  const BlockScales* s = w.scales();
  if (w.type() != ElemType::fp8_e4m3 || !s || s->cols == 0)
    return make_error(
        Errc::internal,
        fmt::format("a {} buffer is not an FP8 matrix with block scales", elem_name(w.type())));
  const size_t off =
      static_cast<size_t>(static_cast<const char*>(w.data()) - static_cast<const char*>(s->base));
  const size_t row0 = off / s->cols;
  if (off % s->cols != 0 || (row0 & ((size_t{1} << s->row_shift) - 1)) != 0)
    return make_error(Errc::internal,
                      fmt::format("a view of an FP8 matrix starts at element {} of rows of {}, "
                                  "inside a block of {} rows",
                                  off, s->cols, size_t{1} << s->row_shift));
  kernels::Fp8Weight f;
  f.q = static_cast<const uint8_t*>(w.data());
  f.ldq = s->cols;
  f.scales = s->scales.as<float>() + (row0 >> s->row_shift) * s->ld;
  f.scale_ld = s->ld;
  f.row_shift = s->row_shift;
  return f;
}

Result<kernels::Mxfp4Weight> mxfp4_weight(const Buffer& w) {
  const BlockScales* s = w.scales();
  if (w.type() != ElemType::mxfp4_e2m1 || !s || s->cols == 0 || s->scales.type() != ElemType::u8)
    return make_error(
        Errc::internal,
        fmt::format("a {} buffer is not an MXFP4 matrix with its scales", elem_name(w.type())));
  const size_t off =
      static_cast<size_t>(static_cast<const char*>(w.data()) - static_cast<const char*>(s->base));
  const size_t row_bytes = s->cols / 2;
  if (off % row_bytes != 0)
    return make_error(Errc::internal,
                      fmt::format("a view of an MXFP4 matrix starts at byte {} of rows of {} "
                                  "bytes, inside a row",
                                  off, row_bytes));
  kernels::Mxfp4Weight f;
  f.blocks = static_cast<const uint8_t*>(w.data());
  f.ldb = row_bytes;
  f.scales = s->scales.as<uint8_t>() + (off / row_bytes) * s->ld;
  f.lds = s->ld;
  return f;
}

Result<uint64_t> host_mem_available(const std::string& proc_root) {
  auto m = env::read_meminfo(proc_root);
  if (!m) return m.error();
  if (!m->fields.count("MemAvailable"))
    return make_error(Errc::io, fmt::format("{}/proc/meminfo: no MemAvailable line",
                                            proc_root == "/" ? "" : proc_root));
  return m->get("MemAvailable");
}

Result<uint64_t> device_memory_available(bool unified_memory, uint64_t device_free,
                                         const std::string& proc_root) {
  if (unified_memory) return host_mem_available(proc_root);
  return device_free;
}

Result<WeightsPlacement> parse_weights_placement(const std::string& s) {
  if (s.empty() || s == "auto") return WeightsPlacement::automatic;
  if (s == "device") return WeightsPlacement::device;
  if (s == "host-mapped") return WeightsPlacement::host_mapped;
  return make_error(Errc::config,
                    fmt::format("WEIGHTS_PLACEMENT={} is not one of auto, device, host-mapped", s));
}

const char* weights_placement_name(WeightsPlacement p) {
  switch (p) {
    case WeightsPlacement::automatic:
      return "auto";
    case WeightsPlacement::device:
      return "device";
    case WeightsPlacement::host_mapped:
      return "host-mapped";
  }
  return "?";
}

std::string DeviceInfo::describe() const {
  if (kind != "cuda") return name;
  return fmt::format("cuda {}; weights {}", name,
                     weights == WeightsPlacement::host_mapped ? "host-mapped (read in place)"
                                                              : "in device memory");
}

Result<std::vector<Buffer>> Device::alloc_weights(
    const std::vector<std::pair<ElemType, size_t>>& sizes) {
  std::vector<Buffer> out;
  out.reserve(sizes.size());
  for (const auto& [type, numel] : sizes) {
    auto b = alloc(type, numel);
    if (!b) return b.error();
    out.push_back(*b);
  }
  return out;
}

}  // namespace spark::engine
