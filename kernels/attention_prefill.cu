// Prefill attention over the paged KV cache, flash-attention style (FlashAttention-2's
// work split): a block owns a tile of queries of one head of one sequence and walks the
// causal range of keys in tiles, keeping the running row max, row sum and output in
// registers (online softmax in fp32, exp2 domain). Products run on the tensor cores
// (mma.sync m16n8k16, bf16 in, fp32 accumulation); the score accumulators are reused as
// the A operand of P*V without leaving registers; Q, K and V^T fragments come out of
// shared memory by ldmatrix (.trans for V). K and V tiles are gathered through the block
// table with cp.async; an fp32 cache (or fp32 q) is rounded to bf16 for the products, on
// the way into shared memory. head_dim is padded with zeros to the kernel's HD (64, 128
// or 256).
//
// Two kernels. The tiled kernel (the engine's): W warps of 16 x MT query rows (4 x 16,
// 4 x 32 or 8 x 32: 64, 128 or 256 queries a block; more rows a warp halve the shared-
// memory reads per product, more warps halve the gather per product), one K and one V
// buffer filled FlashAttention-2's way (V of tile i lands while S = Q K^T of tile i is
// computed, K of tile i+1 while softmax and P V run), each key's block looked up once a
// tile into 32-bit offsets in shared memory, the causal mask applied only where a tile
// crosses a warp's diagonal, a warp idle on tiles wholly above its rows, exp2 with the
// scale folded into one FMA, the output rescaled only when a row maximum rises, and a
// grid ordered longest tile first, heads innermost (the query heads of one KV head run
// side by side and share its K/V in L2). Shared memory: (BM + 2 BN) x (HD + 8) bf16, so
// 68 KiB at 128 queries (GB10 has 99 KiB a block) and 103 KiB at 256. The previous kernel
// (64 queries, K and V double-buffered together, mask on every tile, grid in tile order,
// 64-bit gather offsets) is kept for the benchmark's side-by-side rows and for pools too
// large for 32-bit offsets (AttentionBatch::prefill_variant).
#include <algorithm>
#include <cfloat>
#include <string>
#include <type_traits>

#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/paged_attention.h"

namespace spark::kernels {
namespace {

constexpr int kBM = 64;  // queries per block
constexpr int kWarpsP = 4;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Eight elements of an fp32 or e4m3 cache row as bf16 (a uint4); zeros where invalid. e4m3
// values are bf16 values (3 mantissa bits, exponents within bf16's): exact.
template <typename C>
__device__ __forceinline__ uint4 load8_bf16(const C* p, bool valid) {
  if (!valid) return make_uint4(0, 0, 0, 0);
  float f[8];
  dev::load8(p, f);
  return make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]),
                    pack_bf16(f[6], f[7]));
}

