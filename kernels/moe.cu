// Mixture-of-experts on the GPU: the router's choice, and the experts' products in two forms.
//
// Routing: one warp per token row; its scores live in registers (up to 32 a lane), groups
// and the top-k are rounds of warp argmax with the twin's order (larger value, then lower
// index).
//
// Decode form (up to kMoeDecodeMaxRows rows): the step's chosen experts are read once each,
// however many rows chose them. Every block works out the step's distinct held experts from
// the ids (at most rows x top_k of them, in ascending id), so the work list never leaves the
// device and a decode step stays one graph. gate/up: block (tile of 16 intermediate rows,
// distinct expert u) computes act = silu(g) * u for every row that chose u (the shared
// experts are one more u, every row). down: block (tile of 16 output columns) loops over the
// distinct experts in ascending id and adds each row's weighted product in registers, then
// the shared experts, then writes (or adds into the residual stream): a fixed order, no
// atomics, the same bits every run.
//
// Grouped form (more rows: prefill, many streams): the rows' (row, expert) pairs are counted
// and placed by expert on the device (one block), then two grouped products on the tensor
// cores (mma.sync m16n8k16, 64x64 tiles over each expert's rows, cp.async double-buffered):
// gate/up with SwiGLU in its epilogue, and down into fp32 rows; a last pass sums each row's
// pairs in the order above.
//
// FP8 experts (MoeExpertsArgs' *_fp8 fields): the kernels are instantiated a second time
// with FP8 reads, so the bf16 instantiations stay as they were. Decode: each lane widens its
// 8 bytes of a weight row in registers (exactly: half holds every e4m3 value), sums their
// products with x in fp32 and adds that partial sum times the block's scale (8 columns never
// cross a 128-column block). Grouped: the weight tile is dequantized into shared memory as
// bf16 before the mma, so the grouped form's weights are w * scale rounded to bf16 (exact
// when the scales are powers of two; otherwise within half a bf16 ulp of each weight).
//
// MXFP4 experts (MoeExpertsArgs' *_mx4 fields, gpt-oss's routed experts): a third
// instantiation. Decode: each lane reads 16 bytes of a weight row (32 columns, one scale
// block) and widens the e2m1 codes in registers two at a time to code * 2^-14 (an fp16 built
// from the code's bits, exact, kernels/mxfp4.h), sums the block's products with x in fp32 and
// multiplies that sum once by 2^14 * scale (a power of two, so only the order of the fp32
// sums differs from widening value * scale first). From two rows (form 3: from one) gpt-oss's
// experts, and bf16 experts from 5 to 8 rows, run on the tensor-core decode kernels further
// down instead (mma.sync over the step's rows; MXFP4 widened to fp16 there).
// Grouped: the weight tile is widened into shared memory as bf16 (value * scale, exact in
// bf16) before the mma. The shared experts stay bf16.
//
// gpt-oss's routed experts (MoeExpertsArgs' gpt-oss fields): both forms read gate and up
// from rows 2i and 2i + 1 when interleaved, add the gate/up bias to the fp32 products and
// apply the clamped activation in the gate/up epilogue, and add the down bias to each
// expert's fp32 output before the router's weight (decode: in registers; grouped: into y).
// Runtime flags in the epilogues only: the plain experts' loops and instantiations are
// unchanged.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda_check.cuh"
#include "kernels/cuda_runtime.h"
#include "kernels/device_common.cuh"
#include "kernels/moe.h"
#include "kernels/mxfp4.h"

namespace spark::kernels {
namespace {

using dev::bf16;

// ---- routing ---------------------------------------------------------------------------

constexpr int kRouteWarps = 4;

// (v, i) ahead of (w, j): larger value, equal values by the lower index.
__device__ __forceinline__ bool ahead(float v, int i, float w, int j) {
  return v > w || (v == w && i < j);
}

// The warp's best (value, index) of the lanes' candidates.
__device__ __forceinline__ void warp_best(float* v, int* i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, *v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, *i, o);
    if (ahead(ov, oi, *v, *i)) *v = ov, *i = oi;
  }
}

// kRoutePerLane: experts a lane holds (element e = lane + 32 j), the fewest that cover the
// model's experts: a top-k round's scan is that long.
template <int kRoutePerLane>
__global__ void __launch_bounds__(kRouteWarps * 32)
    moe_route_kernel(const float* logits, const float* bias, MoeRouteArgs a, size_t rows,
                     int32_t* ids, float* weights) {
  dev::pdl_wait();
  dev::pdl_trigger();
  extern __shared__ float route_smem[];  // per warp: the choice values (groups)
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const size_t r = blockIdx.x * size_t{kRouteWarps} + warp;
  if (r >= rows) return;
  const int E = a.experts;
  const float* lg = logits + r * static_cast<size_t>(E);
  float score[kRoutePerLane], choice[kRoutePerLane];
  // Scores: element e = lane + 32 j.
  if (a.sigmoid) {
#pragma unroll
    for (int j = 0; j < kRoutePerLane; ++j) {
      const int e = static_cast<int>(lane) + 32 * j;
      if (e < E) {
        const float s = 1.f / (1.f + expf(-lg[e]));
        score[j] = s;
        choice[j] = bias ? s + bias[e] : s;
      } else {
        score[j] = choice[j] = -INFINITY;
      }
    }
  } else {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kRoutePerLane; ++j) {
      const int e = static_cast<int>(lane) + 32 * j;
      score[j] = e < E ? lg[e] : -INFINITY;
      mx = fmaxf(mx, score[j]);
    }
    mx = dev::warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kRoutePerLane; ++j) {
      const int e = static_cast<int>(lane) + 32 * j;
      score[j] = e < E ? expf(score[j] - mx) : 0.f;
      sum += score[j];
    }
    sum = dev::warp_sum(sum);
#pragma unroll
    for (int j = 0; j < kRoutePerLane; ++j) {
      const int e = static_cast<int>(lane) + 32 * j;
      score[j] = e < E ? score[j] / sum : -INFINITY;
      choice[j] = score[j];
    }
  }
  if (a.n_group > 1) {
    // Group scores (top-2 sums of choice values) from shared memory, then the best
    // topk_group groups by rounds of argmax; the others' experts leave the choice.
    float* ch = route_smem + warp * kMoeMaxExperts;
#pragma unroll
    for (int j = 0; j < kRoutePerLane; ++j) {
      const int e = static_cast<int>(lane) + 32 * j;
      if (e < E) ch[e] = choice[j];
    }
    __syncwarp();
    const int per = E / a.n_group;
    float gs[kRoutePerLane];  // group g = lane + 32 j (n_group <= E)
#pragma unroll
    for (int j = 0; j < kRoutePerLane; ++j) {
      const int g = static_cast<int>(lane) + 32 * j;
      gs[j] = -INFINITY;
      if (g < a.n_group) {
        float m1 = -INFINITY, m2 = -INFINITY;
        for (int e = g * per; e < (g + 1) * per; ++e) {
          const float v = ch[e];
          if (v > m1) {
            m2 = m1;
            m1 = v;
          } else if (v > m2) {
            m2 = v;
          }
        }
        gs[j] = m1 + m2;
      }
    }
    uint32_t keep = 0;  // bit j: group lane + 32 j stays
    for (int round = 0; round < a.topk_group; ++round) {
      float bv = -INFINITY;
      int bi = 0x7fffffff;
#pragma unroll
      for (int j = 0; j < kRoutePerLane; ++j) {
        const int g = static_cast<int>(lane) + 32 * j;
        if (g < a.n_group && !((keep >> j) & 1u) && ahead(gs[j], g, bv, bi)) bv = gs[j], bi = g;
      }
      warp_best(&bv, &bi);
      if (static_cast<int>(lane) == bi % 32) keep |= 1u << (bi / 32);
    }
    // Each lane learns which groups stay through shared memory (group flags after the
    // choice values' slots are reused: the values were read into gs).
    __syncwarp();
    int* kept = reinterpret_cast<int*>(ch);
#pragma unroll
    for (int j = 0; j < kRoutePerLane; ++j) {
      const int g = static_cast<int>(lane) + 32 * j;
      if (g < a.n_group) kept[g] = (keep >> j) & 1u;
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < kRoutePerLane; ++j) {
      const int e = static_cast<int>(lane) + 32 * j;
      if (e < E && !kept[e / per]) choice[j] = -INFINITY;
    }
  }
  // The top-k by rounds of argmax; chosen entries leave the candidates.
  uint32_t taken = 0;
  float w_lane = 0.f;  // lane j (< top_k) keeps the j-th weight
  int id_lane = 0;
  float sum = 0.f;
  for (int k = 0; k < a.top_k; ++k) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < kRoutePerLane; ++j) {
      const int e = static_cast<int>(lane) + 32 * j;
      if (e < E && !((taken >> j) & 1u) && ahead(choice[j], e, bv, bi)) bv = choice[j], bi = e;
    }
    warp_best(&bv, &bi);
    // The owner of the winner gives its score to every lane.
    float s = 0.f;
    if (static_cast<int>(lane) == bi % 32) {
      taken |= 1u << (bi / 32);
#pragma unroll
      for (int j = 0; j < kRoutePerLane; ++j)
        if (j == bi / 32) s = score[j];
    }
    s = __shfl_sync(0xffffffffu, s, bi % 32);
    sum += s;
    if (static_cast<int>(lane) == k) w_lane = s, id_lane = bi;
  }
  if (static_cast<int>(lane) < a.top_k) {
    float w = w_lane;
    if (a.norm_topk) w = w / (a.sigmoid ? sum + 1e-20f : sum);
    w *= a.scaling;
    ids[r * static_cast<size_t>(a.top_k) + lane] = id_lane;
    weights[r * static_cast<size_t>(a.top_k) + lane] = w;
  }
}

// ---- decode form -----------------------------------------------------------------------

constexpr int kDecWarps = 8;
constexpr int kDecRowsPerWarp = 2;
constexpr int kDecTile = kDecWarps * kDecRowsPerWarp;  // intermediate or output rows a block
constexpr int kDecMaxPairs = kMoeDecodeMaxRows * kMoeMaxTopK;

// The step's distinct held experts in ascending id, from the ids of rows x top_k pairs:
// every block computes the same list in shared memory. uid[p]: pair p's place in the list
// (-1 when not held); returns the list's length.
struct DecodeList {
  int n;
  int expert[kDecMaxPairs];
  int uid[kDecMaxPairs];
};

__device__ void decode_list(const MoeExpertsArgs& a, DecodeList* L, bool l2 = false) {
  const int P = a.rows * a.top_k;
  __shared__ int s_ids[kDecMaxPairs];
  __shared__ bool s_first[kDecMaxPairs];
  // The ids once into shared memory (through L2 when read ahead of the wait: L2 is where the
  // routing kernel's writes are coherent).
  for (int p = threadIdx.x; p < P; p += blockDim.x) s_ids[p] = l2 ? __ldcg(a.ids + p) : a.ids[p];
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = s_ids[p];
    const bool held = e >= a.expert0 && e < a.expert0 + a.experts;
    bool first = held;
    for (int q = 0; q < p && first; ++q) first = s_ids[q] != e;
    s_first[p] = first;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = s_ids[p];
    const bool held = e >= a.expert0 && e < a.expert0 + a.experts;
    int rank = 0;
    for (int q = 0; q < P; ++q) rank += s_first[q] && s_ids[q] < e;
    L->uid[p] = held ? rank : -1;
    if (s_first[p]) L->expert[rank] = e;
  }
  if (threadIdx.x == 0) {
    int n = 0;
    for (int q = 0; q < P; ++q) n += s_first[q];
    L->n = n;
  }
  __syncthreads();
}

__device__ __forceinline__ float dot8(const uint4& w, const uint4& x) {
  float fw[8], fx[8];
  dev::bf16x8_to_f(w, fw);
  dev::bf16x8_to_f(x, fx);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(fw[i], fx[i], s);
  return s;
}

// The fp32 dot product of 8 e4m3 weights (unscaled) with 8 bf16 values.
__device__ __forceinline__ float dot8_fp8(const uint2& w, const uint4& x) {
  float fw[8], fx[8];
  dev::e4m3x8_to_f(w, fw);
  dev::bf16x8_to_f(x, fx);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(fw[i], fx[i], s);
  return s;
}

// The fp32 dot product of 16 e4m3 weights (unscaled; one 16-byte load) with 16 bf16 values
// (two 16-byte loads), one chain of fmas.
__device__ __forceinline__ float dot16_fp8(const uint4& w, const uint4& x0, const uint4& x1) {
  float fw[16], fx[16];
  dev::e4m3x8_to_f(make_uint2(w.x, w.y), fw);
  dev::e4m3x8_to_f(make_uint2(w.z, w.w), fw + 8);
  dev::bf16x8_to_f(x0, fx);
  dev::bf16x8_to_f(x1, fx + 8);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) s = fmaf(fw[i], fx[i], s);
  return s;
}

// Whether an FP8 weight's rows of `cols` bytes can be read 16 bytes at a time: 16-byte
// aligned rows and a whole number of 16-byte pieces (every checkpoint shape; the 8-byte loop
// is the fallback).
__device__ __forceinline__ bool fp8_rows16(const Fp8Weight& w, size_t cols) {
  return cols % 16 == 0 && w.ldq % 16 == 0 && reinterpret_cast<uintptr_t>(w.q) % 16 == 0;
}

