// Paged KV write on the GPU: one block per token copies its K and V rows
// (n_kv_heads * head_dim elements each) to the pool slot the slot mapping names,
// converting between the activation and cache types.
#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/paged_attention.h"

namespace spark::kernels {
namespace {

template <typename S, typename C>
__global__ void kv_write_kernel(C* __restrict__ kpool, C* __restrict__ vpool, size_t row,
                                long long pool_slots, const int32_t* __restrict__ slots,
                                size_t n_tokens, const S* __restrict__ k, size_t k_stride,
                                const S* __restrict__ v, size_t v_stride) {
  dev::pdl_wait();  // programmatic launch: the kernel ahead has finished
  dev::pdl_trigger();

  for (size_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
    const int32_t slot = slots[t];
    if (slot < 0 || slot >= pool_slots) continue;
    C* kd = kpool + static_cast<size_t>(slot) * row;
    C* vd = vpool + static_cast<size_t>(slot) * row;
    const S* ks = k + t * k_stride;
    const S* vs = v + t * v_stride;
    for (size_t i = threadIdx.x; i < row; i += blockDim.x) {
      kd[i] = dev::from_f<C>(dev::to_f(ks[i]));
      vd[i] = dev::from_f<C>(dev::to_f(vs[i]));
    }
  }
}

}  // namespace

Status paged_kv_write_cuda_device(const PagedKVDevice& kv, const int32_t* slots, size_t n_tokens,
                                  DType src, const void* k, size_t k_stride, const void* v,
                                  size_t v_stride, void* stream) {
  const size_t row = static_cast<size_t>(kv.n_kv_heads) * static_cast<size_t>(kv.head_dim);
  if (kv.n_kv_heads <= 0 || kv.head_dim <= 0 || kv.block_size <= 0 || kv.num_blocks <= 0)
    return make_error(
        Errc::usage, "paged_kv_write: n_kv_heads, head_dim, block_size and num_blocks must be > 0");
  if (k_stride < row || v_stride < row)
    return make_error(Errc::usage,
                      "paged_kv_write: k_stride/v_stride less than n_kv_heads * head_dim");
  if (src == DType::e4m3)
    return make_error(Errc::usage,
                      "paged_kv_write: k and v must be f32 or bf16 (fp8 is a cache type)");
  if (n_tokens == 0) return Status::Ok();
  if (!kv.k || !kv.v || !slots || !k || !v)
    return make_error(Errc::usage, "paged_kv_write: null pointer among pools, slots, k, v");
  const long long pool_slots = static_cast<long long>(kv.num_blocks) * kv.block_size;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>(n_tokens, 65535));
  const unsigned threads = static_cast<unsigned>(std::min<size_t>((row + 31) / 32 * 32, 256));
  auto st = static_cast<cudaStream_t>(stream);
  SPARK_DISPATCH_DTYPE(src, S,
                       SPARK_DISPATCH_KV(kv.dtype, C,
                                         SPARK_CUDA_TRY(dev::launch(
                                             kv_write_kernel<S, C>, dim3(blocks), dim3(threads), 0,
                                             st, static_cast<C*>(kv.k), static_cast<C*>(kv.v), row,
                                             pool_slots, slots, n_tokens, static_cast<const S*>(k),
                                             k_stride, static_cast<const S*>(v), v_stride))));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace spark::kernels
