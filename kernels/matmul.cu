// Matrix products: cuBLASLt, opened with dlopen (only its header is used at build time, so
// the binaries start without it), and an own kernel for decode shapes.
//
// The own kernel (m <= 32) has two forms: the streaming form (m <= 4, fp32 FMA, one warp
// reading whole weight rows) and the tensor-core form (mma.sync, the block's warps split k);
// each is described where it is defined below.
#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "kernels/bias.h"
#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/matmul.h"
#include "kernels/rope_epilogue.cuh"

namespace spark::kernels {
namespace {

using dev::kClusters;
using dev::RopeEpilogue;
using dev::store_rope_head_norm;
using dev::store_rope_t;

// The products of one launch: block b of the grid computes rows of part[i] where
// first_block[i] <= b < first_block[i + 1].

struct OwnGroup {
  MatmulArgs part[kMatmulMaxGroup];
  unsigned first_block[kMatmulMaxGroup + 1];
  int n;
  RopeEpilogue rope;
};

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

// ROPE >= 0: the q/k/v part of that index with the RoPE epilogue. The warp's two units are
// then the rotation pair (i, i + head_dim/2) of one head, not two adjacent rows. QKN: with
// the per-head norms first (store_rope_head_norm; a cluster launch).
template <int M, int R, int U, int NW, int ROPE = -1, int NORM = 0, bool QKN = false>
__device__ __forceinline__ void gemv_block(const MatmulArgs& p, size_t blk,
                                           const RopeEpilogue& rp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t u0 = (blk * kGemvWarps + static_cast<size_t>(warp)) * R;
  static_assert(ROPE < 0 || (R == 2 && NW == 1), "RoPE pairs take two units a warp");
  size_t units[R];
  const size_t pair_i = dev::stream_units<R, ROPE>(u0, rp.head_dim, units);
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
      for (int m = 0; m < M; ++m) dev::bf16x8_to_f(av[u][m], af[m]);
      if constexpr (NORM == 1) {
        float nf[8];
        dev::bf16x8_to_f(nv[u], nf);
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
          dev::bf16x8_to_f(wv[u][r][j], wf);
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
  if constexpr (ROPE >= 0 && QKN) {
    float a0[M], a1[M];
#pragma unroll
    for (int m = 0; m < M; ++m) a0[m] = acc[0][0][m], a1[m] = acc[1][0][m];
    if (p.out_dtype == DType::bf16)
      store_rope_head_norm<ROPE, M, dev::bf16>(p, rp, units[0], pair_i, uok[0], a0, a1);
    else
      store_rope_head_norm<ROPE, M, float>(p, rp, units[0], pair_i, uok[0], a0, a1);
  } else if constexpr (ROPE >= 0) {
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
// QKN: the per-head norms first, launched in clusters of head_dim / 16 blocks.
template <int M, int NORM, bool QKN = false>
__global__ void __launch_bounds__(kGemvWarps * 32, (gemv_min_blocks<M, 2, 4, 1>()))
    gemv_rope_kernel(OwnGroup G) {
  if constexpr (QKN && !kClusters) {
    (void)G;  // clusters need sm_90: matmul_qkv_rope_head_norms() is false there
  } else {
    const unsigned b = blockIdx.x;
    if (b >= G.first_block[2])
      gemv_block<M, 2, 4, 1, 2, NORM, QKN>(G.part[2], b - G.first_block[2], G.rope);
    else if (b >= G.first_block[1])
      gemv_block<M, 2, 4, 1, 1, NORM, QKN>(G.part[1], b - G.first_block[1], G.rope);
    else
      gemv_block<M, 2, 4, 1, 0, NORM, QKN>(G.part[0], b, G.rope);
  }
}

// ---- the tensor-core form (m <= kMatmulOwnMaxRows) ---------------------------------------
// out^T = W * A^T with mma.sync m16n8k16 (bf16 in, fp32 accumulation). A tile is 16 weight
// rows as the mma's A operand, its fragment rows g and g + 8: 16 consecutive rows; with
// swiglu gate row o and up row n + o of 8 outputs (one lane ends with both products of an
// output); with RoPE the rotation pair (u, u + head_dim/2) of 8 pairs of a head (one lane
// ends with both rows of a pair). Up to 8 * NT rows of A are the B operand.
// Each lane loads 16 contiguous bytes of a tile row (and of an A row) per 32-wide k chunk
// and feeds them to two mma k-steps: a dot product does not depend on the order of k, so a
// lane's 8 consecutive elements stand in for the mma's strided k positions as long as W and
// A use the same mapping. Every load is 16 bytes wide and W is read exactly once.
// A warp holds RT tiles, so one load of A feeds RT tiles (A is read from L1/L2 once per RT
// tiles of W, not once per tile), and keeps U chunks of every tile row in flight, the first
// U loaded before pdl_wait() (a weight does not depend on the kernel ahead). The KW warps of
// a block split k and meet in shared memory; the block's warps share the epilogue.
// NORM == 2: the product runs over RMSNorm(A) with the norm's weight folded into W
// (MatmulArgs::norm_unit): each lane sums the squares of the A elements it loads, the sums
// meet with the products', and each output is scaled by its row's 1 / rms.
template <int ROPE>
__device__ __forceinline__ void tc_tile_rows(const MatmulArgs& p, const RopeEpilogue& rp,
                                             size_t tile, int g, size_t& r0, size_t& r1,
                                             size_t& pair_i, bool& ok0, bool& ok1) {
  if constexpr (ROPE >= 0) {
    const size_t half = rp.head_dim / 2, pair = tile * 8 + static_cast<size_t>(g);
    pair_i = pair % half;
    r0 = (pair / half) * rp.head_dim + pair_i;
    r1 = r0 + half;
    ok0 = ok1 = r0 < p.n;
  } else if (p.swiglu) {
    r0 = tile * 8 + static_cast<size_t>(g);
    r1 = p.n + r0;
    ok0 = ok1 = r0 < p.n;
  } else {
    r0 = tile * 16 + static_cast<size_t>(g);
    r1 = r0 + 8;
    ok0 = r0 < p.n, ok1 = r1 < p.n;
  }
}

// Tiles of one product: 16 rows, 8 swiglu outputs, or 8 rotation pairs (16 rows) each.
__host__ __device__ constexpr size_t tc_tiles(size_t n, bool swiglu) {
  return swiglu ? (n + 7) / 8 : (n + 15) / 16;
}

// Shared memory of a block: the warps' partial sums, then with NORM their sums of squares.
__host__ __device__ constexpr size_t tc_smem_bytes(int NT, int RT, int KW) {
  return static_cast<size_t>(KW) * (static_cast<size_t>(RT) * NT * 4 * 32 + NT * 8) * sizeof(float);
}

template <int NT, int RT, int U, int KW, int ROPE, int NORM>
__device__ __forceinline__ void tc_block(const MatmulArgs& p, size_t blk, const RopeEpilogue& rp,
                                         float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const dev::bf16* W = static_cast<const dev::bf16*>(p.w);
  const dev::bf16* A = static_cast<const dev::bf16*>(p.a);
  size_t r0[RT], r1[RT], pi[RT];
  bool ok0[RT], ok1[RT];
  const uint4* w0[RT];
  const uint4* w1[RT];
#pragma unroll
  for (int t = 0; t < RT; ++t) {
    tc_tile_rows<ROPE>(p, rp, blk * RT + static_cast<size_t>(t), g, r0[t], r1[t], pi[t], ok0[t],
                       ok1[t]);
    w0[t] = reinterpret_cast<const uint4*>(W + (ok0[t] ? r0[t] : 0) * p.ldw);
    w1[t] = reinterpret_cast<const uint4*>(W + (ok1[t] ? r1[t] : 0) * p.ldw);
  }
  const uint4* ar[NT];
  bool aok[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const size_t m = static_cast<size_t>(t) * 8 + static_cast<size_t>(g);
    aok[t] = m < p.m;
    ar[t] = reinterpret_cast<const uint4*>(A + (aok[t] ? m : 0) * p.lda);
  }
  float acc[RT][NT][4];
#pragma unroll
  for (int t = 0; t < RT; ++t)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[t][j][0] = acc[t][j][1] = acc[t][j][2] = acc[t][j][3] = 0.f;
  float ss[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) ss[j] = 0.f;

  // This warp's share of the 32-wide k chunks; lane c takes the 16 bytes at c * 8.
  const size_t chunks = (p.k + 31) / 32, kq_end = p.k / 8;
  const size_t per = (chunks + KW - 1) / KW;
  const size_t c_begin = static_cast<size_t>(warp) * per;
  const size_t c_end = c_begin + per < chunks ? c_begin + per : chunks;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 wv[U][RT][2];
  auto load_w = [&](size_t ch0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t kq = (ch0 + u) * 4 + static_cast<size_t>(c);
      const bool kok = ch0 + u < c_end && kq < kq_end;
#pragma unroll
      for (int t = 0; t < RT; ++t) {
        wv[u][t][0] = kok && ok0[t] ? __ldcs(w0[t] + kq) : zero;
        wv[u][t][1] = kok && ok1[t] ? __ldcs(w1[t] + kq) : zero;
      }
    }
  };
  load_w(c_begin);
  dev::pdl_wait();
  for (size_t ch0 = c_begin; ch0 < c_end;) {
    uint4 av[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t kq = (ch0 + u) * 4 + static_cast<size_t>(c);
      const bool kok = ch0 + u < c_end && kq < kq_end;
#pragma unroll
      for (int j = 0; j < NT; ++j) av[u][j] = kok && aok[j] ? __ldg(ar[j] + kq) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if constexpr (NORM == 2) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          float f[8];
          dev::bf16x8_to_f(av[u][j], f);
#pragma unroll
          for (int e = 0; e < 8; ++e) ss[j] = fmaf(f[e], f[e], ss[j]);
        }
      }
#pragma unroll
      for (int t = 0; t < RT; ++t) {
        // Step 1: elements 0..3 of each lane's 8; step 2: elements 4..7.
        const uint32_t a1[4] = {wv[u][t][0].x, wv[u][t][1].x, wv[u][t][0].y, wv[u][t][1].y};
        const uint32_t a2[4] = {wv[u][t][0].z, wv[u][t][1].z, wv[u][t][0].w, wv[u][t][1].w};
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          dev::mma_bf16_16816(acc[t][j], a1, av[u][j].x, av[u][j].y);
          dev::mma_bf16_16816(acc[t][j], a2, av[u][j].z, av[u][j].w);
        }
      }
    }
    ch0 += U;
    if (ch0 >= c_end) break;
    load_w(ch0);
  }
  dev::pdl_trigger();