// Q's A fragment for k-step kk: rows r and r + 8 of the warp's 16, columns 2c..2c+1 and +8.
template <int P>
__device__ __forceinline__ void load_q_frag(const dev::bf16* q_s, int r, int kk, int c,
                                            uint32_t* a) {
  const dev::bf16* qa = q_s + r * P + kk * 16 + c * 2;
  a[0] = *reinterpret_cast<const uint32_t*>(qa);
  a[1] = *reinterpret_cast<const uint32_t*>(qa + 8 * P);
  a[2] = *reinterpret_cast<const uint32_t*>(qa + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(qa + 8 * P + 8);
}

// ---- the previous kernel ---------------------------------------------------------------

template <int HD, int BN>
struct PrefillSmem {
  static constexpr int kP =
      HD + 8;  // row pitch (bf16) of every tile, padded against bank conflicts
  static constexpr size_t q_elems = size_t{kBM} * kP;
  static constexpr size_t kv_elems = size_t{BN} * kP;            // one K or V tile
  static constexpr size_t bytes = (q_elems + 4 * kv_elems) * 2;  // Q, then K and V twice
};

using dev::cp_async16;
using dev::cp_async_commit;
using dev::cp_async_wait;
using dev::smem_u32;

template <typename C, int HD, int BN>
__global__ void __launch_bounds__(kWarpsP * 32) prefill_v1_kernel(AttentionBatch b) {
  using S = PrefillSmem<HD, BN>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  dev::bf16* q_s = reinterpret_cast<dev::bf16*>(smem_raw);
  dev::bf16* kv_s = q_s + S::q_elems;  // stage t: K at kv_s + 2t*kv_elems, V right after

  const int seq = blockIdx.z, h = blockIdx.y;
  const int qs = b.query_start[seq];
  const int qlen = b.query_start[seq + 1] - qs;
  const int m0 = blockIdx.x * kBM;
  if (m0 >= qlen) return;
  const int ctx = b.seq_lens[seq];
  const int hd = b.kv.head_dim;
  const int group = b.n_heads / b.kv.n_kv_heads;
  const int kvh = h / group;
  const int pbase = ctx - qlen;  // position of query 0
  const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;

  // Q tile -> shared (bf16, zero padded).
  constexpr int kCh = HD / 8;
  for (int c = tid; c < kBM * kCh; c += blockDim.x) {
    const int r = c / kCh, d = (c % kCh) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (m0 + r < qlen && d < hd) {
      const size_t off =
          static_cast<size_t>(qs + m0 + r) * b.q_stride + static_cast<size_t>(h) * hd + d;
      if (b.dtype == DType::bf16) {
        v = *reinterpret_cast<const uint4*>(static_cast<const dev::bf16*>(b.q) + off);
      } else {
        float f[8];
        dev::load8(static_cast<const float*>(b.q) + off, f);
        v = make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]),
                       pack_bf16(f[6], f[7]));
      }
    }
    *reinterpret_cast<uint4*>(q_s + r * S::kP + d) = v;
  }

  const int g = lane >> 2, cq = lane & 3;
  const int rA = warp * 16 + g, rB = rA + 8;  // this thread's two rows in the tile
  const int posA = pbase + m0 + rA, posB = pbase + m0 + rB;
  const bool rowA_ok = m0 + rA < qlen, rowB_ok = m0 + rB < qlen;
  const float sl2 = b.scale * 1.4426950408889634f;

  const int last = pbase + min(m0 + kBM, qlen) - 1;  // last query position of the tile
  const int kend = min(ctx, last + 1);
  int kstart = 0;
  if (b.window > 0) kstart = max(0, pbase + m0 - b.window + 1);
  kstart = kstart / BN * BN;

  float o[HD / 8][4];
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;

  const int32_t* table = b.block_tables + static_cast<size_t>(seq) * b.max_blocks_per_seq;
  const size_t row_elems = static_cast<size_t>(b.kv.n_kv_heads) * hd;
  const C* kpool = static_cast<const C*>(b.kv.k);
  const C* vpool = static_cast<const C*>(b.kv.v);

  // K/V tiles are double-buffered: tile i+1 is copied (cp.async for a bf16 cache) while
  // tile i is computed. An fp32 cache is converted on the way, synchronously.
  auto issue_tile = [&](int n0, int stage) {
    dev::bf16* ks = kv_s + static_cast<size_t>(2 * stage) * S::kv_elems;
    dev::bf16* vs = ks + S::kv_elems;
    for (int c = tid; c < BN * kCh; c += blockDim.x) {
      const int r = c / kCh, d = (c % kCh) * 8;
      const int kp = n0 + r;
      const bool valid = kp < kend && d < hd;
      size_t off = 0;
      if (valid) {
        const int blk = table[kp / b.kv.block_size];
        off = (static_cast<size_t>(blk) * b.kv.block_size + kp % b.kv.block_size) * row_elems +
              static_cast<size_t>(kvh) * hd + d;
      }
      if constexpr (std::is_same_v<C, dev::bf16>) {
        cp_async16(ks + r * S::kP + d, kpool + off, valid);
        cp_async16(vs + r * S::kP + d, vpool + off, valid);
      } else {
        *reinterpret_cast<uint4*>(ks + r * S::kP + d) = load8_bf16<C>(kpool + off, valid);
        *reinterpret_cast<uint4*>(vs + r * S::kP + d) = load8_bf16<C>(vpool + off, valid);
      }
    }
    cp_async_commit();
  };

  // Q's A fragments stay in registers for every key tile (head_dim <= 128).
  constexpr bool kHoistQ = HD <= 128;
  uint32_t qf[kHoistQ ? HD / 16 : 1][4];
  if constexpr (kHoistQ) {
    __syncthreads();  // Q is in shared memory
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) load_q_frag<S::kP>(q_s, rA, kk, cq, qf[kk]);
  }

  issue_tile(kstart, 0);
  int stage = 0;
  for (int n0 = kstart; n0 < kend; n0 += BN, stage ^= 1) {
    if (n0 + BN < kend) {
      issue_tile(n0 + BN, stage ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile `stage` (and Q, the first time) is in shared memory
    const dev::bf16* k_s = kv_s + static_cast<size_t>(2 * stage) * S::kv_elems;
    const dev::bf16* v_s = k_s + S::kv_elems;

    // S = Q K^T for this warp's 16 rows; K's B fragments by ldmatrix (two key tiles and
    // both k halves per instruction).
    float s[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t a[4];
      if constexpr (kHoistQ) {
        a[0] = qf[kk][0], a[1] = qf[kk][1], a[2] = qf[kk][2], a[3] = qf[kk][3];
      } else {
        load_q_frag<S::kP>(q_s, rA, kk, cq, a);
      }
#pragma unroll
      for (int j = 0; j < BN / 8; j += 2) {
        const dev::bf16* krow =
            k_s + ((j + (lane >> 4)) * 8 + (lane & 7)) * S::kP + kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t b0, b1, b2, b3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                     : "r"(smem_u32(krow)));
        dev::mma_bf16_16816(s[j], a, b0, b1);
        dev::mma_bf16_16816(s[j + 1], a, b2, b3);
      }
    }

    // Mask, scale to the exp2 domain, online softmax.
    float tmA = -INFINITY, tmB = -INFINITY;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kp = n0 + j * 8 + cq * 2 + (e & 1);
        const int pos = e < 2 ? posA : posB;
        const bool ok = (e < 2 ? rowA_ok : rowB_ok) && kp <= pos && kp < kend &&
                        (b.window <= 0 || kp > pos - b.window);
        s[j][e] = ok ? s[j][e] * sl2 : -INFINITY;
        if (e < 2)
          tmA = fmaxf(tmA, s[j][e]);
        else
          tmB = fmaxf(tmB, s[j][e]);
      }
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
      tmA = fmaxf(tmA, __shfl_xor_sync(0xffffffffu, tmA, o2));
      tmB = fmaxf(tmB, __shfl_xor_sync(0xffffffffu, tmB, o2));
    }
    const float nmA = fmaxf(mA, tmA), nmB = fmaxf(mB, tmB);
    const float uA = nmA == -INFINITY ? 0.f : nmA, uB = nmB == -INFINITY ? 0.f : nmB;
    const float alA = exp2f(mA - uA), alB = exp2f(mB - uB);
    mA = nmA, mB = nmB;
    float sumA = 0.f, sumB = 0.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      s[j][0] = exp2f(s[j][0] - uA), s[j][1] = exp2f(s[j][1] - uA);
      s[j][2] = exp2f(s[j][2] - uB), s[j][3] = exp2f(s[j][3] - uB);
      sumA += s[j][0] + s[j][1];
      sumB += s[j][2] + s[j][3];
    }
    lA = lA * alA + sumA;
    lB = lB * alB + sumB;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[j][0] *= alA, o[j][1] *= alA, o[j][2] *= alB, o[j][3] *= alB;

      // O += P V; V's B fragments come transposed out of the row-major tile (ldmatrix.trans).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int j = 0; j < HD / 8; j += 2) {
        const dev::bf16* vrow =
            v_s + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * S::kP + (j + (lane >> 4)) * 8;
        uint32_t b0, b1, b2, b3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                     : "r"(smem_u32(vrow)));
        dev::mma_bf16_16816(o[j], a, b0, b1);
        dev::mma_bf16_16816(o[j + 1], a, b2, b3);
      }
    }
    __syncthreads();  // every warp is done with tile `stage` before it is refilled
  }

