#pragma once
// For .cu files only: element loads/stores for the storage types (fp32, bf16, and e4m3 for
// the KV cache), warp reductions and the DType dispatches the untyped entry points share.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "kernels/dtype.h"
#include "kernels/launch.h"

namespace spark::kernels::dev {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_f(float v) {
  return v;
}
__device__ __forceinline__ float to_f(bf16 v) {
  return __bfloat162float(v);
}
// The KV cache's FP8 element: e4m3, one byte, widened exactly (through half, which holds
// every e4m3 value) and stored with round-to-nearest-even, saturating at +-448.
using e4m3 = __nv_fp8_e4m3;
__device__ __forceinline__ float to_f(e4m3 v) {
  return static_cast<float>(v);
}
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ e4m3 from_f<e4m3>(float v) {
  return e4m3(v);  // cvt.rn.satfinite: as fp8_e4m3_code (kernels/dtype.h)
}
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float v) {
  return __float2bfloat16_rn(v);
}

// Programmatic dependent launch (sm_90 and later). A kernel launched with the
// programmatic-serialization attribute may start before the kernel ahead of it in the
// stream has finished; it must call pdl_wait() before it reads anything that kernel writes
// or writes anything it reads (pdl_wait returns once the previous grid completed and its
// memory is visible). pdl_trigger() lets the next such kernel start early. Both are no-ops
// for a kernel launched without the attribute, and when no dependent was launched so.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

/// Launches `kernel` in clusters of `cs` blocks along x (grid.x a multiple of cs; sm_90 and
/// later), or without clusters for cs = 0, and with programmatic dependent launch when
/// programmatic_launch() is on (the kernel must call pdl_wait() before its first access of
/// data); else as <<<>>> does.
template <typename... KArgs, typename... Args>
cudaError_t launch_clusters(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t st, unsigned cs, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cs > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cs;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (programmatic_launch()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

/// launch_clusters without clusters.
template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                   Args&&... args) {
  return launch_clusters(kernel, grid, block, smem, st, 0u, std::forward<Args>(args)...);
}

/// RoPE of one rotation pair (x0 at i, x1 at i + head_dim/2) at `pos` with the pair's
/// inverse frequency, each result rounded to T: what rope_kernel and the q/k/v products'
/// RoPE epilogue both compute (one function, so the two give the same bits).
template <typename T>
__device__ __forceinline__ void rope_pair(float x0, float x1, float pos, float inv_freq, T* r0,
                                          T* r1) {
  float s, c;
  sincosf(pos * inv_freq, &s, &c);
  *r0 = from_f<T>(x0 * c - x1 * s);
  *r1 = from_f<T>(x1 * c + x0 * s);
}

// Asynchronous copies global -> shared (sm_80+): 16 bytes without passing through
// registers, zero-filled when !valid; a commit closes a group, wait<N> leaves at most N
// groups in flight.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/// Decode attention: q of one lane's 8 dimensions (from d0) of query heads g0 .. g0 + gn - 1
/// of KV head kvh (`group` query heads each) for query row `token`, times `scale`; zeros
/// for heads past gn and for a lane past the head (!active). Both decode kernels' layout.
template <int G, typename Batch>
__device__ __forceinline__ void load_q_lane(const Batch& b, size_t token, int group, int kvh,
                                            int g0, int gn, int d0, bool active, float scale,
                                            float (&q)[G][8]) {
  const int hd = b.kv.head_dim;
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v = 0.f;
      if (g < gn && active) {
        const size_t off =
            token * b.q_stride + static_cast<size_t>((kvh * group + g0 + g) * hd + d0 + j);
        v = b.dtype == DType::bf16 ? __bfloat162float(static_cast<const bf16*>(b.q)[off])
                                   : static_cast<const float*>(b.q)[off];
      }
      q[g][j] = v * scale;
    }
}

/// Decode attention: the dot product of a row spread over L lanes (8 dimensions each, L a
/// power of two dividing 32), every lane of the group getting it. All 32 lanes must call.
template <int L>
__device__ __forceinline__ float lanes_dot8(const float (&q)[8], const float (&k)[8]) {
  float dot = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) dot = fmaf(q[j], k[j], dot);
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  return dot;
}

