// Multi-head latent attention (DeepSeek-V3) on the GPU, over a paged latent cache of rows of
// latent + rope values. Four launches per layer (five past kOutCombine ranges): the heads'
// q_nope go into the latent space through kv_b_proj's key rows (with q_pe rotated), each
// token's kv_a row is normalised, rotated and written to the cache, the heads attend over
// ranges of the context (a block per token, group of heads and range, each cache row read
// once for the group; as many ranges as fill the GPU, mla_splits), and the ranges' partials
// are combined (past kOutCombine ranges by a launch of their own) and taken out through
// kv_b_proj's value rows. The CPU twin is mla_ref.cc; fp32 accumulation everywhere.
//
// The attention has two kernels writing the same partials. For a bf16 cache of latent 512
// (DeepSeek-V3's 576-value rows) the tensor-core one: groups of up to 64 heads are the M
// dimension of mma.sync m16n8k16 (bf16 in, fp32 accumulation), S = Q K^T over the whole row
// and O += P V over its first 512 values, with the latent query and the softmax weights
// rounded to bf16 (at 128 heads a decode token does about 280 KFLOP a cache position, which
// the scalar kernel could not keep up with the row's bytes). Otherwise (an f32 cache, other
// widths, MlaCudaArgs::scalar_attention) the scalar fp32 kernel, groups of 4 heads.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/mla.h"

