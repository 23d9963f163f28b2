// RMSNorm on the GPU: one thread block per row. Each thread accumulates x^2 over a strided
// slice of the row in fp32, warps reduce with shuffles, warp 0 reduces the per-warp sums
// and publishes 1/rms through shared memory, then every thread scales its slice.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda_check.cuh"
#include "kernels/cuda_runtime.h"
#include "kernels/device_common.cuh"
#include "kernels/rmsnorm.h"

namespace spark::kernels {
namespace {

__device__ __forceinline__ float load_f32(float v) {
  return v;
}
__device__ __forceinline__ float load_f32(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T store_as(float v);
template <>
__device__ __forceinline__ float store_as<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 store_as<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// blockDim.x must be a multiple of 32 (at most 1024). Rows beyond gridDim.x are handled by
// striding, so any row count launches.
template <typename T>
__global__ void rmsnorm_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                               size_t rows, size_t dim, float eps) {
  __shared__ float warp_sums[32];
  __shared__ float inv_rms;
  const unsigned lane = threadIdx.x & 31u;
  const unsigned warp = threadIdx.x >> 5;
  const unsigned nwarps = blockDim.x >> 5;
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * dim;
    T* yr = y + row * dim;
    float ss = 0.f;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
      float v = load_f32(xr[i]);
      ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) warp_sums[warp] = ss;
    __syncthreads();
    if (warp == 0) {
      float s = lane < nwarps ? warp_sums[lane] : 0.f;
      s = warp_sum(s);
      if (lane == 0) inv_rms = rsqrtf(s / static_cast<float>(dim) + eps);
    }
    __syncthreads();
    const float inv = inv_rms;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x)
      yr[i] = store_as<T>(load_f32(xr[i]) * inv * load_f32(w[i]));
    __syncthreads();  // warp_sums and inv_rms are rewritten for the next row
  }
}

// Threads per block: enough warps to cover short rows in one pass, at most 512 so several
// blocks fit per SM for long rows.
unsigned threads_for(size_t dim) {
  size_t t = (dim + 31) / 32 * 32;
  return static_cast<unsigned>(std::clamp<size_t>(t, 32, 512));
}

template <typename T>
Status launch(const T* x, const T* w, T* y, size_t rows, size_t dim, float eps,
              cudaStream_t stream) {
  SPARK_TRY(rmsnorm_check_args(x, w, y, rows, dim, eps, sizeof(T)));
  if (rows == 0) return Status::Ok();
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>(rows, 1u << 20));
  rmsnorm_kernel<T><<<blocks, threads_for(dim), 0, stream>>>(x, w, y, rows, dim, eps);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

template <typename T, typename Dev>
Status run_on_host_arrays(const T* x, const T* w, T* y, size_t rows, size_t dim, float eps) {
  SPARK_TRY(rmsnorm_check_args(x, w, y, rows, dim, eps, sizeof(T)));
  if (rows == 0) return Status::Ok();
  SPARK_TRY(cuda_device_count().status());
  const size_t xbytes = rows * dim * sizeof(T);
  const size_t wbytes = dim * sizeof(T);
  auto dx = DeviceMemory::allocate(xbytes);
  SPARK_TRY(dx.status());
  auto dw = DeviceMemory::allocate(wbytes);
  SPARK_TRY(dw.status());
  auto dy = DeviceMemory::allocate(xbytes);
  SPARK_TRY(dy.status());
  SPARK_TRY(dx->copy_from_host(x, xbytes));
  SPARK_TRY(dw->copy_from_host(w, wbytes));
  SPARK_TRY(launch(static_cast<const Dev*>(dx->get()), static_cast<const Dev*>(dw->get()),
                   static_cast<Dev*>(dy->get()), rows, dim, eps, nullptr));
  SPARK_CUDA_TRY(cudaDeviceSynchronize());
  SPARK_TRY(dy->copy_to_host(y, xbytes));
  return Status::Ok();
}

static_assert(sizeof(__nv_bfloat16) == sizeof(bf16_bits), "bf16 host and device layouts differ");

}  // namespace

Status rmsnorm_cuda(const float* x_host, const float* w_host, float* y_host, size_t rows,
                    size_t dim, float eps) {
  return run_on_host_arrays<float, float>(x_host, w_host, y_host, rows, dim, eps);
}

Status rmsnorm_bf16_cuda(const bf16_bits* x_host, const bf16_bits* w_host, bf16_bits* y_host,
                         size_t rows, size_t dim, float eps) {
  return run_on_host_arrays<bf16_bits, __nv_bfloat16>(x_host, w_host, y_host, rows, dim, eps);
}