// d += a b on the tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulators): a is
// the A fragment (16 x 16, row), b0 b1 the B fragment (16 x 8, col), d the 16 x 8 C fragment.
__device__ __forceinline__ void mma_bf16_16816(float* d, const uint32_t* a, uint32_t b0,
                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The same with fp16 operands (fp32 accumulation).
__device__ __forceinline__ void mma_f16_16816(float* d, const uint32_t* a, uint32_t b0,
                                              uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Four 8 x 8 b16 matrices from shared memory (ldmatrix x4; lane i gives row i's address),
// as stored or transposed.
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// 8 bf16 (one 16-byte load, value i in bits 16i .. 16i + 15) widened to float, exactly.
__device__ __forceinline__ void bf16x8_to_f(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
/// `scratch` holds 33 floats; the call ends with a barrier, so scratch may be reused.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < nw ? scratch[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) scratch[32] = s;
  }
  __syncthreads();
  const float r = scratch[32];
  __syncthreads();
  return r;
}

/// Eight elements as floats from a 16-byte aligned address.
__device__ __forceinline__ void load8(const bf16* p, float* f) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float* f) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

// 8 e4m3 bytes (value i in byte i) widened to float, exactly.
__device__ __forceinline__ void e4m3x8_to_f(const uint2& u, float* f) {
  const uint32_t w[2] = {u.x, u.y};
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>((w[i] >> (16 * j)) & 0xffffu);
      const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      f[4 * i + 2 * j] = v.x;
      f[4 * i + 2 * j + 1] = v.y;
    }
}
/// Eight e4m3 elements as floats from an 8-byte aligned address.
__device__ __forceinline__ void load8(const e4m3* p, float* f) {
  e4m3x8_to_f(*reinterpret_cast<const uint2*>(p), f);
}

// Eight cache elements as loaded (16 bytes of bf16, or 32 of fp32), widened on use: the
// paged-attention kernels issue several rows' loads before they use the first.
template <typename C>
struct Raw8;
template <>
struct Raw8<bf16> {
  uint4 v;
};
template <>
struct Raw8<float> {
  float4 a, b;
};
template <>
struct Raw8<e4m3> {
  uint2 v;
};
__device__ __forceinline__ void load_raw(const e4m3* p, Raw8<e4m3>& r) {
  r.v = __ldg(reinterpret_cast<const uint2*>(p));
}
__device__ __forceinline__ void zero_raw(Raw8<e4m3>& r) {
  r.v = make_uint2(0, 0);
}
__device__ __forceinline__ void to_floats(const Raw8<e4m3>& r, float* f) {
  e4m3x8_to_f(r.v, f);
}
__device__ __forceinline__ void load_raw(const bf16* p, Raw8<bf16>& r) {
  r.v = __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ void load_raw(const float* p, Raw8<float>& r) {
  r.a = __ldg(reinterpret_cast<const float4*>(p));
  r.b = __ldg(reinterpret_cast<const float4*>(p) + 1);
}
__device__ __forceinline__ void zero_raw(Raw8<bf16>& r) {
  r.v = make_uint4(0, 0, 0, 0);
}
__device__ __forceinline__ void zero_raw(Raw8<float>& r) {
  r.a = r.b = make_float4(0.f, 0.f, 0.f, 0.f);
}
__device__ __forceinline__ void to_floats(const Raw8<bf16>& r, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r.v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x, f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void to_floats(const Raw8<float>& r, float* f) {
  f[0] = r.a.x, f[1] = r.a.y, f[2] = r.a.z, f[3] = r.a.w;
  f[4] = r.b.x, f[5] = r.b.y, f[6] = r.b.z, f[7] = r.b.w;
}

/// Stores `v` as element `at` of a KV cache pool of type `dt` (f32, bf16 or e4m3).
__device__ __forceinline__ void store_cache(void* pool, DType dt, size_t at, float v) {
  if (dt == DType::bf16)
    static_cast<bf16*>(pool)[at] = from_f<bf16>(v);
  else if (dt == DType::e4m3)
    static_cast<e4m3*>(pool)[at] = from_f<e4m3>(v);
  else
    static_cast<float*>(pool)[at] = v;
}

}  // namespace spark::kernels::dev

/// Calls `body` with `T` bound to float or __nv_bfloat16 as `dt` says.
#define SPARK_DISPATCH_DTYPE(dt, T, ...)         \
  do {                                           \
    if ((dt) == ::spark::kernels::DType::bf16) { \
      using T = ::spark::kernels::dev::bf16;     \
      __VA_ARGS__;                               \
    } else {                                     \
      using T = float;                           \
      __VA_ARGS__;                               \
    }                                            \
  } while (0)

/// Calls `body` with `C` bound to float, __nv_bfloat16 or __nv_fp8_e4m3 as the KV cache
/// type `dt` says (the attention kernels and the KV writes; activations use the above).
#define SPARK_DISPATCH_KV(dt, C, ...)            \
  do {                                           \
    if ((dt) == ::spark::kernels::DType::e4m3) { \
      using C = ::spark::kernels::dev::e4m3;     \
      __VA_ARGS__;                               \
    } else {                                     \
      SPARK_DISPATCH_DTYPE(dt, C, __VA_ARGS__);  \
    }                                            \
  } while (0)
