#include "daemon/engine/collective.h"

#include <fmt/format.h>

#include <cstring>

#include "kernels/cuda_stream.h"

namespace spark::engine {

Status Collective::all_gather(const void* in, void* out, size_t bytes_per_rank) {
  auto* o = static_cast<char*>(out);
  const int me = rank();
  std::memcpy(o + static_cast<size_t>(me) * bytes_per_rank, in, bytes_per_rank);
  for (int r = 0; r < world_size(); ++r)
    SPARK_TRY(broadcast(o + static_cast<size_t>(r) * bytes_per_rank, bytes_per_rank, r));
  return Status::Ok();
}

Status LocalCollective::all_gather(const void* in, void* out, size_t bytes_per_rank) {
  if (in != out) std::memmove(out, in, bytes_per_rank);
  return Status::Ok();
}

HostStagedCollective::HostStagedCollective(std::shared_ptr<Collective> host)
    : host_(std::move(host)) {}

HostStagedCollective::~HostStagedCollective() {
  if (pinned_) kernels::cuda_host_free(pinned_);
}

Status HostStagedCollective::stage(size_t bytes) {
  if (bytes <= pinned_bytes_) return Status::Ok();
  if (pinned_) kernels::cuda_host_free(pinned_);
  pinned_ = nullptr;
  pinned_bytes_ = 0;
  auto p = kernels::cuda_host_alloc(bytes);
  if (!p)
    return make_error(p.error().code,
                      fmt::format("rank {}: the host-staged collective's {} MiB page-locked "
                                  "buffer: {}",
                                  rank(), bytes >> 20, p.error().message));
  pinned_ = *p;
  pinned_bytes_ = bytes;
  return Status::Ok();
}

Status HostStagedCollective::all_reduce_sum_device(void* data, size_t count, DType dtype,
                                                   void* stream) {
  if (world_size() == 1 || count == 0) return Status::Ok();
  if (dtype != DType::f32 && dtype != DType::bf16)
    return make_error(Errc::unsupported,
                      fmt::format("host-staged all-reduce: dtype {} (f32 and bf16 are summed)",
                                  dtype_name(dtype)));
  const size_t bytes = count * dtype_size(dtype);
  SPARK_TRY(stage(bytes));
  // The stream's earlier work produced `data`; the copy back of the previous call has also
  // finished once this returns, so the staging buffer is free.
  SPARK_TRY(kernels::cuda_stream_synchronize(stream));
  SPARK_TRY(kernels::cuda_memcpy_async(pinned_, data, bytes, stream));
  SPARK_TRY(kernels::cuda_stream_synchronize(stream));
  if (dtype == DType::f32) {
    SPARK_TRY(host_->all_reduce_sum(static_cast<float*>(pinned_), count));
  } else {
    // bf16 summed in fp32 and rounded once, as NCCL's bf16 sum of two ranks is.
    auto* h = static_cast<uint16_t*>(pinned_);
    wide_.resize(count);
    for (size_t i = 0; i < count; ++i) wide_[i] = bf16_to_float(h[i]);
    SPARK_TRY(host_->all_reduce_sum(wide_.data(), count));
    for (size_t i = 0; i < count; ++i) h[i] = float_to_bf16(wide_[i]);
  }
  return kernels::cuda_memcpy_async(data, pinned_, bytes, stream);
}

Status HostStagedCollective::all_gather_device(const void* in, void* out, size_t count_per_rank,
                                               DType dtype, void* stream) {
  const size_t b = count_per_rank * dtype_size(dtype);
  if (b == 0) return Status::Ok();
  const size_t W = static_cast<size_t>(world_size());
  SPARK_TRY(stage(b * (W + 1)));
  auto* h = static_cast<char*>(pinned_);
  SPARK_TRY(kernels::cuda_stream_synchronize(stream));
  SPARK_TRY(kernels::cuda_memcpy_async(h, in, b, stream));
  SPARK_TRY(kernels::cuda_stream_synchronize(stream));
  SPARK_TRY(host_->all_gather(h, h + b, b));
  return kernels::cuda_memcpy_async(out, h + b, b * W, stream);
}

}  // namespace spark::engine