#pragma unroll
  for (int o2 = 1; o2 <= 2; o2 <<= 1) {
    lA += __shfl_xor_sync(0xffffffffu, lA, o2);
    lB += __shfl_xor_sync(0xffffffffu, lB, o2);
  }
  // The head's sink (if any) joins each row's denominator here, once.
  const float iA = attention_norm_factor(b.sinks, h, mA, lA),
              iB = attention_norm_factor(b.sinks, h, mB, lB);
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) {
    const int d = j * 8 + cq * 2;
    if (d >= hd) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const bool ok = half == 0 ? rowA_ok : rowB_ok;
      if (!ok) continue;
      const int r = half == 0 ? rA : rB;
      const float inv = half == 0 ? iA : iB;
      const size_t off =
          static_cast<size_t>(qs + m0 + r) * b.out_stride + static_cast<size_t>(h) * hd + d;
      const float x0 = o[j][2 * half] * inv, x1 = o[j][2 * half + 1] * inv;
      if (b.dtype == DType::bf16) {
        *reinterpret_cast<__nv_bfloat162*>(static_cast<dev::bf16*>(b.out) + off) =
            __floats2bfloat162_rn(x0, x1);
      } else {
        float* op = static_cast<float*>(b.out) + off;
        op[0] = x0, op[1] = x1;
      }
    }
  }
}

template <typename C, int HD, int BN>
Status launch_prefill_v1(const AttentionBatch& b, cudaStream_t st) {
  constexpr size_t smem = PrefillSmem<HD, BN>::bytes;
  auto* k = prefill_v1_kernel<C, HD, BN>;
  SPARK_TRY(detail::prepare_launch(k, "attention_prefill", kWarpsP * 32, smem));
  const dim3 grid(static_cast<unsigned>((b.max_query_len + kBM - 1) / kBM),
                  static_cast<unsigned>(b.n_heads), static_cast<unsigned>(b.n_seqs));
  k<<<grid, kWarpsP * 32, smem, st>>>(b);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

template <typename C>
Status dispatch_prefill_v1(const AttentionBatch& b, cudaStream_t st) {
  const int hd = b.kv.head_dim;
  if (hd <= 64) return launch_prefill_v1<C, 64, 64>(b, st);
  if (hd <= 128) return launch_prefill_v1<C, 128, 64>(b, st);
  return launch_prefill_v1<C, 256, 32>(b, st);
}

// ---- the tiled kernel ----------------------------------------------------------------

// W warps of 16 x MT query rows each; one K and one V buffer (V of a tile loads under
// Q K^T, the next K under softmax and P V), and the tile's gather offsets, two tiles deep.
template <int HD, int BN, int MT, int W>
struct TiledSmem {
  static constexpr int kBM = W * 16 * MT;  // queries per block
  static constexpr int kP = HD + 8;        // row pitch (bf16): 16-byte rows 1 bank group apart
  static constexpr size_t q_elems = size_t{kBM} * kP;
  static constexpr size_t kv_elems = size_t{BN} * kP;
  static constexpr size_t bytes = (q_elems + 2 * kv_elems) * 2 + 2 * BN * sizeof(uint32_t);
};

// A key with no row in the tile (past the attended range).
constexpr uint32_t kNoRow = 0xffffffffu;

// 2^x on the special-function unit; -inf gives +0, which is what masked scores need.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The online softmax of one key tile for a warp's MT 16-row tiles (both kernels below):
// masks what the row may not see where `need_mask` (causal; `window` > 0 also the keys
// before it), raises each row's running maximum (raw score units; the scale sl2 goes into
// the exponent's FMA), replaces the scores by their exp2 and adds them to the row sums.
// al gets each row's rescale factor for o; returns whether any of this lane's maxima rose.
template <int MT, int BN>
__device__ __forceinline__ bool softmax_tile(float (&s)[MT][BN / 8][4], float (&mrow)[MT][2],
                                             float (&lrow)[MT][2], float (&al)[MT][2],
                                             bool need_mask, int n0, int wfirst, int g, int cq,
                                             int window, float sl2) {
  bool raised = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int posA = wfirst + mt * 16 + g, posB = posA + 8;
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kp = n0 + j * 8 + cq * 2 + (e & 1);
          const int pos = e < 2 ? posA : posB;
          if (kp > pos || (window > 0 && kp <= pos - window)) s[mt][j][e] = -INFINITY;
        }
    }
    float tm[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      tm[0] = fmaxf(tm[0], fmaxf(s[mt][j][0], s[mt][j][1]));
      tm[1] = fmaxf(tm[1], fmaxf(s[mt][j][2], s[mt][j][3]));
    }
    float ms[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      tm[hr] = fmaxf(tm[hr], __shfl_xor_sync(0xffffffffu, tm[hr], 1));
      tm[hr] = fmaxf(tm[hr], __shfl_xor_sync(0xffffffffu, tm[hr], 2));
      const float nm = fmaxf(mrow[mt][hr], tm[hr]);
      ms[hr] = nm == -INFINITY ? 0.f : nm * sl2;
      if (nm != mrow[mt][hr]) {
        al[mt][hr] = fast_exp2(fmaf(mrow[mt][hr], sl2, -ms[hr]));
        raised = true;
      } else {
        al[mt][hr] = 1.f;
      }
      mrow[mt][hr] = nm;
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[mt][j][e] = fast_exp2(fmaf(s[mt][j][e], sl2, -ms[e >> 1]));
        sum[e >> 1] += s[mt][j][e];
      }
    lrow[mt][0] = lrow[mt][0] * al[mt][0] + sum[0];
    lrow[mt][1] = lrow[mt][1] * al[mt][1] + sum[1];
  }
  return raised;
}

