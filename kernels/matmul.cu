// Matrix products: cuBLASLt, opened with dlopen (only its header is used at build time, so
// the binaries start without it), and an own kernel for decode shapes.
//
// The own kernel (m <= 32): out^T = W * A^T on the tensor cores (mma.sync m16n8k16, bf16
// in, fp32 accumulation), W's 16 rows per warp as the mma's A operand and up to 32 rows of
// A as its B operand. Each lane loads 16 contiguous bytes of W (and of A) per 32-wide k
// chunk and feeds them to two mma k-steps: a dot product does not depend on the order of
// k, so a lane's 8 consecutive elements stand in for the mma's strided k positions as
// long as W and A use the same mapping. That keeps every load 16 bytes wide and W read
// exactly once, with several chunks in flight per lane; the 8 warps of a block split k
// and reduce through shared memory.
#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/matmul.h"

namespace spark::kernels {
namespace {

constexpr int kUnroll = 4;  // 32-wide k chunks in flight per lane

__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The products of one launch: block b of the grid computes rows of part[i] where
// first_block[i] <= b < first_block[i + 1].
// The q/k/v products' RoPE and KV write (matmul_qkv_rope_cuda_device); unused elsewhere.
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
};

struct OwnGroup {
  MatmulArgs part[kMatmulMaxGroup];
  unsigned first_block[kMatmulMaxGroup + 1];
  int n;
  RopeEpilogue rope;
};

// Output rows (of W, i.e. columns of out) per block: 16, or 8 gate/up pairs with swiglu.
__host__ __device__ constexpr size_t own_rows_per_block(bool swiglu) {
  return swiglu ? 8 : 16;
}

// One block's work for product p: NT n-tiles of 8 rows of A (m <= 8 * NT); W warps split k.
// The mma's A operand rows g and g + 8 are W rows w0 and w1: 16 consecutive rows, or with
// swiglu gate row i and up row n + i, so one lane ends with both products of an output.
// The epilogue both forms share: output (m, n) of a plain product (bias, then the
// accumulate, rounded once to the output type), and of a [gate | up] pair with SwiGLU (the
// two products rounded as the [gate | up] buffer would hold them, then silu(g) * u).
// `prior`: the old output when accumulating, already read (else read here).
__device__ __forceinline__ void store_product(const MatmulArgs& p, size_t m, size_t n, float s,
                                              const float* prior = nullptr) {
  if (p.bias) s += __bfloat162float(static_cast<const dev::bf16*>(p.bias)[n]);
  const size_t off = m * p.ldo + n;
  if (p.out_dtype == DType::bf16) {
    dev::bf16* o = static_cast<dev::bf16*>(p.out) + off;
    if (p.accumulate) s += prior ? *prior : __bfloat162float(*o);
    *o = __float2bfloat16_rn(s);
  } else {
    float* o = static_cast<float*>(p.out) + off;
    if (p.accumulate) s += prior ? *prior : *o;
    *o = s;
  }
}
__device__ __forceinline__ void store_swiglu(const MatmulArgs& p, size_t m, size_t n, float gt,
                                             float up) {
  const dev::bf16* bias = static_cast<const dev::bf16*>(p.bias);
  const bool bf16_out = p.out_dtype == DType::bf16;
  if (bias) gt += __bfloat162float(bias[n]), up += __bfloat162float(bias[p.n + n]);
  if (bf16_out) {
    gt = __bfloat162float(__float2bfloat16_rn(gt));
    up = __bfloat162float(__float2bfloat16_rn(up));
  }
  const float y = gt / (1.f + expf(-gt)) * up;
  const size_t off = m * p.ldo + n;
  if (bf16_out)
    static_cast<dev::bf16*>(p.out)[off] = __float2bfloat16_rn(y);
  else
    static_cast<float*>(p.out)[off] = y;
}

template <int NT, int kOwnWarps>
__device__ __forceinline__ void own_block(const MatmulArgs& p, size_t blk,
                                          float (*red)[32][NT * 4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const dev::bf16* W = static_cast<const dev::bf16*>(p.w);
  const dev::bf16* A = static_cast<const dev::bf16*>(p.a);
  const size_t n0 = blk * own_rows_per_block(p.swiglu);
  const size_t rw0 = n0 + g, rw1 = p.swiglu ? p.n + n0 + g : n0 + g + 8;
  const bool w0ok = rw0 < p.n, w1ok = p.swiglu ? w0ok : rw1 < p.n;
  const dev::bf16* w0 = W + (w0ok ? rw0 : 0) * p.ldw;
  const dev::bf16* w1 = W + (w1ok ? rw1 : 0) * p.ldw;
  const dev::bf16* ar[NT];
  bool aok[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const size_t m = static_cast<size_t>(t) * 8 + g;
    aok[t] = m < p.m;
    ar[t] = A + (aok[t] ? m : 0) * p.lda;
  }
  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

  // This warp's share of the k chunks.
  const size_t chunks = (p.k + 31) / 32;
  const size_t per = (chunks + kOwnWarps - 1) / kOwnWarps;
  const size_t c_begin = static_cast<size_t>(warp) * per;
  const size_t c_end = c_begin + per < chunks ? c_begin + per : chunks;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (size_t ch = c_begin; ch < c_end; ch += kUnroll) {
    uint4 wv0[kUnroll], wv1[kUnroll], av[kUnroll][NT];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t k = (ch + u) * 32 + static_cast<size_t>(c) * 8;
      const bool kok = ch + u < c_end && k < p.k;
      wv0[u] = kok && w0ok ? __ldg(reinterpret_cast<const uint4*>(w0 + k)) : zero;
      wv1[u] = kok && w1ok ? __ldg(reinterpret_cast<const uint4*>(w1 + k)) : zero;
#pragma unroll
      for (int t = 0; t < NT; ++t)
        av[u][t] = kok && aok[t] ? *reinterpret_cast<const uint4*>(ar[t] + k) : zero;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // Step 1: elements 0..3 of each lane's 8; step 2: elements 4..7.
      const uint32_t a1[4] = {wv0[u].x, wv1[u].x, wv0[u].y, wv1[u].y};
      const uint32_t a2[4] = {wv0[u].z, wv1[u].z, wv0[u].w, wv1[u].w};
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        mma16816(acc[t], a1, av[u][t].x, av[u][t].y);
        mma16816(acc[t], a2, av[u][t].z, av[u][t].w);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) red[warp][lane][t * 4 + e] = acc[t][e];
  __syncthreads();
  if (warp != 0) return;
  float sum[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kOwnWarps; ++w) s += red[w][lane][t * 4 + e];
      sum[t][e] = s;
    }
  if (p.swiglu) {
    // c0, c1: gate of output n0 + g for A rows 2c, 2c + 1; c2, c3: the matching up.
    const size_t n = n0 + g;
    if (n >= p.n) return;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const size_t m = static_cast<size_t>(t) * 8 + 2 * c + e;
        if (m >= p.m) continue;
        store_swiglu(p, m, n, sum[t][e], sum[t][e + 2]);
      }
    return;
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float s = sum[t][e];
      // c0,c1: W row g, A rows 2c, 2c+1; c2,c3: W row g+8.
      const size_t n = n0 + g + (e >= 2 ? 8 : 0);
      const size_t m = static_cast<size_t>(t) * 8 + 2 * c + (e & 1);
      if (n >= p.n || m >= p.m) continue;
      store_product(p, m, n, s);
    }
}

