// Decode attention over the paged KV cache, split-K ("flash-decoding"). Grid: (KV head x
// group chunk, split slot, sequence); block: 4 warps. One block serves every query head of
// its KV head's group (up to G), so each K and V row is read once per step.
//
// Memory: a row of one KV head is head_dim contiguous elements; L = HD/8 lanes cover it
// with one 16-byte load each, so a warp reads 32/L rows per load instruction and the
// block's NS = 4 * 32/L "streams" each walk every NS-th row of the split. A lane issues the
// K and the V loads of U rows before it uses the first (V does not depend on the scores),
// and fetches the block-table entries of its next U rows before computing, so per warp
// 2 * U * 512 bytes are in flight and the only wait per batch is one memory round trip.
//
// Arithmetic: q (pre-scaled by scale * log2 e) sits in registers; a score is 8 FMAs per
// lane and a reduction over the L lanes of the row; each stream keeps an online softmax
// (max, sum, weighted V) per head in fp32, rescaled once per batch of U rows.
//
// Merge: the block merges its streams through shared memory. With one used split it
// writes the output; otherwise it leaves (max, sum, output) in the workspace, and the last
// split of its (sequence, KV block) to finish (a counter, reset by that block) merges all
// used splits. Splits past a sequence's `used` exit at once, so a graph captured with a
// large context bound costs what the real contexts need.
#include <cfloat>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/paged_attention.h"

namespace spark::kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kGMax = 8;        // query heads per block; larger groups run in chunks
constexpr float kNeg = -1e30f;  // "no score yet": finite, so max/exp2 stay NaN-free
constexpr float kLog2e = 1.4426950408889634f;

using dev::load_raw;
using dev::to_floats;
using dev::zero_raw;
template <typename C>
using Raw = dev::Raw8<C>;

struct SplitParams {
  AttentionBatch b;
  int group;          // query heads per KV head
  int chunks;         // ceil(group / kGMax): KV-head blocks = n_kv_heads * chunks
  int cap;            // split slots per (sequence, KV block) = gridDim.y
  int bs_shift;       // log2(block_size) when it is a power of two, else -1
  float qscale;       // scale * log2 e
  int32_t* counters;  // [n_seqs][KV blocks]
  float* partials;    // [n_seqs][n_heads][cap][head_dim + 2]
};

// What a block of either split-K kernel works on: its sequence, KV head (block) and head
// chunk, its split and the split's positions [lo, lo + n). False when it has none (the
// block returns; a sequence without context, which the engine never sends, gets zeros from
// its split 0). gmax: the most heads of a chunk the kernel holds.
struct SplitWork {
  int seq, kvb, kvh, split, g0, gn, used, lo, n;
  size_t token;
};
__device__ __forceinline__ bool split_work(const SplitParams& P, int gmax, SplitWork& w) {
  const AttentionBatch& b = P.b;
  w.split = blockIdx.y, w.kvb = blockIdx.x, w.seq = blockIdx.z;
  w.kvh = w.kvb / P.chunks;
  const int ctx = b.seq_lens[w.seq];
  const DecodeSplitPlan plan = attention_decode_plan(ctx, b.window, P.cap);
  w.used = plan.used;
  w.g0 = (w.kvb % P.chunks) * kGMax;
  w.gn = min(gmax, P.group - w.g0);
  w.token = b.query_start ? static_cast<size_t>(b.query_start[w.seq]) : static_cast<size_t>(w.seq);
  if (w.used == 0) {
    const int hd = b.kv.head_dim;
    if (w.split == 0)
      for (int i = static_cast<int>(threadIdx.x); i < w.gn * hd; i += kThreads) {
        const size_t off =
            w.token * b.out_stride + static_cast<size_t>((w.kvh * P.group + w.g0) * hd + i);
        if (b.dtype == DType::bf16)
          static_cast<dev::bf16*>(b.out)[off] = __float2bfloat16_rn(0.f);
        else
          static_cast<float*>(b.out)[off] = 0.f;
      }
    return false;
  }
  if (w.split >= w.used) return false;  // uniform over the block: nothing of this sequence
  w.lo = plan.first + w.split * plan.chunk;
  w.n = min(plan.chunk, ctx - w.lo);  // >= 1
  return true;
}