template <typename C, int HD, int BN, int MT, int W>
__global__ void __launch_bounds__(W * 32, 8 / W) prefill_tiled_kernel(AttentionBatch b) {
  using S = TiledSmem<HD, BN, MT, W>;
  constexpr int kBM = S::kBM, kP = S::kP, kCh = HD / 8, kT = W * 32;
  constexpr int kKK = HD / 16;  // k-steps of S = Q K^T
  static_assert(BN <= kT, "one thread per key fills the gather offsets");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  dev::bf16* q_s = reinterpret_cast<dev::bf16*>(smem_raw);
  dev::bf16* k_s = q_s + S::q_elems;
  dev::bf16* v_s = k_s + S::kv_elems;
  uint32_t* ofs_s = reinterpret_cast<uint32_t*>(v_s + S::kv_elems);  // [2][BN]

  const int h = blockIdx.x, seq = blockIdx.z;
  const int tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);  // longest tiles first
  const int qs = b.query_start[seq];
  const int qlen = b.query_start[seq + 1] - qs;
  const int m0 = tile * kBM;
  if (m0 >= qlen) return;
  const int ctx = b.seq_lens[seq];
  const int hd = b.kv.head_dim;
  const int kvh = h / (b.n_heads / b.kv.n_kv_heads);
  const int rows = min(kBM, qlen - m0);  // valid query rows of the tile
  const int p0 = ctx - qlen + m0;        // position of the tile's first query
  const int kend = p0 + rows;            // keys [kstart, kend) are attended by some row
  int kstart = b.window > 0 ? max(0, p0 - b.window + 1) : 0;
  kstart = kstart / BN * BN;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;

  // Q tile -> shared memory (bf16, zero padded): in the first cp.async group with K's tile.
  for (int c = tid; c < kBM * kCh; c += kT) {
    const int r = c / kCh, d = (c % kCh) * 8;
    const bool valid = r < rows && d < hd;
    const size_t off =
        valid ? static_cast<size_t>(qs + m0 + r) * b.q_stride + static_cast<size_t>(h) * hd + d : 0;
    dev::bf16* dst = q_s + r * kP + d;
    if (b.dtype == DType::bf16)
      cp_async16(dst, static_cast<const dev::bf16*>(b.q) + off, valid);
    else
      *reinterpret_cast<uint4*>(dst) =
          load8_bf16<float>(static_cast<const float*>(b.q) + off, valid);
  }

  // The gather: one thread per key of a tile looks its block up once and leaves the row's
  // offset in 8-element units (32 bits: the host checks the pool's size) for the K and
  // the V copies of every thread.
  const int32_t* table = b.block_tables + static_cast<size_t>(seq) * b.max_blocks_per_seq;
  const uint32_t row8 = static_cast<uint32_t>(b.kv.n_kv_heads * hd / 8);
  const uint32_t head8 = static_cast<uint32_t>(kvh * hd / 8);
  const int bsz = b.kv.block_size;
  const int bshift = (bsz & (bsz - 1)) == 0 ? __ffs(bsz) - 1 : -1;  // a power of two: shifts
  auto fill_offsets = [&](int n0, uint32_t* ofs) {
    if (tid < BN) {
      const int kp = n0 + tid;
      uint32_t o = kNoRow;
      if (kp < kend) {
        const int blk = bshift >= 0 ? table[kp >> bshift] : table[kp / bsz];
        const int in = bshift >= 0 ? kp & (bsz - 1) : kp % bsz;
        o = (static_cast<uint32_t>(blk) * static_cast<uint32_t>(bsz) + static_cast<uint32_t>(in)) *
                row8 +
            head8;
      }
      ofs[tid] = o;
    }
  };
  const C* kpool = static_cast<const C*>(b.kv.k);
  const C* vpool = static_cast<const C*>(b.kv.v);
  // One K or V tile into `dst` by the offsets `ofs`; keys without a row are zeros.
  auto load_tile = [&](dev::bf16* dst, const C* pool, const uint32_t* ofs) {
#pragma unroll
    for (int c = tid; c < BN * kCh; c += kT) {
      const int r = c / kCh, d8 = c % kCh;
      const uint32_t o = ofs[r];
      const bool valid = o != kNoRow && d8 * 8 < hd;
      const C* src = pool + static_cast<size_t>(valid ? o + d8 : 0) * 8;
      if constexpr (std::is_same_v<C, dev::bf16>)
        cp_async16(dst + r * kP + d8 * 8, src, valid);
      else
        *reinterpret_cast<uint4*>(dst + r * kP + d8 * 8) = load8_bf16<C>(src, valid);
    }
    cp_async_commit();
  };

  fill_offsets(kstart, ofs_s);
  __syncthreads();
  load_tile(k_s, kpool, ofs_s);

  const int g = lane >> 2, cq = lane & 3;
  const int wr = warp * 16 * MT;           // the warp's first row in the tile
  const int wfirst = p0 + wr;              // ... its position
  const int wlast = wfirst + 16 * MT - 1;  // the position of its last row
  const bool warp_live = wr < rows;
  const float sl2 = b.scale * 1.4426950408889634f;
  // The output is rescaled only on tiles that raise some row's maximum (the benchmark's
  // variant 5 rescales on every tile, to time the difference).
  const bool lazy = b.prefill_variant != 5;

  // Q's A fragments stay in registers when they are few (MT * head_dim <= 128).
  constexpr bool kHoistQ = MT * HD <= 128;
  uint32_t qf[kHoistQ ? MT * kKK : 1][4];
  if constexpr (kHoistQ) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kk = 0; kk < kKK; ++kk)
        dev::ldsm_x4(qf[mt * kKK + kk],
                     q_s + (wr + mt * 16 + (lane & 15)) * kP + kk * 16 + (lane >> 4) * 8);
  }

  float o[MT][HD / 8][4];
  float mrow[MT][2], lrow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
    mrow[mt][0] = mrow[mt][1] = -INFINITY;
    lrow[mt][0] = lrow[mt][1] = 0.f;
  }

  for (int n0 = kstart, it = 0; n0 < kend; n0 += BN, ++it) {
    const uint32_t* ofs = ofs_s + (it & 1) * BN;
    uint32_t* ofs_next = ofs_s + ((it + 1) & 1) * BN;
    const bool more = n0 + BN < kend;
    cp_async_wait<0>();
    __syncthreads();  // K of this tile (and Q) landed; every warp is done with V's buffer
    load_tile(v_s, vpool, ofs);
    if (more) fill_offsets(n0 + BN, ofs_next);  // read after the next barrier
    // A warp whose rows all precede the tile's first key has nothing to do on it.
    const bool active = warp_live && n0 <= wlast;
    float s[MT][BN / 8][4];
    if (active) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kKK; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (kHoistQ) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt * kKK + kk][i];
          } else {
            dev::ldsm_x4(a[mt],
                         q_s + (wr + mt * 16 + (lane & 15)) * kP + kk * 16 + (lane >> 4) * 8);
          }
        }