// Row `row` of an FP8 weight: its bytes and its scale row.
__device__ __forceinline__ const uint8_t* fp8_row(const Fp8Weight& w, size_t row) {
  return w.q + row * w.ldq;
}
__device__ __forceinline__ const float* fp8_scale_row(const Fp8Weight& w, size_t row) {
  return w.scales + (row >> w.row_shift) * w.scale_ld;
}

// The weights an instantiation reads: bf16 only, some FP8, or MXFP4 routed experts (with
// bf16 shared experts).
enum WKind : int { kWBf16 = 0, kWFp8 = 1, kWMx4 = 2 };

// e2m1 codes: the 8 nibbles of `w` (nibble n: column n, low nibble first) widened to float,
// exactly: magnitude (1 + m / 2) * 2^(e - 1) built as a float's bits, e = 0 the subnormal
// m * 0.5, then the sign bit.
__device__ __forceinline__ void e2m1x8(uint32_t w, float* f) {
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const uint32_t c = (w >> (4 * n)) & 0xfu;
    const uint32_t e = (c >> 1) & 3u, m = c & 1u;
    const uint32_t mag = e == 0 ? (m ? 0x3f000000u : 0u) : ((e + 126u) << 23) | (m << 22);
    f[n] = __uint_as_float(mag | ((c & 8u) << 28));
  }
}

// Codes k and k + 4 of `w` widened to fp32 through fp16 (kernels/mxfp4.h): each is the
// code's value * 2^-14, exactly.
__device__ __forceinline__ float2 e2m1_pair(uint32_t w, int k) {
  const uint32_t h = mxfp4_e2m1_pair_fp16(w, k);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// An e8m0 scale byte's value 2^(s - 127) as a float (s = 0: the subnormal 2^-127; 0xff NaN).
__device__ __forceinline__ float e8m0_value(uint32_t s) {
  return s == 0xffu ? __uint_as_float(0x7fc00000u)
                    : (s == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23));
}

// Row `row` of an MXFP4 weight: its codes and its scale bytes.
__device__ __forceinline__ const uint8_t* mx4_row(const Mxfp4Weight& w, size_t row) {
  return w.blocks + row * w.ldb;
}
__device__ __forceinline__ const uint8_t* mx4_scale_row(const Mxfp4Weight& w, size_t row) {
  return w.scales + row * w.lds;
}

// Word j (0-3) of 16 bytes: 8 e2m1 codes, columns 8j .. 8j + 7.
__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

__device__ __forceinline__ float silu_mul(float g, float u) {
  return g / (1.f + expf(-g)) * u;
}

// Any of gpt-oss's fields set (the routed experts take the epilogues below).
__device__ __forceinline__ bool gptoss(const MoeExpertsArgs& a) {
  return a.gate_up_bias || a.down_bias || a.interleaved || a.swiglu_limit != 0.f;
}

// gpt-oss's routed experts: g and u plus their biases (gi, ui: their rows in the expert's
// gate/up), then the clamped activation when swiglu_limit > 0,
// else silu(g) * u. The kernels call it only for those experts: the plain epilogue is a
// uniform branch away and its loops are unchanged.
__device__ __forceinline__ float gptoss_act(const MoeExpertsArgs& a, size_t le, int gi, int ui,
                                            float g, float u) {
  if (a.gate_up_bias) {
    const bf16* b =
        static_cast<const bf16*>(a.gate_up_bias) + le * 2 * static_cast<size_t>(a.inter);
    g += __bfloat162float(b[gi]);
    u += __bfloat162float(b[ui]);
  }
  if (a.swiglu_limit > 0.f) {
    const float lim = a.swiglu_limit;
    g = fminf(g, lim);
    u = fminf(fmaxf(u, -lim), lim);
    return (u + 1.f) * (g / (1.f + expf(-a.swiglu_alpha * g)));
  }
  return silu_mul(g, u);
}

// The rows of intermediate i's gate and up in an expert's [2 * inter] gate/up rows.
__device__ __forceinline__ int gate_row(bool interleaved, int i) {
  return interleaved ? 2 * i : i;
}
__device__ __forceinline__ int up_row(bool interleaved, int inter, int i) {
  return interleaved ? 2 * i + 1 : inter + i;
}

// Expert le's down bias at output column h (0 when none).
__device__ __forceinline__ float down_bias_at(const MoeExpertsArgs& a, size_t le, size_t h) {
  return a.down_bias ? __bfloat162float(static_cast<const bf16*>(
                           a.down_bias)[le * static_cast<size_t>(a.hidden) + h])
                     : 0.f;
}

// kR: the step's rows rounded up to 1, 2, 4 or 8 (the accumulators per thread scale with it,
// so a batch-1 step keeps few registers and many blocks resident).
// gate/up of one distinct expert (blockIdx.y) for the rows that chose it; the shared experts
// are blockIdx.y == gridDim.y - 1 when present. act: [rows * top_k + rows][act_stride].
// kW: the weights' kind (each block reads its group's kind).
template <int kR, int kW>
__global__ void __launch_bounds__(kDecWarps * 32)
    moe_gate_up_decode(MoeExpertsArgs a, bf16* act, int act_stride) {
  dev::pdl_wait();
  dev::pdl_trigger();
  __shared__ DecodeList L;
  __shared__ int s_pair[kR], s_row[kR], s_n;
  decode_list(a, &L);
  const bool shared_block = a.shared_inter > 0 && blockIdx.y == gridDim.y - 1;
  const int u = static_cast<int>(blockIdx.y);
  if (!shared_block && u >= L.n) return;
  const int P = a.rows * a.top_k;
  if (threadIdx.x == 0) {
    int n = 0;
    if (shared_block) {
      for (int r = 0; r < a.rows; ++r) s_pair[n] = P + r, s_row[n] = r, ++n;
    } else {
      for (int p = 0; p < P; ++p)
        if (L.uid[p] == u) s_pair[n] = p, s_row[n] = p / a.top_k, ++n;
    }
    s_n = n;
  }
  __syncthreads();
  const int inter = shared_block ? a.shared_inter : a.inter;
  const size_t H = static_cast<size_t>(a.hidden);
  const size_t le = shared_block ? 0 : static_cast<size_t>(L.expert[u] - a.expert0);
  const bf16* W =
      shared_block ? static_cast<const bf16*>(a.shared_gate_up)
                   : static_cast<const bf16*>(a.gate_up) + le * 2 * static_cast<size_t>(inter) * H;
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const int i0 = static_cast<int>(blockIdx.x) * kDecTile + static_cast<int>(warp) * kDecRowsPerWarp;
  if (i0 >= inter) return;
  const int nrows = s_n;
  const bf16* x = static_cast<const bf16*>(a.x);
  float acc[kR][2 * kDecRowsPerWarp];
#pragma unroll
  for (int t = 0; t < kR; ++t)
#pragma unroll
    for (int q = 0; q < 2 * kDecRowsPerWarp; ++q) acc[t][q] = 0.f;
  const Fp8Weight F = shared_block ? a.shared_gate_up_fp8 : a.gate_up_fp8;
  // gpt-oss's routed experts: interleaved rows, biases and the clamped activation.
  const bool gpt = !shared_block && gptoss(a);
  const bool il = gpt && a.interleaved;
  const Mxfp4Weight M = a.gate_up_mx4;
  if (kW == kWMx4 && !shared_block && M.blocks) {
    // The group's rows of the stacked MXFP4 matrix (as for FP8 below). A lane reads 16 bytes
    // of each row: 32 columns, one scale block; 32 lanes cover 1024 columns a step.
    const size_t base = le * 2 * static_cast<size_t>(inter);
    const uint8_t* qr[2 * kDecRowsPerWarp];
    const uint8_t* sr[2 * kDecRowsPerWarp];
#pragma unroll
    for (int q = 0; q < kDecRowsPerWarp; ++q) {
      const int i = min(i0 + q, inter - 1);
      const size_t gr = base + static_cast<size_t>(gate_row(il, i));
      const size_t ur = base + static_cast<size_t>(up_row(il, inter, i));
      qr[2 * q] = mx4_row(M, gr);
      sr[2 * q] = mx4_scale_row(M, gr);
      qr[2 * q + 1] = mx4_row(M, ur);
      sr[2 * q + 1] = mx4_scale_row(M, ur);
    }
    for (size_t c = lane * 32u; c < H; c += 1024) {
      uint4 w[2 * kDecRowsPerWarp];
      float sc[2 * kDecRowsPerWarp];
#pragma unroll
      for (int q = 0; q < 2 * kDecRowsPerWarp; ++q) {
        w[q] = *reinterpret_cast<const uint4*>(qr[q] + c / 2);
        sc[q] = e8m0_value(sr[q][c / kMxfp4BlockK]) * kMxfp4Fp16Unscale;
      }
      // The block's 32 products per row of x and row of the weight, summed unscaled (codes
      // * 2^-14, exact) and multiplied once by the block's scale.
      float bs[kR][2 * kDecRowsPerWarp];
#pragma unroll
      for (int t = 0; t < kR; ++t)
#pragma unroll
        for (int q = 0; q < 2 * kDecRowsPerWarp; ++q) bs[t][q] = 0.f;
          // Word j of the 16 bytes (columns c + 8j .. c + 8j + 7) of every row, widened once
          // and used by each row of x.
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 fw[2 * kDecRowsPerWarp][4];
#pragma unroll
        for (int q = 0; q < 2 * kDecRowsPerWarp; ++q)
#pragma unroll
          for (int k = 0; k < 4; ++k) fw[q][k] = e2m1_pair(word_of(w[q], j), k);
#pragma unroll
        for (int t = 0; t < kR; ++t) {
          if (t >= nrows) break;
          float fx[8];
          dev::bf16x8_to_f(
              *reinterpret_cast<const uint4*>(x + static_cast<size_t>(s_row[t]) * H + c + 8 * j),
              fx);
#pragma unroll
          for (int q = 0; q < 2 * kDecRowsPerWarp; ++q)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              bs[t][q] = fmaf(fw[q][k].x, fx[k], bs[t][q]);
              bs[t][q] = fmaf(fw[q][k].y, fx[k + 4], bs[t][q]);
            }
        }
      }
#pragma unroll
      for (int t = 0; t < kR; ++t)
#pragma unroll
        for (int q = 0; q < 2 * kDecRowsPerWarp; ++q) acc[t][q] = fmaf(bs[t][q], sc[q], acc[t][q]);
    }
  } else if (kW == kWFp8 && F.q) {
    // The group's rows of the stacked FP8 matrix: gate row i, up row inter + i (or 2i, 2i + 1).
    const size_t base = le * 2 * static_cast<size_t>(inter);
    const uint8_t* qr[2 * kDecRowsPerWarp];
    const float* sr[2 * kDecRowsPerWarp];
#pragma unroll
    for (int q = 0; q < kDecRowsPerWarp; ++q) {
      const int i = min(i0 + q, inter - 1);
      const size_t gr = base + static_cast<size_t>(gate_row(il, i));
      const size_t ur = base + static_cast<size_t>(up_row(il, inter, i));
      qr[2 * q] = fp8_row(F, gr);
      sr[2 * q] = fp8_scale_row(F, gr);
      qr[2 * q + 1] = fp8_row(F, ur);
      sr[2 * q + 1] = fp8_scale_row(F, ur);
    }
    if (fp8_rows16(F, H)) {
      // 16 bytes (16 columns, inside one 128-column scale block) of each row a lane: 32
      // lanes cover 512 columns a step, half the load instructions of the 8-byte loop.
#pragma unroll 2
      for (size_t c = lane * 16u; c < H; c += 512) {
        uint4 w[2 * kDecRowsPerWarp];
        float sc[2 * kDecRowsPerWarp];
#pragma unroll
        for (int q = 0; q < 2 * kDecRowsPerWarp; ++q) {
          w[q] = *reinterpret_cast<const uint4*>(qr[q] + c);
          sc[q] = sr[q][c / kFp8BlockK];
        }
#pragma unroll
        for (int t = 0; t < kR; ++t) {
          if (t >= nrows) break;
          const uint4* xr =
              reinterpret_cast<const uint4*>(x + static_cast<size_t>(s_row[t]) * H + c);
          const uint4 x0 = xr[0], x1 = xr[1];
#pragma unroll
          for (int q = 0; q < 2 * kDecRowsPerWarp; ++q)
            acc[t][q] = fmaf(dot16_fp8(w[q], x0, x1), sc[q], acc[t][q]);
        }
      }
    } else {
#pragma unroll 2
      for (size_t c = lane * 8u; c < H; c += 256) {
        uint2 w[2 * kDecRowsPerWarp];
        float sc[2 * kDecRowsPerWarp];
#pragma unroll
        for (int q = 0; q < 2 * kDecRowsPerWarp; ++q) {
          w[q] = *reinterpret_cast<const uint2*>(qr[q] + c);
          sc[q] = sr[q][c / kFp8BlockK];
        }
#pragma unroll
        for (int t = 0; t < kR; ++t) {
          if (t >= nrows) break;
          const uint4 xv =
              *reinterpret_cast<const uint4*>(x + static_cast<size_t>(s_row[t]) * H + c);
#pragma unroll
          for (int q = 0; q < 2 * kDecRowsPerWarp; ++q)
            acc[t][q] = fmaf(dot8_fp8(w[q], xv), sc[q], acc[t][q]);
        }
      }
    }
  } else {
    const bf16* wr[2 * kDecRowsPerWarp];
#pragma unroll
    for (int q = 0; q < kDecRowsPerWarp; ++q) {
      const int i = min(i0 + q, inter - 1);
      wr[2 * q] = W + static_cast<size_t>(gate_row(il, i)) * H;           // gate
      wr[2 * q + 1] = W + static_cast<size_t>(up_row(il, inter, i)) * H;  // up
    }
#pragma unroll 2
    for (size_t c = lane * 8u; c < H; c += 256) {
      uint4 w[2 * kDecRowsPerWarp];
#pragma unroll
      for (int q = 0; q < 2 * kDecRowsPerWarp; ++q)
        w[q] = *reinterpret_cast<const uint4*>(wr[q] + c);
#pragma unroll
      for (int t = 0; t < kR; ++t) {
        if (t >= nrows) break;
        const uint4 xv = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(s_row[t]) * H + c);
#pragma unroll
        for (int q = 0; q < 2 * kDecRowsPerWarp; ++q) acc[t][q] += dot8(w[q], xv);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kR; ++t) {
    if (t >= nrows) break;
#pragma unroll
    for (int q = 0; q < kDecRowsPerWarp; ++q) {
      const float g = dev::warp_sum(acc[t][2 * q]);
      const float up = dev::warp_sum(acc[t][2 * q + 1]);
      const int i = i0 + q;
      if (lane == 0 && i < inter)
        act[static_cast<size_t>(s_pair[t]) * static_cast<size_t>(act_stride) + i] =
            __float2bfloat16_rn(
                gpt ? gptoss_act(a, le, gate_row(il, i), up_row(il, inter, i), g, up)
                    : silu_mul(g, up));
    }
  }
}