// The end of a split, shared by both split-K kernels: the block's NS streams (o_s[j][g][d]
// unnormalised, their maxima m_s[g][j] and sums l_s[g][j], written before a barrier) are
// merged; with one used split the output is written, else this split's partials, and the
// last split of the (sequence, KV block) to finish merges every used split's partials.
template <int NS, int GS, int HD>
__device__ __forceinline__ void split_finish(const SplitParams& P, const float (&o_s)[NS][GS][HD],
                                             const float (&m_s)[GS][NS], const float (&l_s)[GS][NS],
                                             int seq, int kvh, int kvb, int g0, int gn, int split,
                                             int used, size_t token) {
  __shared__ float pm_s[GS][kDecodeMaxSplits], w_s[GS][kDecodeMaxSplits];
  __shared__ int last_s;
  const AttentionBatch& b = P.b;
  const int hd = b.kv.head_dim;
  const int tid = static_cast<int>(threadIdx.x);
  const bool direct = used == 1;
  float* const part_base =
      P.partials + (static_cast<size_t>(seq) * b.n_heads + kvh * P.group + g0) * P.cap * (hd + 2);
  for (int i = tid; i < gn * hd; i += kThreads) {
    const int g = i / hd, d = i % hd;
    float M = kNeg;
#pragma unroll
    for (int j = 0; j < NS; ++j) M = fmaxf(M, m_s[g][j]);
    float sum = 0.f, o = 0.f;
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      const float w = exp2f(m_s[g][j] - M);
      sum += l_s[g][j] * w;
      o += o_s[j][g][d] * w;
    }
    if (direct) {
      const size_t at =
          token * b.out_stride + static_cast<size_t>((kvh * P.group + g0 + g) * hd + d);
      // sum >= 1: the row holding the max contributes exp2(0); the sink joins it here.
      const float r = o * attention_norm_factor(b.sinks, kvh * P.group + g0 + g, M, sum);
      if (b.dtype == DType::bf16)
        static_cast<dev::bf16*>(b.out)[at] = __float2bfloat16_rn(r);
      else
        static_cast<float*>(b.out)[at] = r;
    } else {
      float* part = part_base + (static_cast<size_t>(g) * P.cap + split) * (hd + 2);
      part[2 + d] = o;
      if (d == 0) part[0] = M, part[1] = sum;
    }
  }
  if (direct) return;

  // Publish this split's partials, then count it; the last one merges.
  __threadfence();
  __syncthreads();
  int32_t* counter = P.counters + static_cast<size_t>(seq) * gridDim.x + kvb;
  if (tid == 0) last_s = atomicAdd(counter, 1) == used - 1;
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  for (int i = tid; i < gn * used; i += kThreads) {
    const int g = i / used, sp = i % used;
    const float* part = part_base + (static_cast<size_t>(g) * P.cap + sp) * (hd + 2);
    pm_s[g][sp] = __ldcg(part);
    w_s[g][sp] = __ldcg(part + 1);  // the sum, turned into the weight below
  }
  __syncthreads();
  if (tid < gn) {
    const int g = tid;
    float M = kNeg;
    for (int sp = 0; sp < used; ++sp) M = fmaxf(M, pm_s[g][sp]);
    float sum = 0.f;
    for (int sp = 0; sp < used; ++sp) sum += w_s[g][sp] * exp2f(pm_s[g][sp] - M);
    // sum >= 1: some split holds the max. The sink joins the merged denominator, once.
    const float inv = attention_norm_factor(b.sinks, kvh * P.group + g0 + g, M, sum);
    for (int sp = 0; sp < used; ++sp) w_s[g][sp] = exp2f(pm_s[g][sp] - M) * inv;
  }
  __syncthreads();
  for (int i = tid; i < gn * hd; i += kThreads) {
    const int g = i / hd, d = i % hd;
    const float* part = part_base + static_cast<size_t>(g) * P.cap * (hd + 2) + 2 + d;
    float o = 0.f;
#pragma unroll 4
    for (int sp = 0; sp < used; ++sp)
      o += __ldcg(part + static_cast<size_t>(sp) * (hd + 2)) * w_s[g][sp];
    const size_t at = token * b.out_stride + static_cast<size_t>((kvh * P.group + g0 + g) * hd + d);
    if (b.dtype == DType::bf16)
      static_cast<dev::bf16*>(b.out)[at] = __float2bfloat16_rn(o);
    else
      static_cast<float*>(b.out)[at] = o;
  }
  if (tid == 0) *counter = 0;  // every used split has counted: ready for the next launch
}