#pragma unroll
        for (int j = 0; j < BN / 8; j += 2) {
          uint32_t kb[4];
          dev::ldsm_x4(kb, k_s + ((j + (lane >> 4)) * 8 + (lane & 7)) * kP + kk * 16 +
                               ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            dev::mma_bf16_16816(s[mt][j], a[mt], kb[0], kb[1]);
            dev::mma_bf16_16816(s[mt][j + 1], a[mt], kb[2], kb[3]);
          }
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // V of this tile and the next offsets landed; K's buffer is free
    if (more) load_tile(k_s, kpool, ofs_next);
    if (!active) continue;

    // Only a tile that reaches past the warp's first row (or any tile under a window)
    // needs the mask.
    float al[MT][2];
    const bool raised = softmax_tile<MT, BN>(
        s, mrow, lrow, al, b.window > 0 || n0 + BN - 1 > wfirst, n0, wfirst, g, cq, b.window, sl2);
    if (!lazy || __any_sync(0xffffffffu, raised)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
          o[mt][j][0] *= al[mt][0], o[mt][j][1] *= al[mt][0];
          o[mt][j][2] *= al[mt][1], o[mt][j][3] *= al[mt][1];
        }
    }

    // O += P V; V's B fragments come transposed out of the row-major tile.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int j = 0; j < HD / 8; j += 2) {
        uint32_t vb[4];
        dev::ldsm_x4_trans(
            vb, v_s + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * kP + (j + (lane >> 4)) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          dev::mma_bf16_16816(o[mt][j], a[mt], vb[0], vb[1]);
          dev::mma_bf16_16816(o[mt][j + 1], a[mt], vb[2], vb[3]);
        }
      }
    }
  }

  if (!warp_live) return;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float lA = lrow[mt][0], lB = lrow[mt][1];
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
      lA += __shfl_xor_sync(0xffffffffu, lA, o2);
      lB += __shfl_xor_sync(0xffffffffu, lB, o2);
    }
    // Row maxima are in raw score units; the sink (if any) joins each row's denominator.
    const float iA = attention_norm_factor(b.sinks, h, mrow[mt][0] * sl2, lA),
                iB = attention_norm_factor(b.sinks, h, mrow[mt][1] * sl2, lB);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wr + mt * 16 + g + half * 8;
      if (r >= rows) continue;
      const float inv = half == 0 ? iA : iB;
      const size_t base =
          static_cast<size_t>(qs + m0 + r) * b.out_stride + static_cast<size_t>(h) * hd;
#pragma unroll
      for (int j = 0; j < HD / 8; ++j) {
        const int d = j * 8 + cq * 2;
        if (d >= hd) continue;
        const float x0 = o[mt][j][2 * half] * inv, x1 = o[mt][j][2 * half + 1] * inv;
        if (b.dtype == DType::bf16) {
          *reinterpret_cast<__nv_bfloat162*>(static_cast<dev::bf16*>(b.out) + base + d) =
              __floats2bfloat162_rn(x0, x1);
        } else {
          float* op = static_cast<float*>(b.out) + base + d;
          op[0] = x0, op[1] = x1;
        }
      }
    }
  }
}