// down: output rows [h0, h0 + kDownRows) of every row. The block's warps split the distinct
// experts (and the shared experts, last): warp w takes experts w, w + 8, ...; with fewer
// experts than warps, 8 / experts warps take each, a slice of its columns apiece. Their
// weighted sums meet in shared memory and are added in warp order, so the result does not
// depend on timing. Written once (or added into out).
constexpr int kDownRows = 4;

// Rows [h0, h0 + kDownRows) of every chosen expert's down matrix (and the shared experts')
// asked into L2, one bulk prefetch a group by one thread each: the rows are contiguous in
// every weight format (bf16 rows, FP8 and MXFP4 rows of their row strides). Skipped where a
// range is not 16-byte aligned (the instruction's rule) or before sm_90.
template <int kW>
__device__ __forceinline__ void down_prefetch_l2(const MoeExpertsArgs& a, const DecodeList& L,
                                                 int h0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int groups = L.n + (a.shared_inter > 0 ? 1 : 0);
  const int u = static_cast<int>(threadIdx.x);
  if (u >= groups || h0 >= a.hidden) return;
  const bool sh = u == L.n;
  const size_t H = static_cast<size_t>(a.hidden);
  const size_t rows = static_cast<size_t>(min(kDownRows, a.hidden - h0));
  const size_t le = sh ? 0 : static_cast<size_t>(L.expert[u] - a.expert0);
  const int inter = sh ? a.shared_inter : a.inter;
  const uint8_t* p = nullptr;
  size_t bytes = 0;
  const Fp8Weight F = sh ? a.shared_down_fp8 : a.down_fp8;
  if (kW == kWMx4 && !sh && a.down_mx4.blocks) {
    p = mx4_row(a.down_mx4, le * H + static_cast<size_t>(h0));
    bytes = rows * a.down_mx4.ldb;
  } else if (kW == kWFp8 && F.q) {
    p = fp8_row(F, le * H + static_cast<size_t>(h0));
    bytes = rows * F.ldq;
  } else {
    const bf16* W = sh ? static_cast<const bf16*>(a.shared_down)
                       : static_cast<const bf16*>(a.down) + le * H * static_cast<size_t>(inter);
    p = reinterpret_cast<const uint8_t*>(W + static_cast<size_t>(h0) * static_cast<size_t>(inter));
    bytes = rows * static_cast<size_t>(inter) * sizeof(bf16);
  }
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0 || bytes % 16 != 0 || bytes >= (size_t{1} << 31))
    return;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p),
               "r"(static_cast<uint32_t>(bytes))
               : "memory");
#else
  (void)a, (void)L, (void)h0;
#endif
}

template <int kR, int kW>
__global__ void __launch_bounds__(kDecWarps * 32)
    moe_down_decode(MoeExpertsArgs a, const bf16* act, int act_stride) {
  __shared__ DecodeList L;
  __shared__ float red[kDecWarps][kR][kDownRows];
  const int h0 = static_cast<int>(blockIdx.x) * kDownRows;
  // Ahead of the wait: the step's expert list and the block's rows of each chosen expert
  // asked into L2, so they stream in while gate/up finishes. Neither depends on gate/up (the
  // kernel ahead, always): the ids were written by the routing kernel, which had finished
  // when gate/up passed its own wait, before any of its blocks let this launch start.
  decode_list(a, &L, true);
  down_prefetch_l2<kW>(a, L, h0);
  dev::pdl_wait();
  dev::pdl_trigger();
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  if (h0 >= a.hidden) return;  // the whole block
  const int P = a.rows * a.top_k;
  const size_t H = static_cast<size_t>(a.hidden);
  float acc[kR][kDownRows];
#pragma unroll
  for (int t = 0; t < kR; ++t)
#pragma unroll
    for (int q = 0; q < kDownRows; ++q) acc[t][q] = 0.f;
  const int groups = L.n + (a.shared_inter > 0 ? 1 : 0);
  // With fewer groups than warps (a batch-1 step of a top-4 model: 4 of 8), each group takes
  // wpg warps, each a slice of its columns, so no warp idles; else one warp a group.
  const int wpg = groups > 0 && groups < kDecWarps ? kDecWarps / groups : 1;
  const int slice = static_cast<int>(warp) % wpg;
  const int lane_col = slice * 32 + static_cast<int>(lane);
  for (int u = static_cast<int>(warp) / wpg; u < groups; u += kDecWarps / wpg) {
    const bool sh = u == L.n;
    const int inter = sh ? a.shared_inter : a.inter;
    const size_t le = sh ? 0 : static_cast<size_t>(L.expert[u] - a.expert0);
    const bf16* W = sh ? static_cast<const bf16*>(a.shared_down)
                       : static_cast<const bf16*>(a.down) + le * H * static_cast<size_t>(inter);
    const Fp8Weight F = sh ? a.shared_down_fp8 : a.down_fp8;
    float part[kR][kDownRows];
#pragma unroll
    for (int t = 0; t < kR; ++t)
#pragma unroll
      for (int q = 0; q < kDownRows; ++q) part[t][q] = 0.f;
    // The pairs of this expert, by row: pair_of[t] (-1: row t did not choose it).
    int pair_of[kR];
#pragma unroll
    for (int t = 0; t < kR; ++t) {
      pair_of[t] = -1;
      if (t < a.rows) {
        if (sh) {
          pair_of[t] = P + t;
        } else {
          for (int j = 0; j < a.top_k; ++j)
            if (L.uid[t * a.top_k + j] == u) pair_of[t] = t * a.top_k + j;
        }
      }
    }
    const Mxfp4Weight M = a.down_mx4;
    if (kW == kWMx4 && !sh && M.blocks) {
      // The group's rows of the stacked MXFP4 matrix: output row h is row le * hidden + h; a
      // lane reads 16 bytes (32 columns, one scale) of each.
      const uint8_t* qr[kDownRows];
      const uint8_t* sr[kDownRows];
#pragma unroll
      for (int q = 0; q < kDownRows; ++q) {
        const size_t row = le * H + static_cast<size_t>(min(h0 + q, a.hidden - 1));
        qr[q] = mx4_row(M, row);
        sr[q] = mx4_scale_row(M, row);
      }
      for (int c = lane_col * 32; c < inter; c += 1024 * wpg) {
        uint4 w[kDownRows];
        float sc[kDownRows];
#pragma unroll
        for (int q = 0; q < kDownRows; ++q) {
          w[q] = *reinterpret_cast<const uint4*>(qr[q] + c / 2);
          sc[q] = e8m0_value(sr[q][c / kMxfp4BlockK]) * kMxfp4Fp16Unscale;
        }
        // The block's 32 products per pair and output row, summed unscaled (codes * 2^-14,
        // exact) and multiplied once by the block's scale.
        float bs[kR][kDownRows];
#pragma unroll
        for (int t = 0; t < kR; ++t)
#pragma unroll
          for (int q = 0; q < kDownRows; ++q) bs[t][q] = 0.f;
            // Word j (columns c + 8j .. c + 8j + 7) of every row, widened once and used by each
            // pair's act.
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float2 fw[kDownRows][4];
#pragma unroll
          for (int q = 0; q < kDownRows; ++q)
#pragma unroll
            for (int k = 0; k < 4; ++k) fw[q][k] = e2m1_pair(word_of(w[q], j), k);
#pragma unroll
          for (int t = 0; t < kR; ++t) {
            if (pair_of[t] < 0) continue;
            float fa[8];
            dev::bf16x8_to_f(
                *reinterpret_cast<const uint4*>(
                    act + static_cast<size_t>(pair_of[t]) * static_cast<size_t>(act_stride) + c +
                    8 * j),
                fa);
#pragma unroll
            for (int q = 0; q < kDownRows; ++q)
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                bs[t][q] = fmaf(fw[q][k].x, fa[k], bs[t][q]);
                bs[t][q] = fmaf(fw[q][k].y, fa[k + 4], bs[t][q]);
              }
          }
        }
#pragma unroll
        for (int t = 0; t < kR; ++t)
#pragma unroll
          for (int q = 0; q < kDownRows; ++q) part[t][q] = fmaf(bs[t][q], sc[q], part[t][q]);
      }
    } else if (kW == kWFp8 && F.q) {
      // The group's rows of the stacked FP8 matrix: output row h is row le * hidden + h.
      const uint8_t* qr[kDownRows];
      const float* sr[kDownRows];
#pragma unroll
      for (int q = 0; q < kDownRows; ++q) {
        const size_t row = le * H + static_cast<size_t>(min(h0 + q, a.hidden - 1));
        qr[q] = fp8_row(F, row);
        sr[q] = fp8_scale_row(F, row);
      }
      if (fp8_rows16(F, static_cast<size_t>(inter))) {
        // 16 bytes of each row a lane, as in gate/up.
#pragma unroll 2
        for (int c = lane_col * 16; c < inter; c += 512 * wpg) {
          uint4 w[kDownRows];
          float sc[kDownRows];
#pragma unroll
          for (int q = 0; q < kDownRows; ++q) {
            w[q] = *reinterpret_cast<const uint4*>(qr[q] + c);
            sc[q] = sr[q][c / kFp8BlockK];
          }
#pragma unroll
          for (int t = 0; t < kR; ++t) {
            if (pair_of[t] < 0) continue;
            const uint4* ar = reinterpret_cast<const uint4*>(
                act + static_cast<size_t>(pair_of[t]) * static_cast<size_t>(act_stride) + c);
            const uint4 a0 = ar[0], a1 = ar[1];
#pragma unroll
            for (int q = 0; q < kDownRows; ++q)
              part[t][q] = fmaf(dot16_fp8(w[q], a0, a1), sc[q], part[t][q]);
          }
        }
      } else {
#pragma unroll 2
        for (int c = lane_col * 8; c < inter; c += 256 * wpg) {
          uint2 w[kDownRows];
          float sc[kDownRows];
#pragma unroll
          for (int q = 0; q < kDownRows; ++q) {
            w[q] = *reinterpret_cast<const uint2*>(qr[q] + c);
            sc[q] = sr[q][c / kFp8BlockK];
          }
#pragma unroll
          for (int t = 0; t < kR; ++t) {
            if (pair_of[t] < 0) continue;
            const uint4 av = *reinterpret_cast<const uint4*>(
                act + static_cast<size_t>(pair_of[t]) * static_cast<size_t>(act_stride) + c);
#pragma unroll
            for (int q = 0; q < kDownRows; ++q)
              part[t][q] = fmaf(dot8_fp8(w[q], av), sc[q], part[t][q]);
          }
        }
      }
    } else {
#pragma unroll 2
      for (int c = lane_col * 8; c < inter; c += 256 * wpg) {
        uint4 w[kDownRows];
#pragma unroll
        for (int q = 0; q < kDownRows; ++q) {
          const int h = min(h0 + q, a.hidden - 1);
          w[q] = *reinterpret_cast<const uint4*>(
              W + static_cast<size_t>(h) * static_cast<size_t>(inter) + c);
        }
#pragma unroll
        for (int t = 0; t < kR; ++t) {
          if (pair_of[t] < 0) continue;
          const uint4 av = *reinterpret_cast<const uint4*>(
              act + static_cast<size_t>(pair_of[t]) * static_cast<size_t>(act_stride) + c);
#pragma unroll
          for (int q = 0; q < kDownRows; ++q) part[t][q] += dot8(w[q], av);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kR; ++t) {
      if (pair_of[t] < 0) continue;
      const float wt = sh ? 1.f : a.weights[pair_of[t]];
#pragma unroll
      for (int q = 0; q < kDownRows; ++q) {
        float y = dev::warp_sum(part[t][q]);
        // gpt-oss: the expert's down bias, before the router's weight (once: slice 0's).
        if (!sh && a.down_bias && slice == 0)
          y += down_bias_at(a, le, static_cast<size_t>(min(h0 + q, a.hidden - 1)));
        acc[t][q] += wt * y;
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < kR; ++t)
#pragma unroll
      for (int q = 0; q < kDownRows; ++q) red[warp][t][q] = acc[t][q];
  }
  __syncthreads();
  const int t = static_cast<int>(threadIdx.x) / kDownRows,
            q = static_cast<int>(threadIdx.x) % kDownRows;
  const int h = h0 + q;
  if (t >= a.rows || h >= a.hidden) return;
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < kDecWarps; ++w) sum += red[w][t][q];
  bf16* out = static_cast<bf16*>(a.out);
  const size_t at = static_cast<size_t>(t) * H + static_cast<size_t>(h);
  const float prior = a.accumulate ? __bfloat162float(out[at]) : 0.f;
  out[at] = __float2bfloat16_rn(prior + sum);
}

