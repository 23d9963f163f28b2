#pragma once
// The RoPE epilogue of the q/k/v products of a decode step, shared by the bf16 own kernel
// (kernels/matmul.cu, matmul_qkv_rope_cuda_device) and the FP8 one (kernels/fp8_matmul.cu,
// fp8_qkv_rope_cuda_device): each warp holds the fp32 sums of one rotation pair (n0, n0 +
// head_dim/2) of a head after its shuffles; the epilogue rounds them as the product would
// store them, applies Qwen3's per-head norm where asked (a cluster of blocks per head),
// rotates them with dev::rope_pair and writes k's and v's rows to their cache slots: the bits
// of the products and then rope_kernel with its KV write. `Args` is MatmulArgs or
// Fp8MatmulArgs (bias, out, out_dtype, ldo, m are what the epilogue reads). Include in a .cu
// file only.
#include <cooperative_groups.h>

#include <string>

#include "core/error.h"
#include "kernels/device_common.cuh"
#include "kernels/rope.h"

namespace spark::kernels::dev {

// Thread block clusters (the per-head norms in the q/k/v epilogue): sm_90 and later.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool kClusters = false;
#else
constexpr bool kClusters = true;
#endif

// Rotation pairs a block of the products holds: one a warp, eight warps.
constexpr int kRopePairsPerBlock = 8;

// What the epilogue needs beside the product's own arguments (set by rope_epilogue_for).
struct RopeEpilogue {
  const int32_t* positions = nullptr;
  const float* inv_freq = nullptr;
  size_t head_dim = 0;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  DType cache_dtype = DType::bf16;
  long long cache_slots = 0;
  const int32_t* slots = nullptr;
  size_t kv_row = 0;  // cache row: n_kv_heads * head_dim elements
  // Per-head RMSNorms before the rotation (Qwen3's q_norm and k_norm, [head_dim] of the
  // output's type; null: none): the launch is then a cluster of head_dim / 16 blocks per head.
  const void* q_norm = nullptr;
  const void* k_norm = nullptr;
  float norm_eps = 0.f;
};

// The two units of a warp of the streaming q/k/v products with the RoPE epilogue: the warp's
// first unit u0 (even) stands for rotation pair u0 / 2, whose rows are i and i + head_dim/2
// of its head. Returns i; units[0], units[1] are the rows.
__device__ __forceinline__ size_t rope_pair_units(size_t u0, size_t head_dim, size_t* units) {
  const size_t pair = u0 / 2, half = head_dim / 2;
  const size_t i = pair % half;
  units[0] = (pair / half) * head_dim + i;
  units[1] = units[0] + half;
  return i;
}

// The R units (output rows) a warp of the streaming products takes from its first unit u0:
// u0 .. u0 + R - 1, or with the RoPE epilogue (ROPE >= 0, R = 2) a rotation pair's rows
// (rope_pair_units). Returns the pair's i (0 without RoPE).
template <int R, int ROPE>
__device__ __forceinline__ size_t stream_units(size_t u0, size_t head_dim, size_t* units) {
  static_assert(ROPE < 0 || R == 2, "RoPE pairs take two units a warp");
  if constexpr (ROPE >= 0) {
    return rope_pair_units(u0, head_dim, units);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) units[r] = u0 + r;
    return 0;
  }
}