template <typename C, int HD, int BN, int MT, int W = 4>
Status launch_prefill_tiled(const AttentionBatch& b, cudaStream_t st) {
  using S = TiledSmem<HD, BN, MT, W>;
  auto* k = prefill_tiled_kernel<C, HD, BN, MT, W>;
  SPARK_TRY(detail::prepare_launch(k, "attention_prefill", W * 32, S::bytes));
  const int tiles = (b.max_query_len + S::kBM - 1) / S::kBM;
  if (tiles > 65535)
    return make_error(Errc::usage, "attention_prefill: " + std::to_string(tiles) +
                                       " query tiles of " + std::to_string(S::kBM) +
                                       " exceed the grid's 65535; split the prompt into chunks");
  const dim3 grid(static_cast<unsigned>(b.n_heads), static_cast<unsigned>(tiles),
                  static_cast<unsigned>(b.n_seqs));
  k<<<grid, W * 32, S::bytes, st>>>(b);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

// ---- the skewed kernel: two groups of 4 warps out of phase ---------------------------
// With one block of 8 warps on a multiprocessor, the tiled kernel's barriers keep every
// warp in step: all of them run the softmax at once and the tensor cores idle meanwhile.
// Here the second group of 4 warps runs each tile's P V one tile late, ahead of the next
// tile's Q K^T (FlashAttention-3's ping-pong, with mma.sync): while one group is in its
// softmax the other is in a product. K/V are a ring of 3 stages, so the tile a late warp
// still reads is never the one being refilled; one barrier a tile.
template <int HD, int BN, int MT>
struct SkewSmem {
  static constexpr int kW = 8, kStages = 3;
  static constexpr int kBM = kW * 16 * MT;
  static constexpr int kP = HD + 8;
  static constexpr size_t q_elems = size_t{kBM} * kP;
  static constexpr size_t kv_elems = size_t{BN} * kP;
  static constexpr size_t bytes =
      (q_elems + 2 * kStages * kv_elems) * 2 + kStages * BN * sizeof(uint32_t);
};

template <typename C, int HD, int BN, int MT>
__global__ void __launch_bounds__(256, 1) prefill_skew_kernel(AttentionBatch b) {
  using S = SkewSmem<HD, BN, MT>;
  constexpr int kBM = S::kBM, kP = S::kP, kCh = HD / 8, kT = S::kW * 32, kNS = S::kStages;
  constexpr int kKK = HD / 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  dev::bf16* q_s = reinterpret_cast<dev::bf16*>(smem_raw);
  dev::bf16* kv_s = q_s + S::q_elems;  // stage t: K at kv_s + 2t * kv_elems, V after it
  uint32_t* ofs_s = reinterpret_cast<uint32_t*>(kv_s + 2 * kNS * S::kv_elems);  // [kNS][BN]

  const int h = blockIdx.x, seq = blockIdx.z;
  const int tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int qs = b.query_start[seq];
  const int qlen = b.query_start[seq + 1] - qs;
  const int m0 = tile * kBM;
  if (m0 >= qlen) return;
  const int ctx = b.seq_lens[seq];
  const int hd = b.kv.head_dim;
  const int kvh = h / (b.n_heads / b.kv.n_kv_heads);
  const int rows = min(kBM, qlen - m0);
  const int p0 = ctx - qlen + m0;
  const int kend = p0 + rows;
  int kstart = b.window > 0 ? max(0, p0 - b.window + 1) : 0;
  kstart = kstart / BN * BN;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const bool late = warp >= 4;  // the group whose P V runs one tile late

  for (int c = tid; c < kBM * kCh; c += kT) {
    const int r = c / kCh, d = (c % kCh) * 8;
    const bool valid = r < rows && d < hd;
    const size_t off =
        valid ? static_cast<size_t>(qs + m0 + r) * b.q_stride + static_cast<size_t>(h) * hd + d : 0;
    dev::bf16* dst = q_s + r * kP + d;
    if (b.dtype == DType::bf16)
      cp_async16(dst, static_cast<const dev::bf16*>(b.q) + off, valid);
    else
      *reinterpret_cast<uint4*>(dst) =
          load8_bf16<float>(static_cast<const float*>(b.q) + off, valid);
  }

  const int32_t* table = b.block_tables + static_cast<size_t>(seq) * b.max_blocks_per_seq;
  const uint32_t row8 = static_cast<uint32_t>(b.kv.n_kv_heads * hd / 8);
  const uint32_t head8 = static_cast<uint32_t>(kvh * hd / 8);
  const int bsz = b.kv.block_size;
  const int bshift = (bsz & (bsz - 1)) == 0 ? __ffs(bsz) - 1 : -1;
  auto fill_offsets = [&](int n0, uint32_t* ofs) {
    if (tid < BN) {
      const int kp = n0 + tid;
      uint32_t o = kNoRow;
      if (kp < kend) {
        const int blk = bshift >= 0 ? table[kp >> bshift] : table[kp / bsz];
        const int in = bshift >= 0 ? kp & (bsz - 1) : kp % bsz;
        o = (static_cast<uint32_t>(blk) * static_cast<uint32_t>(bsz) + static_cast<uint32_t>(in)) *
                row8 +
            head8;
      }
      ofs[tid] = o;
    }
  };
  const C* kpool = static_cast<const C*>(b.kv.k);
  const C* vpool = static_cast<const C*>(b.kv.v);
  // K and V of one tile into stage `st` by that stage's offsets, one cp.async group.
  auto load_tile = [&](int st) {
    const uint32_t* ofs = ofs_s + st * BN;
    dev::bf16* ks = kv_s + static_cast<size_t>(2 * st) * S::kv_elems;
    dev::bf16* vs = ks + S::kv_elems;
#pragma unroll
    for (int c = tid; c < BN * kCh; c += kT) {
      const int r = c / kCh, d8 = c % kCh;
      const uint32_t o = ofs[r];
      const bool valid = o != kNoRow && d8 * 8 < hd;
      const size_t e = static_cast<size_t>(valid ? o + d8 : 0) * 8;
      if constexpr (std::is_same_v<C, dev::bf16>) {
        cp_async16(ks + r * kP + d8 * 8, kpool + e, valid);
        cp_async16(vs + r * kP + d8 * 8, vpool + e, valid);
      } else {
        *reinterpret_cast<uint4*>(ks + r * kP + d8 * 8) = load8_bf16<C>(kpool + e, valid);
        *reinterpret_cast<uint4*>(vs + r * kP + d8 * 8) = load8_bf16<C>(vpool + e, valid);
      }
    }
    cp_async_commit();
  };

  fill_offsets(kstart, ofs_s);
  if (kstart + BN < kend) fill_offsets(kstart + BN, ofs_s + BN);
  __syncthreads();
  load_tile(0);

  const int g = lane >> 2, cq = lane & 3;
  const int wr = warp * 16 * MT;
  const int wfirst = p0 + wr;
  const int wlast = wfirst + 16 * MT - 1;
  const bool warp_live = wr < rows;
  const float sl2 = b.scale * 1.4426950408889634f;

  constexpr bool kHoistQ = MT * HD <= 128;
  uint32_t qf[kHoistQ ? MT * kKK : 1][4];
  if constexpr (kHoistQ) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kk = 0; kk < kKK; ++kk)
        dev::ldsm_x4(qf[mt * kKK + kk],
                     q_s + (wr + mt * 16 + (lane & 15)) * kP + kk * 16 + (lane >> 4) * 8);
  }

  float o[MT][HD / 8][4];
  float mrow[MT][2], lrow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
    mrow[mt][0] = mrow[mt][1] = -INFINITY;
    lrow[mt][0] = lrow[mt][1] = 0.f;
  }
  uint32_t pp[MT][BN / 16][4];  // P of the last tile as bf16 A fragments
  int pv_stage = -1;            // the stage P V still has to read (late group), or -1

  auto pv = [&](int st) {
    const dev::bf16* v_s = kv_s + static_cast<size_t>(2 * st + 1) * S::kv_elems;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int j = 0; j < HD / 8; j += 2) {
        uint32_t vb[4];
        dev::ldsm_x4_trans(
            vb, v_s + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * kP + (j + (lane >> 4)) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          dev::mma_bf16_16816(o[mt][j], pp[mt][kk], vb[0], vb[1]);
          dev::mma_bf16_16816(o[mt][j + 1], pp[mt][kk], vb[2], vb[3]);
        }
      }
  };

  for (int n0 = kstart, it = 0; n0 < kend; n0 += BN, ++it) {
    const int st = it % kNS;
    cp_async_wait<0>();
    // This tile landed; every warp is done with the stage refilled next (read two tiles
    // ago by the early group, one tile ago by the late one).
    __syncthreads();
    if (n0 + BN < kend) load_tile((it + 1) % kNS);
    if (n0 + 2 * BN < kend) fill_offsets(n0 + 2 * BN, ofs_s + ((it + 2) % kNS) * BN);
    if (late && pv_stage >= 0) {
      pv(pv_stage);
      pv_stage = -1;
    }
    if (!(warp_live && n0 <= wlast)) continue;
    const dev::bf16* k_s = kv_s + static_cast<size_t>(2 * st) * S::kv_elems;

    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKK; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (kHoistQ) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt * kKK + kk][i];
        } else {
          dev::ldsm_x4(a[mt], q_s + (wr + mt * 16 + (lane & 15)) * kP + kk * 16 + (lane >> 4) * 8);
        }
      }