// ---- MXFP4 decode on the tensor cores (gpt-oss's routed experts) -----------------------
//
// The decode form above widens each code to fp32 and spends two instructions a weight per
// row of x on the conversion and the fma; at batch 1 that is as much issue time as the bytes
// take to arrive, and it grows with the rows. Here the codes are widened to fp16 (code *
// 2^-14, exact, mxfp4_e2m1x8_fp16: 11 instructions for 8 codes) and the products are mma.sync
// m16n8k16 (fp16 in, fp32 accumulation), the step's rows (up to kMmaMaxRows) the mma's
// columns in tiles of 8 that share the widened codes, so each 8 more rows cost two mma
// instructions a scale block and no more widening.
//
// A warp's tile is 16 weight rows (gate/up: 8 intermediates' gate rows and their up rows;
// down: 16 output rows). Lane (g = lane / 4, q = lane % 4) reads word q (codes 8q .. 8q + 7)
// of each 32-column scale block of rows g and g + 8: one mma pair covers one scale block of
// all 16 rows, its fp32 result is multiplied by each row's scale and added up. The B operand
// is fp16 with each 8 columns stored in the order 0 2 1 3 4 6 5 7 (mma_pos), so a lane's one
// 16-byte load holds both mmas' registers:
//   x: gate/up stages the rows that chose its expert in shared memory, each times 2^e with
//      e such that its largest magnitude lands in [2^14, 2^15) (values under 2^-28 of that
//      lose low bits, far under the fp32 sum's own rounding); the result is scaled back by
//      2^(14 - e).
//   act: gate/up rounds the activation to bf16 (the twin's act) and stores it as fp16, exact
//      because the clamped activation is bounded (|act| < (limit + 1) * limit; taken only
//      for swiglu_limit < 128). down reads it straight from the workspace.
// gate/up splits each tile's columns between two warps (their sums added in a fixed order);
// down gives each distinct expert kMmaDownWarps / experts warps, each a slice of the columns,
// and adds the warps' sums in warp order, as the form above: the same bits every run.
//
// Taken from two rows up to kMmaMaxRows (moe_experts_cuda_device): at 8 streams on an H100
// the step is 1027 tokens/s for gpt-oss-20b against the fp32 kernels' 521 (120b: 563 against
// 309), at 32 streams 1468 against the grouped form's 1255 (120b: 489 against 410). At batch 1
// they are slower than the fp32 kernels (gpt-oss-120b 278 against 296 tokens/s, 20b 392
// against 421): half as many warps, each with twice the
// dependent load steps (45 scale blocks in steps of 8), so fewer bytes are in flight; asking
// L2 for each tile row 16 blocks ahead made it slower still (258 against 297). The next steps
// are more, shorter column slices or a cp.async pipeline through shared memory.
constexpr int kMmaWarps = 8;   // gate/up: kMmaTiles tiles of kMmaKSplit warps each
constexpr int kMmaKSplit = 2;  // warps sharing a gate/up tile's columns
constexpr int kMmaTiles = kMmaWarps / kMmaKSplit;
// down: 16 warps a block. Its grid is hidden / 16 blocks (128 at Qwen3's and GLM's hidden), so
// the warps a block are the warps an SM; with 8, at 8 streams on an H100 the step ran at 545
// tokens/s for Qwen3-30B-A3B in FP8 against 604 with 16, 580 against 618 in bf16 and 1044
// against 1181 for gpt-oss-20b (more warps, more of the weights in flight).
constexpr int kMmaDownWarps = 16;
constexpr int kMmaUnroll = 8;     // scale blocks a lane's loads cover at once (a multiple of 4)
constexpr int kMmaMaxRows = 32;   // the most step rows: 4 column tiles of 8 in down
constexpr int kMmaPassRows = 16;  // gate/up: most rows of x staged in shared memory at a time
// gate/up's static shared memory (under this; the dynamic part is its staged rows of x).
constexpr size_t kMmaStaticSmem = 16 * 1024;

// Where column c is stored in the B operand's fp16 rows: within each 8 columns, the order
// 0 2 1 3 4 6 5 7 (registers (0, 2), (1, 3), (4, 6), (5, 7): mxfp4_e2m1x8_fp16's pairs).
__device__ __forceinline__ int mma_pos(int c) {
  const int p = c & 7;
  const int q = (p == 1 || p == 5) ? p + 1 : (p == 2 || p == 6) ? p - 1 : p;
  return (c & ~7) | q;
}

// Halves per staged row of x (a row stride of 64 bytes mod 128: two rows' 64-byte pieces
// of one quarter warp's 16-byte loads fall in different banks).
__host__ __device__ __forceinline__ int mma_xs_ld(int hidden) {
  return (hidden + 63) / 64 * 64 + 32;
}

// 2^k as a float, k in [-126, 127].
__device__ __forceinline__ float exp2i(int k) {
  return __int_as_float((127 + k) << 23);
}

// One 32-column scale block of a 16-row tile: rows g and g + 8's words (wa, wb), widened once,
// times the B registers of the first nt of NT column tiles (xv[t]; nt the same for the warp);
// each fp32 result times each row's scale added into acc[t].
template <int NT>
__device__ __forceinline__ void mx4_block_mma(uint32_t wa, uint32_t wb, const uint4* xv, float sa,
                                              float sb, float (*acc)[4], int nt) {
  uint32_t A[4], B[4];
  mxfp4_e2m1x8_fp16(wa, A);
  mxfp4_e2m1x8_fp16(wb, B);
  const uint32_t a0[4] = {A[0], B[0], A[2], B[2]};
  const uint32_t a1[4] = {A[1], B[1], A[3], B[3]};
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= nt) break;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    dev::mma_f16_16816(c, a0, xv[t].x, xv[t].y);
    dev::mma_f16_16816(c, a1, xv[t].z, xv[t].w);
    acc[t][0] = fmaf(c[0], sa, acc[t][0]);
    acc[t][1] = fmaf(c[1], sa, acc[t][1]);
    acc[t][2] = fmaf(c[2], sb, acc[t][2]);
    acc[t][3] = fmaf(c[3], sb, acc[t][3]);
  }
}

// Scale blocks [b0, b1) of a 16-row tile: qa/qb the lane's word of rows g and g + 8 (block 0),
// sa/sb their scale rows, bx[t] the lane's B row of column tile t (fp16, block 0; null: zeros);
// only the first nt tiles (the same for the warp) are read and multiplied.
template <int NT>
__device__ __forceinline__ void mx4_tile_mma(const uint8_t* qa, const uint8_t* qb,
                                             const uint8_t* sa, const uint8_t* sb,
                                             const __half* const* bx, int b0, int b1,
                                             float (*acc)[4], int nt = NT) {
  const unsigned lane = threadIdx.x & 31u, q = lane & 3u;
  for (int b = b0; b < b1; b += kMmaUnroll) {
    uint32_t wa[kMmaUnroll], wb[kMmaUnroll];
    float fa[kMmaUnroll / 4], fb[kMmaUnroll / 4];
#pragma unroll
    for (int j = 0; j < kMmaUnroll; ++j) {
      const bool in = b + j < b1;
      wa[j] = in ? *reinterpret_cast<const uint32_t*>(qa + 16 * (b + j)) : 0u;
      wb[j] = in ? *reinterpret_cast<const uint32_t*>(qb + 16 * (b + j)) : 0u;
    }
    // Lane q holds the scales of blocks b + 4r + q; the others come by shuffle.
#pragma unroll
    for (int r = 0; r < kMmaUnroll / 4; ++r) {
      const int bb = b + 4 * r + static_cast<int>(q);
      fa[r] = bb < b1 ? e8m0_value(sa[bb]) : 0.f;
      fb[r] = bb < b1 ? e8m0_value(sb[bb]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kMmaUnroll; ++j) {
      if (b + j >= b1) break;  // the same for every lane
      uint4 xv[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t)
        xv[t] = t < nt && bx[t] ? *reinterpret_cast<const uint4*>(bx[t] + 32 * (b + j))
                                : make_uint4(0u, 0u, 0u, 0u);
      const int src = static_cast<int>((lane & ~3u) | static_cast<unsigned>(j & 3));
      const float s_a = __shfl_sync(0xffffffffu, fa[j / 4], src);
      const float s_b = __shfl_sync(0xffffffffu, fb[j / 4], src);
      mx4_block_mma<NT>(wa[j], wb[j], xv, s_a, s_b, acc, nt);
    }
  }
}

// bf16 experts on the same kernels: a lane reads 16 bytes (8 columns, 8q .. 8q + 7) of each
// 32-column block of rows g and g + 8, and the mma's k index runs over the block's columns
// in the order that makes the loaded words the operands' registers as they are: mma h
// (h = 0, 1) takes columns 8q + 4h .. 8q + 4h + 3 of lane q as its k = 2q, 2q + 1 (the first
// two) and 2q + 8, 2q + 9 (the last two). A's registers are then rows g and g + 8's words
// 2h and 2h + 1, and B's are words 2h and 2h + 1 of the same 8 columns of x (or act), so x
// and act stay bf16 in their natural column order, unscaled.
constexpr int kMmaUnrollBf16 = 4;  // 32-column blocks a lane's loads cover at once

// One 32-column block of a 16-row tile of bf16 weights: rows g and g + 8's 16 bytes (wa, wb)
// times the B registers of the first nt of NT column tiles (xv[t]), added into acc[t].
template <int NT>
__device__ __forceinline__ void bf16_block_mma(const uint4& wa, const uint4& wb, const uint4* xv,
                                               float (*acc)[4], int nt) {
  const uint32_t a0[4] = {wa.x, wb.x, wa.y, wb.y};
  const uint32_t a1[4] = {wa.z, wb.z, wa.w, wb.w};
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= nt) break;
    dev::mma_bf16_16816(acc[t], a0, xv[t].x, xv[t].y);
    dev::mma_bf16_16816(acc[t], a1, xv[t].z, xv[t].w);
  }
}

// Blocks [b0, b1) of a 16-row tile of bf16 weights: ra/rb the lane's 8 columns of rows g and
// g + 8 (block 0), bx[t] the lane's 8 columns of tile t's B row (block 0; null: zeros); only
// the first nt tiles (the same for the warp) are read and multiplied.
template <int NT>
__device__ __forceinline__ void bf16_tile_mma(const bf16* ra, const bf16* rb, const bf16* const* bx,
                                              int b0, int b1, float (*acc)[4], int nt = NT) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int b = b0; b < b1; b += kMmaUnrollBf16) {
    uint4 wa[kMmaUnrollBf16], wb[kMmaUnrollBf16];
#pragma unroll
    for (int j = 0; j < kMmaUnrollBf16; ++j) {
      const bool in = b + j < b1;
      wa[j] = in ? *reinterpret_cast<const uint4*>(ra + 32 * (b + j)) : zero;
      wb[j] = in ? *reinterpret_cast<const uint4*>(rb + 32 * (b + j)) : zero;
    }
#pragma unroll
    for (int j = 0; j < kMmaUnrollBf16; ++j) {
      if (b + j >= b1) break;  // the same for every lane
      uint4 xv[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t)
        xv[t] = t < nt && bx[t] ? *reinterpret_cast<const uint4*>(bx[t] + 32 * (b + j)) : zero;
      bf16_block_mma<NT>(wa[j], wb[j], xv, acc, nt);
    }
  }
}

// FP8 experts on the same kernels: a lane reads 8 bytes (8 columns, 8q .. 8q + 7) of each
// 32-column block of rows g and g + 8 and widens each pair with one cvt to fp16, exactly
// (every e4m3 value, subnormals too, is a normal fp16); the mma's k index runs over the
// block's columns as for bf16 above, so B is in its natural column order. gate/up's B is x
// staged as fp16 (times 2^e a row, as for MXFP4). down's B is act as gate/up stores it, bf16
// as the twin rounds it (an fp16 act would overflow past 65504, and nothing bounds an
// unclamped activation), so down takes the fp16 pairs on to bf16, exactly: the fp16 bits
// shifted right by 3 are a bf16 of the value times 2^-112 (an e4m3 value's 3 significant bits
// lose nothing; its exponent lands in bf16's normal range), and a bf16 multiply by 2^112
// brings it back. The products of a 128-column scale block are summed in a zeroed fragment,
// then multiplied by rows g and g + 8's scales into acc.
constexpr int kMmaUnrollFp8 = 8;  // 32-column blocks a lane's loads cover at once

