// Embedding lookup on the GPU: one block per token copies its table row, 16 bytes per
// thread per step where rows are 16-byte aligned, element by element otherwise.
#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/embedding.h"

namespace spark::kernels {
namespace {

template <typename T>
__global__ void embedding_kernel(const T* __restrict__ table, size_t vocab, size_t dim,
                                 const int32_t* __restrict__ ids, size_t n, T* __restrict__ out,
                                 bool vec) {
  for (size_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int32_t id = ids[t];
    T* o = out + t * dim;
    const bool ok = id >= 0 && static_cast<size_t>(id) < vocab;
    const T* row = table + (ok ? static_cast<size_t>(id) : 0) * dim;
    if (vec) {
      const size_t nv = dim * sizeof(T) / 16;
      const uint4* src = reinterpret_cast<const uint4*>(row);
      uint4* dst = reinterpret_cast<uint4*>(o);
      for (size_t i = threadIdx.x; i < nv; i += blockDim.x)
        dst[i] = ok ? src[i] : make_uint4(0, 0, 0, 0);
    } else {
      for (size_t i = threadIdx.x; i < dim; i += blockDim.x)
        o[i] = ok ? row[i] : dev::from_f<T>(0.f);
    }
  }
}

}  // namespace

Status embedding_cuda_device(DType dt, const void* table, size_t vocab, size_t dim,
                             const int32_t* ids, size_t n, void* out, void* stream) {
  SPARK_TRY(embedding_check_args(table, vocab, dim, ids, n, out));
  if (n == 0) return Status::Ok();
  const size_t row_bytes = dim * dtype_size(dt);
  const bool vec = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(table) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>(n, 65535));
  SPARK_DISPATCH_DTYPE(
      dt, T,
      embedding_kernel<T><<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(table), vocab, dim, ids, n, static_cast<T*>(out), vec));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace spark::kernels
