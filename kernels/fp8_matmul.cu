// Products over FP8 weights kept as stored (kernels/fp8.h): the decode GEMV, which reads the
// e4m3 bytes once and widens them in registers, the dequantization into a bf16 workspace
// for prefill, and the activations' quantization for the tensor-core prefill.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/fp8.h"
#include "kernels/matmul.h"
#include "kernels/rope_epilogue.cuh"

namespace spark::kernels {
namespace {

// ---- the decode GEMV (m <= kFp8GemvMaxRows) ----------------------------------------------
// The streaming form of the bf16 own kernel (kernels/matmul.cu) over one byte a weight: one
// warp owns R output units (a unit is an output column n: one weight row, or with swiglu the
// gate row n and the up row p.n + n) and reads them whole. Lane l takes the 16 bytes (16
// e4m3 values) at l * 16 + 512 * s of each row for steps s, so one load instruction of a
// warp covers 512 contiguous bytes of a row, four 128-column scale blocks; U steps of every
// row and their scales are in flight per lane before the first is used, the first U loaded
// before pdl_wait() (no kernel of a step writes a weight). At one row of A (RING) each slot
// is loaded again (step s + U) as soon as its step is widened, so U steps stay in flight
// while the others are summed; the other forms load the next U steps after summing these
// (at one row that left the loads idle for the widening and the sums: the one-row products
// read at 56-57% of HBM against 65-72% with the slots reloaded, H100, kernel bench). Each
// 16 values are widened exactly (e4m3 -> half -> float; one cvt a pair from sm_89 on), their
// products with A's 16 (bf16, read through L1, shared by the block's warps) summed in fp32
// and that partial sum multiplied by its block's scale into the row's fp32 sum; the warp's
// sums meet by xor shuffles and lane r * M + m stores unit r's output for A row m.
constexpr int kWarps = 8;

// 16 e4m3 values (byte e of the load is value e) widened exactly to float.
__device__ __forceinline__ void e4m3x16_to_f(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>((w[i] >> (16 * h)) & 0xffffu), __NV_E4M3);
      const float2 x = __half22float2(__half2(r));
      f[4 * i + 2 * h] = x.x;
      f[4 * i + 2 * h + 1] = x.y;
    }
}

// Output (m, n) of a plain product: bias, then the old output when accumulating, in fp32,
// rounded once to the output type.
__device__ __forceinline__ void store_product(const Fp8MatmulArgs& p, size_t m, size_t n, float s) {
  if (p.bias) s += __bfloat162float(static_cast<const dev::bf16*>(p.bias)[n]);
  const size_t off = m * p.ldo + n;
  if (p.out_dtype == DType::bf16) {
    dev::bf16* o = static_cast<dev::bf16*>(p.out) + off;
    if (p.accumulate) s += __bfloat162float(*o);
    *o = __float2bfloat16_rn(s);
  } else {
    float* o = static_cast<float*>(p.out) + off;
    if (p.accumulate) s += *o;
    *o = s;
  }
}