// 8 e4m3 bytes (columns 8q .. 8q + 7 of a row) widened to 4 fp16 pairs, column order.
__device__ __forceinline__ void e4m3x8_fp16(const uint2& w, uint32_t* h) {
  const uint32_t v[2] = {w.x, w.y};
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>((v[i] >> (16 * k)) & 0xffffu), __NV_E4M3);
      h[2 * i + k] = static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
    }
}

// The 4 fp16 pairs of e4m3x8_fp16 as bf16 pairs, exactly (the zeros too; a NaN code, which
// no checkpoint's weights hold, reads as 122880).
__device__ __forceinline__ void fp16x4_to_bf16(uint32_t* h) {
  const __nv_bfloat162 k112 = __halves2bfloat162(__ushort_as_bfloat16(0x7780u),
                                                 __ushort_as_bfloat16(0x7780u));  // 2^112
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t t = (h[i] & 0x80008000u) | ((h[i] >> 3) & 0x0fff0fffu);
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&t), k112);
    h[i] = *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Blocks [b0, b1) of a 16-row tile of FP8 weights: qa/qb the lane's 8 bytes of rows g and
// g + 8 (block 0), sa/sb their scale rows (one float per 128 columns), bx[t] the lane's 8
// columns of tile t's B row (block 0; null: zeros), fp16 or with kBf16B bf16; only the first
// nt tiles (the same for the warp) are read and multiplied.
template <int NT, bool kBf16B>
__device__ __forceinline__ void fp8_tile_mma(const uint8_t* qa, const uint8_t* qb, const float* sa,
                                             const float* sb, const uint16_t* const* bx, int b0,
                                             int b1, float (*acc)[4], int nt = NT) {
  constexpr int kPer = kFp8BlockK / 32;  // 32-column blocks a scale covers
  const uint2 zero = make_uint2(0u, 0u);
  float c[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.f;
  for (int b = b0; b < b1; b += kMmaUnrollFp8) {
    uint2 wa[kMmaUnrollFp8], wb[kMmaUnrollFp8];
#pragma unroll
    for (int j = 0; j < kMmaUnrollFp8; ++j) {
      const bool in = b + j < b1;
      wa[j] = in ? *reinterpret_cast<const uint2*>(qa + 32 * (b + j)) : zero;
      wb[j] = in ? *reinterpret_cast<const uint2*>(qb + 32 * (b + j)) : zero;
    }
    // The scales of the (at most kSpan) scale blocks these loads touch, in flight with them.
    constexpr int kSpan = (kMmaUnrollFp8 + kPer - 2) / kPer + 1;
    const int s0 = b / kPer, slast = (b1 - 1) / kPer;
    float fa[kSpan], fb[kSpan];
#pragma unroll
    for (int k = 0; k < kSpan; ++k) {
      fa[k] = s0 + k <= slast ? sa[s0 + k] : 0.f;
      fb[k] = s0 + k <= slast ? sb[s0 + k] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kMmaUnrollFp8; ++j) {
      const int blk = b + j;
      if (blk >= b1) break;  // the same for every lane
      uint32_t A[4], B[4];
      e4m3x8_fp16(wa[j], A);
      e4m3x8_fp16(wb[j], B);
      if constexpr (kBf16B) {
        fp16x4_to_bf16(A);
        fp16x4_to_bf16(B);
      }
      const uint32_t a0[4] = {A[0], B[0], A[1], B[1]};
      const uint32_t a1[4] = {A[2], B[2], A[3], B[3]};
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t >= nt) break;
        const uint4 xv =
            bx[t] ? *reinterpret_cast<const uint4*>(bx[t] + 32 * blk) : make_uint4(0u, 0u, 0u, 0u);
        if constexpr (kBf16B) {
          dev::mma_bf16_16816(c[t], a0, xv.x, xv.y);
          dev::mma_bf16_16816(c[t], a1, xv.z, xv.w);
        } else {
          dev::mma_f16_16816(c[t], a0, xv.x, xv.y);
          dev::mma_f16_16816(c[t], a1, xv.z, xv.w);
        }
      }
      if ((blk + 1) % kPer == 0 || blk + 1 == b1) {
        const int k = blk / kPer - s0;
        float s_a = fa[0], s_b = fb[0];
#pragma unroll
        for (int m = 1; m < kSpan; ++m)
          if (k == m) s_a = fa[m], s_b = fb[m];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          acc[t][0] = fmaf(c[t][0], s_a, acc[t][0]);
          acc[t][1] = fmaf(c[t][1], s_a, acc[t][1]);
          acc[t][2] = fmaf(c[t][2], s_b, acc[t][2]);
          acc[t][3] = fmaf(c[t][3], s_b, acc[t][3]);
          c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.f;
        }
      }
    }
  }
}

// gate/up: block (32 intermediates, distinct expert blockIdx.y; with bf16 shared experts the
// last blockIdx.y, every row); warps 2t and 2t + 1 take tile t's two halves of the columns.
// The rows that chose the expert are staged in shared memory pass_rows (16, or 8 where 16
// rows of x do not fit a block's shared memory, as on GB10 at gpt-oss's widths) at a time
// (dynamic: min(rows, pass_rows) x mma_xs_ld(hidden) halves), each pass one or two column
// tiles of 8; more rows (at most kMmaMaxRows) take more passes over the same weights, then
// mostly from L2.
template <int NT, int kW>
__device__ __forceinline__ void gate_up_mma_pass(const MoeExpertsArgs& a, const void* xs, int xs_ld,
                                                 int pn, bool active, bool shared, size_t gr,
                                                 size_t ur, int kb0, int kb1, float (*acc)[4]) {
  const unsigned lane = threadIdx.x & 31u;
  const int g = static_cast<int>(lane >> 2), q = static_cast<int>(lane & 3u);
  if constexpr (kW == kWMx4 || kW == kWFp8) {
    const __half* bx[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t)
      bx[t] = 8 * t + g < pn
                  ? static_cast<const __half*>(xs) + static_cast<size_t>(8 * t + g) * xs_ld + 8 * q
                  : nullptr;
    if (active && kW == kWMx4) {
      const Mxfp4Weight& M = a.gate_up_mx4;
      mx4_tile_mma<NT>(mx4_row(M, gr) + 4 * q, mx4_row(M, ur) + 4 * q, mx4_scale_row(M, gr),
                       mx4_scale_row(M, ur), bx, kb0, kb1, acc);
    } else if (active) {
      const Fp8Weight& F = shared ? a.shared_gate_up_fp8 : a.gate_up_fp8;
      fp8_tile_mma<NT, false>(fp8_row(F, gr) + 8 * q, fp8_row(F, ur) + 8 * q, fp8_scale_row(F, gr),
                              fp8_scale_row(F, ur), reinterpret_cast<const uint16_t* const*>(bx),
                              kb0, kb1, acc);
    }
  } else {
    const bf16* bx[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t)
      bx[t] = 8 * t + g < pn
                  ? static_cast<const bf16*>(xs) + static_cast<size_t>(8 * t + g) * xs_ld + 8 * q
                  : nullptr;
    if (active) {
      const size_t H = static_cast<size_t>(a.hidden);
      const bf16* W = static_cast<const bf16*>(shared ? a.shared_gate_up : a.gate_up) +
                      static_cast<size_t>(8 * q);
      bf16_tile_mma<NT>(W + gr * H, W + ur * H, bx, kb0, kb1, acc);
    }
  }
}

// NTM: the most column tiles of a pass (1 for steps of up to 8 rows, 2 past them). kW: kWMx4
// (x staged as fp16 times 2^e in mma_pos order, act fp16 likewise), kWFp8 (x staged as fp16
// times 2^e in column order, act bf16; FP8 shared experts too) or kWBf16 (x and act bf16 as
// they are).
template <int NTM, int kW>
__global__ void __launch_bounds__(kMmaWarps * 32)
    moe_gate_up_mma(MoeExpertsArgs a, bf16* act, int act_stride, int pass_rows) {
  constexpr bool kMx4 = kW == kWMx4, kHalf = kW == kWMx4 || kW == kWFp8;
  dev::pdl_wait();
  dev::pdl_trigger();
  extern __shared__ __align__(16) unsigned char mma_smem[];
  __shared__ DecodeList L;
  __shared__ int s_pair[kMmaMaxRows], s_row[kMmaMaxRows], s_e[kMmaMaxRows];
  __shared__ unsigned s_max[kMmaMaxRows];
  __shared__ int s_n;
  __shared__ float s_part[kMmaWarps][32][4 * NTM];
  decode_list(a, &L);
  // bf16 shared experts: the last blockIdx.y, every row (act rows rows * top_k + r).
  const bool shared = !kMx4 && a.shared_inter > 0 && blockIdx.y == gridDim.y - 1;
  const int u = static_cast<int>(blockIdx.y);
  if (!shared && u >= L.n) return;  // the whole block
  if (threadIdx.x == 0) {
    int n = 0;
    if (shared) {
      for (int r = 0; r < a.rows && n < kMmaMaxRows; ++r)
        s_pair[n] = a.rows * a.top_k + r, s_row[n] = r, ++n;
    } else {
      // A row chooses an expert once (top-k), so at most rows <= kMmaMaxRows of them.
      for (int p = 0; p < a.rows * a.top_k; ++p)
        if (L.uid[p] == u && n < kMmaMaxRows) s_pair[n] = p, s_row[n] = p / a.top_k, ++n;
    }
    s_n = n;
  }
  if (threadIdx.x < kMmaMaxRows) s_max[threadIdx.x] = 0u;
  __syncthreads();
  const int nrows = s_n, H = a.hidden, xs_ld = mma_xs_ld(H), g8 = H / 8;
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const int inter = shared ? a.shared_inter : a.inter,
            tile = static_cast<int>(blockIdx.x) * kMmaTiles + static_cast<int>(warp) / kMmaKSplit;
  const int part = static_cast<int>(warp) % kMmaKSplit, nb = H / kMxfp4BlockK;
  const int kb0 = part * nb / kMmaKSplit, kb1 = (part + 1) * nb / kMmaKSplit;
  const bool active = tile * 8 < inter;
  const bool il = !shared && a.interleaved;
  const size_t le = shared ? 0 : static_cast<size_t>(L.expert[u] - a.expert0);
  const size_t base = le * 2 * static_cast<size_t>(inter);
  const bf16* x = static_cast<const bf16*>(a.x);
  if constexpr (kHalf) {
    // Each row's largest magnitude (non-negative floats order as their bits; NaN is skipped
    // here and carried by the product).
    for (int k = static_cast<int>(threadIdx.x); k < nrows * g8; k += blockDim.x) {
      float f[8];
      dev::bf16x8_to_f(*reinterpret_cast<const uint4*>(x + static_cast<size_t>(s_row[k / g8]) * H +
                                                       (k % g8) * 8),
                       f);
      float m = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(f[i]));
      atomicMax(&s_max[k / g8], __float_as_uint(m));
    }
    __syncthreads();
    if (threadIdx.x < static_cast<unsigned>(nrows)) {
      const float m = __uint_as_float(s_max[threadIdx.x]);
      int e = 0;
      if (m > 0.f && m <= 3.4e38f) {
        int p = 0;
        (void)frexpf(m, &p);  // m in [2^(p-1), 2^p)
        e = min(max(15 - p, -100), 100);
      }
      s_e[threadIdx.x] = e;
    }
  }
  const int g = static_cast<int>(lane >> 2), q = static_cast<int>(lane & 3u);
  const int i = tile * 8 + g;
  const int ic = min(i, inter - 1);
  const size_t gr = base + static_cast<size_t>(gate_row(il, ic));
  const size_t ur = base + static_cast<size_t>(up_row(il, inter, ic));
  for (int p0 = 0; p0 < nrows; p0 += pass_rows) {
    const int pn = min(pass_rows, nrows - p0);
    __syncthreads();  // s_e written; the last pass's reads of xs and s_part done
    for (int k = static_cast<int>(threadIdx.x); k < pn * g8; k += blockDim.x) {
      const int t = k / g8, c = (k % g8) * 8;
      const uint4* from =
          reinterpret_cast<const uint4*>(x + static_cast<size_t>(s_row[p0 + t]) * H + c);
      uint4* to = reinterpret_cast<uint4*>(reinterpret_cast<__half*>(mma_smem) +
                                           static_cast<size_t>(t) * xs_ld + c);
      if constexpr (kHalf) {
        float f[8];
        dev::bf16x8_to_f(*from, f);
        const float sc = exp2i(s_e[p0 + t]);
        __align__(16) __half h[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) h[kMx4 ? mma_pos(j) : j] = __float2half_rn(f[j] * sc);
        *to = *reinterpret_cast<const uint4*>(h);
      } else {
        *to = *from;
      }
    }
    __syncthreads();
    float acc[NTM][4];
#pragma unroll
    for (int t = 0; t < NTM; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    if (NTM > 1 && pn > 8)
      gate_up_mma_pass<NTM, kW>(a, mma_smem, xs_ld, pn, active, shared, gr, ur, kb0, kb1, acc);
    else
      gate_up_mma_pass<1, kW>(a, mma_smem, xs_ld, pn, active, shared, gr, ur, kb0, kb1, acc);
    if (part > 0) {
#pragma unroll
      for (int t = 0; t < NTM; ++t)
#pragma unroll
        for (int k = 0; k < 4; ++k) s_part[warp][lane][4 * t + k] = acc[t][k];
    }
    __syncthreads();
    if (part == 0 && active && i < inter) {
      for (int s = 1; s < kMmaKSplit; ++s)
#pragma unroll
        for (int t = 0; t < NTM; ++t)
#pragma unroll
          for (int k = 0; k < 4; ++k) acc[t][k] += s_part[warp + s][lane][4 * t + k];
#pragma unroll
      for (int t = 0; t < NTM; ++t)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int n = 8 * t + 2 * q + r;  // the mma's column: the pass's row n
          if (n >= pn) continue;
          const float f = kMx4 ? exp2i(14 - s_e[p0 + n]) : kHalf ? exp2i(-s_e[p0 + n]) : 1.f;
          const float gv = acc[t][r] * f, uv = acc[t][2 + r] * f;
          const float v = shared ? silu_mul(gv, uv)
                                 : gptoss_act(a, le, gate_row(il, i), up_row(il, inter, i), gv, uv);
          const size_t at = static_cast<size_t>(s_pair[p0 + n]) * static_cast<size_t>(act_stride);
          if constexpr (kMx4)
            reinterpret_cast<__half*>(act)[at + mma_pos(i)] =
                __float2half_rn(__bfloat162float(__float2bfloat16_rn(v)));
          else
            act[at + i] = __float2bfloat16_rn(v);
        }
    }
  }
}