// Each part is called with a constant index, so its arguments stay in parameter space.
template <int NT, int kOwnWarps>
__global__ void __launch_bounds__(kOwnWarps * 32) own_kernel(OwnGroup G) {
  __shared__ float red[kOwnWarps][32][NT * 4];
  const unsigned b = blockIdx.x;
  if (G.n > 2 && b >= G.first_block[2])
    own_block<NT, kOwnWarps>(G.part[2], b - G.first_block[2], red);
  else if (G.n > 1 && b >= G.first_block[1])
    own_block<NT, kOwnWarps>(G.part[1], b - G.first_block[1], red);
  else
    own_block<NT, kOwnWarps>(G.part[0], b, red);
}

// ---- the streaming form (m <= kMatmulGemvMaxRows) ----------------------------------------
// One warp owns R output units of one product (a unit is an output column n of out: one
// weight row, or with swiglu the gate row n and the up row p.n + n) and reads them whole:
// lane l takes the 16 bytes at l * 8 + 256 * s of each row for steps s, so each load
// instruction of a warp covers 512 contiguous bytes of a row, and U steps of every row are
// in flight per lane before the first is used. The first U steps are loaded before
// pdl_wait(): a weight does not depend on the kernel ahead, so under programmatic launch
// they stream while that kernel finishes. A (m <= 4 rows, a few KiB) is read through L1,
// shared by the block's warps. fp32 FMA; the warp's partial sums meet by xor shuffles.
// NORM: A's rows are the residual and the product runs over RMSNorm(A) * norm_w
// (MatmulArgs::norm_w): each lane multiplies its A elements by norm_w's and sums their
// squares as it goes; a warp covers the whole row, so after the shuffles every lane holds
// the row's sum of squares and scales its sums by 1 / rms. No pass before the product, no
// barrier: the separate norm kernel and its launch boundary are gone.
// With accumulate, the lane that stores an output reads the old value right after
// pdl_wait(), so the read is not a dependent trip after the product.
constexpr int kGemvWarps = 8;
// Warps of the one-row forms (r1 u8, r2 u4: 58 registers at sm_90) resident per
// multiprocessor: four blocks of eight (the register file's 64 Ki / (58 x 256)).
constexpr size_t kGemvResidentWarpsPerSm = 32;

__device__ __forceinline__ void bf16x8_to_f(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// The RoPE epilogue of the q/k/v products (PART 0, 1, 2 = q, k, v): the product's rounding
// of output row m's rotation pair (n0, n1 = n0 + head_dim/2), then for q and k rope_pair, as
// rope_kernel computes it from the stored values; k's rotated and v's rows also go to the
// cache slot, as its KV write converts them.
template <int PART, typename T>
__device__ __forceinline__ void store_rope_t(const MatmulArgs& p, const RopeEpilogue& rp, size_t m,
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
    if (rp.cache_dtype == DType::bf16) {
      dev::bf16* c = static_cast<dev::bf16*>(cache) + at;
      c[n0] = dev::from_f<dev::bf16>(dev::to_f(t0)), c[n1] = dev::from_f<dev::bf16>(dev::to_f(t1));
    } else {
      float* c = static_cast<float*>(cache) + at;
      c[n0] = dev::to_f(t0), c[n1] = dev::to_f(t1);
    }
  }
}