  // The warps' partial sums (lane-minor, so the stores and loads hit 32 banks), then the
  // sums of squares of A's rows (lanes 4g..4g+3 hold row g's).
  constexpr int Q = RT * NT * 4;
#pragma unroll
  for (int t = 0; t < RT; ++t)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[(warp * Q + (t * NT + j) * 4 + e) * 32 + lane] = acc[t][j][e];
  float* ssr = red + KW * Q * 32;
  if constexpr (NORM == 2) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      float s = ss[j];
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (c == 0) ssr[warp * NT * 8 + j * 8 + g] = s;
    }
  }
  __syncthreads();
  // Tile t's n-tile j is warp (t * NT + j) % KW's to finish: c0, c1 are tile row g (r0) for
  // A rows 2c, 2c + 1 of the n-tile; c2, c3 tile row g + 8 (r1).
  for (int q = warp; q < RT * NT; q += KW) {
    const int t = q / NT, j = q % NT;
    float s[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < KW; ++w) v += red[(w * Q + q * 4 + e) * 32 + lane];
      s[e] = v;
    }
    const size_t m0 = static_cast<size_t>(j) * 8 + 2 * static_cast<size_t>(c);
    if constexpr (NORM == 2) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < KW; ++w) v += ssr[w * NT * 8 + j * 8 + 2 * c + e];
        const float inv = rsqrtf(v / static_cast<float>(p.k) + p.norm_eps);
        s[e] *= inv, s[e + 2] *= inv;
      }
    }
    // Both unrolled branches index with constants only, so r0/r1/ok stay in registers.