template <typename C, int HD, int G, int U, int MINB>
__global__ void __launch_bounds__(kThreads, MINB) split_kernel(SplitParams P) {
  dev::pdl_wait();  // programmatic launch: the kernel ahead has finished
  dev::pdl_trigger();

  constexpr int L = HD / 8;    // lanes per row
  constexpr int RPW = 32 / L;  // rows per warp and load
  constexpr int NS = kWarps * RPW;
  constexpr int STEP = NS * U;  // rows per batch of the block
  __shared__ __align__(16) float o_s[NS][G][HD];
  __shared__ float m_s[G][NS], l_s[G][NS];

  const AttentionBatch& b = P.b;
  // Splits on y, KV blocks on x: blocks are scheduled in linear order, so the splits that
  // hold work (the first `used`) of every KV block come first, and the ones past a short
  // context (which exit at once) are not ahead of them on a full first wave.
  SplitWork W;
  if (!split_work(P, min(kGMax, G), W)) return;
  const int seq = W.seq, kvb = W.kvb, kvh = W.kvh, split = W.split, used = W.used;
  const int g0 = W.g0, gn = W.gn, lo = W.lo, n = W.n;
  const size_t token = W.token;
  const int hd = b.kv.head_dim;
  const int tid = static_cast<int>(threadIdx.x);

  const int lane = tid & 31, warp = tid >> 5;
  const int sub = lane / L, li = lane % L;
  const int stream = warp * RPW + sub;
  const int d0 = li * 8;
  const bool active = d0 < hd;

  // q of this lane's 8 dimensions for each head, scaled into the log2 domain.
  float q[G][8];
  dev::load_q_lane(b, token, P.group, kvh, g0, gn, d0, active, P.qscale, q);

  const C* kpool = static_cast<const C*>(b.kv.k);
  const C* vpool = static_cast<const C*>(b.kv.v);
  const int bs = b.kv.block_size;
  const size_t row_elems = static_cast<size_t>(b.kv.n_kv_heads) * hd;
  const size_t head_off = static_cast<size_t>(kvh) * hd + d0;
  const int32_t* table = b.block_tables + static_cast<size_t>(seq) * b.max_blocks_per_seq;
  // Pool slot (block * block_size + offset) of position p; 32 bits, as the engine's slots.
  auto fetch = [&](int p) -> int {
    const int tb = P.bs_shift >= 0 ? p >> P.bs_shift : p / bs;
    return __ldg(table + tb) * bs + (p - tb * bs);
  };
  auto at = [&](int slot) { return static_cast<size_t>(slot) * row_elems + head_off; };

  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kNeg, l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
  }

  int off[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int r = u * NS + stream;
    off[u] = r < n ? fetch(lo + r) : 0;
  }
  // The loop bound is uniform over the block, so every lane reaches the shuffles.
  for (int base = 0; base < n; base += STEP) {
    Raw<C> kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = base + u * NS + stream;
      if (active && r < n) {
        load_raw(kpool + at(off[u]), kr[u]);
        load_raw(vpool + at(off[u]), vr[u]);
      } else {
        zero_raw(kr[u]), zero_raw(vr[u]);
      }
    }
    // The next batch's table entries, while this batch's rows are in flight.
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = base + STEP + u * NS + stream;
      off[u] = r < n ? fetch(lo + r) : 0;
    }
    float s[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      to_floats(kr[u], kf);
      const bool valid = base + u * NS + stream < n;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float dot = dev::lanes_dot8<L>(q[g], kf);
        s[u][g] = valid ? dot : kNeg;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u][g]);
      const float corr = exp2f(m[g] - mx);
      m[g] = mx;
      l[g] *= corr;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] *= corr;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      to_floats(vr[u], vf);
      const bool valid = base + u * NS + stream < n;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = valid ? exp2f(s[u][g] - m[g]) : 0.f;
        l[g] += p;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = fmaf(p, vf[j], acc[g][j]);
      }
    }
  }

  // Merge the streams of the block.
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (active)
#pragma unroll
      for (int j = 0; j < 8; ++j) o_s[stream][g][d0 + j] = acc[g][j];
    if (li == 0) m_s[g][stream] = m[g], l_s[g][stream] = l[g];
  }
  __syncthreads();
  split_finish<NS, G, HD>(P, o_s, m_s, l_s, seq, kvh, kvb, g0, gn, split, used, token);
}