// ROPE >= 0: the q/k/v part of that index with the RoPE epilogue. The warp's two units are
// then the rotation pair (i, i + head_dim/2) of one head, not two adjacent rows.
template <int M, int R, int U, int NW, int ROPE = -1, int NORM = 0>
__device__ __forceinline__ void gemv_block(const MatmulArgs& p, size_t blk,
                                           const RopeEpilogue& rp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t u0 = (blk * kGemvWarps + static_cast<size_t>(warp)) * R;
  static_assert(ROPE < 0 || (R == 2 && NW == 1), "RoPE pairs take two units a warp");
  size_t units[R];
  size_t pair_i = 0;
  if constexpr (ROPE >= 0) {
    const size_t pair = u0 / 2, half = rp.head_dim / 2;
    pair_i = pair % half;
    units[0] = (pair / half) * rp.head_dim + pair_i;
    units[1] = units[0] + half;
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) units[r] = u0 + r;
  }
  const uint4* wrow[R][NW];
  bool uok[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    uok[r] = units[r] < p.n;
    const size_t unit = uok[r] ? units[r] : 0;
#pragma unroll
    for (int j = 0; j < NW; ++j)
      wrow[r][j] = reinterpret_cast<const uint4*>(static_cast<const dev::bf16*>(p.w) +
                                                  (unit + static_cast<size_t>(j) * p.n) * p.ldw);
  }
  const uint4* arow[M];
#pragma unroll
  for (int m = 0; m < M; ++m)
    arow[m] = reinterpret_cast<const uint4*>(static_cast<const dev::bf16*>(p.a) +
                                             (m < static_cast<int>(p.m) ? m : 0) * p.lda);
  const size_t kv = p.k / 8;  // 16-byte pieces per row
  const size_t steps = (kv + 31) / 32;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  float acc[R][NW][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][j][m] = 0.f;

  uint4 wv[U][R][NW];
  auto load_w = [&](size_t s0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = (s0 + u) * 32 + lane;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NW; ++j) wv[u][r][j] = i < kv && uok[r] ? __ldcs(wrow[r][j] + i) : zero;
    }
  };
  const uint4* nrow = static_cast<const uint4*>(p.norm_w);
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; ++m) ss[m] = 0.f;
  load_w(0);
  dev::pdl_wait();
  // Lane r * M + m stores unit r's output for A row m (below); with accumulate it reads the
  // old value now.
  float prior = 0.f;
  if constexpr (ROPE < 0 && NW == 1) {
    const int pr = lane / M, pm = lane % M;
    if (p.accumulate && lane < R * M && pm < static_cast<int>(p.m)) {
      size_t n = 0;
      bool ok = false;
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (r == pr) n = units[r], ok = uok[r];
      if (ok) {
        const size_t off = static_cast<size_t>(pm) * p.ldo + n;
        prior = p.out_dtype == DType::bf16
                    ? __bfloat162float(static_cast<const dev::bf16*>(p.out)[off])
                    : static_cast<const float*>(p.out)[off];
      }
    }
  }
  for (size_t s0 = 0;;) {
    uint4 av[U][M];
    uint4 nv[NORM == 1 ? U : 1];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = (s0 + u) * 32 + lane;
#pragma unroll
      for (int m = 0; m < M; ++m) av[u][m] = i < kv ? __ldg(arow[m] + i) : zero;
      if constexpr (NORM == 1) nv[u] = i < kv ? __ldg(nrow + i) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float af[M][8];
#pragma unroll
      for (int m = 0; m < M; ++m) bf16x8_to_f(av[u][m], af[m]);
      if constexpr (NORM == 1) {
        float nf[8];
        bf16x8_to_f(nv[u], nf);
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            ss[m] = fmaf(af[m][e], af[m][e], ss[m]);
            af[m][e] *= nf[e];
          }
      } else if constexpr (NORM == 2) {
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int e = 0; e < 8; ++e) ss[m] = fmaf(af[m][e], af[m][e], ss[m]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NW; ++j) {
          float wf[8];
          bf16x8_to_f(wv[u][r][j], wf);
#pragma unroll
          for (int m = 0; m < M; ++m)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][j][m] = fmaf(wf[e], af[m][e], acc[r][j][m]);
        }
    }
    s0 += U;
    if (s0 >= steps) break;
    load_w(s0);
  }
  dev::pdl_trigger();
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][j][m] = dev::warp_sum(acc[r][j][m]);
  if constexpr (NORM > 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float inv = rsqrtf(dev::warp_sum(ss[m]) / static_cast<float>(p.k) + p.norm_eps);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NW; ++j) acc[r][j][m] *= inv;
    }
  }

  // Lane r * M + m stores unit r's output for A row m.
  if constexpr (ROPE >= 0) {
    // Lane m stores row m's pair: both units' sums are in every lane after the shuffles.
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (lane != m || !uok[0] || m >= static_cast<int>(p.m)) continue;
      if (p.out_dtype == DType::bf16)
        store_rope_t<ROPE, dev::bf16>(p, rp, static_cast<size_t>(m), units[0], pair_i, acc[0][0][m],
                                      acc[1][0][m]);
      else
        store_rope_t<ROPE, float>(p, rp, static_cast<size_t>(m), units[0], pair_i, acc[0][0][m],
                                  acc[1][0][m]);
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (lane != r * M + m || !uok[r] || m >= static_cast<int>(p.m)) continue;
        const size_t n = units[r];
        if constexpr (NW == 2)
          store_swiglu(p, static_cast<size_t>(m), n, acc[r][0][m], acc[r][1][m]);
        else
          store_product(p, static_cast<size_t>(m), n, acc[r][0][m], &prior);
      }
  }
}