// The RoPE epilogue of the q/k/v products (PART 0, 1, 2 = q, k, v): the product's rounding
// of output row m's rotation pair (n0, n1 = n0 + head_dim/2), then for q and k rope_pair, as
// rope_kernel computes it from the stored values; k's rotated and v's rows also go to the
// cache slot, as its KV write converts them.
template <int PART, typename T, typename Args>
__device__ __forceinline__ void store_rope_t(const Args& p, const RopeEpilogue& rp, size_t m,
                                             size_t n0, size_t i, float a0, float a1) {
  const size_t n1 = n0 + rp.head_dim / 2;
  if (p.bias) {
    const dev::bf16* bias = static_cast<const dev::bf16*>(p.bias);
    a0 += __bfloat162float(bias[n0]), a1 += __bfloat162float(bias[n1]);
  }
  T t0 = dev::from_f<T>(a0), t1 = dev::from_f<T>(a1);
  if constexpr (PART < 2)
    dev::rope_pair(dev::to_f(t0), dev::to_f(t1), static_cast<float>(rp.positions[m]),
                   rp.inv_freq[i], &t0, &t1);
  T* o = static_cast<T*>(p.out) + m * p.ldo;
  o[n0] = t0, o[n1] = t1;
  if constexpr (PART > 0) {
    const int32_t slot = rp.slots[m];
    if (slot < 0 || slot >= rp.cache_slots) return;
    const size_t at = static_cast<size_t>(slot) * rp.kv_row;
    void* cache = PART == 1 ? rp.k_cache : rp.v_cache;
    dev::store_cache(cache, rp.cache_dtype, at + n0, dev::to_f(t0));
    dev::store_cache(cache, rp.cache_dtype, at + n1, dev::to_f(t1));
  }
}

// The RoPE epilogue with a per-head RMSNorm first (Qwen3's q/k norms): what rope_kernel
// computes from the stored products, bit for bit. A head's hd / 2 rotation pairs are one
// per warp over the hd / 16 blocks of a cluster (block rank c holds pairs 8c .. 8c + 7). Each
// warp leaves its pair's stored values (bias added, rounded to the output type) in shared
// memory; after a cluster barrier warp 0 of every block sums the head's squares through
// distributed shared memory in rope_kernel's order (lane l: pairs l + 32 j, then the warp's
// butterfly), so the 1 / rms is rope_kernel's; each warp then scales, rotates and stores its
// pair (and k's cache row); a last barrier keeps the values until every block has read them.
// v, and a part without a norm, store as store_rope_t does (their clusters never wait).
template <int ROPE, int M, typename T, typename Args>
__device__ __forceinline__ void store_rope_head_norm(const Args& p, const RopeEpilogue& rp,
                                                     size_t n0, size_t i, bool ok,
                                                     const float (&a0)[M], const float (&a1)[M]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* nw = static_cast<const T*>(ROPE == 0 ? rp.q_norm : ROPE == 1 ? rp.k_norm : nullptr);
  if (ROPE == 2 || !nw) {
#pragma unroll
    for (int m = 0; m < M; ++m)
      if (lane == m && ok && m < static_cast<int>(p.m))
        store_rope_t<ROPE, T>(p, rp, static_cast<size_t>(m), n0, i, a0[m], a1[m]);
    return;
  }
  __shared__ float2 pairs_s[kRopePairsPerBlock][M];
  __shared__ float inv_s[M];
  const size_t half = rp.head_dim / 2, n1 = n0 + half;
  float t0[M], t1[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float x0 = a0[m], x1 = a1[m];
    if (p.bias) {
      const dev::bf16* bias = static_cast<const dev::bf16*>(p.bias);
      x0 += __bfloat162float(bias[n0]), x1 += __bfloat162float(bias[n1]);
    }
    t0[m] = dev::to_f(dev::from_f<T>(x0)), t1[m] = dev::to_f(dev::from_f<T>(x1));
    if (lane == 0)
      pairs_s[warp][m] =
          ok && m < static_cast<int>(p.m) ? make_float2(t0[m], t1[m]) : make_float2(0.f, 0.f);
  }
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  if (warp == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int q = lane + 32 * j;
        if (q < static_cast<int>(half)) {
          const float2 v = *cluster.map_shared_rank(&pairs_s[q % kRopePairsPerBlock][m],
                                                    static_cast<unsigned>(q / kRopePairsPerBlock));
          ss = fmaf(v.x, v.x, fmaf(v.y, v.y, ss));
        }
      }
      ss = dev::warp_sum(ss);
      if (lane == 0) inv_s[m] = rsqrtf(ss / static_cast<float>(rp.head_dim) + rp.norm_eps);
    }
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (lane != m || !ok || m >= static_cast<int>(p.m)) continue;
    const float inv = inv_s[m];
    const float x0 = t0[m] * inv * dev::to_f(nw[i]), x1 = t1[m] * inv * dev::to_f(nw[i + half]);
    T r0, r1;
    dev::rope_pair(x0, x1, static_cast<float>(rp.positions[m]), rp.inv_freq[i], &r0, &r1);
    T* o = static_cast<T*>(p.out) + static_cast<size_t>(m) * p.ldo;
    o[n0] = r0, o[n1] = r1;
    if constexpr (ROPE == 1) {
      const int32_t slot = rp.slots[m];
      if (slot >= 0 && slot < rp.cache_slots) {
        const size_t at = static_cast<size_t>(slot) * rp.kv_row;
        dev::store_cache(rp.k_cache, rp.cache_dtype, at + n0, dev::to_f(r0));
        dev::store_cache(rp.k_cache, rp.cache_dtype, at + n1, dev::to_f(r1));
      }
    }
  }
  cluster.sync();  // the other blocks read pairs_s until here
}