// down: block (16 output rows); each distinct expert (then the bf16 shared experts, weight 1,
// every row) kMmaDownWarps / groups warps (at least one), each a slice of its 32-column
// blocks. The mma's columns are the rows that chose the expert, in ascending row order, in
// tiles of 8: an expert chosen by c rows runs ceil(c / 8) tiles (NT: the most any expert can
// need, one kernel per NT so a step of few rows keeps the registers of one tile). Each warp
// adds its experts' weighted results into its own rows of `red` in shared memory, experts in
// ascending order, then the warps' sums are added in warp order: the same bits every run.
// act: fp16 in mma_pos order for MXFP4 (gate/up's above), bf16 as it is for FP8 and bf16.
template <int NT, int kW>
__global__ void __launch_bounds__(kMmaDownWarps * 32)
    moe_down_mma(MoeExpertsArgs a, const bf16* act, int act_stride) {
  constexpr bool kMx4 = kW == kWMx4;
  __shared__ DecodeList L;
  __shared__ float red[kMmaDownWarps][16][kMmaMaxRows];
  // The pairs that chose each distinct expert u: s_list[s_off[u] .. s_off[u] + s_cnt[u]), in
  // ascending pair (so row) order.
  __shared__ int s_cnt[kDecMaxPairs], s_off[kDecMaxPairs], s_list[kDecMaxPairs];
  dev::pdl_wait();
  dev::pdl_trigger();
  decode_list(a, &L);
  const int K = a.top_k, P = a.rows * K;
  for (int u = static_cast<int>(threadIdx.x); u < L.n; u += blockDim.x) s_cnt[u] = 0;
  __syncthreads();
  for (int p = static_cast<int>(threadIdx.x); p < P; p += blockDim.x)
    if (L.uid[p] >= 0) atomicAdd(&s_cnt[L.uid[p]], 1);
  __syncthreads();
  if (threadIdx.x == 0)
    for (int u = 0, off = 0; u < L.n; ++u) s_off[u] = off, off += s_cnt[u];
  __syncthreads();
  for (int p = static_cast<int>(threadIdx.x); p < P; p += blockDim.x) {
    const int u = L.uid[p];
    if (u < 0) continue;
    int rank = 0;
    for (int p2 = 0; p2 < p; ++p2) rank += L.uid[p2] == u;
    s_list[s_off[u] + rank] = p;
  }
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (int k = static_cast<int>(lane); k < 16 * kMmaMaxRows; k += 32)
    red[warp][k / kMmaMaxRows][k % kMmaMaxRows] = 0.f;
  __syncthreads();
  const int g = static_cast<int>(lane >> 2), q = static_cast<int>(lane & 3u);
  const int H = a.hidden, h0 = static_cast<int>(blockIdx.x) * 16;
  const bool has_shared = !kMx4 && a.shared_inter > 0;
  const int groups = L.n + (has_shared ? 1 : 0);
  const int wpg = groups > 0 && groups < kMmaDownWarps ? kMmaDownWarps / groups : 1;
  const int slice = static_cast<int>(warp) % wpg;
  const int ra = min(h0 + g, H - 1), rb = min(h0 + g + 8, H - 1);
  for (int u = static_cast<int>(warp) / wpg; u < groups; u += kMmaDownWarps / wpg) {
    const bool shared = has_shared && u == L.n;
    const int inter = shared ? a.shared_inter : a.inter, nb = inter / kMxfp4BlockK;
    const size_t le = shared ? 0 : static_cast<size_t>(L.expert[u] - a.expert0);
    // Column n of the expert's tiles: its n-th row (the shared experts: row n, whose act rows
    // follow the pairs). pb[t]: the act row of column 8t + g (the B column this lane gives);
    // pc[t][r], rc[t][r]: the pair (weight) and step row of columns 8t + 2q + r (the C
    // columns it holds); -1 past the expert's rows.
    const int cnt = shared ? a.rows : s_cnt[u], off = shared ? 0 : s_off[u];
    const int nt = (cnt + 7) / 8;
    int pb[NT], pc[NT][2], rc[NT][2];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int nbx = 8 * t + g;
      pb[t] = nbx >= cnt ? -1 : shared ? a.rows * K + nbx : s_list[off + nbx];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int n = 8 * t + 2 * q + r;
        pc[t][r] = n >= cnt ? -1 : shared ? a.rows * K + n : s_list[off + n];
        rc[t][r] = n >= cnt ? -1 : shared ? n : pc[t][r] / K;
      }
    }
    float part[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) part[t][0] = part[t][1] = part[t][2] = part[t][3] = 0.f;
    const int kb0 = slice * nb / wpg, kb1 = (slice + 1) * nb / wpg;
    if constexpr (kMx4) {
      const __half* acth = reinterpret_cast<const __half*>(act);
      const __half* bx[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t)
        bx[t] = pb[t] >= 0
                    ? acth + static_cast<size_t>(pb[t]) * static_cast<size_t>(act_stride) + 8 * q
                    : nullptr;
      const Mxfp4Weight& M = a.down_mx4;
      const size_t rowa = le * static_cast<size_t>(H) + static_cast<size_t>(ra);
      const size_t rowb = le * static_cast<size_t>(H) + static_cast<size_t>(rb);
      mx4_tile_mma<NT>(mx4_row(M, rowa) + 4 * q, mx4_row(M, rowb) + 4 * q, mx4_scale_row(M, rowa),
                       mx4_scale_row(M, rowb), bx, kb0, kb1, part, nt);
    } else if constexpr (kW == kWFp8) {
      const uint16_t* acts = reinterpret_cast<const uint16_t*>(act);
      const uint16_t* bx[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t)
        bx[t] = pb[t] >= 0
                    ? acts + static_cast<size_t>(pb[t]) * static_cast<size_t>(act_stride) + 8 * q
                    : nullptr;
      const Fp8Weight& F = shared ? a.shared_down_fp8 : a.down_fp8;
      const size_t first = shared ? 0 : le * static_cast<size_t>(H);
      const size_t rowa = first + static_cast<size_t>(ra), rowb = first + static_cast<size_t>(rb);
      fp8_tile_mma<NT, true>(fp8_row(F, rowa) + 8 * q, fp8_row(F, rowb) + 8 * q,
                             fp8_scale_row(F, rowa), fp8_scale_row(F, rowb), bx, kb0, kb1, part,
                             nt);
    } else {
      const bf16* bx[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t)
        bx[t] = pb[t] >= 0
                    ? act + static_cast<size_t>(pb[t]) * static_cast<size_t>(act_stride) + 8 * q
                    : nullptr;
      const size_t I = static_cast<size_t>(inter);
      const bf16* W = shared ? static_cast<const bf16*>(a.shared_down)
                             : static_cast<const bf16*>(a.down) + le * static_cast<size_t>(H) * I;
      W += static_cast<size_t>(8 * q);
      bf16_tile_mma<NT>(W + static_cast<size_t>(ra) * I, W + static_cast<size_t>(rb) * I, bx, kb0,
                        kb1, part, nt);
    }
    const float unscale = kMx4 ? kMxfp4Fp16Unscale : 1.f;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (pc[t][r] < 0) continue;
        const float wt = shared ? 1.f : a.weights[pc[t][r]];
        float ya = part[t][r] * unscale, yb = part[t][2 + r] * unscale;
        // gpt-oss: the expert's down bias, before the router's weight (once: slice 0's).
        if (!shared && a.down_bias && slice == 0) {
          ya += down_bias_at(a, le, static_cast<size_t>(ra));
          yb += down_bias_at(a, le, static_cast<size_t>(rb));
        }
        red[warp][g][rc[t][r]] += wt * ya;
        red[warp][g + 8][rc[t][r]] += wt * yb;
      }
    // A row is a different column (so lane) of the next expert's tiles.
    __syncwarp();
  }
  __syncthreads();
  bf16* out = static_cast<bf16*>(a.out);
  for (int k = static_cast<int>(threadIdx.x); k < 16 * a.rows; k += blockDim.x) {
    const int r = k / a.rows, t = k % a.rows, h = h0 + r;
    if (h >= H) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kMmaDownWarps; ++w) sum += red[w][r][t];
    const size_t at = static_cast<size_t>(t) * static_cast<size_t>(H) + static_cast<size_t>(h);
    const float prior = a.accumulate ? __bfloat162float(out[at]) : 0.f;
    out[at] = __float2bfloat16_rn(prior + sum);
  }
}

// ---- grouped form ----------------------------------------------------------------------

constexpr int kGBM = 64, kGBN = 64, kGBK = 32, kGThreads = 128;
constexpr int kGLds = kGBK + 8;  // shared row stride (bf16): 80 bytes, ldmatrix without conflicts

// The grouped form's workspace, laid out by moe_experts_workspace_bytes.
struct GroupedWs {
  int* counts;    // [groups]
  int* row_off;   // [groups + 1]: first sorted row of each group
  int* tile_off;  // [groups + 1]: first tile of each group
  int* pos;       // [pairs]: sorted row of pair p (p < rows * top_k: routed; then shared)
  int* row_src;   // [pairs]: the token row of sorted row s
  bf16* act;      // [pairs][act_stride]
  float* y;       // [pairs][hidden]
  int pairs, groups, act_stride;
};

GroupedWs grouped_ws(const MoeExpertsArgs& a) {
  const MoeWorkspaceLayout l =
      moe_workspace_layout(a.rows, a.top_k, a.hidden, a.inter, a.shared_inter, a.experts);
  char* base = static_cast<char*>(a.workspace);
  GroupedWs w{};
  w.groups = l.groups;
  w.pairs = l.pairs;
  w.act_stride = l.act_stride;
  w.counts = reinterpret_cast<int*>(base + l.counts);
  w.row_off = reinterpret_cast<int*>(base + l.row_off);
  w.tile_off = reinterpret_cast<int*>(base + l.tile_off);
  w.pos = reinterpret_cast<int*>(base + l.pos);
  w.row_src = reinterpret_cast<int*>(base + l.row_src);
  w.act = reinterpret_cast<bf16*>(base + l.act);
  w.y = reinterpret_cast<float*>(base + l.y);
  return w;
}