// The one-row forms that keep 8 steps of 16 bytes in flight per lane (r1 u8, r1 u4 with
// swiglu, r2 u4, the RoPE form) fit 64 registers, four blocks of eight warps per
// multiprocessor; ptxas left alone gives the norm's forms 66-68 and so three blocks, a
// quarter fewer loads in flight (measured: q/k/v 16.6 against 14.6 us). The bound keeps four.
template <int M, int R, int U, int NW>
__host__ __device__ constexpr int gemv_min_blocks() {
  return M == 1 && R * U * NW <= 8 ? 4 : 1;
}

template <int M, int R, int U, int NW, int NORM>
__global__ void __launch_bounds__(kGemvWarps * 32, (gemv_min_blocks<M, R, U, NW>()))
    gemv_kernel(OwnGroup G) {
  const unsigned b = blockIdx.x;
  if (G.n > 2 && b >= G.first_block[2])
    gemv_block<M, R, U, NW, -1, NORM>(G.part[2], b - G.first_block[2], G.rope);
  else if (G.n > 1 && b >= G.first_block[1])
    gemv_block<M, R, U, NW, -1, NORM>(G.part[1], b - G.first_block[1], G.rope);
  else
    gemv_block<M, R, U, NW, -1, NORM>(G.part[0], b, G.rope);
}

// q, k and v (parts 0, 1, 2) with the RoPE epilogue, two units (a rotation pair) a warp.
template <int M, int NORM>
__global__ void __launch_bounds__(kGemvWarps * 32, (gemv_min_blocks<M, 2, 4, 1>()))
    gemv_rope_kernel(OwnGroup G) {
  const unsigned b = blockIdx.x;
  if (b >= G.first_block[2])
    gemv_block<M, 2, 4, 1, 2, NORM>(G.part[2], b - G.first_block[2], G.rope);
  else if (b >= G.first_block[1])
    gemv_block<M, 2, 4, 1, 1, NORM>(G.part[1], b - G.first_block[1], G.rope);
  else
    gemv_block<M, 2, 4, 1, 0, NORM>(G.part[0], b, G.rope);
}

// out[m][n] += bias[n] (bf16) for fp32 outputs, whose cuBLASLt bias must be fp32.
__global__ void bias_f32_kernel(float* out, size_t ldo, const dev::bf16* bias, size_t m, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < m * n;
       i += size_t{gridDim.x} * blockDim.x)
    out[(i / n) * ldo + i % n] += __bfloat162float(bias[i % n]);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// What every form of the own kernel needs of its operands: 16-byte loads of A and W rows.
bool own_operands_ok(const MatmulArgs& a) {
  return a.k % 8 == 0 && a.lda % 8 == 0 && a.ldw % 8 == 0 && aligned16(a.a) && aligned16(a.w);
}

// Largest power of two dividing the address, at most 256 (what cuBLASLt asks about).
uint32_t alignment_of(const void* p) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

}  // namespace

namespace {

template <typename K>
Status launch_own(K kernel, unsigned grid, unsigned threads, cudaStream_t st, const OwnGroup& G) {
  SPARK_CUDA_TRY(dev::launch(kernel, dim3(grid), dim3(threads), 0, st, G));
  return Status::Ok();
}

// The streaming form's units per launch block and its kernels for m rows.
template <int R, int U, int NW>
Status launch_gemv(OwnGroup G, const MatmulArgs* parts, int n_parts, cudaStream_t st) {
  size_t blocks = 0;
  for (int i = 0; i < n_parts; ++i) {
    G.first_block[i] = static_cast<unsigned>(blocks);
    blocks += (parts[i].n + kGemvWarps * R - 1) / (kGemvWarps * R);
    if (blocks > 0x7fffffffu) return make_error(Errc::usage, "matmul (own kernel): n too large");
  }
  G.first_block[n_parts] = static_cast<unsigned>(blocks);
  const unsigned grid = static_cast<unsigned>(blocks);
  auto go = [&](auto norm) {
    constexpr int N = decltype(norm)::value;
    switch (parts[0].m) {
      case 1:
        return launch_own(gemv_kernel<1, R, U, NW, N>, grid, kGemvWarps * 32, st, G);
      case 2:
        return launch_own(gemv_kernel<2, R, U, NW, N>, grid, kGemvWarps * 32, st, G);
      case 3:
        return launch_own(gemv_kernel<3, R, U, NW, N>, grid, kGemvWarps * 32, st, G);
      default:
        return launch_own(gemv_kernel<4, R, U, NW, N>, grid, kGemvWarps * 32, st, G);
    }
  };
  return parts[0].norm_unit ? go(std::integral_constant<int, 2>{})
         : parts[0].norm_w  ? go(std::integral_constant<int, 1>{})
                            : go(std::integral_constant<int, 0>{});
}

}  // namespace