Status rmsnorm_cuda_device(const float* x_dev, const float* w_dev, float* y_dev, size_t rows,
                           size_t dim, float eps, void* stream) {
  return launch(x_dev, w_dev, y_dev, rows, dim, eps, static_cast<cudaStream_t>(stream));
}

Status rmsnorm_bf16_cuda_device(const bf16_bits* x_dev, const bf16_bits* w_dev, bf16_bits* y_dev,
                                size_t rows, size_t dim, float eps, void* stream) {
  return launch(
      reinterpret_cast<const __nv_bfloat16*>(x_dev), reinterpret_cast<const __nv_bfloat16*>(w_dev),
      reinterpret_cast<__nv_bfloat16*>(y_dev), rows, dim, eps, static_cast<cudaStream_t>(stream));
}

namespace {

// hidden += delta (rounded to T) and out = rmsnorm(hidden) * w, one block per row. Each
// thread re-reads in the second pass only the elements it wrote in the first, so the
// in-place update needs no barrier beyond the reduction's.
template <typename T>
__global__ void add_rmsnorm_kernel(T* __restrict__ hidden, const T* __restrict__ delta,
                                   const T* __restrict__ w, T* __restrict__ out, size_t rows,
                                   size_t dim, float eps) {
  dev::pdl_wait();  // programmatic launch: the kernel ahead has finished
  dev::pdl_trigger();

  __shared__ float scratch[33];
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
    T* h = hidden + row * dim;
    float ss = 0.f;
    if (delta) {
      const T* d = delta + row * dim;
      for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const T v = dev::from_f<T>(dev::to_f(h[i]) + dev::to_f(d[i]));
        h[i] = v;
        const float f = dev::to_f(v);
        ss = fmaf(f, f, ss);
      }
    } else {
      for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float f = dev::to_f(h[i]);
        ss = fmaf(f, f, ss);
      }
    }
    ss = dev::block_sum(ss, scratch);
    const float inv = rsqrtf(ss / static_cast<float>(dim) + eps);
    T* o = out + row * dim;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x)
      o[i] = dev::from_f<T>(dev::to_f(h[i]) * inv * dev::to_f(w[i]));
  }
}

// The same for rows of at most kHeld * blockDim.x elements, with the row held in registers
// between the passes (and the weights loaded in the first), so the second pass reads no
// memory: one round trip less per row, which is most of the time of a decode row. The
// arithmetic is the kernel's above, element for element, so the results are identical.
constexpr int kHeld = 16;
template <typename T>
__global__ void add_rmsnorm_held_kernel(T* __restrict__ hidden, const T* __restrict__ delta,
                                        const T* __restrict__ w, T* __restrict__ out, size_t rows,
                                        size_t dim, float eps) {
  dev::pdl_wait();  // programmatic launch: the kernel ahead has finished
  dev::pdl_trigger();

  __shared__ float scratch[33];
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
    T* h = hidden + row * dim;
    const T* d = delta ? delta + row * dim : nullptr;
    float hv[kHeld], wv[kHeld];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      const size_t i = threadIdx.x + static_cast<size_t>(k) * blockDim.x;
      hv[k] = wv[k] = 0.f;
      if (i < dim) {
        wv[k] = dev::to_f(w[i]);
        if (d) {
          const T v = dev::from_f<T>(dev::to_f(h[i]) + dev::to_f(d[i]));
          h[i] = v;
          hv[k] = dev::to_f(v);
        } else {
          hv[k] = dev::to_f(h[i]);
        }
        ss = fmaf(hv[k], hv[k], ss);
      }
    }
    ss = dev::block_sum(ss, scratch);
    const float inv = rsqrtf(ss / static_cast<float>(dim) + eps);
    T* o = out + row * dim;
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      const size_t i = threadIdx.x + static_cast<size_t>(k) * blockDim.x;
      if (i < dim) o[i] = dev::from_f<T>(hv[k] * inv * wv[k]);
    }
  }
}