#pragma unroll
    for (int tt = 0; tt < RT; ++tt) {
      if (tt != t) continue;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const size_t m = m0 + static_cast<size_t>(e);
        if (m >= p.m) continue;
        if constexpr (ROPE >= 0) {
          if (!ok0[tt]) continue;
          if (p.out_dtype == DType::bf16)
            store_rope_t<ROPE, dev::bf16>(p, rp, m, r0[tt], pi[tt], s[e], s[e + 2]);
          else
            store_rope_t<ROPE, float>(p, rp, m, r0[tt], pi[tt], s[e], s[e + 2]);
        } else {
          if (p.swiglu) {
            if (ok0[tt]) store_swiglu(p, m, r0[tt], s[e], s[e + 2]);
          } else {
            if (ok0[tt]) store_product(p, m, r0[tt], s[e]);
            if (ok1[tt]) store_product(p, m, r1[tt], s[e + 2]);
          }
        }
      }
    }
  }
}

// Two blocks of 8 warps (or one of 16) a multiprocessor at least: at most 128 registers.
template <int NT, int RT, int U, int KW, int NORM>
__global__ void __launch_bounds__(KW * 32, 16 / KW) tc_kernel(OwnGroup G) {
  extern __shared__ float tc_red[];
  const unsigned b = blockIdx.x;
  if (G.n > 2 && b >= G.first_block[2])
    tc_block<NT, RT, U, KW, -1, NORM>(G.part[2], b - G.first_block[2], G.rope, tc_red);
  else if (G.n > 1 && b >= G.first_block[1])
    tc_block<NT, RT, U, KW, -1, NORM>(G.part[1], b - G.first_block[1], G.rope, tc_red);
  else
    tc_block<NT, RT, U, KW, -1, NORM>(G.part[0], b, G.rope, tc_red);
}