Status matmul_own_group_cuda_device(const MatmulArgs* parts, int n_parts, void* stream,
                                    OwnVariant variant) {
  if (n_parts < 1 || n_parts > kMatmulMaxGroup)
    return make_error(Errc::usage, "matmul (own kernel): a group of " + std::to_string(n_parts) +
                                       " products; 1 to " + std::to_string(kMatmulMaxGroup));
  if (parts[0].m == 0) return matmul_check_args(parts[0]);
  OwnGroup G{};
  G.n = n_parts;
  bool swiglu = false;
  for (int i = 0; i < n_parts; ++i) {
    const MatmulArgs& a = parts[i];
    SPARK_TRY(matmul_check_args(a));
    if (a.m != parts[0].m)
      return make_error(Errc::usage, "matmul (own kernel): the products of a group differ in m");
    if (a.m > kMatmulOwnMaxRows)
      return make_error(Errc::usage, "matmul (own kernel): m " + std::to_string(a.m) + " is over " +
                                         std::to_string(kMatmulOwnMaxRows) + " rows; use cuBLASLt");
    if (a.accumulate && a.swiglu)
      return make_error(Errc::usage, "matmul (own kernel): swiglu with accumulate");
    if (!own_operands_ok(a))
      return make_error(
          Errc::usage,
          "matmul (own kernel): needs k, lda, ldw multiples of 8 and 16-byte aligned a, w");
    if (i > 0 && a.swiglu != swiglu)
      return make_error(Errc::usage,
                        "matmul (own kernel): a group mixes swiglu and plain products");
    if (i > 0 && (a.norm_w == nullptr) != (parts[0].norm_w == nullptr))
      return make_error(Errc::usage,
                        "matmul (own kernel): a group mixes products with and without a norm");
    if (i > 0 && a.norm_unit != parts[0].norm_unit)
      return make_error(Errc::usage,
                        "matmul (own kernel): a group mixes folded and unfolded norm weights");
    if (a.norm_w && !aligned16(a.norm_w))
      return make_error(Errc::usage, "matmul (own kernel): norm_w must be 16-byte aligned");
    swiglu = a.swiglu;
    G.part[i] = a;
  }
  auto st = static_cast<cudaStream_t>(stream);
  const size_t m = parts[0].m;
  // Measured on the H200 (bench/kernels, "own forms"): the streaming form wins at 1 and 2
  // rows (one row: one unit per warp and 8 steps in flight; two: two units and 4 steps), the
  // tensor-core form from 3 rows on, where the streaming form's FMA and A reads add up. At
  // one row, a launch whose units would take between one and two waves of resident warps
  // (the q/k/v group's 6144 rows on 132 multiprocessors x 32 warps) takes two units per warp
  // instead, so it ends in one wave with no tail.
  if (variant == OwnVariant::automatic) {
    // A norm in the product needs the streaming form: at 3 and 4 rows its leanest shape.
    variant = m == 1   ? (swiglu ? OwnVariant::gemv_r1_u4 : OwnVariant::gemv_r1_u8)
              : m == 2 ? OwnVariant::gemv_r2_u4
              : matmul_has_norm(parts[0]) && m <= kMatmulGemvMaxRows ? OwnVariant::gemv_r1_u4
                                                                     : OwnVariant::mma;
    if (variant == OwnVariant::gemv_r1_u8) {
      auto lim = cuda_device_limits(-1);
      SPARK_TRY(lim.status());
      size_t units = 0;
      for (int i = 0; i < n_parts; ++i) units += parts[i].n;
      const size_t resident = static_cast<size_t>(lim->sm_count) * kGemvResidentWarpsPerSm;
      if (units > resident && units <= 2 * resident) variant = OwnVariant::gemv_r2_u4;
    }
  }
  if (variant == OwnVariant::mma && matmul_has_norm(parts[0]))
    return make_error(Errc::usage,
                      "matmul (own kernel): a norm in the product needs the streaming form "
                      "(at most " +
                          std::to_string(kMatmulGemvMaxRows) + " rows), not mma");
  if (variant != OwnVariant::mma) {
    if (m > kMatmulGemvMaxRows)
      return make_error(Errc::usage, "matmul (own kernel): the streaming form takes at most " +
                                         std::to_string(kMatmulGemvMaxRows) + " rows, not " +
                                         std::to_string(m));
    // swiglu: one unit is two weight rows (gate, up), so it runs the R = 1 forms, but for
    // r2 u2 (two units, four rows).
    switch (variant) {
      case OwnVariant::gemv_r1_u8:
        return swiglu ? launch_gemv<1, 8, 2>(G, parts, n_parts, st)
                      : launch_gemv<1, 8, 1>(G, parts, n_parts, st);
      case OwnVariant::gemv_r1_u4:
        return swiglu ? launch_gemv<1, 4, 2>(G, parts, n_parts, st)
                      : launch_gemv<1, 4, 1>(G, parts, n_parts, st);
      case OwnVariant::gemv_r2_u4:
        return swiglu ? launch_gemv<1, 4, 2>(G, parts, n_parts, st)
                      : launch_gemv<2, 4, 1>(G, parts, n_parts, st);
      case OwnVariant::gemv_r2_u2:  // swiglu: two units (four weight rows) a warp
        return swiglu ? launch_gemv<2, 2, 2>(G, parts, n_parts, st)
                      : launch_gemv<2, 2, 1>(G, parts, n_parts, st);
      default:
        return swiglu ? launch_gemv<1, 8, 2>(G, parts, n_parts, st)
                      : launch_gemv<2, 8, 1>(G, parts, n_parts, st);
    }
  }
  size_t blocks = 0;
  for (int i = 0; i < n_parts; ++i) {
    G.first_block[i] = static_cast<unsigned>(blocks);
    blocks += (parts[i].n + own_rows_per_block(parts[i].swiglu) - 1) /
              own_rows_per_block(parts[i].swiglu);
    if (blocks > 0x7fffffffu) return make_error(Errc::usage, "matmul (own kernel): n too large");
  }
  G.first_block[n_parts] = static_cast<unsigned>(blocks);
  const dim3 grid(static_cast<unsigned>(blocks));
  const size_t nt = (m + 7) / 8;
  // Few row blocks (small n) fill the GPU only with more warps per block splitting k.
  auto lim = cuda_device_limits(-1);
  SPARK_TRY(lim.status());
  const bool wide = blocks < static_cast<size_t>(4 * lim->sm_count);
  auto go = [&](auto nt_c) {
    constexpr int NT = decltype(nt_c)::value;
    if (wide)
      own_kernel<NT, 16><<<grid, 16 * 32, 0, st>>>(G);
    else
      own_kernel<NT, 8><<<grid, 8 * 32, 0, st>>>(G);
  };
  if (nt == 1)
    go(std::integral_constant<int, 1>{});
  else if (nt == 2)
    go(std::integral_constant<int, 2>{});
  else if (nt == 3)
    go(std::integral_constant<int, 3>{});
  else
    go(std::integral_constant<int, 4>{});
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status matmul_own_cuda_device(const MatmulArgs& a, void* stream) {
  return matmul_own_group_cuda_device(&a, 1, stream);
}

Status matmul_qkv_rope_cuda_device(const MatmulArgs* parts, const RopeArgs& rope, void* stream) {
  auto bad = [](const std::string& why) {
    return make_error(Errc::usage, "matmul q/k/v with RoPE: " + why);
  };
  SPARK_TRY(rope_check_args(rope));
  const size_t m = parts[0].m;
  const size_t hd = static_cast<size_t>(rope.head_dim);
  const size_t widths[3] = {static_cast<size_t>(rope.n_heads) * hd,
                            static_cast<size_t>(rope.n_kv_heads) * hd,
                            static_cast<size_t>(rope.n_kv_heads) * hd};
  const void* outs[3] = {rope.q, rope.k, rope.v};
  const size_t strides[3] = {rope.q_stride, rope.k_stride, rope.v_stride};
  OwnGroup G{};
  G.n = 3;
  for (int i = 0; i < 3; ++i) {
    const MatmulArgs& a = parts[i];
    SPARK_TRY(matmul_check_args(a));
    if (a.m != m) return bad("the products differ in m");
    if (a.swiglu || a.accumulate) return bad("plain products only");
    if (!own_operands_ok(a))
      return bad("needs k, lda, ldw multiples of 8 and 16-byte aligned a, w");
    if (a.out_dtype != rope.dtype) return bad("outputs of rope's dtype");
    if ((a.norm_w == nullptr) != (parts[0].norm_w == nullptr) || a.norm_unit != parts[0].norm_unit)
      return bad("the parts mix products with and without a norm, or folded and not");
    if (a.norm_w && !aligned16(a.norm_w)) return bad("norm_w must be 16-byte aligned");
    if (a.n != widths[i] || a.out != outs[i] || a.ldo != strides[i])
      return bad("part " + std::to_string(i) + " must write rope's " + "qkv"[i] + " (" +
                 std::to_string(widths[i]) + " columns, stride " + std::to_string(strides[i]) +
                 ")");
    G.part[i] = a;
  }
  if (m == 0) return Status::Ok();
  if (m > kMatmulGemvMaxRows) return bad("at most 4 rows (the streaming form)");
  if (rope.n_tokens != m) return bad("rope's n_tokens must be the products' m");
  if (rope.q_norm || rope.k_norm) return bad("no per-head norms (run the separate kernels)");
  if (!rope.k || !rope.k_cache || !rope.v_cache || !rope.slots || !rope.v)
    return bad("needs the KV write (k, v, both caches and the slots)");
  G.rope.positions = rope.positions;
  G.rope.inv_freq = rope.inv_freq;
  G.rope.head_dim = hd;
  G.rope.k_cache = rope.k_cache;
  G.rope.v_cache = rope.v_cache;
  G.rope.cache_dtype = rope.cache_dtype;
  G.rope.cache_slots = rope.cache_slots;
  G.rope.slots = rope.slots;
  G.rope.kv_row = widths[1];
  // Two units a warp: a head's hd / 2 pairs over hd / 16 blocks of eight warps.
  size_t blocks = 0;
  for (int i = 0; i < 3; ++i) {
    G.first_block[i] = static_cast<unsigned>(blocks);
    blocks += (widths[i] + kGemvWarps * 2 - 1) / (kGemvWarps * 2);
  }
  G.first_block[3] = static_cast<unsigned>(blocks);
  auto st = static_cast<cudaStream_t>(stream);
  const unsigned grid = static_cast<unsigned>(blocks), threads = kGemvWarps * 32;
  auto go = [&](auto norm) {
    constexpr int N = decltype(norm)::value;
    switch (m) {
      case 1:
        return launch_own(gemv_rope_kernel<1, N>, grid, threads, st, G);
      case 2:
        return launch_own(gemv_rope_kernel<2, N>, grid, threads, st, G);
      case 3:
        return launch_own(gemv_rope_kernel<3, N>, grid, threads, st, G);
      default:
        return launch_own(gemv_rope_kernel<4, N>, grid, threads, st, G);
    }
  };
  return parts[0].norm_unit ? go(std::integral_constant<int, 2>{})
         : parts[0].norm_w  ? go(std::integral_constant<int, 1>{})
                            : go(std::integral_constant<int, 0>{});
}

// ---- cuBLASLt ------------------------------------------------------------------------------

struct Matmul::Impl {
  void* lib = nullptr;
  std::string path;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
#define SPARK_LT_FN(name) decltype(&::name) name = nullptr
  SPARK_LT_FN(cublasLtCreate);
  SPARK_LT_FN(cublasLtDestroy);
  SPARK_LT_FN(cublasLtMatmulDescCreate);
  SPARK_LT_FN(cublasLtMatmulDescDestroy);
  SPARK_LT_FN(cublasLtMatmulDescSetAttribute);
  SPARK_LT_FN(cublasLtMatrixLayoutCreate);
  SPARK_LT_FN(cublasLtMatrixLayoutDestroy);
  SPARK_LT_FN(cublasLtMatmulPreferenceCreate);
  SPARK_LT_FN(cublasLtMatmulPreferenceDestroy);
  SPARK_LT_FN(cublasLtMatmulPreferenceSetAttribute);
  SPARK_LT_FN(cublasLtMatmulAlgoGetHeuristic);
  SPARK_LT_FN(cublasLtMatmul);
#undef SPARK_LT_FN

  // One prepared product per shape, strides, types, epilogue and alignment.
  using Key = std::tuple<size_t, size_t, size_t, size_t, size_t, size_t, int, bool, bool, uint32_t>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t wl = nullptr, al = nullptr, ol = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  std::map<Key, Plan> plans;

  ~Impl() {
    for (auto& [k, p] : plans) {
      if (p.desc) cublasLtMatmulDescDestroy(p.desc);
      if (p.wl) cublasLtMatrixLayoutDestroy(p.wl);
      if (p.al) cublasLtMatrixLayoutDestroy(p.al);
      if (p.ol) cublasLtMatrixLayoutDestroy(p.ol);
    }
    if (handle) cublasLtDestroy(handle);
    if (workspace) cudaFree(workspace);
    // The library stays loaded: cuBLASLt registers exit-time hooks of its own.
  }
};

Matmul::Matmul(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Matmul::~Matmul() = default;

const std::string& Matmul::library_path() const {
  return impl_->path;
}

namespace {
Error lt_error(cublasStatus_t s, const char* what) {
  return make_error(
      s == CUBLAS_STATUS_NOT_SUPPORTED ? Errc::unsupported : Errc::internal,
      std::string("cuBLASLt ") + what + " failed: status " + std::to_string(static_cast<int>(s)));
}
}  // namespace

#define SPARK_LT_TRY(expr, what)                                                  \
  do {                                                                            \
    cublasStatus_t spark_lt_s_ = (expr);                                          \
    if (spark_lt_s_ != CUBLAS_STATUS_SUCCESS) return lt_error(spark_lt_s_, what); \
  } while (0)

Result<std::unique_ptr<Matmul>> Matmul::create(size_t workspace_bytes) {
  SPARK_TRY(cuda_device_count().status());
  auto impl = std::make_unique<Impl>();
  const char* name = "libcublasLt.so.13";
  impl->lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!impl->lib)
    impl->lib = dlopen("/usr/local/cuda/lib64/libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
  if (!impl->lib)
    return make_error(Errc::unsupported,
                      std::string("matrix products need ") + name +
                          " (CUDA 13's cuBLASLt): " + dlerror() +
                          " (install the CUDA toolkit's libcublas, or put /usr/local/cuda/lib64 on "
                          "LD_LIBRARY_PATH)");
  Dl_info info{};
#define SPARK_LT_SYM(fn)                                                  \
  impl->fn = reinterpret_cast<decltype(impl->fn)>(dlsym(impl->lib, #fn)); \
  if (!impl->fn)                                                          \
    return make_error(Errc::unsupported,                                  \
                      std::string(name) + " has no " #fn ": not CUDA 13's cuBLASLt");
  SPARK_LT_SYM(cublasLtCreate);
  SPARK_LT_SYM(cublasLtDestroy);
  SPARK_LT_SYM(cublasLtMatmulDescCreate);
  SPARK_LT_SYM(cublasLtMatmulDescDestroy);
  SPARK_LT_SYM(cublasLtMatmulDescSetAttribute);
  SPARK_LT_SYM(cublasLtMatrixLayoutCreate);
  SPARK_LT_SYM(cublasLtMatrixLayoutDestroy);
  SPARK_LT_SYM(cublasLtMatmulPreferenceCreate);
  SPARK_LT_SYM(cublasLtMatmulPreferenceDestroy);
  SPARK_LT_SYM(cublasLtMatmulPreferenceSetAttribute);
  SPARK_LT_SYM(cublasLtMatmulAlgoGetHeuristic);
  SPARK_LT_SYM(cublasLtMatmul);
#undef SPARK_LT_SYM
  impl->path = dladdr(reinterpret_cast<void*>(impl->cublasLtCreate), &info) && info.dli_fname
                   ? info.dli_fname
                   : name;
  SPARK_LT_TRY(impl->cublasLtCreate(&impl->handle), "cublasLtCreate");
  if (workspace_bytes > 0) SPARK_CUDA_TRY(cudaMalloc(&impl->workspace, workspace_bytes));
  impl->workspace_bytes = workspace_bytes;
  return std::unique_ptr<Matmul>(new Matmul(std::move(impl)));
}

MatmulBackend Matmul::choose(size_t m, size_t n, size_t k) const {
  // Measured on the H200 (bench/kernels, bench/results/kernel_bench-*): at 1 and 2 rows the
  // own kernel's streaming form reads every shape as fast as cuBLASLt or faster (4096 x 4096
  // 10.7 us against 13.5, 1024 x 4096 5.0 against 7.0, gate_up/down/lm_head within 1-2%, at
  // 85-98% of HBM), and it takes SwiGLU into its epilogue; from 3 to 8 rows its tensor-core
  // form wins only on 4096 x 4096 (11.9 us against 12.7); cuBLASLt reads the large weights
  // at 84-94% there, and wins at m = 32 and every prefill.
  const size_t nk = n * k;
  if (m <= 2) return MatmulBackend::own;
  if (m <= 8 && nk >= (size_t{8} << 20) && nk <= (size_t{16} << 20)) return MatmulBackend::own;
  return MatmulBackend::cublaslt;
}

Status Matmul::run(const MatmulArgs& a, void* stream) {
  SPARK_TRY(matmul_check_args(a));
  if (a.m == 0) return Status::Ok();
  // cuBLASLt has no such epilogue or prologue.
  if (a.swiglu || matmul_has_norm(a)) return matmul_own_cuda_device(a, stream);
  MatmulBackend be = a.backend == MatmulBackend::automatic ? choose(a.m, a.n, a.k) : a.backend;
  if (be == MatmulBackend::own && a.m <= kMatmulOwnMaxRows && own_operands_ok(a))
    return matmul_own_cuda_device(a, stream);
  if (be == MatmulBackend::own && a.backend == MatmulBackend::own)
    return matmul_own_cuda_device(a, stream);  // reports why it cannot
  Impl& I = *impl_;
  auto st = static_cast<cudaStream_t>(stream);
  const bool lt_bias = a.bias && a.out_dtype == DType::bf16;
  const uint32_t align = std::min({alignment_of(a.a), alignment_of(a.w), alignment_of(a.out)});
  const Impl::Key key{
      a.m,     a.n,          a.k,  a.lda, a.ldw, a.ldo, static_cast<int>(a.out_dtype),
      lt_bias, a.accumulate, align};
  auto it = I.plans.find(key);
  if (it == I.plans.end()) {
    Impl::Plan p;
    const cudaDataType_t ot = a.out_dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    SPARK_LT_TRY(I.cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                 "MatmulDescCreate");
    const cublasOperation_t tr = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    SPARK_LT_TRY(
        I.cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr),
        "TRANSA");
    SPARK_LT_TRY(
        I.cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt),
        "TRANSB");
    if (lt_bias) {
      const cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
      SPARK_LT_TRY(
          I.cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep),
          "EPILOGUE");
    }
    // Column-major view: out^T (n x m) = W (n x k, stored as k x n) ^T * A^T (k x m).
    SPARK_LT_TRY(
        I.cublasLtMatrixLayoutCreate(&p.wl, CUDA_R_16BF, a.k, a.n, static_cast<int64_t>(a.ldw)),
        "layout W");
    SPARK_LT_TRY(
        I.cublasLtMatrixLayoutCreate(&p.al, CUDA_R_16BF, a.k, a.m, static_cast<int64_t>(a.lda)),
        "layout A");
    SPARK_LT_TRY(I.cublasLtMatrixLayoutCreate(&p.ol, ot, a.n, a.m, static_cast<int64_t>(a.ldo)),
                 "layout out");
    cublasLtMatmulPreference_t pref = nullptr;
    SPARK_LT_TRY(I.cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
    const size_t ws = I.workspace_bytes;
    I.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                           sizeof ws);
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      I.cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align);
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    cublasStatus_t hs = I.cublasLtMatmulAlgoGetHeuristic(I.handle, p.desc, p.wl, p.al, p.ol, p.ol,
                                                         pref, 1, &res, &found);
    I.cublasLtMatmulPreferenceDestroy(pref);
    if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
      if (p.desc) I.cublasLtMatmulDescDestroy(p.desc);
      I.cublasLtMatrixLayoutDestroy(p.wl), I.cublasLtMatrixLayoutDestroy(p.al),
          I.cublasLtMatrixLayoutDestroy(p.ol);
      return make_error(Errc::unsupported, "cuBLASLt has no algorithm for m " +
                                               std::to_string(a.m) + " n " + std::to_string(a.n) +
                                               " k " + std::to_string(a.k) + " (status " +
                                               std::to_string(static_cast<int>(hs)) + ")");
    }
    p.algo = res.algo;
    it = I.plans.emplace(key, p).first;
  }
  Impl::Plan& p = it->second;
  if (lt_bias)
    SPARK_LT_TRY(I.cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &a.bias, sizeof a.bias),
                 "BIAS_POINTER");
  const float alpha = 1.f, beta = a.accumulate ? 1.f : 0.f;
  SPARK_LT_TRY(I.cublasLtMatmul(I.handle, p.desc, &alpha, a.w, p.wl, a.a, p.al, &beta, a.out, p.ol,
                                a.out, p.ol, &p.algo, I.workspace, I.workspace_bytes, st),
               "cublasLtMatmul");
  if (a.bias && !lt_bias) {
    const size_t n = a.m * a.n;
    bias_f32_kernel<<<static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 65535)), 256, 0,
                      st>>>(static_cast<float*>(a.out), a.ldo,
                            static_cast<const dev::bf16*>(a.bias), a.m, a.n);
    SPARK_CUDA_TRY(cudaGetLastError());
  }
  return Status::Ok();
}

}  // namespace spark::kernels