// Output (m, n) of a [gate | up] pair: the two products rounded as a [gate | up] buffer of
// the output type holds them, then silu(g) * u.
__device__ __forceinline__ void store_swiglu(const Fp8MatmulArgs& p, size_t m, size_t n, float gt,
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

// Block `block` of one product of a group. With p.norm_w the product runs over RMSNorm(A) *
// norm_w: each lane multiplies its A values by norm_w's and sums their squares as it goes (a
// warp covers the whole row, so after the shuffles every lane holds the row's sum) and the
// sums are scaled by 1 / rms at the end; a uniform branch, so the plain loop is unchanged.
// ROPE >= 0: part ROPE (0, 1, 2 = q, k, v) of the q/k/v products with the RoPE epilogue
// (kernels/rope_epilogue.cuh): the warp's two units are the rotation pair (i, i + head_dim/2)
// of one head, and QKN puts the per-head norms first (a cluster of head_dim / 16 blocks). A
// unit's sum does not depend on which warp holds it, so the epilogue sees the bits the plain
// product would store.
template <int M, int R, int U, int NW, int ROPE = -1, bool QKN = false, bool RING = false>
__device__ __forceinline__ void fp8_gemv_block(const Fp8MatmulArgs& p, size_t block,
                                               const dev::RopeEpilogue& rp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t u0 = (block * kWarps + static_cast<size_t>(warp)) * R;
  static_assert(ROPE < 0 || (R == 2 && NW == 1), "RoPE pairs take two units a warp");
  size_t units[R];
  const size_t pair_i = dev::stream_units<R, ROPE>(u0, rp.head_dim, units);
  const uint4* wrow[R][NW];
  const float* srow[R][NW];
  bool ok[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    ok[r] = units[r] < p.n;
    const size_t unit = ok[r] ? units[r] : 0;
#pragma unroll
    for (int j = 0; j < NW; ++j) {
      const size_t row = unit + static_cast<size_t>(j) * p.n;
      wrow[r][j] = reinterpret_cast<const uint4*>(p.w.q + row * p.w.ldq);
      srow[r][j] = p.w.scales + (row >> p.w.row_shift) * p.w.scale_ld;
    }
  }
  const uint4* arow[M];
#pragma unroll
  for (int m = 0; m < M; ++m)
    arow[m] = reinterpret_cast<const uint4*>(static_cast<const dev::bf16*>(p.a) +
                                             static_cast<size_t>(m) * p.lda);
  const size_t kv = p.k / 16;  // 16-byte pieces per weight row; piece i is in block i / 8
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
  float sc[U][R][NW];
  // Slot u <- step s of every row (zeros past the row); load_w(s0): steps s0 .. s0 + U - 1.
  auto load_slot = [&](int u, size_t s) {
    const size_t i = s * 32 + lane;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < NW; ++j) {
        const bool in = i < kv && ok[r];
        wv[u][r][j] = in ? __ldcs(wrow[r][j] + i) : zero;
        sc[u][r][j] = in ? __ldg(srow[r][j] + i / 8) : 0.f;
      }
  };
  auto load_w = [&](size_t s0) {
#pragma unroll
    for (int u = 0; u < U; ++u) load_slot(u, s0 + static_cast<size_t>(u));
  };
  const uint4* nrow = static_cast<const uint4*>(p.norm_w);
  const bool norm = nrow != nullptr;
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; ++m) ss[m] = 0.f;
  load_w(0);
  dev::pdl_wait();
  for (size_t s0 = 0;;) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = (s0 + u) * 32 + lane;
      const bool in = i < kv;
      float wf[R][NW][16];
      float scu[R][NW];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NW; ++j) {
          e4m3x16_to_f(wv[u][r][j], wf[r][j]);
          scu[r][j] = sc[u][r][j];
        }
      if constexpr (RING) load_slot(u, s0 + U + u);  // reloaded as soon as widened
      float nf[16];
      if (norm) {
        dev::bf16x8_to_f(in ? __ldg(nrow + 2 * i) : zero, nf);
        dev::bf16x8_to_f(in ? __ldg(nrow + 2 * i + 1) : zero, nf + 8);
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint4 a0 = in ? __ldg(arow[m] + 2 * i) : zero;
        const uint4 a1 = in ? __ldg(arow[m] + 2 * i + 1) : zero;
        float af[16];
        dev::bf16x8_to_f(a0, af);
        dev::bf16x8_to_f(a1, af + 8);
        if (norm) {
#pragma unroll
          for (int e = 0; e < 16; ++e) {
            ss[m] = fmaf(af[e], af[e], ss[m]);
            af[e] *= nf[e];
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < NW; ++j) {
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < 16; ++e) s = fmaf(wf[r][j][e], af[e], s);
            acc[r][j][m] = fmaf(s, scu[r][j], acc[r][j][m]);
          }
      }
    }
    s0 += U;
    if (s0 >= steps) break;
    if constexpr (!RING) load_w(s0);
  }
  dev::pdl_trigger();
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][j][m] = dev::warp_sum(acc[r][j][m]);
  if (norm) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float inv = rsqrtf(dev::warp_sum(ss[m]) / static_cast<float>(p.k) + p.norm_eps);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NW; ++j) acc[r][j][m] *= inv;
    }
  }
  if constexpr (ROPE >= 0 && QKN) {
    float a0[M], a1[M];
#pragma unroll
    for (int m = 0; m < M; ++m) a0[m] = acc[0][0][m], a1[m] = acc[1][0][m];
    if (p.out_dtype == DType::bf16)
      dev::store_rope_head_norm<ROPE, M, dev::bf16>(p, rp, units[0], pair_i, ok[0], a0, a1);
    else
      dev::store_rope_head_norm<ROPE, M, float>(p, rp, units[0], pair_i, ok[0], a0, a1);
  } else if constexpr (ROPE >= 0) {
    // Lane m stores row m's pair: both units' sums are in every lane after the shuffles.
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (lane != m || !ok[0] || m >= static_cast<int>(p.m)) continue;
      if (p.out_dtype == DType::bf16)
        dev::store_rope_t<ROPE, dev::bf16>(p, rp, static_cast<size_t>(m), units[0], pair_i,
                                           acc[0][0][m], acc[1][0][m]);
      else
        dev::store_rope_t<ROPE, float>(p, rp, static_cast<size_t>(m), units[0], pair_i,
                                       acc[0][0][m], acc[1][0][m]);
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (lane != r * M + m || !ok[r]) continue;
        if constexpr (NW == 2)
          store_swiglu(p, static_cast<size_t>(m), units[r], acc[r][0][m], acc[r][1][m]);
        else
          store_product(p, static_cast<size_t>(m), units[r], acc[r][0][m]);
      }
  }
}