// One block: counts per group, the groups' row and tile offsets, and every pair's sorted row.
// A pair's place within its group comes from an atomic: which place a row takes does not
// change any value (each sorted row is computed on its own and summed back by pair).
__global__ void __launch_bounds__(1024) moe_plan_grouped(MoeExpertsArgs a, GroupedWs w) {
  dev::pdl_wait();
  dev::pdl_trigger();
  extern __shared__ int plan_smem[];
  int* cnt = plan_smem;             // [groups]
  int* off = plan_smem + w.groups;  // [groups + 1]
  for (int g = threadIdx.x; g < w.groups; g += blockDim.x) cnt[g] = 0;
  __syncthreads();
  const int routed = a.rows * a.top_k;
  for (int p = threadIdx.x; p < w.pairs; p += blockDim.x) {
    int g = -1;
    if (p < routed) {
      const int e = a.ids[p];
      if (e >= a.expert0 && e < a.expert0 + a.experts) g = e - a.expert0;
    } else {
      g = a.experts;  // the shared experts
    }
    w.pos[p] = g < 0 ? -1 : atomicAdd(&cnt[g], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int rows = 0, tiles = 0;
    for (int g = 0; g < w.groups; ++g) {
      off[g] = rows;
      w.row_off[g] = rows;
      w.tile_off[g] = tiles;
      w.counts[g] = cnt[g];
      rows += cnt[g];
      tiles += (cnt[g] + kGBM - 1) / kGBM;
    }
    off[w.groups] = rows;
    w.row_off[w.groups] = rows;
    w.tile_off[w.groups] = tiles;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < w.pairs; p += blockDim.x) {
    if (w.pos[p] < 0) continue;
    int g = p < routed ? a.ids[p] - a.expert0 : a.experts;
    const int s = off[g] + w.pos[p];
    w.pos[p] = s;
    w.row_src[s] = p < routed ? p / a.top_k : p - routed;
  }
}

// The grouped product of one (group, 64-row tile, 64-column tile). GATE_UP: A rows are the
// tokens' x (through row_src), B the group's [gate | up] rows (32 gate rows i0.. and the 32
// up rows inter + i0..), the epilogue writes act = silu(g) * u for 32 columns. Else (down):
// A rows are act (sorted), B the group's down rows h0.., the epilogue writes fp32 y.
// kW: the weights' kind; a group of FP8 weights dequantizes its B tile into shared memory
// as bf16 (w * scale rounded to bf16) with ordinary loads instead of cp.async, a group of
// MXFP4 weights likewise (e2m1 value * 2^(scale - 127), exact in bf16).
template <bool GATE_UP, int kW>
__global__ void __launch_bounds__(kGThreads) moe_grouped_product(MoeExpertsArgs a, GroupedWs w) {
  dev::pdl_wait();
  dev::pdl_trigger();
  __shared__ __align__(16) unsigned char smem[2 * 2 * kGBM * kGLds * sizeof(bf16)];
  bf16* sA = reinterpret_cast<bf16*>(smem);  // [2][64][kGLds]
  bf16* sB = sA + 2 * kGBM * kGLds;          // [2][64][kGLds]
  const int tile = static_cast<int>(blockIdx.x);
  if (tile >= w.tile_off[w.groups]) return;
  int g = 0;
  while (g + 1 < w.groups && w.tile_off[g + 1] <= tile) ++g;
  const bool sh = a.shared_inter > 0 && g == a.experts;
  const int inter = sh ? a.shared_inter : a.inter;
  const int m0 = w.row_off[g] + (tile - w.tile_off[g]) * kGBM;
  const int m_end = w.row_off[g + 1];
  const size_t H = static_cast<size_t>(a.hidden);
  // Output columns of this block and the B rows they read.
  const int n_out = GATE_UP ? inter : a.hidden;
  const int n0 = static_cast<int>(blockIdx.y) * (GATE_UP ? kGBN / 2 : kGBN);
  if (n0 >= n_out) return;
  const int K = GATE_UP ? a.hidden : inter;
  const bf16* B = GATE_UP ? (sh ? static_cast<const bf16*>(a.shared_gate_up)
                                : static_cast<const bf16*>(a.gate_up) +
                                      static_cast<size_t>(g) * 2 * static_cast<size_t>(inter) * H)
                          : (sh ? static_cast<const bf16*>(a.shared_down)
                                : static_cast<const bf16*>(a.down) +
                                      static_cast<size_t>(g) * H * static_cast<size_t>(inter));
  const Fp8Weight& F =
      GATE_UP ? (sh ? a.shared_gate_up_fp8 : a.gate_up_fp8) : (sh ? a.shared_down_fp8 : a.down_fp8);
  const bool bfp8 = kW == kWFp8 && F.q != nullptr;
  const Mxfp4Weight& M = GATE_UP ? a.gate_up_mx4 : a.down_mx4;
  const bool bmx4 = kW == kWMx4 && !sh && M.blocks != nullptr;
  // The group's first row in the stacked FP8 matrix.
  const size_t frow0 =
      sh ? 0 : static_cast<size_t>(g) * (GATE_UP ? 2 * static_cast<size_t>(inter) : H);
  const int tid = static_cast<int>(threadIdx.x);
  // gpt-oss's routed experts: interleaved gate/up rows, biases and the clamped activation.
  const bool gpt = !sh && gptoss(a);
  const bool il = gpt && a.interleaved;
  // Tile loads: 64 rows x 32 columns = 256 chunks of 16 bytes each for A and for B.
  auto load = [&](int stage, int k0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * kGThreads;
      const int r = c >> 2, kc = (c & 3) * 8;
      // A
      const int srow = m0 + r;
      const bool av = srow < m_end;
      const bf16* asrc;
      if (GATE_UP) {
        const int tok = av ? w.row_src[srow] : 0;
        asrc = static_cast<const bf16*>(a.x) + static_cast<size_t>(tok) * H + k0 + kc;
      } else {
        asrc = w.act + static_cast<size_t>(av ? srow : 0) * static_cast<size_t>(w.act_stride) + k0 +
               kc;
      }
      const bool kin = k0 + kc < K;  // the last tile's columns past K are zeros
      dev::cp_async16(sA + (stage * kGBM + r) * kGLds + kc, av && kin ? asrc : a.x, av && kin);
      // B
      int brow;
      bool bv;
      if (GATE_UP) {
        const int half = r < kGBN / 2 ? 0 : 1;
        const int i = n0 + (r & (kGBN / 2 - 1));
        bv = i < inter;
        brow = half ? up_row(il, inter, bv ? i : 0) : gate_row(il, bv ? i : 0);
      } else {
        brow = n0 + r;
        bv = brow < n_out;
        if (!bv) brow = 0;
      }
      if (bmx4) {
        // 8 columns (4 bytes of codes) in one 32-column block: one scale. K is a multiple
        // of 32, so a chunk is wholly inside or past it; zeros outside the weight.
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (bv && kin) {
          const size_t row = frow0 + static_cast<size_t>(brow);
          const uint32_t q = *reinterpret_cast<const uint32_t*>(mx4_row(M, row) + (k0 + kc) / 2);
          const float sc = e8m0_value(mx4_scale_row(M, row)[(k0 + kc) / kMxfp4BlockK]);
          float f[8];
          e2m1x8(q, f);
          uint32_t* o = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const __nv_bfloat162 p = __floats2bfloat162_rn(f[2 * j] * sc, f[2 * j + 1] * sc);
            o[j] = *reinterpret_cast<const uint32_t*>(&p);
          }
        }
        *reinterpret_cast<uint4*>(sB + (stage * kGBM + r) * kGLds + kc) = v;
      } else if (bfp8) {
        // 8 columns in one 128-column block: one scale. Zeros outside the weight.
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (bv && kin) {
          const size_t row = frow0 + static_cast<size_t>(brow);
          const uint2 q = *reinterpret_cast<const uint2*>(fp8_row(F, row) + k0 + kc);
          const float sc = fp8_scale_row(F, row)[(k0 + kc) / kFp8BlockK];
          float f[8];
          dev::e4m3x8_to_f(q, f);
          uint32_t* o = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const __nv_bfloat162 p = __floats2bfloat162_rn(f[2 * j] * sc, f[2 * j + 1] * sc);
            o[j] = *reinterpret_cast<const uint32_t*>(&p);
          }
        }
        *reinterpret_cast<uint4*>(sB + (stage * kGBM + r) * kGLds + kc) = v;
      } else {
        const bf16* bsrc = B + static_cast<size_t>(brow) * static_cast<size_t>(K) + k0 + kc;
        dev::cp_async16(sB + (stage * kGBM + r) * kGLds + kc, bv && kin ? bsrc : B, bv && kin);
      }
    }
    dev::cp_async_commit();
  };
  const int lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;  // the warp's 32x32 quarter
  float acc[2][4][4] = {};
  const int ktiles = (K + kGBK - 1) / kGBK;
  load(0, 0);
  for (int kt = 0; kt < ktiles; ++kt) {
    const int st = kt & 1;
    if (kt + 1 < ktiles) {
      load(st ^ 1, (kt + 1) * kGBK);
      dev::cp_async_wait<1>();
    } else {
      dev::cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kGBK; kk += 16) {
      uint32_t af[2][4], bfr[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wm * 32 + mi * 16 + (lane & 15);
        const int c = kk + (lane >> 4) * 8;
        dev::ldsm_x4(af[mi], sA + (st * kGBM + r) * kGLds + c);
      }
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        const int r = wn * 32 + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int c = kk + ((lane >> 3) & 1) * 8;
        dev::ldsm_x4(bfr[nj], sB + (st * kGBM + r) * kGLds + c);
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
          dev::mma_bf16_16816(acc[mi][ni], af[mi], bfr[ni >> 1][(ni & 1) * 2],
                              bfr[ni >> 1][(ni & 1) * 2 + 1]);
    }
    __syncthreads();
  }
  // Epilogue through shared memory: C tile [64][64 + 4] fp32.
  float* sC = reinterpret_cast<float*>(smem);
  constexpr int kCs = kGBN + 4;
  static_assert(kGBM * kCs * sizeof(float) <= sizeof(smem), "C tile fits the pipeline's smem");
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int r = wm * 32 + mi * 16 + (lane >> 2);
      const int c = wn * 32 + ni * 8 + (lane & 3) * 2;
      sC[r * kCs + c] = acc[mi][ni][0];
      sC[r * kCs + c + 1] = acc[mi][ni][1];
      sC[(r + 8) * kCs + c] = acc[mi][ni][2];
      sC[(r + 8) * kCs + c + 1] = acc[mi][ni][3];
    }
  __syncthreads();
  if (GATE_UP) {
    for (int e = tid; e < kGBM * (kGBN / 2); e += kGThreads) {
      const int r = e / (kGBN / 2), c = e % (kGBN / 2);
      const int srow = m0 + r, i = n0 + c;
      if (srow >= m_end || i >= inter) continue;
      const float gv = sC[r * kCs + c], uv = sC[r * kCs + c + kGBN / 2];
      w.act[static_cast<size_t>(srow) * static_cast<size_t>(w.act_stride) + i] =
          __float2bfloat16_rn(gpt ? gptoss_act(a, static_cast<size_t>(g), gate_row(il, i),
                                               up_row(il, inter, i), gv, uv)
                                  : silu_mul(gv, uv));
    }
  } else {
    for (int e = tid; e < kGBM * kGBN; e += kGThreads) {
      const int r = e / kGBN, c = e % kGBN;
      const int srow = m0 + r, h = n0 + c;
      if (srow >= m_end || h >= n_out) continue;
      // gpt-oss: the expert's down bias joins y, which the router's weight then multiplies.
      float y = sC[r * kCs + c];
      if (gpt && a.down_bias) y += down_bias_at(a, static_cast<size_t>(g), static_cast<size_t>(h));
      w.y[static_cast<size_t>(srow) * H + static_cast<size_t>(h)] = y;
    }
  }
}

// out[r][h] (+)= sum over row r's held pairs in ascending expert id of weight * y, then the
// shared experts' y.
__global__ void moe_combine_grouped(MoeExpertsArgs a, GroupedWs w) {
  dev::pdl_wait();
  dev::pdl_trigger();
  const size_t H = static_cast<size_t>(a.hidden);
  const size_t total = static_cast<size_t>(a.rows) * H;
  const int K = a.top_k;
  bf16* out = static_cast<bf16*>(a.out);
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total;
       i += size_t{gridDim.x} * blockDim.x) {
    const int r = static_cast<int>(i / H);
    const size_t h = i % H;
    float acc = 0.f;
    int last = -1;  // pairs in ascending expert id (K is small: a selection each time)
    for (int n = 0; n < K; ++n) {
      int best = -1, be = 0x7fffffff;
      for (int j = 0; j < K; ++j) {
        const int e = a.ids[r * K + j];
        if (e > last && e < be) be = e, best = j;
      }
      if (best < 0) break;
      last = be;
      const int p = r * K + best;
      if (w.pos[p] < 0) continue;
      acc += a.weights[p] * w.y[static_cast<size_t>(w.pos[p]) * H + h];
    }
    if (a.shared_inter > 0) acc += w.y[static_cast<size_t>(w.pos[a.rows * K + r]) * H + h];
    const float prior = a.accumulate ? __bfloat162float(out[i]) : 0.f;
    out[i] = __float2bfloat16_rn(prior + acc);
  }
}

// The decode kernels' instantiation for the weights' kind and the step's rows (1, 2, 4 or
// kMoeDecodeMaxRows accumulators a thread).
template <int kW>
auto gate_up_decode_for(int rows) {
  return rows <= 1   ? moe_gate_up_decode<1, kW>
         : rows <= 2 ? moe_gate_up_decode<2, kW>
         : rows <= 4 ? moe_gate_up_decode<4, kW>
                     : moe_gate_up_decode<kMoeDecodeMaxRows, kW>;
}
template <int kW>
auto down_decode_for(int rows) {
  return rows <= 1   ? moe_down_decode<1, kW>
         : rows <= 2 ? moe_down_decode<2, kW>
         : rows <= 4 ? moe_down_decode<4, kW>
                     : moe_down_decode<kMoeDecodeMaxRows, kW>;
}

// Whether bf16 experts can take the tensor-core decode kernels: whole 32-column blocks and
// 16-byte aligned rows (a lane's loads), the shared experts' too.
bool bf16_mma_fits(const MoeExpertsArgs& a) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool shared_ok =
      a.shared_inter == 0 ||
      (a.shared_inter % kMxfp4BlockK == 0 && aligned(a.shared_gate_up) && aligned(a.shared_down));
  return a.hidden % kMxfp4BlockK == 0 && a.inter % kMxfp4BlockK == 0 && aligned(a.x) &&
         aligned(a.gate_up) && aligned(a.down) && shared_ok;
}

// Whether FP8 experts can take the tensor-core decode kernels: every routed matrix FP8, the
// shared experts' too where there are any, and whole 32-column blocks. (A lane's 8-byte loads
// of the codes and x's 16-byte rows are aligned already: moe_experts_check requires q and ldq
// multiples of 8 bytes and x 16-byte aligned.)
bool fp8_mma_fits(const MoeExpertsArgs& a) {
  const bool shared_ok =
      a.shared_inter == 0 || (a.shared_inter % kMxfp4BlockK == 0 &&
                              a.shared_gate_up_fp8.q != nullptr && a.shared_down_fp8.q != nullptr);
  return a.hidden % kMxfp4BlockK == 0 && a.inter % kMxfp4BlockK == 0 &&
         a.gate_up_fp8.q != nullptr && a.down_fp8.q != nullptr && shared_ok;
}