namespace spark::kernels {
namespace {

using dev::bf16;

constexpr int kThreads = 256;
constexpr int kTokGroup = 8;   // tokens per block of the absorbed products
constexpr int kFewTokens = 4;  // fewer tokens than this: the products a token per block
constexpr int kHeadGroup = 4;  // heads per attention block
constexpr int kTile = 16;      // cache rows per attention tile
constexpr size_t kSmemLimit = 48 * 1024;
// Ranges the output product combines itself; past them the combine is a launch of its own.
constexpr int kOutCombine = 32;
static_assert(kTokGroup <= kThreads / 32, "the combine's weights take a warp per token");
static_assert(kMlaMaxSplits % 32 == 0, "the combine's weights take a lane per range");
static_assert(kOutCombine % 32 == 0 && kOutCombine <= kMlaMaxSplits);

struct Dims {
  int heads, nope, rope, v_dim, latent, width, splits;
};

__device__ __forceinline__ void rotate(float* x, int rope, int pos, const float* inv_freq,
                                       bool interleave, float factor, int i) {
  const int half = rope / 2;
  const float a = static_cast<float>(pos) * inv_freq[i];
  const float c = cosf(a) * factor, s = sinf(a) * factor;
  const int i0 = interleave ? 2 * i : i, i1 = interleave ? 2 * i + 1 : i + half;
  const float a0 = x[i0], a1 = x[i1];
  x[i0] = a0 * c - a1 * s;
  x[i1] = a1 * c + a0 * s;
}

// Latent columns per block of the query's absorbed product: 8 lanes of 8 columns (16 bytes of
// a W_UK row each), the warp's 4 groups of 8 lanes and the block's 8 warps on 32 rows at a
// time, so a block reads its slice of every W_UK row once with 16-byte loads.
constexpr int kQCols = 64;

// Block (head, group of TG tokens (kTokGroup, or 1 for a decode step of few tokens), slice of
// kQCols latent columns): q_lat[t][h] over the slice = q_nope W_UK (fp32), the rows' partial sums
// met by shuffles and in shared memory; the slice-0 block also rotates q_pe (written back to q in
// bf16 and, fp32, after the latent in the workspace row).
template <int TG>
__global__ void __launch_bounds__(kThreads)
    mla_q_kernel(bf16* __restrict__ q, const bf16* __restrict__ kv_b,
                 const float* __restrict__ inv_freq, const int32_t* __restrict__ pos,
                 size_t n_tokens, Dims d, bool interleave, float factor, float* __restrict__ qlat,
                 bf16* __restrict__ qlat16) {
  dev::pdl_wait();
  dev::pdl_trigger();
  extern __shared__ float sm[];  // [TG][nope + rope], then [8 warps][TG][kQCols]
  const int h = blockIdx.x, qk = d.nope + d.rope;
  const bool first = blockIdx.z == 0;
  const size_t t0 = static_cast<size_t>(blockIdx.y) * TG;
  const int nt = static_cast<int>(min(static_cast<size_t>(TG), n_tokens - t0));
  // Only the slice-0 block reads (and rewrites) q_pe; the others read q_nope alone.
  const int width = first ? qk : d.nope;
  for (int k = 0; k < TG; ++k) {
    const bf16* src = q + ((t0 + k) * d.heads + h) * static_cast<size_t>(qk);
    for (int i = threadIdx.x; i < width; i += blockDim.x)
      sm[k * qk + i] = k < nt ? __bfloat162float(src[i]) : 0.f;
  }
  __syncthreads();
  if (first) {
    for (int k = 0; k < nt; ++k)
      for (int i = threadIdx.x; i < d.rope / 2; i += blockDim.x)
        rotate(sm + k * qk + d.nope, d.rope, pos[t0 + k], inv_freq, interleave, factor, i);
    __syncthreads();
    for (int k = 0; k < nt; ++k) {
      const size_t row = (t0 + k) * d.heads + h;
      bf16* dst = q + row * static_cast<size_t>(qk) + d.nope;
      float* ql = qlat + row * static_cast<size_t>(d.width) + d.latent;
      for (int i = threadIdx.x; i < d.rope; i += blockDim.x) {
        const float v = sm[k * qk + d.nope + i];
        dst[i] = __float2bfloat16_rn(v);
        ql[i] = v;
        if (qlat16) qlat16[row * static_cast<size_t>(d.width) + d.latent + i] = dst[i];
      }
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int col = static_cast<int>(blockIdx.z) * kQCols + (lane & 7) * 8;
  const int rg = warp * 4 + (lane >> 3);  // row group: rows rg, rg + 32, ...
  const bool live = col < d.latent;
  const bf16* wk = kv_b + static_cast<size_t>(h) * (d.nope + d.v_dim) * d.latent;
  float acc[TG][8];
#pragma unroll
  for (int k = 0; k < TG; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[k][e] = 0.f;
  if (live) {
#pragma unroll 4
    for (int i = rg; i < d.nope; i += 32) {
      float w[8];
      dev::bf16x8_to_f(
          __ldg(reinterpret_cast<const uint4*>(wk + static_cast<size_t>(i) * d.latent + col)), w);
#pragma unroll
      for (int k = 0; k < TG; ++k) {
        const float x = sm[k * qk + i];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[k][e] = fmaf(x, w[e], acc[k][e]);
      }
    }
  }
  // The warp's 4 row groups (lanes 8 apart), then the 8 warps in shared memory.
#pragma unroll
  for (int k = 0; k < TG; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      acc[k][e] += __shfl_xor_sync(0xffffffffu, acc[k][e], 8);
      acc[k][e] += __shfl_xor_sync(0xffffffffu, acc[k][e], 16);
    }
  float* red = sm + TG * qk;
  if (lane < 8)
#pragma unroll
    for (int k = 0; k < TG; ++k)
#pragma unroll
      for (int e = 0; e < 8; ++e) red[(warp * TG + k) * kQCols + lane * 8 + e] = acc[k][e];
  __syncthreads();
  for (int i = threadIdx.x; i < nt * kQCols; i += blockDim.x) {
    const int k = i / kQCols, c = i - k * kQCols;
    const int gc = static_cast<int>(blockIdx.z) * kQCols + c;
    if (gc >= d.latent) continue;
    float v = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) v += red[(w * TG + k) * kQCols + c];
    const size_t at = ((t0 + k) * d.heads + h) * static_cast<size_t>(d.width) + gc;
    qlat[at] = v;
    if (qlat16) qlat16[at] = __float2bfloat16_rn(v);
  }
}

// Block per token: kv_a's latent RMS-normalised times the norm, k_pe rotated, both back into
// kv_a and into the cache row at slots[t].
template <typename C>
__global__ void mla_kv_kernel(bf16* __restrict__ kv_a, const bf16* __restrict__ norm, float eps,
                              const float* __restrict__ inv_freq, const int32_t* __restrict__ pos,
                              const int32_t* __restrict__ slots, long long pool_slots,
                              size_t n_tokens, Dims d, bool interleave, float factor,
                              C* __restrict__ cache) {
  dev::pdl_wait();
  dev::pdl_trigger();
  extern __shared__ float sm[];  // [width] + 33 scratch
  float* scratch = sm + d.width;
  for (size_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
    bf16* r = kv_a + t * static_cast<size_t>(d.width);
    float ss = 0.f;
    for (int i = threadIdx.x; i < d.width; i += blockDim.x) {
      const float v = __bfloat162float(r[i]);
      sm[i] = v;
      if (i < d.latent) ss += v * v;
    }
    ss = dev::block_sum(ss, scratch);
    const float inv = rsqrtf(ss / static_cast<float>(d.latent) + eps);
    for (int i = threadIdx.x; i < d.latent; i += blockDim.x)
      sm[i] = sm[i] * inv * __bfloat162float(norm[i]);
    for (int i = threadIdx.x; i < d.rope / 2; i += blockDim.x)
      rotate(sm + d.latent, d.rope, pos[t], inv_freq, interleave, factor, i);
    __syncthreads();
    const int32_t slot = slots[t];
    const bool keep = slot >= 0 && slot < pool_slots;
    for (int i = threadIdx.x; i < d.width; i += blockDim.x) {
      r[i] = __float2bfloat16_rn(sm[i]);
      if (keep) cache[static_cast<size_t>(slot) * d.width + i] = dev::from_f<C>(sm[i]);
    }
    __syncthreads();
  }
}

// The positions [*j0, *j1) of range s of a token's n_ctx ones: the context shared out evenly
// over `splits` ranges (not the bound's max_seq_len, so that a short context in a graph
// captured for long ones still spreads over the ranges), each at least kMlaMinRange positions
// and rounded up to whole tiles of `tile` rows (one range: all of them). Ranges past the
// context are empty (j0 == j1).
__device__ __forceinline__ void context_range(int n_ctx, int s, int splits, int tile, int* j0,
                                              int* j1) {
  *j0 = 0, *j1 = n_ctx;
  if (splits > 1) {
    int len = max((n_ctx + splits - 1) / splits, kMlaMinRange);
    len = (len + tile - 1) / tile * tile;
    *j0 = min(s * len, n_ctx);
    *j1 = min(*j0 + len, n_ctx);
  }
}

__device__ __forceinline__ int seq_of(const int32_t* qs, int n_seqs, int t) {
  int lo = 0, hi = n_seqs - 1;  // the last s with qs[s] <= t
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (qs[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Block (token, group of kHeadGroup heads, range): online softmax over the range's cache
// rows, a tile of kTile rows in shared memory at a time, shared by the group's heads. Writes
// the range's partial (max, sum, unnormalised latent context) per head.
template <typename C>
__global__ void mla_attend_kernel(const float* __restrict__ qlat, const C* __restrict__ cache,
                                  const int32_t* __restrict__ tables, int table_w, int block_size,
                                  const int32_t* __restrict__ pos, const int32_t* __restrict__ qs,
                                  int n_seqs, float scale, Dims d, float* __restrict__ part) {
  dev::pdl_wait();
  dev::pdl_trigger();
  extern __shared__ float sm[];
  const int W = d.width, L = d.latent;
  float* qsm = sm;                                      // [kHeadGroup][W]
  float* osm = qsm + kHeadGroup * W;                    // [kHeadGroup][L]
  float* sc = osm + kHeadGroup * L;                     // [kHeadGroup][kTile]
  float* ml = sc + kHeadGroup * kTile;                  // m, l, alpha per head: [3][kHeadGroup]
  C* tile = reinterpret_cast<C*>(ml + 3 * kHeadGroup);  // [kTile][W]
  const int t = blockIdx.x, h0 = blockIdx.y * kHeadGroup, s = blockIdx.z;
  const int hn = min(kHeadGroup, d.heads - h0);
  const int seq = seq_of(qs, n_seqs, t);
  const int32_t* table = tables + static_cast<size_t>(seq) * table_w;
  int j0, j1;
  context_range(pos[t] + 1, s, d.splits, kTile, &j0, &j1);
  const size_t P = static_cast<size_t>(L) + kMlaPartHead;
  if (j0 >= j1) {  // an empty range: its maximum and sum alone (the combine passes over it)
    for (int hh = threadIdx.x; hh < hn; hh += blockDim.x) {
      float* o = part + ((static_cast<size_t>(t) * d.heads + h0 + hh) * d.splits + s) * P;
      o[0] = -INFINITY;
      o[1] = 0.f;
    }
    return;
  }
  for (int i = threadIdx.x; i < hn * W; i += blockDim.x)
    qsm[i] = qlat[(static_cast<size_t>(t) * d.heads + h0) * W + i];
  for (int i = threadIdx.x; i < hn * L; i += blockDim.x) osm[i] = 0.f;
  if (threadIdx.x < kHeadGroup) {
    ml[threadIdx.x] = -INFINITY;
    ml[kHeadGroup + threadIdx.x] = 0.f;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int jt = j0; jt < j1; jt += kTile) {
    const int nr = min(kTile, j1 - jt);
    for (int i = threadIdx.x; i < nr * W; i += blockDim.x) {
      const int r = i / W, c = i - r * W, p = jt + r;
      const size_t slot = static_cast<size_t>(table[p / block_size]) * block_size + p % block_size;
      tile[i] = cache[slot * W + c];
    }
    __syncthreads();
    for (int pr = warp; pr < hn * nr; pr += nw) {
      const int hh = pr / nr, r = pr - hh * nr;
      const float* qh = qsm + hh * W;
      const C* row = tile + r * W;
      float dot = 0.f;
      for (int c = lane; c < W; c += 32) dot += qh[c] * dev::to_f(row[c]);
      dot = dev::warp_sum(dot);
      if (lane == 0) sc[hh * kTile + r] = dot * scale;
    }
    __syncthreads();
    if (threadIdx.x < hn) {
      const int hh = threadIdx.x;
      float mt = ml[hh];
      for (int r = 0; r < nr; ++r) mt = fmaxf(mt, sc[hh * kTile + r]);
      const float alpha = expf(ml[hh] - mt);
      float sum = 0.f;
      for (int r = 0; r < nr; ++r) {
        const float p = expf(sc[hh * kTile + r] - mt);
        sc[hh * kTile + r] = p;
        sum += p;
      }
      ml[hh] = mt;
      ml[kHeadGroup + hh] = ml[kHeadGroup + hh] * alpha + sum;
      ml[2 * kHeadGroup + hh] = alpha;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hn * L; i += blockDim.x) {
      const int hh = i / L, c = i - hh * L;
      float acc = osm[i] * ml[2 * kHeadGroup + hh];
      for (int r = 0; r < nr; ++r) acc += sc[hh * kTile + r] * dev::to_f(tile[r * W + c]);
      osm[i] = acc;
    }
    __syncthreads();
  }
  for (int hh = 0; hh < hn; ++hh) {
    float* o = part + ((static_cast<size_t>(t) * d.heads + h0 + hh) * d.splits + s) * P;
    if (threadIdx.x == 0) {
      o[0] = ml[hh];
      o[1] = ml[kHeadGroup + hh];
    }
    for (int c = threadIdx.x; c < L; c += blockDim.x) o[kMlaPartHead + c] = osm[hh * L + c];
  }
}

// ---- the tensor-core attention (bf16 cache) ------------------------------------------

constexpr int kTcLatent = 512;          // the latent width it is built for (DeepSeek-V3's)
constexpr int kTcRows = 32;             // cache rows per tile
constexpr int kTcPPitch = kTcRows + 8;  // P's row pitch (bf16): 80 bytes, ldmatrix conflict-free

// Shared memory of the tensor-core kernel with MT tiles of 16 heads: the heads' queries and
// two tiles of cache rows (bf16, rows W + 8 apart: 16 bytes past a multiple of 128, so the
// eight rows an ldmatrix reads fall in distinct banks), the softmax weights P, and one float
// per head and half (the tile's half maxima, at the end the half sums).
size_t attend_tc_smem(int mt, int W) {
  const size_t P = static_cast<size_t>(W) + 8, heads = static_cast<size_t>(16 * mt);
  return (heads * P + 2 * kTcRows * P + heads * kTcPPitch) * sizeof(bf16) +
         2 * heads * sizeof(float);
}

// Block (token, group of 16 MT heads, range), 2 MT warps: the same partials as
// mla_attend_kernel, the products on the tensor cores (mma.sync m16n8k16, bf16 in, fp32
// accumulation). The heads' latent queries are rounded to bf16 into shared memory once; tiles
// of kTcRows cache rows come in through the block table by cp.async, double-buffered (rows
// past the range zero-filled). Warp w takes the 16 heads of tile w % MT and half w / MT: S =
// Q K^T for its half of the tile's rows (K = latent + rope, fragments by ldmatrix), the two
// halves' row maxima meet in shared memory, each writes its weights P = exp(S - max) as bf16
// there, and O += P V for its half of the latent columns (V the same rows' first 512 values,
// by ldmatrix.trans) over all the tile's rows: 128 fp32 accumulators a lane. Heads past the
// shape's are zero queries whose partials are not written.
template <int MT>
__global__ void __launch_bounds__(64 * MT)
    mla_attend_tc_kernel(const bf16* __restrict__ qlat16, const bf16* __restrict__ cache,
                         const int32_t* __restrict__ tables, int table_w, int block_size,
                         const int32_t* __restrict__ pos, const int32_t* __restrict__ qs,
                         int n_seqs, float scale, Dims d, float* __restrict__ part) {
  constexpr int HG = 16 * MT, NT = 64 * MT, L = kTcLatent, BN = kTcRows, PP = kTcPPitch;
  constexpr int NJ = L / 2 / 8;  // n-tiles of O a warp owns
  dev::pdl_wait();
  dev::pdl_trigger();
  extern __shared__ __align__(16) unsigned char tc_sm[];
  const int W = d.width, P = W + 8;
  bf16* q_s = reinterpret_cast<bf16*>(tc_sm);            // [HG][P]
  bf16* kv_s = q_s + HG * P;                             // [2][BN][P]
  bf16* p_s = kv_s + 2 * BN * P;                         // [HG][PP]
  float* red = reinterpret_cast<float*>(p_s + HG * PP);  // [2][HG]
  const int t = blockIdx.x, h0 = blockIdx.y * HG, s = blockIdx.z;
  const int hn = min(HG, d.heads - h0);
  const int seq = seq_of(qs, n_seqs, t);
  const int32_t* table = tables + static_cast<size_t>(seq) * table_w;
  int j0, j1;
  context_range(pos[t] + 1, s, d.splits, BN, &j0, &j1);
  const size_t PW = static_cast<size_t>(L) + kMlaPartHead;
  if (j0 >= j1) {  // an empty range: its maximum and sum alone (the combine passes over it)
    for (int hh = threadIdx.x; hh < hn; hh += NT) {
      float* out = part + ((static_cast<size_t>(t) * d.heads + h0 + hh) * d.splits + s) * PW;
      out[0] = -INFINITY;
      out[1] = 0.f;
    }
    return;
  }
  const int chunks = W / 8;  // 16-byte pieces of a row
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // A warp per row at a time, the lanes its pieces (the index arithmetic of a piece per thread
  // was most of the kernel's instructions). The tile's slots are looked up once a warp, lane l
  // row jt + l, and shuffled to the row's warp: looked up a row at a time, each of a warp's
  // rows waited for its table read before its copies went out (16 in turn a tile at 16 heads).
  static_assert(BN == 32, "a lane per row of the tile looks up its slot");
  auto issue_tile = [&](int jt, int buf) {
    bf16* dst = kv_s + buf * BN * P;
    const int pl = jt + lane;
    long long mine = -1;
    if (pl < j1)
      mine = static_cast<long long>(table[pl / block_size]) * block_size + pl % block_size;
    for (int r = warp; r < BN; r += NT / 32) {
      const long long slot = __shfl_sync(0xffffffffu, mine, r);
      const bool ok = slot >= 0;
      const bf16* row = ok ? cache + static_cast<size_t>(slot) * W : cache;
      for (int c = lane; c < chunks; c += 32)
        dev::cp_async16(dst + r * P + c * 8, ok ? row + c * 8 : cache, ok);
    }
    dev::cp_async_commit();
  };
  issue_tile(j0, 0);
  // The heads' latent queries, as mla_q_kernel rounded them to bf16, by cp.async behind the
  // first tile (the loop's first wait takes both); heads past the shape's zero-filled. (They
  // were read as fp32 and rounded here: twice the bytes, and at 64 heads a range's reads of
  // them were as many as four tiles' of cache rows.)
  {
    const bf16* qsrc = qlat16 + (static_cast<size_t>(t) * d.heads + h0) * W;
    for (int i = threadIdx.x; i < HG * chunks; i += NT) {
      const int hh = i / chunks, c = i - hh * chunks;
      const bool ok = hh < hn;
      dev::cp_async16(q_s + hh * P + c * 8, ok ? qsrc + hh * W + c * 8 : qsrc, ok);
    }
    dev::cp_async_commit();
  }

  const int mt = warp % MT, hf = warp / MT;
  const int g = lane >> 2, tg = lane & 3;  // fragment row (head) and column pair
  // ldmatrix row addresses: A (Q, P) rows mt*16 + lane % 16, columns + 8 for lanes 16..31;
  // K rows (B of S, n-tile pairs) and V rows (B of P V, transposed).
  const bf16* qa = q_s + (mt * 16 + (lane & 15)) * P + (lane >> 4) * 8;
  const bf16* pa = p_s + (mt * 16 + (lane & 15)) * PP + (lane >> 4) * 8;
  const int krow = hf * 16 + (lane >> 4) * 8 + (lane & 7), kcol = ((lane >> 3) & 1) * 8;
  const int vrow = ((lane >> 3) & 1) * 8 + (lane & 7), vcol = hf * (L / 2) + (lane >> 4) * 8;
  float o[NJ][4];
#pragma unroll
  for (int j = 0; j < NJ; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;  // heads g and g + 8 of the tile

  int buf = 0;
  for (int jt = j0; jt < j1; jt += BN, buf ^= 1) {
    if (jt + BN < j1) {
      issue_tile(jt + BN, buf ^ 1);
      dev::cp_async_wait<1>();
    } else {
      dev::cp_async_wait<0>();
    }
    __syncthreads();  // tile `buf` (and the queries, the first time) in shared memory
    const bf16* kv = kv_s + buf * BN * P;

    // S = Q K^T, 16 heads x this half's 16 rows.
    // Two accumulators per n-tile (even and odd k-steps, added at the end): half the chain
    // of dependent products.
    float sc[2][4] = {}, sc2[2][4] = {};
    const bf16* kb = kv + krow * P + kcol;
    const int ksteps = W / 16;
#pragma unroll 2
    for (int kk = 0; kk + 1 < ksteps; kk += 2) {
      uint32_t a[4], b[4], a2[4], b2[4];
      dev::ldsm_x4(a, qa + kk * 16);
      dev::ldsm_x4(b, kb + kk * 16);
      dev::ldsm_x4(a2, qa + kk * 16 + 16);
      dev::ldsm_x4(b2, kb + kk * 16 + 16);
      dev::mma_bf16_16816(sc[0], a, b[0], b[1]);
      dev::mma_bf16_16816(sc[1], a, b[2], b[3]);
      dev::mma_bf16_16816(sc2[0], a2, b2[0], b2[1]);
      dev::mma_bf16_16816(sc2[1], a2, b2[2], b2[3]);
    }
    if (ksteps % 2 != 0) {
      uint32_t a[4], b[4];
      dev::ldsm_x4(a, qa + (ksteps - 1) * 16);
      dev::ldsm_x4(b, kb + (ksteps - 1) * 16);
      dev::mma_bf16_16816(sc[0], a, b[0], b[1]);
      dev::mma_bf16_16816(sc[1], a, b[2], b[3]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[j][e] += sc2[j][e];
    // Scale, mask the rows past the range, this half's maxima.
    const int r0 = jt + hf * 16 + tg * 2;
    float xA = -INFINITY, xB = -INFINITY;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool ok = r0 + j * 8 + e < j1;
        sc[j][e] = ok ? sc[j][e] * scale : -INFINITY;
        sc[j][2 + e] = ok ? sc[j][2 + e] * scale : -INFINITY;
        xA = fmaxf(xA, sc[j][e]);
        xB = fmaxf(xB, sc[j][2 + e]);
      }
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
      xA = fmaxf(xA, __shfl_xor_sync(0xffffffffu, xA, o2));
      xB = fmaxf(xB, __shfl_xor_sync(0xffffffffu, xB, o2));
    }
    if (tg == 0) {
      red[hf * HG + mt * 16 + g] = xA;
      red[hf * HG + mt * 16 + g + 8] = xB;
    }
    __syncthreads();
    // Both halves take the same maximum (the tile's first row is in range: finite), so the
    // same rescale; each keeps the sum of its own rows' weights.
    const float nA = fmaxf(mA, fmaxf(red[mt * 16 + g], red[HG + mt * 16 + g]));
    const float nB = fmaxf(mB, fmaxf(red[mt * 16 + g + 8], red[HG + mt * 16 + g + 8]));
    const float alA = __expf(mA - nA), alB = __expf(mB - nB);
    mA = nA, mB = nB;
    float sumA = 0.f, sumB = 0.f;
    bf16* pw = p_s + (mt * 16 + g) * PP + hf * 16 + tg * 2;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // The weights as the product takes them (bf16), summed as rounded, so the output is
      // their exact convex combination.
      const __nv_bfloat162 wa = __floats2bfloat162_rn(__expf(sc[j][0] - nA), __expf(sc[j][1] - nA));
      const __nv_bfloat162 wb = __floats2bfloat162_rn(__expf(sc[j][2] - nB), __expf(sc[j][3] - nB));
      *reinterpret_cast<__nv_bfloat162*>(pw + j * 8) = wa;
      *reinterpret_cast<__nv_bfloat162*>(pw + 8 * PP + j * 8) = wb;
      sumA += __low2float(wa) + __high2float(wa);
      sumB += __low2float(wb) + __high2float(wb);
    }
    lA = lA * alA + sumA;
    lB = lB * alB + sumB;
#pragma unroll
    for (int j = 0; j < NJ; ++j) o[j][0] *= alA, o[j][1] *= alA, o[j][2] *= alB, o[j][3] *= alB;
    __syncthreads();  // both halves' P in shared memory

    // O += P V over the tile's rows, this half's columns.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      dev::ldsm_x4(a, pa + kk * 16);
      const bf16* vb = kv + (kk * 16 + vrow) * P + vcol;
#pragma unroll
      for (int j = 0; j < NJ; j += 2) {
        uint32_t b[4];
        dev::ldsm_x4_trans(b, vb + j * 8);
        dev::mma_bf16_16816(o[j], a, b[0], b[1]);
        dev::mma_bf16_16816(o[j + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp done with tile `buf`, P and the maxima before reuse
  }

  // The sums over the quad, then the two halves'.
#pragma unroll
  for (int o2 = 1; o2 <= 2; o2 <<= 1) {
    lA += __shfl_xor_sync(0xffffffffu, lA, o2);
    lB += __shfl_xor_sync(0xffffffffu, lB, o2);
  }
  if (tg == 0) {
    red[hf * HG + mt * 16 + g] = lA;
    red[hf * HG + mt * 16 + g + 8] = lB;
  }
  __syncthreads();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int hh = mt * 16 + g + 8 * half;
    if (hh >= hn) continue;
    float* out = part + ((static_cast<size_t>(t) * d.heads + h0 + hh) * d.splits + s) * PW;
    if (hf == 0 && tg == 0) {
      out[0] = half == 0 ? mA : mB;
      out[1] = red[hh] + red[HG + hh];
    }
    // (A range's partial row is 516 floats, its context from the fifth: each pair below
    // starts 8-byte aligned.)
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int c = hf * (L / 2) + j * 8 + tg * 2;
      *reinterpret_cast<float2*>(out + kMlaPartHead + c) =
          make_float2(o[j][2 * half], o[j][2 * half + 1]);
    }
  }
}

// Value rows per block of the output product: where it combines the ranges itself, 64 (each
// block repeats the combine); given the combined contexts, 16 (more blocks: at 16 heads 64 rows
// a block left 32 blocks to read W_UV).
constexpr int kOutRows = 64, kOutRowsCombined = 16;
static_assert(kOutRows % (kThreads / 32) == 0 && kOutRowsCombined % (kThreads / 32) == 0,
              "the output's rows are shared out evenly by warp");

// A warp's weights of a head's ranges (partials pr, P floats apart), a lane per range (the
// ranges' maxima and sums read at once, not one dependent load after another): w[s] =
// exp(m_s - M) with M the largest maximum, 0 for an empty range (sum 0; every token has a
// row, so not every range is). Returns sum_s w[s] l_s, on every lane.
template <int MAXS>
__device__ __forceinline__ float range_weights(const float* pr, size_t P, int splits, float* w) {
  const int lane = threadIdx.x & 31;
  float m[MAXS / 32], l[MAXS / 32];
  float M = -INFINITY;
#pragma unroll
  for (int j = 0; j < MAXS / 32; ++j) {
    const int s = lane + 32 * j;
    m[j] = s < splits ? pr[s * P] : -INFINITY;
    l[j] = s < splits ? pr[s * P + 1] : 0.f;
    if (l[j] > 0.f) M = fmaxf(M, m[j]);
  }
  M = dev::warp_max(M);
  float den = 0.f;
#pragma unroll
  for (int j = 0; j < MAXS / 32; ++j) {
    const int s = lane + 32 * j;
    const float e = l[j] > 0.f ? expf(m[j] - M) : 0.f;
    den += e * l[j];
    if (s < splits) w[s] = e;
  }
  return dev::warp_sum(den);
}

// Latent columns per block of the ranges' own combine (over kOutCombine ranges).
constexpr int kCombineCols = 128;
static_assert(kCombineCols == 32 * 4, "a lane per four columns");

// Block (token, head, slice of kCombineCols latent columns), 8 warps: the ranges' weights (warp
// 0), then warp w sums ranges w, w + 8, ... over the slice (four columns a lane, 16-byte loads),
// passing over the empty ones, and the warps' sums meet in shared memory in order, over the
// weights' sum. The latent context goes to ctx ([token][head][latent], over the latent queries,
// which the attention has finished reading). Each head's partials are read once, spread over
// latent / kCombineCols blocks (a block per head reading them all took microseconds at 16
// heads of 256 ranges).
__global__ void __launch_bounds__(kThreads)
    mla_combine_kernel(const float* __restrict__ part, Dims d, float* __restrict__ ctx) {
  dev::pdl_wait();
  dev::pdl_trigger();
  constexpr int NW = kThreads / 32;
  __shared__ float wsm[kMlaMaxSplits];
  __shared__ float dsm;
  __shared__ float4 red[NW][32];
  const size_t t = blockIdx.x;
  const int h = blockIdx.y, L = d.latent;
  const size_t P = static_cast<size_t>(L) + kMlaPartHead;
  const float* pr = part + (t * d.heads + h) * d.splits * P;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) {
    const float den = range_weights<kMlaMaxSplits>(pr, P, d.splits, wsm);
    if (lane == 0) dsm = den;
  }
  __syncthreads();
  const int c = static_cast<int>(blockIdx.z) * kCombineCols + lane * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (c < L) {
#pragma unroll 4
    for (int s = warp; s < d.splits; s += NW) {
      const float w = wsm[s];
      if (w == 0.f) continue;  // empty (its context was never written) or weightless
      const float4 v = *reinterpret_cast<const float4*>(pr + s * P + kMlaPartHead + c);
      acc.x = fmaf(w, v.x, acc.x);
      acc.y = fmaf(w, v.y, acc.y);
      acc.z = fmaf(w, v.z, acc.z);
      acc.w = fmaf(w, v.w, acc.w);
    }
  }
  red[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && c < L) {
    float4 sum = red[0][lane];
#pragma unroll
    for (int w = 1; w < NW; ++w) {
      const float4 v = red[w][lane];
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    const float den = dsm;
    *reinterpret_cast<float4*>(ctx + (t * d.heads + h) * L + c) =
        make_float4(sum.x / den, sum.y / den, sum.z / den, sum.w / den);
  }
}

// Block (head, group of TG tokens, ROWS value rows): the latent context, either combined
// here from at most kOutCombine ranges' partials (each of the head's blocks combines them: the
// partials are L2-hot and small beside W_UV; the weights first, a warp per token, then each
// column's sum over the ranges with its loads unrolled) or, where `ctx` is given, as
// mla_combine_kernel wrote it; then out = ctx W_UV^T over the block's rows: a warp per row at
// a time, each lane 8 columns (16 bytes) of it per step, the group's tokens together.
template <int TG, int ROWS>
__global__ void __launch_bounds__(kThreads)
    mla_out_kernel(const float* __restrict__ part, const float* __restrict__ ctx,
                   const bf16* __restrict__ kv_b, size_t n_tokens, Dims d, bf16* __restrict__ out) {
  dev::pdl_wait();
  dev::pdl_trigger();
  extern __shared__ __align__(16) float out_sm[];  // [TG][latent]
  __shared__ float wsm[TG][kOutCombine];           // exp(m_s - M) of each range, 0 if empty
  __shared__ float dsm[TG];                        // the weights' sum with the ranges' sums
  const int h = blockIdx.x, L = d.latent;
  const size_t t0 = static_cast<size_t>(blockIdx.y) * TG;
  const int nt = static_cast<int>(min(static_cast<size_t>(TG), n_tokens - t0));
  if (ctx != nullptr) {
    for (int k = 0; k < nt; ++k)
      for (int c = threadIdx.x; c < L; c += blockDim.x)
        out_sm[k * L + c] = ctx[((t0 + k) * d.heads + h) * L + c];
  } else {
    const size_t P = static_cast<size_t>(L) + kMlaPartHead;
    {
      const int lane = threadIdx.x & 31, k = threadIdx.x >> 5;
      if (k < nt) {
        const float den = range_weights<kOutCombine>(part + ((t0 + k) * d.heads + h) * d.splits * P,
                                                     P, d.splits, wsm[k]);
        if (lane == 0) dsm[k] = den;
      }
    }
    __syncthreads();
    for (int k = 0; k < nt; ++k) {
      const float* pr = part + ((t0 + k) * d.heads + h) * d.splits * P + kMlaPartHead;
      const float den = dsm[k];
      for (int c = threadIdx.x; c < L; c += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8
        for (int s = 0; s < d.splits; ++s) {
          const float w = wsm[k][s];
          // An empty range's context was never written (its weight is 0).
          if (w != 0.f) acc = fmaf(w, pr[s * P + c], acc);
        }
        out_sm[k * L + c] = acc / den;
      }
    }
  }
  for (int k = nt; k < TG; ++k)
    for (int c = threadIdx.x; c < L; c += blockDim.x) out_sm[k * L + c] = 0.f;
  __syncthreads();
  const bf16* wv = kv_b + (static_cast<size_t>(h) * (d.nope + d.v_dim) + d.nope) * L;
  // Warp w takes rows v0 + w, v0 + w + 8, ..., RF of them at a time: all their 16 bytes at a
  // column step are read before any is used (a row at a time left one load in flight per
  // lane). A group of tokens keeps two rows in flight: its accumulators are TG times more.
  constexpr int NW = kThreads / 32, RPW = ROWS / NW, RF = TG == 1 ? RPW : 2;
  static_assert(RPW % RF == 0, "whole batches of rows per warp");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int rb = 0; rb < RPW; rb += RF) {
    const int v0 = static_cast<int>(blockIdx.z) * ROWS + warp + rb * NW;
    float acc[RF][TG] = {};
    for (int c = lane * 8; c < L; c += 256) {
      uint4 wr[RF];
#pragma unroll
      for (int r = 0; r < RF; ++r) {
        const int v = v0 + r * NW;
        wr[r] = v < d.v_dim
                    ? __ldg(reinterpret_cast<const uint4*>(wv + static_cast<size_t>(v) * L + c))
                    : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int r = 0; r < RF; ++r) {
        float w[8];
        dev::bf16x8_to_f(wr[r], w);
#pragma unroll
        for (int k = 0; k < TG; ++k) {
          const float4 x0 = *reinterpret_cast<const float4*>(out_sm + k * L + c);
          const float4 x1 = *reinterpret_cast<const float4*>(out_sm + k * L + c + 4);
          const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][k] = fmaf(x[e], w[e], acc[r][k]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RF; ++r) {
      const int v = v0 + r * NW;
#pragma unroll
      for (int k = 0; k < TG; ++k) acc[r][k] = dev::warp_sum(acc[r][k]);
      if (lane == 0 && v < d.v_dim)
        for (int k = 0; k < nt; ++k)
          out[((t0 + k) * d.heads + h) * d.v_dim + v] = __float2bfloat16_rn(acc[r][k]);
    }
  }
}

size_t q_smem_of(int tg, const MlaShape& s) {
  return static_cast<size_t>(tg) * (s.nope + s.rope + (kThreads / 32) * kQCols) * sizeof(float);
}

size_t attend_smem(const Dims& d, DType cache) {
  return (static_cast<size_t>(kHeadGroup) * (d.width + d.latent + kTile + 3)) * sizeof(float) +
         static_cast<size_t>(kTile) * d.width * dtype_size(cache);
}

template <int MT>
Status launch_attend_tc(const MlaCudaArgs& a, const Dims& d, const bf16* qlat16, float* part,
                        cudaStream_t st) {
  const size_t smem = attend_tc_smem(MT, d.width);
  auto* k = mla_attend_tc_kernel<MT>;
  SPARK_TRY(detail::prepare_launch(k, "mla_attend_tc", 64 * MT, smem));
  const unsigned groups = static_cast<unsigned>((a.s.heads + 16 * MT - 1) / (16 * MT));
  SPARK_CUDA_TRY(dev::launch(
      k, dim3(static_cast<unsigned>(a.n_tokens), groups, static_cast<unsigned>(a.splits)),
      dim3(64 * MT), smem, st, qlat16, static_cast<const bf16*>(a.kv.k), a.block_tables,
      a.max_blocks_per_seq, a.kv.block_size, a.positions, a.query_start, a.n_seqs, a.s.scale, d,
      part));
  return Status::Ok();
}

// Tiles of 16 heads per block of the tensor-core attention, 0 for the scalar kernel: the
// tensor-core one takes a bf16 cache of latent 512 and a rope of a multiple of 16 (whole
// k-steps, 16-byte rows; the pool 16-byte aligned for cp.async), as many tiles as the heads need up
// to 4 (the cache rows read once for 64 heads), fewer where the device's shared memory is smaller
// (GB10: one) or where the grid would leave more than half the SMs idle (a split of few tokens'
// heads over fewer blocks; a smaller group reads the rows again, mostly from L2).
int attend_tc_tiles(const MlaCudaArgs& a, int W) {
  if (a.scalar_attention || a.kv.dtype != DType::bf16 || a.s.latent != kTcLatent || W % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.kv.k) % 16 != 0)
    return 0;
  auto lim = cuda_device_limits();
  if (!lim || attend_tc_smem(1, W) > lim->smem_per_block_optin) return 0;
  int mt = a.s.heads > 32 ? 4 : a.s.heads > 16 ? 2 : 1;
  while (mt > 1 && attend_tc_smem(mt, W) > lim->smem_per_block_optin) mt /= 2;
  const auto blocks = [&](int m) {
    return a.n_tokens * static_cast<size_t>((a.s.heads + 16 * m - 1) / (16 * m)) *
           static_cast<size_t>(a.splits);
  };
  while (mt > 1 && 2 * blocks(mt) < static_cast<size_t>(lim->sm_count)) mt /= 2;
  return mt;
}

}  // namespace

Status mla_cuda_device(const MlaCudaArgs& a, void* stream) {
  const MlaShape& s = a.s;
  if (s.heads <= 0 || s.nope <= 0 || s.rope <= 0 || s.rope % 2 != 0 || s.v_dim <= 0 ||
      s.latent <= 0)
    return make_error(Errc::usage,
                      fmt::format("mla: heads {}, nope {}, rope {} (even), v_dim {} and latent {} "
                                  "must be > 0",
                                  s.heads, s.nope, s.rope, s.v_dim, s.latent));
  const int W = s.latent + s.rope;
  if (a.kv.k == nullptr || a.kv.v != nullptr || a.kv.n_kv_heads != 1 || a.kv.head_dim != W ||
      a.kv.block_size <= 0 || a.kv.num_blocks <= 0)
    return make_error(
        Errc::usage,
        fmt::format("mla: the cache must be one pool of rows of latent + rope = {} "
                    "(got {} x {}{})",
                    W, a.kv.n_kv_heads, a.kv.head_dim, a.kv.v ? " with a V pool" : ""));
  if (a.kv.dtype == DType::e4m3)
    return make_error(Errc::unsupported,
                      "mla: the latent cache is bf16 or fp32 (an fp8 latent cache is not built)");
  if (a.n_tokens == 0) return Status::Ok();
  if (!a.q || !a.kv_a || !a.kv_norm || !a.kv_b || !a.inv_freq || !a.out || !a.block_tables ||
      !a.positions || !a.slots || !a.query_start || a.n_seqs <= 0 || a.max_blocks_per_seq <= 0)
    return make_error(Errc::usage, "mla: a null pointer or empty batch among the arguments");
  if (a.splits < 1 || a.splits > kMlaMaxSplits || a.max_seq_len <= 0 ||
      a.n_tokens > 65535u * kTokGroup)
    return make_error(Errc::usage, fmt::format("mla: {} splits, max_seq_len {}, {} tokens",
                                               a.splits, a.max_seq_len, a.n_tokens));
  const size_t need = mla_workspace_bytes(a.n_tokens, s, a.splits);
  if (a.workspace == nullptr || a.workspace_bytes < need)
    return make_error(
        Errc::usage, fmt::format("mla: workspace of {} bytes, {} needed", a.workspace_bytes, need));
  const Dims d{s.heads, s.nope, s.rope, s.v_dim, s.latent, W, a.splits};
  // The absorbed products read kv_b 16 bytes at a time.
  if (s.latent % 8 != 0 || reinterpret_cast<uintptr_t>(a.kv_b) % 16 != 0)
    return make_error(
        Errc::unsupported,
        fmt::format("mla: latent {} must be a multiple of 8 and kv_b 16-byte aligned", s.latent));
  const size_t q_smem = q_smem_of(kTokGroup, s);
  const size_t kv_smem = (static_cast<size_t>(W) + 33) * sizeof(float);
  const int tc_tiles = attend_tc_tiles(a, W);
  // The tensor-core attention's shared memory was checked against the device's limit.
  const size_t at_smem = tc_tiles > 0 ? 0 : attend_smem(d, a.kv.dtype);
  const size_t out_smem = static_cast<size_t>(kTokGroup) * s.latent * sizeof(float);
  if (std::max({q_smem, kv_smem, at_smem, out_smem}) > kSmemLimit)
    return make_error(Errc::unsupported,
                      fmt::format("mla: latent {} + rope {} (nope {}) needs more than {} bytes of "
                                  "shared memory per block",
                                  s.latent, s.rope, s.nope, kSmemLimit));
  auto st = static_cast<cudaStream_t>(stream);
  float* qlat = static_cast<float*>(a.workspace);
  // The partials 16-byte aligned after the latent queries (mla_workspace_bytes rounds them).
  const size_t qrows = a.n_tokens * static_cast<size_t>(s.heads) * W;
  float* part = qlat + (qrows + 3) / 4 * 4;
  // The tensor-core attention's bf16 copy of the latent queries after the partials (at a
  // multiple of 16 bytes: the partials' rows are whole 16 bytes).
  bf16* qlat16 =
      tc_tiles > 0
          ? reinterpret_cast<bf16*>(part + a.n_tokens * static_cast<size_t>(s.heads) * a.splits *
                                               (static_cast<size_t>(s.latent) + kMlaPartHead))
          : nullptr;
  auto* q = static_cast<bf16*>(a.q);
  const auto* kv_b = static_cast<const bf16*>(a.kv_b);
  // A step of few tokens (batch-1 decode) takes the products a token per block: a group of
  // kTokGroup would hold and multiply rows of zeros (and its registers halve the blocks an
  // SM holds).
  const int tg = a.n_tokens < kFewTokens ? 1 : kTokGroup;
  const unsigned tok_groups = static_cast<unsigned>((a.n_tokens + tg - 1) / tg);
  const unsigned q_slices = static_cast<unsigned>((s.latent + kQCols - 1) / kQCols);
  const dim3 q_grid(static_cast<unsigned>(s.heads), tok_groups, q_slices);
  if (tg == 1)
    SPARK_CUDA_TRY(dev::launch(mla_q_kernel<1>, q_grid, dim3(kThreads), q_smem_of(1, s), st, q,
                               kv_b, a.inv_freq, a.positions, a.n_tokens, d, s.interleave,
                               s.rope_factor, qlat, qlat16));
  else
    SPARK_CUDA_TRY(dev::launch(mla_q_kernel<kTokGroup>, q_grid, dim3(kThreads), q_smem, st, q, kv_b,
                               a.inv_freq, a.positions, a.n_tokens, d, s.interleave, s.rope_factor,
                               qlat, qlat16));
  const long long pool_slots = static_cast<long long>(a.kv.num_blocks) * a.kv.block_size;
  const unsigned kv_blocks = static_cast<unsigned>(std::min<size_t>(a.n_tokens, 65535));
  const unsigned head_groups = static_cast<unsigned>((s.heads + kHeadGroup - 1) / kHeadGroup);
  SPARK_DISPATCH_DTYPE(
      a.kv.dtype, C,
      SPARK_CUDA_TRY(dev::launch(mla_kv_kernel<C>, dim3(kv_blocks), dim3(kThreads), kv_smem, st,
                                 static_cast<bf16*>(a.kv_a), static_cast<const bf16*>(a.kv_norm),
                                 a.eps, a.inv_freq, a.positions, a.slots, pool_slots, a.n_tokens, d,
                                 s.interleave, s.rope_factor, static_cast<C*>(a.kv.k))));
  if (tc_tiles == 4)
    SPARK_TRY(launch_attend_tc<4>(a, d, qlat16, part, st));
  else if (tc_tiles == 2)
    SPARK_TRY(launch_attend_tc<2>(a, d, qlat16, part, st));
  else if (tc_tiles == 1)
    SPARK_TRY(launch_attend_tc<1>(a, d, qlat16, part, st));
  else
    SPARK_DISPATCH_DTYPE(
        a.kv.dtype, C,
        SPARK_CUDA_TRY(dev::launch(
            mla_attend_kernel<C>,
            dim3(static_cast<unsigned>(a.n_tokens), head_groups, static_cast<unsigned>(a.splits)),
            dim3(kThreads), at_smem, st, static_cast<const float*>(qlat),
            static_cast<const C*>(a.kv.k), a.block_tables, a.max_blocks_per_seq, a.kv.block_size,
            a.positions, a.query_start, a.n_seqs, s.scale, d, part)));
  // Over kOutCombine ranges the combine is its own launch; its contexts go over the latent
  // queries (the attention has read them by then: each launch waits for the one before).
  const float* ctx = nullptr;
  if (a.splits > kOutCombine) {
    SPARK_CUDA_TRY(
        dev::launch(mla_combine_kernel,
                    dim3(static_cast<unsigned>(a.n_tokens), static_cast<unsigned>(s.heads),
                         static_cast<unsigned>((s.latent + kCombineCols - 1) / kCombineCols)),
                    dim3(kThreads), 0, st, static_cast<const float*>(part), d, qlat));
    ctx = qlat;
  }
  const int rows = ctx ? kOutRowsCombined : kOutRows;
  const dim3 out_grid(static_cast<unsigned>(s.heads), tok_groups,
                      static_cast<unsigned>((s.v_dim + rows - 1) / rows));
  const size_t out1_smem = static_cast<size_t>(s.latent) * sizeof(float);
  auto out = [&](auto kernel, size_t smem) {
    return dev::launch(kernel, out_grid, dim3(kThreads), smem, st, static_cast<const float*>(part),
                       ctx, kv_b, a.n_tokens, d, static_cast<bf16*>(a.out));
  };
  if (tg == 1)
    SPARK_CUDA_TRY(ctx ? out(mla_out_kernel<1, kOutRowsCombined>, out1_smem)
                       : out(mla_out_kernel<1, kOutRows>, out1_smem));
  else
    SPARK_CUDA_TRY(ctx ? out(mla_out_kernel<kTokGroup, kOutRowsCombined>, out_smem)
                       : out(mla_out_kernel<kTokGroup, kOutRows>, out_smem));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace spark::kernels