// ---- the tensor-core form (bf16 and e4m3 caches, head_dim 32, 64 or 128) --------------
// The same splits, plan and end as split_kernel; each warp takes tiles of 16 positions of
// its split (tiles w, w + 4, ...; U of them a batch) and does a tile's arithmetic in mma.sync
// m16n8k16 (bf16 in, fp32 accumulation), the group's heads (up to 8) as the 8 columns:
//   scores: S^T (16 positions x 8 heads) = K (16 x head_dim) Q^T. Lane (g = lane / 4,
//     q = lane % 4) loads 16 bytes of positions g and g + 8 of the tile from the cache: dims
//     32t + 8q .. 8q + 7 of each 32-dimension block t, as the register kernel does. The sum
//     over dimensions is the same in any order, so the mma's k index is mapped onto the
//     loaded registers (k-step h of block t: logical k 2q + e <-> dim 32t + 8q + 4h + e,
//     2q + 8 + e <-> 32t + 8q + 4h + 2 + e), and q's B fragment is loaded the same way. The
//     result holds, per lane, positions g and g + 8 of heads 2q and 2q + 1.
//   softmax: online per head in fp32 (scores times scale * log2 e); a head's columns sit in
//     the 8 lanes of one q, so its max takes three shuffles and its sum stays per lane.
//   P V: O^T (head_dim x 8 heads) += V^T (head_dim x 16 positions) P^T. P^T's B fragment is
//     the score fragment rounded to bf16 and transposed in registers (movmatrix, 8 x 8 b16);
//     V^T's A fragment is each loaded V register (an 8 x 8 matrix: position x 8 dims)
//     transposed, so dims are again a permutation: register j of block t holds dims
//     32t + 8(g / 2) + 2j + g % 2 after the transpose. No shared memory until the end; the
//     accumulators belong to the lane's own two heads, so rescaling needs no exchange.
// P is rounded to bf16 (relative 2^-9 a weight), as the prefill kernel does; q of an fp32
// batch is rounded to bf16 too. An e4m3 cache's 8 bytes a lane are widened to bf16 pairs
// (exactly) when used, so half the registers hold the rows in flight.
constexpr int kTcWarps = kWarps;  // the block is split_kernel's 4 warps
constexpr int kTcHeads = 8;       // heads as the mma's columns

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A lane's 8 cache elements of a row as loaded (bf16: 16 bytes; e4m3: 8 bytes, half the
// registers while in flight), and as 4 bf16 pairs (e4m3 values are bf16 values: exact).
template <typename C>
struct TcRaw;
template <>
struct TcRaw<dev::bf16> {
  using T = uint4;
};
template <>
struct TcRaw<dev::e4m3> {
  using T = uint2;
};
__device__ __forceinline__ uint4 tc_zero(uint4) {
  return make_uint4(0u, 0u, 0u, 0u);
}
__device__ __forceinline__ uint2 tc_zero(uint2) {
  return make_uint2(0u, 0u);
}
__device__ __forceinline__ uint4 tc_pairs(const uint4& r) {
  return r;
}
__device__ __forceinline__ uint4 tc_pairs(const uint2& r) {
  float f[8];
  dev::e4m3x8_to_f(r, f);
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                    pack_bf16x2(f[6], f[7]));
}