// Up to three products over the same A in one launch (the q, k and v projections of a decode
// step): their blocks in order, each block one product's (a uniform branch); a single product
// is a group of one.
struct Fp8Group {
  Fp8MatmulArgs part[kFp8GemvMaxGroup];
  unsigned first_block[kFp8GemvMaxGroup];
  int n;
};

template <int M, int R, int U, int NW, bool RING = false>
__global__ void __launch_bounds__(kWarps * 32, RING ? 2 : 1) fp8_gemv_kernel(Fp8Group g) {
  const unsigned b = blockIdx.x;
  const dev::RopeEpilogue none{};  // read by the RoPE forms only
  if (g.n > 2 && b >= g.first_block[2])
    fp8_gemv_block<M, R, U, NW, -1, false, RING>(g.part[2], b - g.first_block[2], none);
  else if (g.n > 1 && b >= g.first_block[1])
    fp8_gemv_block<M, R, U, NW, -1, false, RING>(g.part[1], b - g.first_block[1], none);
  else
    fp8_gemv_block<M, R, U, NW, -1, false, RING>(g.part[0], b, none);
}

// The [gate | up] pairs at one row of A, held to two blocks a multiprocessor (128 registers):
// left to itself the compiler gives them 153, so one block (8 warps) an SM, and they read
// gate/up at half the plain product's rate. Their slots reloaded as used, three steps of
// each row (at that bound four spill 568 bytes, three 156; four without the reloads spilled
// 132). (The one-row forms only: an explicit bound on the others moves them to up to 255
// registers with spills, and forms that measured well are left as they are.)
__global__ void __launch_bounds__(kWarps * 32, 2) fp8_gemv_swiglu1_kernel(Fp8Group g) {
  constexpr bool RING = true;
  const unsigned b = blockIdx.x;
  const dev::RopeEpilogue none{};
  if (g.n > 2 && b >= g.first_block[2])
    fp8_gemv_block<1, 1, 3, 2, -1, false, RING>(g.part[2], b - g.first_block[2], none);
  else if (g.n > 1 && b >= g.first_block[1])
    fp8_gemv_block<1, 1, 3, 2, -1, false, RING>(g.part[1], b - g.first_block[1], none);
  else
    fp8_gemv_block<1, 1, 3, 2, -1, false, RING>(g.part[0], b, none);
}