// q, k and v (parts 0, 1, 2) with the RoPE epilogue (at most 8 rows).
template <int RT, int U, int KW, int NORM>
__global__ void __launch_bounds__(KW * 32, 16 / KW) tc_rope_kernel(OwnGroup G) {
  extern __shared__ float tc_red[];
  const unsigned b = blockIdx.x;
  if (b >= G.first_block[2])
    tc_block<1, RT, U, KW, 2, NORM>(G.part[2], b - G.first_block[2], G.rope, tc_red);
  else if (b >= G.first_block[1])
    tc_block<1, RT, U, KW, 1, NORM>(G.part[1], b - G.first_block[1], G.rope, tc_red);
  else
    tc_block<1, RT, U, KW, 0, NORM>(G.part[0], b, G.rope, tc_red);
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

// The tensor-core form's shape for `tiles` tiles in all: RT tiles a warp, KW warps a block.
struct TcShape {
  int rt = 0, kw = 0;
};

// Automatic, as measured on the H200 (bench/kernels, "own forms", m = 1-8): one tile a warp
// (two or four, with fewer chunks in flight per tile in the same registers, were slower on
// every shape: gate_up 28672 x 4096 at 8 rows 60 us with one, 65 with two, 74 with four),
// and 16 warps splitting k where there are fewer tiles than multiprocessors (1024 x 4096:
// 5.5 us against 6.0 with 8; 4096 x 4096: 13.6 against 11.5, so 8 there).
TcShape tc_auto_shape(size_t tiles, int sms, TcShape want) {
  TcShape s = want;
  if (s.rt == 0) s.rt = 1;
  if (s.kw == 0) s.kw = tiles < static_cast<size_t>(sms) ? 16 : 8;
  return s;
}

template <int NT, int RT, int KW, int NORM>
Status launch_tc_shape(const OwnGroup& G, unsigned grid, cudaStream_t st, bool rope) {
  constexpr int U = NT == 1 ? 8 / RT : NT == 2 ? 4 : 2;
  constexpr size_t smem = tc_smem_bytes(NT, RT, KW);
  static_assert(smem <= 48 * 1024, "the tensor-core form's shared memory needs no opt-in");
  if constexpr (NT == 1) {
    if (rope) {
      SPARK_CUDA_TRY(
          dev::launch(tc_rope_kernel<RT, U, KW, NORM>, dim3(grid), dim3(KW * 32), smem, st, G));
      return Status::Ok();
    }
  }
  SPARK_CUDA_TRY(
      dev::launch(tc_kernel<NT, RT, U, KW, NORM>, dim3(grid), dim3(KW * 32), smem, st, G));
  return Status::Ok();
}

template <int NT, int RT, int NORM>
Status launch_tc_kw(const OwnGroup& G, unsigned grid, cudaStream_t st, bool rope, int kw) {
  return kw == 16 ? launch_tc_shape<NT, RT, 16, NORM>(G, grid, st, rope)
                  : launch_tc_shape<NT, RT, 8, NORM>(G, grid, st, rope);
}

// G's parts set and checked; rope: parts 0, 1, 2 are q, k, v with G.rope's epilogue.
Status launch_tc(OwnGroup G, const MatmulArgs* parts, int n_parts, cudaStream_t st, TcShape want,
                 bool rope) {
  const MatmulArgs& p0 = parts[0];
  const size_t nt = (p0.m + 7) / 8;
  auto bad = [](const std::string& why) {
    return make_error(Errc::usage, "matmul (own kernel, tensor-core form): " + why);
  };
  if (p0.norm_w)
    return bad("a norm with its weight in the product needs the streaming form (at most " +
               std::to_string(kMatmulGemvMaxRows) + " rows); fold the weight (norm_unit)");
  if (nt > 1 && (rope || p0.norm_unit))
    return bad("RoPE and the norm in the product take at most 8 rows, not " + std::to_string(p0.m));
  if ((want.rt != 0 && want.rt != 1 && want.rt != 2 && want.rt != 4) ||
      (want.kw != 0 && want.kw != 8 && want.kw != 16))
    return bad("row tiles 1, 2 or 4 and k warps 8 or 16, not " + std::to_string(want.rt) + " and " +
               std::to_string(want.kw));
  if (nt > 1 && want.rt > 1) return bad("one row tile a warp above 8 rows");
  auto lim = cuda_device_limits(-1);
  SPARK_TRY(lim.status());
  size_t tiles = 0;
  for (int i = 0; i < n_parts; ++i) tiles += tc_tiles(parts[i].n, parts[i].swiglu);
  const TcShape s = tc_auto_shape(tiles, lim->sm_count, want);
  size_t blocks = 0;
  for (int i = 0; i < n_parts; ++i) {
    G.first_block[i] = static_cast<unsigned>(blocks);
    blocks += (tc_tiles(parts[i].n, parts[i].swiglu) + static_cast<size_t>(s.rt) - 1) /
              static_cast<size_t>(s.rt);
    if (blocks > 0x7fffffffu) return bad("n too large");
  }
  G.first_block[n_parts] = static_cast<unsigned>(blocks);
  const unsigned grid = static_cast<unsigned>(blocks);
  if (nt == 1) {
    auto go = [&](auto norm) {
      constexpr int N = decltype(norm)::value;
      return s.rt == 4   ? launch_tc_kw<1, 4, N>(G, grid, st, rope, s.kw)
             : s.rt == 2 ? launch_tc_kw<1, 2, N>(G, grid, st, rope, s.kw)
                         : launch_tc_kw<1, 1, N>(G, grid, st, rope, s.kw);
    };
    return p0.norm_unit ? go(std::integral_constant<int, 2>{})
                        : go(std::integral_constant<int, 0>{});
  }
  if (nt == 2) return launch_tc_kw<2, 1, 0>(G, grid, st, false, s.kw);
  if (nt == 3) return launch_tc_kw<3, 1, 0>(G, grid, st, false, s.kw);
  return launch_tc_kw<4, 1, 0>(G, grid, st, false, s.kw);
}

}  // namespace