template <typename C, int HD, int U>
__global__ void __launch_bounds__(kThreads, 2) split_tc_kernel(SplitParams P) {
  dev::pdl_wait();
  dev::pdl_trigger();
  constexpr int NT = HD / 32;  // 32-dimension blocks
  __shared__ __align__(16) float o_s[kTcWarps][kTcHeads][HD];
  __shared__ float m_s[kTcHeads][kTcWarps], l_s[kTcHeads][kTcWarps];

  const AttentionBatch& b = P.b;
  SplitWork W;
  if (!split_work(P, kGMax, W)) return;
  const int seq = W.seq, kvb = W.kvb, kvh = W.kvh, split = W.split, used = W.used;
  const int g0 = W.g0, gn = W.gn, lo = W.lo, n = W.n;
  const size_t token = W.token;
  const int tid = static_cast<int>(threadIdx.x);
  const int tiles = (n + 15) / 16;

  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, q = lane & 3;

  // q's B fragments: head g0 + g, dims 32t + 8q .. 8q + 7 as four bf16 pairs (zeros past gn).
  uint32_t qf[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v0 = 0.f, v1 = 0.f;
      if (g < gn) {
        const size_t off = token * b.q_stride + static_cast<size_t>((kvh * P.group + g0 + g) * HD +
                                                                    32 * t + 8 * q + 2 * j);
        if (b.dtype == DType::bf16) {
          v0 = __bfloat162float(static_cast<const dev::bf16*>(b.q)[off]);
          v1 = __bfloat162float(static_cast<const dev::bf16*>(b.q)[off + 1]);
        } else {
          v0 = static_cast<const float*>(b.q)[off];
          v1 = static_cast<const float*>(b.q)[off + 1];
        }
      }
      qf[t][j] = pack_bf16x2(v0, v1);
    }

  using Raw = typename TcRaw<C>::T;
  const C* kpool = static_cast<const C*>(b.kv.k);
  const C* vpool = static_cast<const C*>(b.kv.v);
  const int bs = b.kv.block_size;
  const size_t row_elems = static_cast<size_t>(b.kv.n_kv_heads) * HD;
  const size_t head_off = static_cast<size_t>(kvh) * HD + 8 * q;
  const int32_t* table = b.block_tables + static_cast<size_t>(seq) * b.max_blocks_per_seq;
  auto fetch = [&](int r) -> int {  // pool slot of the split's position r (< n)
    const int p = lo + r;
    const int tb = P.bs_shift >= 0 ? p >> P.bs_shift : p / bs;
    return __ldg(table + tb) * bs + (p - tb * bs);
  };

  float m[2] = {kNeg, kNeg}, l[2] = {0.f, 0.f};  // heads 2q and 2q + 1
  float o[2 * NT][4];
#pragma unroll
  for (int i = 0; i < 2 * NT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) o[i][j] = 0.f;

  // Tile (it + u) * kTcWarps + warp of the split; the loop bound is uniform over the warp.
  int off[U][2];
  auto fetch_batch = [&](int it) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = ((it + u) * kTcWarps + warp) * 16 + g;
      off[u][0] = r < n ? fetch(r) : -1;
      off[u][1] = r + 8 < n ? fetch(r + 8) : -1;
    }
  };
  fetch_batch(0);
  for (int it = 0; it * kTcWarps + warp < tiles; it += U) {
    Raw kr[U][2][NT], vr[U][2][NT];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (off[u][h] >= 0) {
            const size_t at = static_cast<size_t>(off[u][h]) * row_elems + head_off + 32 * t;
            kr[u][h][t] = *reinterpret_cast<const Raw*>(kpool + at);
            vr[u][h][t] = *reinterpret_cast<const Raw*>(vpool + at);
          } else {
            kr[u][h][t] = tc_zero(Raw{});
            vr[u][h][t] = tc_zero(Raw{});
          }
        }
    fetch_batch(it + U);  // the next batch's slots while these rows are in flight

    // Scores of the batch's tiles, scaled into the log2 domain; kNeg past the split.
    float s[U][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const uint4 kp0 = tc_pairs(kr[u][0][t]), kp1 = tc_pairs(kr[u][1][t]);
        const uint32_t* k0 = reinterpret_cast<const uint32_t*>(&kp0);
        const uint32_t* k1 = reinterpret_cast<const uint32_t*>(&kp1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t a[4] = {k0[2 * h], k1[2 * h], k0[2 * h + 1], k1[2 * h + 1]};
          dev::mma_bf16_16816(c, a, qf[t][2 * h], qf[t][2 * h + 1]);
        }
      }
      // Positions g and g + 8 of the tile: kNeg past the split (their rows were zeros).
      const int r = ((it + u) * kTcWarps + warp) * 16 + g;
      s[u][0] = r < n ? c[0] * P.qscale : kNeg;
      s[u][1] = r < n ? c[1] * P.qscale : kNeg;
      s[u][2] = r + 8 < n ? c[2] * P.qscale : kNeg;
      s[u][3] = r + 8 < n ? c[3] * P.qscale : kNeg;
    }

    // Online softmax per head (columns 2q + e), one rescale a batch.
    float corr[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = m[e];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, fmaxf(s[u][e], s[u][2 + e]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      corr[e] = exp2f(m[e] - mx);
      m[e] = mx;
      l[e] *= corr[e];
    }
#pragma unroll
    for (int i = 0; i < 2 * NT; ++i) {
      o[i][0] *= corr[0], o[i][1] *= corr[1];
      o[i][2] *= corr[0], o[i][3] *= corr[1];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float p[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) p[k] = exp2f(s[u][k] - m[k & 1]);
      l[0] += p[0] + p[2];
      l[1] += p[1] + p[3];
      // P^T's B fragment: positions 2q, 2q + 1 (b0) and 2q + 8, 2q + 9 (b1) of head g.
      const uint32_t b0 = movmatrix_trans(pack_bf16x2(p[0], p[1]));
      const uint32_t b1 = movmatrix_trans(pack_bf16x2(p[2], p[3]));
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const uint4 vp0 = tc_pairs(vr[u][0][t]), vp1 = tc_pairs(vr[u][1][t]);
        const uint32_t* v0 = reinterpret_cast<const uint32_t*>(&vp0);
        const uint32_t* v1 = reinterpret_cast<const uint32_t*>(&vp1);
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          const uint32_t a[4] = {movmatrix_trans(v0[2 * w]), movmatrix_trans(v0[2 * w + 1]),
                                 movmatrix_trans(v1[2 * w]), movmatrix_trans(v1[2 * w + 1])};
          dev::mma_bf16_16816(o[2 * t + w], a, b0, b1);
        }
      }
    }
  }

  // The warp's sums over its 8 lanes of each q; its state into shared memory as streams.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 4);
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 8);
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 16);
    if (g == 0) m_s[2 * q + e][warp] = m[e], l_s[2 * q + e][warp] = l[e];
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      // Rows g and g + 8 of tile (t, w): registers j = 2w and 2w + 1 of block t.
      const int d_lo = 32 * t + 8 * (g >> 1) + 4 * w + (g & 1);
      const int d_hi = d_lo + 2;
      o_s[warp][2 * q][d_lo] = o[2 * t + w][0];
      o_s[warp][2 * q + 1][d_lo] = o[2 * t + w][1];
      o_s[warp][2 * q][d_hi] = o[2 * t + w][2];
      o_s[warp][2 * q + 1][d_hi] = o[2 * t + w][3];
    }
  __syncthreads();
  split_finish<kTcWarps, kTcHeads, HD>(P, o_s, m_s, l_s, seq, kvh, kvb, g0, gn, split, used, token);
}