// Part i (0, 1, 2 = q, k, v) of the q/k/v products must write what the epilogue stores:
// rope's q, k or v, n_heads or n_kv_heads x head_dim columns at rope's stride. Empty when it
// does, else what it must write.
inline std::string qkv_part_mismatch(const RopeArgs& rope, int i, size_t n, const void* out,
                                     size_t ldo) {
  const size_t hd = static_cast<size_t>(rope.head_dim);
  const size_t width = static_cast<size_t>(i == 0 ? rope.n_heads : rope.n_kv_heads) * hd;
  const void* want = i == 0 ? rope.q : i == 1 ? rope.k : rope.v;
  const size_t stride = i == 0 ? rope.q_stride : i == 1 ? rope.k_stride : rope.v_stride;
  if (n == width && out == want && ldo == stride) return {};
  return "part " + std::to_string(i) + " must write rope's " + "qkv"[i] + " (" +
         std::to_string(width) + " columns, stride " + std::to_string(stride) + ")";
}

// The epilogue's arguments for `rope` over m rows (the products' checks are the caller's):
// the KV write set, whole heads rotating, and per-head norms only where `head_norms_ok`.
// `what` names the caller in errors.
inline Status rope_epilogue_for(const RopeArgs& rope, size_t m, bool head_norms_ok,
                                const char* what, RopeEpilogue* out) {
  auto bad = [&](const std::string& why) {
    return make_error(Errc::usage, std::string(what) + " with RoPE: " + why);
  };
  SPARK_TRY(rope_check_args(rope));
  if (rope.n_tokens != m) return bad("rope's n_tokens must be the products' m");
  if (rope.rotary_dim > 0 && rope.rotary_dim != rope.head_dim)
    return bad("whole heads rotate in the epilogue (partial rotary: run the separate kernels)");
  if ((rope.q_norm || rope.k_norm) && !head_norms_ok)
    return bad(
        "per-head norms need 1-2 rows, head_dim 32, 64 or 128 and thread block "
        "clusters (sm_90); here " +
        std::to_string(m) + " rows, head_dim " + std::to_string(rope.head_dim) +
        " (run the separate kernels)");
  if (!rope.k || !rope.k_cache || !rope.v_cache || !rope.slots || !rope.v)
    return bad("needs the KV write (k, v, both caches and the slots)");
  RopeEpilogue& e = *out;
  e.positions = rope.positions;
  e.inv_freq = rope.inv_freq;
  e.head_dim = static_cast<size_t>(rope.head_dim);
  e.k_cache = rope.k_cache;
  e.v_cache = rope.v_cache;
  e.cache_dtype = rope.cache_dtype;
  e.cache_slots = rope.cache_slots;
  e.slots = rope.slots;
  e.kv_row = static_cast<size_t>(rope.n_kv_heads) * static_cast<size_t>(rope.head_dim);
  e.q_norm = rope.q_norm;
  e.k_norm = rope.k_norm;
  e.norm_eps = rope.norm_eps;
  return Status::Ok();
}

}  // namespace spark::kernels::dev