namespace {

Status own_group(const MatmulArgs* parts, int n_parts, void* stream, OwnVariant variant,
                 TcShape shape) {
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
    // A norm with its weight in the product needs the streaming form: at 3 and 4 rows its
    // leanest shape; a folded one (norm_unit) the tensor-core form takes too.
    variant = m == 1   ? (swiglu ? OwnVariant::gemv_r1_u4 : OwnVariant::gemv_r1_u8)
              : m == 2 ? OwnVariant::gemv_r2_u4
              : parts[0].norm_w && m <= kMatmulGemvMaxRows ? OwnVariant::gemv_r1_u4
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
  return launch_tc(G, parts, n_parts, st, shape, false);
}

}  // namespace

Status matmul_own_group_cuda_device(const MatmulArgs* parts, int n_parts, void* stream,
                                    OwnVariant variant) {
  return own_group(parts, n_parts, stream, variant, TcShape{});
}

Status matmul_own_mma_cuda_device(const MatmulArgs* parts, int n_parts, void* stream, int row_tiles,
                                  int k_warps) {
  return own_group(parts, n_parts, stream, OwnVariant::mma, TcShape{row_tiles, k_warps});
}

Status matmul_own_cuda_device(const MatmulArgs& a, void* stream) {
  return matmul_own_group_cuda_device(&a, 1, stream);
}