template <typename C>
Status launch_tc(const SplitParams& P, dim3 grid, cudaStream_t st) {
  const int hd = P.b.kv.head_dim;
  if (hd == 32)
    SPARK_CUDA_TRY(dev::launch(split_tc_kernel<C, 32, 2>, grid, dim3(kThreads), 0, st, P));
  else if (hd == 64)
    SPARK_CUDA_TRY(dev::launch(split_tc_kernel<C, 64, 2>, grid, dim3(kThreads), 0, st, P));
  else
    SPARK_CUDA_TRY(dev::launch(split_tc_kernel<C, 128, 2>, grid, dim3(kThreads), 0, st, P));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

template <typename C, int HD>
Status launch_hd(const SplitParams& P, int gmax, dim3 grid, cudaStream_t st) {
  // Fewer rows per batch where G heads already take many registers.
  if (gmax <= 1)
    SPARK_CUDA_TRY(dev::launch(split_kernel<C, HD, 1, 8, 1>, grid, dim3(kThreads), 0, st, P));
  else if (gmax <= 2)
    SPARK_CUDA_TRY(dev::launch(split_kernel<C, HD, 2, 8, 1>, grid, dim3(kThreads), 0, st, P));
  else if (gmax <= 4 && HD == 128 && P.b.decode_variant == 1)
    SPARK_CUDA_TRY(dev::launch(split_kernel<C, 128, 4, 4, 3>, grid, dim3(kThreads), 0, st, P));
  else if (gmax <= 4)
    SPARK_CUDA_TRY(dev::launch(split_kernel<C, HD, 4, 8, 1>, grid, dim3(kThreads), 0, st, P));
  else
    SPARK_CUDA_TRY(dev::launch(split_kernel<C, HD, 8, 4, 1>, grid, dim3(kThreads), 0, st, P));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

template <typename C>
Status launch(const SplitParams& P, int gmax, dim3 grid, cudaStream_t st) {
  const int hd = P.b.kv.head_dim;
  if (hd <= 64) return launch_hd<C, 64>(P, gmax, grid, st);
  if (hd <= 128) return launch_hd<C, 128>(P, gmax, grid, st);
  return launch_hd<C, 256>(P, gmax, grid, st);
}

}  // namespace

Status attention_decode_cuda_device(const AttentionBatch& b, void* stream) {
  SPARK_TRY(attention_check_args(b, true));
  if (b.n_seqs == 0) return Status::Ok();
  if (attention_decode_short_takes(b)) return attention_decode_short_cuda_device(b, stream);
  if (b.n_seqs > 65535)
    return make_error(Errc::usage, "attention_decode: more than 65535 sequences in one batch");
  SplitParams P{};
  P.b = b;
  P.group = b.n_heads / b.kv.n_kv_heads;
  P.chunks = (P.group + kGMax - 1) / kGMax;
  const long long kv_blocks = static_cast<long long>(b.kv.n_kv_heads) * P.chunks;
  if (kv_blocks > 65535)
    return make_error(Errc::usage,
                      "attention_decode: too many KV heads x head chunks for one grid");
  P.cap = attention_decode_split_cap(b.n_seqs, static_cast<int>(kv_blocks), b.max_seq_len);
  P.bs_shift = -1;
  for (int s = 0; s < 31; ++s)
    if ((1 << s) == b.kv.block_size) P.bs_shift = s;
  P.qscale = b.scale * kLog2e;
  // Counters first (n_seqs x KV blocks <= n_seqs x n_heads), then the partials, as
  // attention_decode_workspace_bytes lays them out.
  const size_t pairs = static_cast<size_t>(b.n_seqs) * static_cast<size_t>(b.n_heads);
  P.counters = static_cast<int32_t*>(b.workspace);
  P.partials = reinterpret_cast<float*>(static_cast<char*>(b.workspace) +
                                        (pairs + 63) / 64 * 64 * sizeof(int32_t));
  const int gmax = P.group < kGMax ? P.group : kGMax;
  auto st = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(kv_blocks), static_cast<unsigned>(P.cap),
                  static_cast<unsigned>(b.n_seqs));
  SPARK_TRY(cuda_check_launch("attention_decode", kThreads, 0));
  if (b.decode_variant == 4) {
    if (!attention_decode_tc_fits(b.kv.dtype, b.kv.head_dim))
      return make_error(Errc::usage,
                        std::string("attention_decode (tensor cores): a bf16 or e4m3 cache of "
                                    "head_dim 32, 64 or 128, not ") +
                            dtype_name(b.kv.dtype) + " of head_dim " +
                            std::to_string(b.kv.head_dim));
    if (b.kv.dtype == DType::bf16)
      SPARK_TRY(launch_tc<dev::bf16>(P, grid, st));
    else
      SPARK_TRY(launch_tc<dev::e4m3>(P, grid, st));
    return Status::Ok();
  }
  SPARK_DISPATCH_KV(b.kv.dtype, C, SPARK_TRY(launch<C>(P, gmax, grid, st)));
  return Status::Ok();
}

}  // namespace spark::kernels