// q, k and v (parts 0, 1, 2) with the RoPE epilogue, two units (a rotation pair) a warp and
// four steps of each in flight (reloaded as used at one row). QKN: the per-head norms first, in
// clusters of head_dim / 16 blocks.
struct Fp8RopeGroup {
  Fp8Group g;
  dev::RopeEpilogue rope;
};

template <int M, bool QKN>
__global__ void __launch_bounds__(kWarps * 32, M == 1 ? 2 : 1)
    fp8_gemv_rope_kernel(Fp8RopeGroup G) {
  constexpr bool RING = M == 1;  // 128 registers at one row with the slots reloaded
  if constexpr (QKN && !dev::kClusters) {
    (void)G;  // clusters need sm_90: matmul_qkv_rope_head_norms() is false there
  } else {
    const unsigned b = blockIdx.x;
    if (b >= G.g.first_block[2])
      fp8_gemv_block<M, 2, 4, 1, 2, QKN, RING>(G.g.part[2], b - G.g.first_block[2], G.rope);
    else if (b >= G.g.first_block[1])
      fp8_gemv_block<M, 2, 4, 1, 1, QKN, RING>(G.g.part[1], b - G.g.first_block[1], G.rope);
    else
      fp8_gemv_block<M, 2, 4, 1, 0, QKN, RING>(G.g.part[0], b, G.rope);
  }
}

// Plain products: two output columns a warp with four steps of each row in flight per lane,
// or, where that would leave fewer than two blocks a multiprocessor (1024 rows: 64 blocks on
// 132) and always at one row of A, one column with eight steps at one row of A (four from
// two rows on); with swiglu one [gate | up] pair with four steps of each (three at one row).
// A's 16 values loaded once feed every weight row of the warp.
template <int M>
Status launch_gemv(Fp8Group g, bool one_row, cudaStream_t st) {
  auto go = [&](auto kernel, size_t units_per_block) -> Status {
    size_t grid = 0;
    for (int i = 0; i < g.n; ++i) {
      g.first_block[i] = static_cast<unsigned>(grid);
      grid += (g.part[i].n + units_per_block - 1) / units_per_block;
    }
    SPARK_CUDA_TRY(
        dev::launch(kernel, dim3(static_cast<unsigned>(grid)), dim3(kWarps * 32), 0, st, g));
    return Status::Ok();
  };
  if constexpr (M == 1) {
    (void)one_row;
    if (g.part[0].swiglu) return go(fp8_gemv_swiglu1_kernel, kWarps);
    return go(fp8_gemv_kernel<1, 1, 8, 1, true>, kWarps);
  } else {
    if (g.part[0].swiglu) return go(fp8_gemv_kernel<M, 1, 4, 2>, kWarps);
    // (From two rows on, eight steps in flight take 170-190 registers at sm_90, one block a
    // multiprocessor; four take about 130.)
    if (one_row) return go(fp8_gemv_kernel<M, 1, 4, 1>, kWarps);
    return go(fp8_gemv_kernel<M, 2, 4, 1>, 2 * kWarps);
  }
}