// gate/up's dynamic shared memory: min(rows, pass_rows) staged rows of x.
size_t mma_dynamic_smem(const MoeExpertsArgs& a, int pass_rows) {
  return static_cast<size_t>(std::min(a.rows, pass_rows)) *
         static_cast<size_t>(mma_xs_ld(a.hidden)) * sizeof(__half);
}

}  // namespace

// The rows gate/up stages a pass: kMmaPassRows, or 8 where those do not fit the device's
// shared memory a block (GB10's 99 KiB at hidden 2880) or moe_smem_cap(); 0 where neither
// does (the other forms run).
int moe_mma_pass_rows(const MoeExpertsArgs& a) {
  auto lim = cuda_device_limits(-1);
  if (!lim.ok()) return 0;
  const size_t cap = moe_smem_cap();
  const size_t most =
      cap > 0 ? std::min(cap, lim->smem_per_block_optin) : lim->smem_per_block_optin;
  for (const int pr : {kMmaPassRows, 8})
    if (mma_dynamic_smem(a, pr) + kMmaStaticSmem <= most) return pr;
  return 0;
}

Status moe_route_cuda_device(const float* logits, const float* bias, const MoeRouteArgs& a,
                             size_t rows, int32_t* ids, float* weights, void* stream) {
  SPARK_TRY(moe_route_check(a));
  if (rows == 0) return Status::Ok();
  const size_t smem = a.n_group > 1 ? kRouteWarps * kMoeMaxExperts * sizeof(float) : 0;
  const unsigned blocks = static_cast<unsigned>((rows + kRouteWarps - 1) / kRouteWarps);
  auto go = [&](auto kernel) -> Status {
    SPARK_TRY(detail::prepare_launch(kernel, "moe_route", kRouteWarps * 32, smem));
    SPARK_CUDA_TRY(dev::launch(kernel, dim3(blocks), dim3(kRouteWarps * 32), smem,
                               static_cast<cudaStream_t>(stream), logits, bias, a, rows, ids,
                               weights));
    SPARK_CUDA_LAUNCHED("moe_route");
    return Status::Ok();
  };
  static_assert(kMoeMaxExperts <= 32 * 32, "a lane holds at most 32 experts (one bit each)");
  if (a.experts <= 128) return go(moe_route_kernel<4>);
  if (a.experts <= 256) return go(moe_route_kernel<8>);
  if (a.experts <= 512) return go(moe_route_kernel<16>);
  return go(moe_route_kernel<32>);
}

namespace {

// The weights' kind of `a`'s routed experts (FP8 or MXFP4: the instantiations that read them;
// the bf16 ones stay as they were; moe_experts_check refuses FP8 beside MXFP4).
int weights_kind(const MoeExpertsArgs& a) {
  const bool fp8 = a.gate_up_fp8.q != nullptr || a.shared_gate_up_fp8.q != nullptr;
  return a.gate_up_mx4.blocks ? kWMx4 : fp8 ? kWFp8 : kWBf16;
}

// The rows gate/up of the tensor-core decode kernels stages a pass for `a`, 0 where those
// kernels are not taken: form 3 at every row count up to kMmaMaxRows; forms 1, 2 and 4
// never. Their cost stays nearly flat in the rows while the fp32 kernels' grows. Automatic
// (form 0), as measured on an H100:
int mma_pass_rows_for(const MoeExpertsArgs& a) {
  const int kind = weights_kind(a);
  //  - gpt-oss's MXFP4 experts (their act is fp16, exact for the clamped activation's range;
  //    no shared experts) from two rows up to kMmaMaxRows, past 8 rows in place of the
  //    grouped form: 8 streams of gpt-oss-20b 1027 against 521 tokens/s, 32 streams 1468
  //    against the grouped form's 1255; at one row the fp32 kernels are faster (421 against
  //    392).
  //  - bf16 experts (whole 32-column blocks, 16-byte aligned rows; shared experts too) from 5
  //    to 8 rows, where the fp32 kernels run their 8-row instantiation: Qwen3-30B-A3B's
  //    experts at 8 rows take 242 us against 254 (5 and 8 streams: 438 and 573 against 394
  //    and 534 tokens/s), at 4 rows 137 against 126, at 2 71 against 64; past 8 rows the
  //    grouped form's tiles are faster (32 rows: 555 against 709 us; the down launch's column
  //    tiles are mostly rows that did not choose the expert there).
  //  - FP8 experts (every routed and shared matrix FP8, whole 32-column blocks, 8-byte
  //    aligned rows) from two rows up to kMmaMaxRows, past 8 rows in place of the grouped
  //    form: Qwen3-30B-A3B in FP8 at 8 streams 604 against the fp32 kernels' 325 tokens/s,
  //    at 32 streams 1108 against the grouped form's 908; at one row the fp32 kernels are
  //    faster (289 against 264).
  const bool auto_rows = kind == kWBf16 ? a.rows >= 5 && a.rows <= kMoeDecodeMaxRows : a.rows >= 2;
  const bool mma_rows = (a.form == 3 || (a.form == 0 && auto_rows)) && a.rows <= kMmaMaxRows &&
                        a.rows * a.top_k <= kDecMaxPairs;
  const bool mma_kind = kind == kWMx4
                            ? a.shared_inter == 0 && a.swiglu_limit > 0.f && a.swiglu_limit < 128.f
                        : kind == kWFp8 ? fp8_mma_fits(a)
                                        : bf16_mma_fits(a);
  return mma_rows && mma_kind ? moe_mma_pass_rows(a) : 0;
}

// moe_experts_kernels' answer, given mma_pass_rows_for(a).
int kernels_for(const MoeExpertsArgs& a, int pass_rows) {
  if (pass_rows > 0) return 3;
  return a.form == 1 || ((a.form == 0 || a.form >= 3) && a.rows <= kMoeDecodeMaxRows) ? 1 : 2;
}

}  // namespace

int moe_experts_kernels(const MoeExpertsArgs& a) {
  return kernels_for(a, mma_pass_rows_for(a));
}

Status moe_experts_cuda_device(const MoeExpertsArgs& a, void* stream) {
  SPARK_TRY(moe_experts_check(a));
  if (a.rows == 0) return Status::Ok();
  auto st = static_cast<cudaStream_t>(stream);
  const int kind = weights_kind(a);
  const int pass_rows = mma_pass_rows_for(a);
  const bool decode = kernels_for(a, pass_rows) == 1;
  if (pass_rows > 0) {
    const GroupedWs w = grouped_ws(a);
    const unsigned distinct = static_cast<unsigned>(std::min(a.rows * a.top_k, a.experts));
    const bool has_shared = kind != kWMx4 && a.shared_inter > 0;
    const size_t smem = mma_dynamic_smem(a, pass_rows);
    auto pick = [&](auto one, auto two) { return a.rows > 8 && pass_rows > 8 ? two : one; };
    auto gate_up = kind == kWMx4   ? pick(moe_gate_up_mma<1, kWMx4>, moe_gate_up_mma<2, kWMx4>)
                   : kind == kWFp8 ? pick(moe_gate_up_mma<1, kWFp8>, moe_gate_up_mma<2, kWFp8>)
                                   : pick(moe_gate_up_mma<1, kWBf16>, moe_gate_up_mma<2, kWBf16>);
    // Past 48 KiB in all the kernel's limit is raised (moe_mma_pass_rows checked it fits).
    SPARK_TRY(
        detail::prepare_launch(gate_up, "moe_gate_up_mma", kMmaWarps * 32, smem + kMmaStaticSmem));
    const unsigned ys = distinct + (has_shared ? 1u : 0u);
    if (ys > 0) {
      const int imax = std::max(a.inter, has_shared ? a.shared_inter : 0);
      const dim3 grid(static_cast<unsigned>((imax + 8 * kMmaTiles - 1) / (8 * kMmaTiles)), ys);
      SPARK_CUDA_TRY(dev::launch(gate_up, grid, dim3(kMmaWarps * 32), smem, st, a, w.act,
                                 w.act_stride, pass_rows));
      SPARK_CUDA_LAUNCHED("moe_gate_up_mma");
    }
    const int tiles = (a.rows + 7) / 8;
    auto down_for = [&](auto k1, auto k2, auto k3, auto k4) {
      return tiles <= 1 ? k1 : tiles == 2 ? k2 : tiles == 3 ? k3 : k4;
    };
    auto down = kind == kWMx4   ? down_for(moe_down_mma<1, kWMx4>, moe_down_mma<2, kWMx4>,
                                           moe_down_mma<3, kWMx4>, moe_down_mma<4, kWMx4>)
                : kind == kWFp8 ? down_for(moe_down_mma<1, kWFp8>, moe_down_mma<2, kWFp8>,
                                           moe_down_mma<3, kWFp8>, moe_down_mma<4, kWFp8>)
                                : down_for(moe_down_mma<1, kWBf16>, moe_down_mma<2, kWBf16>,
                                           moe_down_mma<3, kWBf16>, moe_down_mma<4, kWBf16>);
    SPARK_CUDA_TRY(dev::launch(down, dim3(static_cast<unsigned>((a.hidden + 15) / 16)),
                               dim3(kMmaDownWarps * 32), 0, st, a, static_cast<const bf16*>(w.act),
                               w.act_stride));
    SPARK_CUDA_LAUNCHED("moe_down_mma");
    return Status::Ok();
  }
  if (decode) {
    // act rows: pair p = row * top_k + j, then the shared experts' rows.
    const GroupedWs w = grouped_ws(a);
    const int imax = std::max(a.inter, a.shared_inter);
    const int distinct = std::min(a.rows * a.top_k, a.experts);
    const unsigned ys = static_cast<unsigned>(distinct + (a.shared_inter > 0 ? 1 : 0));
    if (ys > 0) {
      const dim3 grid(static_cast<unsigned>((imax + kDecTile - 1) / kDecTile), ys);
      auto gate_up = kind == kWMx4   ? gate_up_decode_for<kWMx4>(a.rows)
                     : kind == kWFp8 ? gate_up_decode_for<kWFp8>(a.rows)
                                     : gate_up_decode_for<kWBf16>(a.rows);
      SPARK_CUDA_TRY(
          dev::launch(gate_up, grid, dim3(kDecWarps * 32), 0, st, a, w.act, w.act_stride));
      SPARK_CUDA_LAUNCHED("moe_gate_up_decode");
    }
    const dim3 grid(static_cast<unsigned>((a.hidden + kDownRows - 1) / kDownRows));
    auto down = kind == kWMx4   ? down_decode_for<kWMx4>(a.rows)
                : kind == kWFp8 ? down_decode_for<kWFp8>(a.rows)
                                : down_decode_for<kWBf16>(a.rows);
    SPARK_CUDA_TRY(dev::launch(down, grid, dim3(kDecWarps * 32), 0, st, a,
                               static_cast<const bf16*>(w.act), w.act_stride));
    SPARK_CUDA_LAUNCHED("moe_down_decode");
    return Status::Ok();
  }
  const GroupedWs w = grouped_ws(a);
  const size_t plan_smem = sizeof(int) * static_cast<size_t>(2 * w.groups + 1);
  SPARK_TRY(detail::prepare_launch(moe_plan_grouped, "moe_plan_grouped", 1024, plan_smem));
  SPARK_CUDA_TRY(dev::launch(moe_plan_grouped, dim3(1), dim3(1024), plan_smem, st, a, w));
  SPARK_CUDA_LAUNCHED("moe_plan_grouped");
  // Tiles: at most one partial tile per group beyond the pairs' full tiles.
  const unsigned tiles = static_cast<unsigned>((w.pairs + kGBM - 1) / kGBM + w.groups);
  const int imax = std::max(a.inter, a.shared_inter);
  SPARK_CUDA_TRY(dev::launch(kind == kWMx4   ? moe_grouped_product<true, kWMx4>
                             : kind == kWFp8 ? moe_grouped_product<true, kWFp8>
                                             : moe_grouped_product<true, kWBf16>,
                             dim3(tiles, static_cast<unsigned>((imax + kGBN / 2 - 1) / (kGBN / 2))),
                             dim3(kGThreads), 0, st, a, w));
  SPARK_CUDA_LAUNCHED("moe_grouped_product<gate_up>");
  SPARK_CUDA_TRY(dev::launch(kind == kWMx4   ? moe_grouped_product<false, kWMx4>
                             : kind == kWFp8 ? moe_grouped_product<false, kWFp8>
                                             : moe_grouped_product<false, kWBf16>,
                             dim3(tiles, static_cast<unsigned>((a.hidden + kGBN - 1) / kGBN)),
                             dim3(kGThreads), 0, st, a, w));
  SPARK_CUDA_LAUNCHED("moe_grouped_product<down>");
  const size_t total = static_cast<size_t>(a.rows) * static_cast<size_t>(a.hidden);
  const unsigned cblocks = static_cast<unsigned>(std::min<size_t>((total + 255) / 256, 4096));
  SPARK_CUDA_TRY(dev::launch(moe_combine_grouped, dim3(cblocks), dim3(256), 0, st, a, w));
  SPARK_CUDA_LAUNCHED("moe_combine_grouped");
  return Status::Ok();
}

}  // namespace spark::kernels
