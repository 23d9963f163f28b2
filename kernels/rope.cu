// RoPE (rotate-half layout, over the first rotary_dim elements of a head: partial rotary
// leaves the rest unrotated) on the GPU, optionally after a per-head RMSNorm (Qwen3): one
// warp per (token, head) over the q heads and then the k heads; optionally also the KV
// write (the rotated k heads and then the v heads go to their cache slots), so a decode
// layer launches one kernel for both. Each lane holds up to 8
// rotation pairs (i, i + head_dim/2) in registers, so the norm and the rotation read and
// write each element once.
#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/rope.h"

namespace spark::kernels {
namespace {

constexpr int kMaxPairsPerLane = 8;  // head_dim <= 512
// Partial rotary: the elements past rotary_dim pass unrotated (normalised with the head).
constexpr int kMaxPassPerLane = 16;

template <typename T>
__global__ void rope_kernel(RopeArgs a) {
  dev::pdl_wait();  // programmatic launch: the kernel ahead has finished
  dev::pdl_trigger();

  const unsigned lane = threadIdx.x & 31u;
  const bool write_kv = a.k_cache != nullptr;
  const size_t rot = static_cast<size_t>(a.n_heads) + (a.k ? static_cast<size_t>(a.n_kv_heads) : 0);
  // With the KV write, the v heads of each token follow (copies into the cache).
  const size_t heads = rot + (write_kv ? static_cast<size_t>(a.n_kv_heads) : 0);
  const size_t jobs = a.n_tokens * heads;
  const size_t warps = size_t{gridDim.x} * (blockDim.x / 32);
  const int rdim = a.rotary_dim > 0 ? a.rotary_dim : a.head_dim;
  const int half = rdim / 2;
  const int pass = a.head_dim - rdim;  // elements after the rotated ones
  const size_t kv_row = static_cast<size_t>(a.n_kv_heads) * static_cast<size_t>(a.head_dim);
  for (size_t job = blockIdx.x * size_t{blockDim.x / 32} + threadIdx.x / 32; job < jobs;
       job += warps) {
    const size_t t = job / heads, h = job % heads;
    if (h >= rot) {  // a v head: into the cache as the KV write converts it
      const int32_t slot = a.slots[t];
      if (slot < 0 || slot >= a.cache_slots) continue;
      const size_t vh = h - rot;
      const T* src = static_cast<const T*>(a.v) + t * a.v_stride + vh * a.head_dim;
      const size_t at = static_cast<size_t>(slot) * kv_row + vh * a.head_dim;
      for (int i = static_cast<int>(lane); i < a.head_dim; i += 32) {
        dev::store_cache(a.v_cache, a.cache_dtype, at + i, dev::to_f(src[i]));
      }
      continue;
    }
    const bool is_q = h < static_cast<size_t>(a.n_heads);
    T* v = is_q ? static_cast<T*>(a.q) + t * a.q_stride + h * a.head_dim
                : static_cast<T*>(a.k) + t * a.k_stride + (h - a.n_heads) * a.head_dim;
    const T* norm = static_cast<const T*>(is_q ? a.q_norm : a.k_norm);
    float x0[kMaxPairsPerLane], x1[kMaxPairsPerLane], xp[kMaxPassPerLane];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxPairsPerLane; ++j) {
      const int i = static_cast<int>(lane) + 32 * j;
      x0[j] = i < half ? dev::to_f(v[i]) : 0.f;
      x1[j] = i < half ? dev::to_f(v[i + half]) : 0.f;
      ss = fmaf(x0[j], x0[j], fmaf(x1[j], x1[j], ss));
    }
#pragma unroll
    for (int j = 0; j < kMaxPassPerLane; ++j) {
      const int i = static_cast<int>(lane) + 32 * j;
      xp[j] = i < pass ? dev::to_f(v[rdim + i]) : 0.f;
      ss = fmaf(xp[j], xp[j], ss);
    }
    if (norm) {
      ss = dev::warp_sum(ss);
      const float inv = rsqrtf(ss / static_cast<float>(a.head_dim) + a.norm_eps);
#pragma unroll
      for (int j = 0; j < kMaxPairsPerLane; ++j) {
        const int i = static_cast<int>(lane) + 32 * j;
        if (i < half) {
          x0[j] = x0[j] * inv * dev::to_f(norm[i]);
          x1[j] = x1[j] * inv * dev::to_f(norm[i + half]);
        }
      }
#pragma unroll
      for (int j = 0; j < kMaxPassPerLane; ++j) {
        const int i = static_cast<int>(lane) + 32 * j;
        if (i < pass) {
          const T r = dev::from_f<T>(xp[j] * inv * dev::to_f(norm[rdim + i]));
          v[rdim + i] = r;
          xp[j] = dev::to_f(r);
        }
      }
    }
    const float pos = static_cast<float>(a.positions[t]);
#pragma unroll
    for (int j = 0; j < kMaxPairsPerLane; ++j) {
      const int i = static_cast<int>(lane) + 32 * j;
      if (i < half) {
        T r0, r1;
        dev::rope_pair(x0[j], x1[j], pos, a.inv_freq[i], &r0, &r1);
        v[i] = r0;
        v[i + half] = r1;
        x0[j] = dev::to_f(r0), x1[j] = dev::to_f(r1);  // the stored values, for the cache
      }
    }
    if (write_kv && !is_q) {  // the rotated k head, as the KV write reads it back
      const int32_t slot = a.slots[t];
      if (slot < 0 || slot >= a.cache_slots) continue;
      const size_t at = static_cast<size_t>(slot) * kv_row + (h - a.n_heads) * a.head_dim;
#pragma unroll
      for (int j = 0; j < kMaxPairsPerLane; ++j) {
        const int i = static_cast<int>(lane) + 32 * j;
        if (i >= half) continue;
        dev::store_cache(a.k_cache, a.cache_dtype, at + i, x0[j]);
        dev::store_cache(a.k_cache, a.cache_dtype, at + i + half, x1[j]);
      }
#pragma unroll
      for (int j = 0; j < kMaxPassPerLane; ++j) {
        const int i = static_cast<int>(lane) + 32 * j;
        if (i >= pass) continue;
        dev::store_cache(a.k_cache, a.cache_dtype, at + rdim + i, xp[j]);
      }
    }
  }
}

}  // namespace

Status rope_cuda_device(const RopeArgs& a, void* stream) {
  SPARK_TRY(rope_check_args(a));
  if (a.n_tokens == 0) return Status::Ok();
  if (a.k_cache) {
    if (!a.k || !a.v || !a.v_cache || !a.slots)
      return make_error(Errc::usage, "rope with the KV write: null k, v, cache or slots");
    const size_t kv_row = static_cast<size_t>(a.n_kv_heads) * static_cast<size_t>(a.head_dim);
    if (a.v_stride < kv_row)
      return make_error(Errc::usage,
                        "rope with the KV write: v_stride less than n_kv_heads * head_dim");
  }
  const size_t jobs = a.n_tokens * static_cast<size_t>(a.n_heads + (a.k ? a.n_kv_heads : 0) +
                                                       (a.k_cache ? a.n_kv_heads : 0));
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((jobs + 7) / 8, 1u << 16));
  SPARK_DISPATCH_DTYPE(a.dtype, T,
                       SPARK_CUDA_TRY(dev::launch(rope_kernel<T>, dim3(blocks), dim3(256), 0,
                                                  static_cast<cudaStream_t>(stream), a)));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace spark::kernels