#pragma unroll
      for (int j = 0; j < BN / 8; j += 2) {
        uint32_t kb[4];
        dev::ldsm_x4(
            kb, k_s + ((j + (lane >> 4)) * 8 + (lane & 7)) * kP + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          dev::mma_bf16_16816(s[mt][j], a[mt], kb[0], kb[1]);
          dev::mma_bf16_16816(s[mt][j + 1], a[mt], kb[2], kb[3]);
        }
      }
    }

    float al[MT][2];
    const bool raised = softmax_tile<MT, BN>(
        s, mrow, lrow, al, b.window > 0 || n0 + BN - 1 > wfirst, n0, wfirst, g, cq, b.window, sl2);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pp[mt][kk][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pp[mt][kk][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pp[mt][kk][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pp[mt][kk][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
    // The late group's P V of the previous tile is already in o, so o can be rescaled.
    if (__any_sync(0xffffffffu, raised)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
          o[mt][j][0] *= al[mt][0], o[mt][j][1] *= al[mt][0];
          o[mt][j][2] *= al[mt][1], o[mt][j][3] *= al[mt][1];
        }
    }
    if (late)
      pv_stage = st;
    else
      pv(st);
  }
  if (pv_stage >= 0) pv(pv_stage);  // the late group's last tile: its stage is not refilled

  if (!warp_live) return;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float lA = lrow[mt][0], lB = lrow[mt][1];
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
      lA += __shfl_xor_sync(0xffffffffu, lA, o2);
      lB += __shfl_xor_sync(0xffffffffu, lB, o2);
    }
    // Row maxima are in raw score units; the sink (if any) joins each row's denominator.
    const float iA = attention_norm_factor(b.sinks, h, mrow[mt][0] * sl2, lA),
                iB = attention_norm_factor(b.sinks, h, mrow[mt][1] * sl2, lB);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wr + mt * 16 + g + half * 8;
      if (r >= rows) continue;
      const float inv = half == 0 ? iA : iB;
      const size_t base =
          static_cast<size_t>(qs + m0 + r) * b.out_stride + static_cast<size_t>(h) * hd;
#pragma unroll
      for (int j = 0; j < HD / 8; ++j) {
        const int d = j * 8 + cq * 2;
        if (d >= hd) continue;
        const float x0 = o[mt][j][2 * half] * inv, x1 = o[mt][j][2 * half + 1] * inv;
        if (b.dtype == DType::bf16) {
          *reinterpret_cast<__nv_bfloat162*>(static_cast<dev::bf16*>(b.out) + base + d) =
              __floats2bfloat162_rn(x0, x1);
        } else {
          float* op = static_cast<float*>(b.out) + base + d;
          op[0] = x0, op[1] = x1;
        }
      }
    }
  }
}