bool matmul_qkv_rope_head_norms(size_t m, size_t head_dim) {
  if (m < 1 || m > 2 || (head_dim != 32 && head_dim != 64 && head_dim != 128)) return false;
  auto lim = cuda_device_limits();
  return lim && lim->cluster_launch && cuda_hopper_paths(lim->cc_major, cuda_fallbacks());
}

Status matmul_qkv_rope_cuda_device(const MatmulArgs* parts, const RopeArgs& rope, void* stream,
                                   OwnVariant variant) {
  auto bad = [](const std::string& why) {
    return make_error(Errc::usage, "matmul q/k/v with RoPE: " + why);
  };
  SPARK_TRY(rope_check_args(rope));
  const size_t m = parts[0].m;
  const size_t hd = static_cast<size_t>(rope.head_dim);
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
    if (auto why = dev::qkv_part_mismatch(rope, i, a.n, a.out, a.ldo); !why.empty())
      return bad(why);
    G.part[i] = a;
  }
  if (m == 0) return Status::Ok();
  if (m > kMatmulQkvRopeMaxRows)
    return bad("at most " + std::to_string(kMatmulQkvRopeMaxRows) + " rows, not " +
               std::to_string(m));
  const bool head_norms = rope.q_norm || rope.k_norm;
  SPARK_TRY(
      dev::rope_epilogue_for(rope, m, matmul_qkv_rope_head_norms(m, hd), "matmul q/k/v", &G.rope));
  if (head_norms && variant == OwnVariant::mma)
    return bad("per-head norms in the streaming form only");
  auto st = static_cast<cudaStream_t>(stream);
  // As the plain products choose (matmul_own_group_cuda_device): the streaming form at 1
  // and 2 rows and for a norm with its weight, the tensor-core form from 3 rows on.
  if (variant == OwnVariant::automatic)
    variant = m <= 2 || (parts[0].norm_w && m <= kMatmulGemvMaxRows) ? OwnVariant::gemv_r2_u4
                                                                     : OwnVariant::mma;
  if (variant == OwnVariant::mma) return launch_tc(G, parts, 3, st, TcShape{}, true);
  if (variant != OwnVariant::gemv_r2_u4)
    return bad(std::string("the streaming form's RoPE shape is gemv r2 u4, not ") +
               own_variant_name(variant));
  if (m > kMatmulGemvMaxRows)
    return bad("the streaming form takes at most " + std::to_string(kMatmulGemvMaxRows) +
               " rows, not " + std::to_string(m));
  // Two units a warp: a head's hd / 2 pairs over hd / 16 blocks of eight warps.
  size_t blocks = 0;
  for (int i = 0; i < 3; ++i) {
    G.first_block[i] = static_cast<unsigned>(blocks);
    blocks += (parts[i].n + kGemvWarps * 2 - 1) / (kGemvWarps * 2);
  }
  G.first_block[3] = static_cast<unsigned>(blocks);
  const unsigned grid = static_cast<unsigned>(blocks), threads = kGemvWarps * 32;
  if (head_norms) {
    // A cluster per head: its hd / 16 blocks (every part's blocks are whole heads).
    const unsigned cs = static_cast<unsigned>(hd / 16);
    auto go = [&](auto norm) -> Status {
      constexpr int N = decltype(norm)::value;
      SPARK_CUDA_TRY(m == 1 ? dev::launch_clusters(gemv_rope_kernel<1, N, true>, dim3(grid),
                                                   dim3(threads), 0, st, cs, G)
                            : dev::launch_clusters(gemv_rope_kernel<2, N, true>, dim3(grid),
                                                   dim3(threads), 0, st, cs, G));
      return Status::Ok();
    };
    return parts[0].norm_unit ? go(std::integral_constant<int, 2>{})
           : parts[0].norm_w  ? go(std::integral_constant<int, 1>{})
                              : go(std::integral_constant<int, 0>{});
  }
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
    int heuristic_status = 0;  // what the heuristic answered where it found nothing
  };
  std::map<Key, Plan> plans;
  // The FP8 tensor-core products' plans: m, n, k, lda, ldo, bias in the epilogue,
  // accumulate. A plan with no descriptor records that cuBLASLt has no algorithm there.
  using Fp8Key = std::tuple<size_t, size_t, size_t, size_t, size_t, bool, bool>;
  std::map<Fp8Key, Plan> fp8_plans;

  void destroy(Plan& p) {
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
    if (p.wl) cublasLtMatrixLayoutDestroy(p.wl);
    if (p.al) cublasLtMatrixLayoutDestroy(p.al);
    if (p.ol) cublasLtMatrixLayoutDestroy(p.ol);
    p = Plan{};
  }

  ~Impl() {
    for (auto& [k, p] : fp8_plans) destroy(p);
    for (auto& [k, p] : plans) destroy(p);
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
      I.destroy(p);
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

Status Matmul::run_fp8(const Fp8TcArgs& a, void* stream) {
  SPARK_TRY(fp8_tc_check(a));
  if (a.m == 0) return Status::Ok();
  Impl& I = *impl_;
  auto st = static_cast<cudaStream_t>(stream);
  // The bias goes into the epilogue where cuBLASLt takes it there, else it is added after
  // (rows of exactly n: bias_add_cuda_device's layout).
  int heuristic_status = -1;  // -1: a descriptor or layout was refused before it
  auto plan = [&](bool lt_bias) -> Impl::Plan* {
    const Impl::Fp8Key key{a.m, a.n, a.k, a.lda, a.ldo, lt_bias, a.accumulate};
    auto it = I.fp8_plans.find(key);
    if (it != I.fp8_plans.end()) {
      heuristic_status = it->second.heuristic_status;
      return it->second.desc ? &it->second : nullptr;
    }
    Impl::Plan p;
    bool ok = I.cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) ==
              CUBLAS_STATUS_SUCCESS;
    // Column-major view, as run(): out^T (n x m) = W (k x n)^T * A^T (k x m); W takes the
    // 128 x 128 block scales, A the 128-element vector ones.
    const cublasOperation_t tr = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    const int32_t w_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t n) {
      ok = ok && I.cublasLtMatmulDescSetAttribute(p.desc, attr, v, n) == CUBLAS_STATUS_SUCCESS;
    };
    set(CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr);
    set(CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt);
    set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &w_mode, sizeof w_mode);
    set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &a_mode, sizeof a_mode);
    // The heuristic offers no block-scaled algorithm before the scale pointers are set
    // (each call sets its own below).
    const void* w_scales0 = a.w.scales;
    const void* a_scales0 = a.a_scales;
    set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales0, sizeof w_scales0);
    set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scales0, sizeof a_scales0);
    if (lt_bias) set(CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep);
    ok = ok &&
         I.cublasLtMatrixLayoutCreate(&p.wl, CUDA_R_8F_E4M3, a.k, a.n,
                                      static_cast<int64_t>(a.w.ldq)) == CUBLAS_STATUS_SUCCESS &&
         I.cublasLtMatrixLayoutCreate(&p.al, CUDA_R_8F_E4M3, a.k, a.m,
                                      static_cast<int64_t>(a.lda)) == CUBLAS_STATUS_SUCCESS &&
         I.cublasLtMatrixLayoutCreate(&p.ol, CUDA_R_16BF, a.n, a.m, static_cast<int64_t>(a.ldo)) ==
             CUBLAS_STATUS_SUCCESS;
    int found = 0;
    if (ok) {
      cublasLtMatmulPreference_t pref = nullptr;
      if (I.cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS) {
        const size_t ws = I.workspace_bytes;
        I.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                               sizeof ws);
        cublasLtMatmulHeuristicResult_t res{};
        const cublasStatus_t hs = I.cublasLtMatmulAlgoGetHeuristic(
            I.handle, p.desc, p.wl, p.al, p.ol, p.ol, pref, 1, &res, &found);
        if (hs != CUBLAS_STATUS_SUCCESS) found = 0;
        heuristic_status = static_cast<int>(hs);
        p.algo = res.algo;
        I.cublasLtMatmulPreferenceDestroy(pref);
      }
    }
    if (!ok || found == 0) {
      I.destroy(p);
      p.heuristic_status = heuristic_status;
    }
    it = I.fp8_plans.emplace(key, p).first;
    return it->second.desc ? &it->second : nullptr;
  };
  const bool bias_after = a.bias && a.ldo == a.n;
  Impl::Plan* p = plan(a.bias != nullptr);
  bool lt_bias = a.bias != nullptr;
  if (!p && bias_after) p = plan(false), lt_bias = false;
  if (!p)
    return make_error(Errc::unsupported, "cuBLASLt has no block-scaled FP8 algorithm for m " +
                                             std::to_string(a.m) + " n " + std::to_string(a.n) +
                                             " k " + std::to_string(a.k) +
                                             " on this GPU (heuristic status " +
                                             std::to_string(heuristic_status) + ")");
  const void* w_scales = a.w.scales;
  const void* a_scales = a.a_scales;
  SPARK_LT_TRY(I.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                &w_scales, sizeof w_scales),
               "A_SCALE_POINTER");
  SPARK_LT_TRY(I.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                &a_scales, sizeof a_scales),
               "B_SCALE_POINTER");
  if (lt_bias)
    SPARK_LT_TRY(I.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &a.bias, sizeof a.bias),
                 "BIAS_POINTER");
  const float alpha = 1.f, beta = a.accumulate ? 1.f : 0.f;
  SPARK_LT_TRY(I.cublasLtMatmul(I.handle, p->desc, &alpha, a.w.q, p->wl, a.a, p->al, &beta, a.out,
                                p->ol, a.out, p->ol, &p->algo, I.workspace, I.workspace_bytes, st),
               "cublasLtMatmul (FP8)");
  if (a.bias && !lt_bias)
    SPARK_TRY(bias_add_cuda_device(DType::bf16, a.out, a.bias, a.m, a.n, stream));
  return Status::Ok();
}

}  // namespace spark::kernels