// ---- dequantization ----------------------------------------------------------------------
// One thread a weight: w = e4m3 * scale rounded to bf16 once (nearest, ties to even): the
// float product hi and its exact rest lo (an fma) decide a tie that hi alone would round to
// even; fp8_dequantize_ref rounds the same way.
__device__ __forceinline__ uint16_t nearest_bf16(float hi, float lo) {
  const uint32_t u = __float_as_uint(hi);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    if (u & 0x007fffffu) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN stays NaN
    return static_cast<uint16_t>(u >> 16);                                   // infinity
  }
  if ((u & 0xffffu) == 0x8000u && lo != 0.f) {
    const bool away = (lo > 0.f) == (hi > 0.f);
    return static_cast<uint16_t>((u >> 16) + (away ? 1u : 0u));
  }
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__global__ void fp8_dequantize_kernel(Fp8Weight w, size_t row0, size_t rows, size_t k,
                                      uint16_t* out, size_t ldo) {
  dev::pdl_wait();  // the workspace may still be read by the kernel ahead
  const size_t total = rows * k;
  for (size_t idx = blockIdx.x * size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += size_t{gridDim.x} * blockDim.x) {
    const size_t r = idx / k, c = idx % k, row = row0 + r;
    const __half_raw h = __nv_cvt_fp8_to_halfraw(w.q[row * w.ldq + c], __NV_E4M3);
    const float q = __half2float(__half(h));
    const float s = w.scales[(row >> w.row_shift) * w.scale_ld + c / kFp8BlockK];
    const float hi = __fmul_rn(q, s);
    const float lo = fmaf(q, s, -hi);
    out[r * ldo + c] = nearest_bf16(hi, lo);
  }
  dev::pdl_trigger();
}