template <typename C, int HD, int BN, int MT>
Status launch_prefill_skew(const AttentionBatch& b, cudaStream_t st) {
  using S = SkewSmem<HD, BN, MT>;
  auto* k = prefill_skew_kernel<C, HD, BN, MT>;
  SPARK_TRY(detail::prepare_launch(k, "attention_prefill", S::kW * 32, S::bytes));
  const int tiles = (b.max_query_len + S::kBM - 1) / S::kBM;
  if (tiles > 65535)
    return make_error(Errc::usage, "attention_prefill: " + std::to_string(tiles) +
                                       " query tiles of " + std::to_string(S::kBM) +
                                       " exceed the grid's 65535; split the prompt into chunks");
  const dim3 grid(static_cast<unsigned>(b.n_heads), static_cast<unsigned>(tiles),
                  static_cast<unsigned>(b.n_seqs));
  k<<<grid, S::kW * 32, S::bytes, st>>>(b);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

// Block shapes: 64, 128 or 256 queries (4 warps of 16 or 32 rows, 8 warps of 32). More
// rows a warp halve the shared-memory reads per product, more warps a block halve the
// gather and the L2 reads per product; fewer, shorter blocks win when the grid is too
// small to fill the device, where the longest block sets the time (short prompts). The
// engine's choice (variant 0): 256 where the shared memory allows and the grid has a
// block per multiprocessor, else 128 with two blocks per multiprocessor, else 64; and
// where the skewed kernel's 3-stage ring fits (the H200, not GB10), it instead of 256.
template <typename C>
Status dispatch_prefill_tiled(const AttentionBatch& b, cudaStream_t st) {
  const int hd = b.kv.head_dim;
  // head_dim 256: two m-tiles would need 256 accumulator registers a thread.
  if (hd > 128) return launch_prefill_tiled<C, 256, 32, 1>(b, st);
  auto lim = cuda_device_limits();
  SPARK_TRY(lim.status());
  const size_t wide = hd <= 64 ? TiledSmem<64, 64, 2, 8>::bytes : TiledSmem<128, 64, 2, 8>::bytes;
  auto blocks = [&](int bm) {
    return static_cast<long long>((b.max_query_len + bm - 1) / bm) * b.n_heads * b.n_seqs;
  };
  const bool skew_fits = lim->smem_per_block_optin >=
                         (hd <= 64 ? SkewSmem<64, 64, 2>::bytes : SkewSmem<128, 64, 2>::bytes);
  if (b.prefill_variant == 6 ||
      (b.prefill_variant == 0 && skew_fits && blocks(256) >= lim->sm_count))
    return hd <= 64 ? launch_prefill_skew<C, 64, 64, 2>(b, st)
                    : launch_prefill_skew<C, 128, 64, 2>(b, st);
  int bm = 64;
  if (b.prefill_variant == 3)
    bm = 128;
  else if (b.prefill_variant == 4 || b.prefill_variant == 5)
    bm = 256;
  else if (b.prefill_variant == 0)
    bm = lim->smem_per_block_optin >= wide && blocks(256) >= lim->sm_count ? 256
         : blocks(128) >= 2LL * lim->sm_count                              ? 128
                                                                           : 64;
  if (hd <= 64)
    return bm == 256   ? launch_prefill_tiled<C, 64, 64, 2, 8>(b, st)
           : bm == 128 ? launch_prefill_tiled<C, 64, 64, 2>(b, st)
                       : launch_prefill_tiled<C, 64, 64, 1>(b, st);
  return bm == 256   ? launch_prefill_tiled<C, 128, 64, 2, 8>(b, st)
         : bm == 128 ? launch_prefill_tiled<C, 128, 64, 2>(b, st)
                     : launch_prefill_tiled<C, 128, 64, 1>(b, st);
}

}  // namespace

Status attention_prefill_cuda_device(const AttentionBatch& b, void* stream) {
  SPARK_TRY(attention_check_args(b, false));
  if (b.n_seqs == 0 || b.n_tokens == 0) return Status::Ok();
  if (b.n_seqs > 65535 || b.n_heads > 65535)
    return make_error(Errc::usage,
                      "attention_prefill: more than 65535 sequences or heads in one batch");
  auto st = static_cast<cudaStream_t>(stream);
  // The tiled kernel's gather offsets are 32-bit counts of 8-element units: a pool beyond
  // that (or of unknown size) runs on the previous kernel, whose offsets are 64-bit.
  const unsigned long long units = static_cast<unsigned long long>(std::max(b.kv.num_blocks, 0)) *
                                   static_cast<unsigned long long>(b.kv.block_size) *
                                   static_cast<unsigned long long>(b.kv.n_kv_heads) *
                                   static_cast<unsigned long long>(b.kv.head_dim / 8);
  if (b.prefill_variant == 1 || units == 0 || units >= (1ull << 32))
    SPARK_DISPATCH_KV(b.kv.dtype, C, return dispatch_prefill_v1<C>(b, st));
  SPARK_DISPATCH_KV(b.kv.dtype, C, return dispatch_prefill_tiled<C>(b, st));
  return Status::Ok();
}

}  // namespace spark::kernels