// One warp per (token, head), in place.
template <typename T>
__global__ void head_rmsnorm_kernel(T* __restrict__ x, size_t token_stride, size_t n_tokens,
                                    int n_heads, int head_dim, const T* __restrict__ w, float eps) {
  const size_t warps = size_t{gridDim.x} * (blockDim.x / 32);
  const unsigned lane = threadIdx.x & 31u;
  for (size_t job = blockIdx.x * size_t{blockDim.x / 32} + threadIdx.x / 32;
       job < n_tokens * static_cast<size_t>(n_heads); job += warps) {
    const size_t t = job / static_cast<size_t>(n_heads), hh = job % static_cast<size_t>(n_heads);
    T* v = x + t * token_stride + hh * static_cast<size_t>(head_dim);
    float ss = 0.f;
    for (int i = static_cast<int>(lane); i < head_dim; i += 32) {
      const float f = dev::to_f(v[i]);
      ss = fmaf(f, f, ss);
    }
    ss = dev::warp_sum(ss);
    const float inv = rsqrtf(ss / static_cast<float>(head_dim) + eps);
    for (int i = static_cast<int>(lane); i < head_dim; i += 32)
      v[i] = dev::from_f<T>(dev::to_f(v[i]) * inv * dev::to_f(w[i]));
  }
}

}  // namespace

Status add_rmsnorm_cuda_device(DType dt, void* hidden, const void* delta, const void* w, void* out,
                               size_t rows, size_t dim, float eps, void* stream) {
  SPARK_TRY(rmsnorm_check_args(hidden, w, out, rows, dim, eps, dtype_size(dt)));
  if (rows == 0) return Status::Ok();
  if (out == hidden || (delta && out == delta))
    return make_error(Errc::usage, "add_rmsnorm: out must not alias hidden or delta");
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>(rows, 1u << 20));
  const unsigned threads = threads_for(dim);
  if (dim <= static_cast<size_t>(kHeld) * threads)
    SPARK_DISPATCH_DTYPE(
        dt, T,
        SPARK_CUDA_TRY(dev::launch(add_rmsnorm_held_kernel<T>, dim3(blocks), dim3(threads), 0,
                                   static_cast<cudaStream_t>(stream), static_cast<T*>(hidden),
                                   static_cast<const T*>(delta), static_cast<const T*>(w),
                                   static_cast<T*>(out), rows, dim, eps)));
  else
    SPARK_DISPATCH_DTYPE(
        dt, T,
        SPARK_CUDA_TRY(dev::launch(add_rmsnorm_kernel<T>, dim3(blocks), dim3(threads), 0,
                                   static_cast<cudaStream_t>(stream), static_cast<T*>(hidden),
                                   static_cast<const T*>(delta), static_cast<const T*>(w),
                                   static_cast<T*>(out), rows, dim, eps)));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status head_rmsnorm_cuda_device(DType dt, void* x, size_t token_stride, size_t n_tokens,
                                int n_heads, int head_dim, const void* w, float eps, void* stream) {
  if (n_heads <= 0 || head_dim <= 0)
    return make_error(Errc::usage, "head_rmsnorm: n_heads and head_dim must be > 0");
  if (token_stride < static_cast<size_t>(n_heads) * static_cast<size_t>(head_dim))
    return make_error(Errc::usage, "head_rmsnorm: token_stride is less than n_heads * head_dim");
  if (!std::isfinite(eps) || eps < 0)
    return make_error(Errc::usage, "head_rmsnorm: eps must be finite and >= 0");
  if (n_tokens == 0) return Status::Ok();
  if (!x || !w) return make_error(Errc::usage, "head_rmsnorm: null pointer");
  const size_t jobs = n_tokens * static_cast<size_t>(n_heads);
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((jobs + 7) / 8, 1u << 16));
  SPARK_DISPATCH_DTYPE(dt, T,
                       head_rmsnorm_kernel<T>
                       <<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
                           static_cast<T*>(x), token_stride, n_tokens, n_heads, head_dim,
                           static_cast<const T*>(w), eps));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

namespace {
__global__ void fold_weight_kernel(__nv_bfloat16* w, size_t rows, size_t cols,
                                   const __nv_bfloat16* g) {
  const size_t n = rows * cols;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x)
    w[i] = __float2bfloat16_rn(__bfloat162float(w[i]) * __bfloat162float(g[i % cols]));
}
}  // namespace

Status rmsnorm_fold_weight_cuda_device(bf16_bits* w, size_t rows, size_t cols,
                                       const bf16_bits* norm_w, void* stream) {
  if (rows == 0 || cols == 0) return Status::Ok();
  if (!w || !norm_w) return make_error(Errc::usage, "rmsnorm_fold_weight: null pointer");
  const size_t n = rows * cols;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 1u << 16));
  fold_weight_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<__nv_bfloat16*>(w), rows, cols,
      reinterpret_cast<const __nv_bfloat16*>(norm_w));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace spark::kernels