// One warp a (row, 128-column block): lane l holds columns 4l .. 4l + 3 of the block (one
// 8-byte load), the block's amax meets by xor shuffles, and each lane stores its 4 codes as
// one word; lane 0 stores the scale. As fp8_quantize_rows_ref, bit for bit: the scale and
// the quotients are IEEE-rounded fp32 divisions, the codes cvt.rn.satfinite.
__global__ void fp8_quantize_rows_kernel(const uint16_t* a, size_t lda, size_t m, size_t k,
                                         Fp8Rows out) {
  dev::pdl_wait();  // a is written by the kernel ahead; q may still be read by the product
  const size_t blocks = (k + kFp8BlockK - 1) / kFp8BlockK;
  const size_t warp = (blockIdx.x * size_t{blockDim.x} + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (warp < m * blocks) {
    const size_t r = warp / blocks, kb = warp % blocks;
    const size_t c = kb * kFp8BlockK + static_cast<size_t>(lane) * 4;
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (c < k) {  // k is a multiple of 8: a lane's 4 columns are all in or all out
      const uint2 v = *reinterpret_cast<const uint2*>(a + r * lda + c);
      x[0] = __uint_as_float(v.x << 16), x[1] = __uint_as_float(v.x & 0xffff0000u);
      x[2] = __uint_as_float(v.y << 16), x[3] = __uint_as_float(v.y & 0xffff0000u);
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(x[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
    if (c < k) {
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        word |= static_cast<uint32_t>(
                    __nv_cvt_float_to_fp8(__fdiv_rn(x[i], scale), __NV_SATFINITE, __NV_E4M3))
                << (8 * i);
      *reinterpret_cast<uint32_t*>(out.q + r * out.ldq + c) = word;
    }
    if (lane == 0) out.scales[kb * out.scale_ld + r] = scale;
  }
  dev::pdl_trigger();
}

}  // namespace

Status fp8_gemv_cuda_device(const Fp8MatmulArgs& a, void* stream) {
  return fp8_gemv_group_cuda_device(&a, 1, stream);
}

Status fp8_gemv_group_cuda_device(const Fp8MatmulArgs* parts, int n, void* stream) {
  if (n < 1 || n > static_cast<int>(kFp8GemvMaxGroup))
    return make_error(Errc::usage, "fp8 matmul: a group of " + std::to_string(n) +
                                       " products (1 to " + std::to_string(kFp8GemvMaxGroup) + ")");
  const Fp8MatmulArgs& a = parts[0];
  size_t units = 0;
  Fp8Group g{};
  g.n = n;
  for (int i = 0; i < n; ++i) {
    const Fp8MatmulArgs& p = parts[i];
    SPARK_TRY(fp8_matmul_check(p));
    if (i > 0 && (p.a != a.a || p.lda != a.lda || p.m != a.m || p.k != a.k ||
                  p.norm_w != a.norm_w || p.norm_eps != a.norm_eps || p.swiglu || a.swiglu))
      return make_error(Errc::usage,
                        "fp8 matmul: a group's products share a, lda, m, k and the norm, and "
                        "none is a swiglu product");
    units += p.n;
    g.part[i] = p;
  }
  if (a.m > kFp8GemvMaxRows)
    return make_error(Errc::usage, "fp8 matmul: the decode kernel takes at most " +
                                       std::to_string(kFp8GemvMaxRows) + " rows, not " +
                                       std::to_string(a.m) +
                                       " (dequantize and use the bf16 product)");
  if (a.m == 0) return Status::Ok();
  const size_t units_per_block = a.swiglu ? kWarps : 2 * kWarps;
  if ((units + units_per_block - 1) / units_per_block + n > 0x7fffffffu)
    return make_error(Errc::usage, "fp8 matmul: n " + std::to_string(units) + " too large");
  SPARK_TRY(cuda_check_launch("fp8_gemv", kWarps * 32, 0));
  auto lim = cuda_device_limits(-1);
  SPARK_TRY(lim.status());
  // One row of A: always one output column a warp with eight steps in flight (128
  // registers, two blocks a multiprocessor; the two-column form's 145 leave one).
  const bool one_row =
      a.m == 1 || (units + 2 * kWarps - 1) / (2 * kWarps) < 2 * static_cast<size_t>(lim->sm_count);
  auto st = static_cast<cudaStream_t>(stream);
  switch (a.m) {
    case 1:
      return launch_gemv<1>(g, one_row, st);
    case 2:
      return launch_gemv<2>(g, one_row, st);
    case 3:
      return launch_gemv<3>(g, one_row, st);
    case 4:
      return launch_gemv<4>(g, one_row, st);
    case 5:
      return launch_gemv<5>(g, one_row, st);
    case 6:
      return launch_gemv<6>(g, one_row, st);
    case 7:
      return launch_gemv<7>(g, one_row, st);
    default:
      return launch_gemv<8>(g, one_row, st);
  }
}

Status fp8_qkv_rope_cuda_device(const Fp8MatmulArgs* parts, const RopeArgs& rope, void* stream) {
  auto bad = [](const std::string& why) {
    return make_error(Errc::usage, "fp8 matmul q/k/v with RoPE: " + why);
  };
  SPARK_TRY(rope_check_args(rope));
  const size_t m = parts[0].m;
  const size_t hd = static_cast<size_t>(rope.head_dim);
  Fp8RopeGroup G{};
  G.g.n = 3;
  for (int i = 0; i < 3; ++i) {
    const Fp8MatmulArgs& a = parts[i];
    SPARK_TRY(fp8_matmul_check(a));
    if (a.m != m || a.a != parts[0].a || a.lda != parts[0].lda || a.k != parts[0].k ||
        a.norm_w != parts[0].norm_w || a.norm_eps != parts[0].norm_eps)
      return bad("the products share a, lda, m, k and the norm");
    if (a.swiglu || a.accumulate) return bad("plain products only");
    if (a.out_dtype != rope.dtype) return bad("outputs of rope's dtype");
    if (auto why = dev::qkv_part_mismatch(rope, i, a.n, a.out, a.ldo); !why.empty())
      return bad(why);
    G.g.part[i] = a;
  }
  if (m == 0) return Status::Ok();
  if (m > kMatmulQkvRopeMaxRows)
    return bad("at most " + std::to_string(kMatmulQkvRopeMaxRows) + " rows, not " +
               std::to_string(m));
  const bool head_norms = rope.q_norm || rope.k_norm;
  SPARK_TRY(dev::rope_epilogue_for(rope, m, matmul_qkv_rope_head_norms(m, hd), "fp8 matmul q/k/v",
                                   &G.rope));
  // Two units a warp: a head's hd / 2 pairs over hd / 16 blocks of eight warps.
  size_t blocks = 0;
  for (int i = 0; i < 3; ++i) {
    G.g.first_block[i] = static_cast<unsigned>(blocks);
    blocks += (parts[i].n + kWarps * 2 - 1) / (kWarps * 2);
  }
  if (blocks > 0x7fffffffu) return bad("n too large");
  SPARK_TRY(cuda_check_launch("fp8_gemv (q/k/v with RoPE)", kWarps * 32, 0));
  auto st = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(blocks)), threads(kWarps * 32);
  if (head_norms) {
    // A cluster per head: its hd / 16 blocks (every part's blocks are whole heads).
    const unsigned cs = static_cast<unsigned>(hd / 16);
    SPARK_CUDA_TRY(
        m == 1 ? dev::launch_clusters(fp8_gemv_rope_kernel<1, true>, grid, threads, 0, st, cs, G)
               : dev::launch_clusters(fp8_gemv_rope_kernel<2, true>, grid, threads, 0, st, cs, G));
    SPARK_CUDA_TRY(cudaGetLastError());
    return Status::Ok();
  }
  auto go = [&](auto kernel) -> Status {
    SPARK_CUDA_TRY(dev::launch(kernel, grid, threads, 0, st, G));
    SPARK_CUDA_TRY(cudaGetLastError());
    return Status::Ok();
  };
  switch (m) {
    case 1:
      return go(fp8_gemv_rope_kernel<1, false>);
    case 2:
      return go(fp8_gemv_rope_kernel<2, false>);
    case 3:
      return go(fp8_gemv_rope_kernel<3, false>);
    case 4:
      return go(fp8_gemv_rope_kernel<4, false>);
    case 5:
      return go(fp8_gemv_rope_kernel<5, false>);
    case 6:
      return go(fp8_gemv_rope_kernel<6, false>);
    case 7:
      return go(fp8_gemv_rope_kernel<7, false>);
    default:
      return go(fp8_gemv_rope_kernel<8, false>);
  }
}

Status fp8_dequantize_cuda_device(const Fp8Weight& w, size_t row0, size_t rows, size_t k, void* out,
                                  size_t ldo, void* stream) {
  SPARK_TRY(fp8_dequantize_check(w, row0, rows, k, out, ldo));
  if (rows == 0) return Status::Ok();
  constexpr unsigned kThreads = 256;
  SPARK_TRY(cuda_check_launch("fp8_dequantize", kThreads, 0));
  const size_t total = rows * k;
  const size_t grid = std::min<size_t>((total + kThreads - 1) / kThreads, size_t{1} << 20);
  SPARK_CUDA_TRY(dev::launch(fp8_dequantize_kernel, dim3(static_cast<unsigned>(grid)),
                             dim3(kThreads), 0, static_cast<cudaStream_t>(stream), w, row0, rows, k,
                             static_cast<uint16_t*>(out), ldo));
  return Status::Ok();
}

Status fp8_quantize_rows_cuda_device(const void* a, size_t lda, size_t m, size_t k,
                                     const Fp8Rows& out, void* stream) {
  SPARK_TRY(fp8_quantize_rows_check(a, lda, m, k, out));
  if (m == 0) return Status::Ok();
  constexpr unsigned kThreads = 256;
  SPARK_TRY(cuda_check_launch("fp8_quantize_rows", kThreads, 0));
  const size_t warps = m * ((k + kFp8BlockK - 1) / kFp8BlockK);
  const size_t grid = (warps + kThreads / 32 - 1) / (kThreads / 32);
  if (grid > 0x7fffffffu) return make_error(Errc::usage, "fp8 quantize rows: too many rows");
  SPARK_CUDA_TRY(dev::launch(fp8_quantize_rows_kernel, dim3(static_cast<unsigned>(grid)),
                             dim3(kThreads), 0, static_cast<cudaStream_t>(stream),
                             static_cast<const uint16_t*>(a), lda, m, k, out));
  return Status::Ok();
}

}  // namespace spark::kernels
