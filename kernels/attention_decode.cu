// Decode attention over the paged KV cache, the partitioned kernel (kept for comparison with
// attention_decode_split.cu in the kernel benchmark). Grid: (partition of kDecodePartition context
// positions, KV head x group chunk, sequence). One block serves every query head of its KV
// head's group (GQA), so each K and V row is read from memory once per step:
//   1. q of the group's heads (pre-scaled) into shared memory;
//   2. scores: rows of the partition are spread over the warps, L = HD/8 lanes per row,
//      each lane a 16-byte load of K and a dot with its 8 q elements, reduced over L lanes;
//   3. softmax of the partition per head (one warp per head);
//   4. V: the same row layout, each lane accumulating p * v for its 8 dimensions, reduced
//      over the rows of a warp by shuffles and over warps through shared memory.
// With one partition the result is written directly; otherwise each partition leaves
// (max, sum, unnormalised output) in the workspace and a second kernel merges them.
#include <cfloat>

#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/paged_attention.h"

namespace spark::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kGMax = 8;  // query heads per block; larger groups run in chunks
constexpr int kP = kDecodePartition;
constexpr int kBatch = 8;  // rows whose loads a lane issues before using the first

using dev::load_raw;
using dev::to_floats;
using dev::zero_raw;
template <typename C>
using Raw = dev::Raw8<C>;

struct DecodeParams {
  AttentionBatch b;
  int group;   // query heads per KV head
  int chunks;  // ceil(group / kGMax)
  int splits;
};

// 1 / softmax denominator for scores whose maximum is m and whose sum of exp(s - m) is l;
// a head's sink logit joins the denominator only (once per head, at the final normalise).
__device__ __forceinline__ float sink_inv(const float* sinks, int h, float m, float l) {
  if (!sinks) return l > 0.f ? 1.f / l : 0.f;
  const float sk = sinks[h];
  const float ref = l > 0.f ? fmaxf(m, sk) : sk;
  const float scaled = l > 0.f ? l * __expf(m - ref) : 0.f;
  const float den = scaled + __expf(sk - ref);
  return l > 0.f ? __expf(m - ref) / den : 0.f;
}

template <typename C, int HD>
__global__ void __launch_bounds__(kWarps * 32) decode_kernel(DecodeParams P) {
  constexpr int L = HD / 8;    // lanes per row
  constexpr int RPW = 32 / L;  // rows per warp
  constexpr int ROWS = kWarps * RPW;
  __shared__ __align__(16) float q_s[kGMax][HD];
  __shared__ float s_s[kGMax][kP];
  __shared__ __align__(16) float red[kWarps][HD];
  __shared__ float stat[2][kGMax];
  __shared__ int32_t tbl_s[kP + 1];  // the pool blocks of this partition's positions

  const AttentionBatch& b = P.b;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / P.chunks, chunk = blockIdx.y % P.chunks;
  const int seq = blockIdx.z;
  const int hd = b.kv.head_dim;
  const int g0 = chunk * kGMax;
  const int gn = min(kGMax, P.group - g0);
  const int ctx = b.seq_lens[seq];
  const size_t token =
      b.query_start ? static_cast<size_t>(b.query_start[seq]) : static_cast<size_t>(seq);
  const int pos = ctx - 1;
  const int first = b.window > 0 ? max(0, pos - b.window + 1) : 0;
  const int lo = max(split * kP, first), hi = min((split + 1) * kP, ctx);
  const int n = hi - lo;  // may be <= 0: an empty partition
  const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;

  // 1. q, scaled.
  for (int i = tid; i < kGMax * HD; i += blockDim.x) {
    const int g = i / HD, d = i % HD;
    float v = 0.f;
    if (g < gn && d < hd) {
      const size_t off =
          token * b.q_stride + static_cast<size_t>((kvh * P.group + g0 + g) * hd + d);
      v = b.dtype == DType::bf16 ? __bfloat162float(static_cast<const dev::bf16*>(b.q)[off])
                                 : static_cast<const float*>(b.q)[off];
    }
    q_s[g][d] = v * b.scale;
  }
  // The block table entries of the partition, fetched with q (one round trip for both)
  // rather than before each K and V row.
  const int bs = b.kv.block_size;
  const int blk0 = n > 0 ? lo / bs : 0;
  const int nblk = n > 0 ? (hi - 1) / bs - blk0 + 1 : 0;
  for (int i = tid; i < nblk; i += blockDim.x)
    tbl_s[i] = b.block_tables[static_cast<size_t>(seq) * b.max_blocks_per_seq + blk0 + i];
  __syncthreads();

  const int sub = static_cast<int>(lane) / L, li = static_cast<int>(lane) % L;
  const int row0 = static_cast<int>(warp) * RPW + sub;
  const int d0 = li * 8;
  const bool active = d0 < hd;
  const C* kpool = static_cast<const C*>(b.kv.k);
  const C* vpool = static_cast<const C*>(b.kv.v);
  const size_t row_elems = static_cast<size_t>(b.kv.n_kv_heads) * hd;
  auto row_ptr = [&](const C* pool, int p) {
    const int blk = tbl_s[p / bs - blk0];
    return pool + (static_cast<size_t>(blk) * bs + p % bs) * row_elems +
           static_cast<size_t>(kvh) * hd + d0;
  };

  // 2. scores. Each lane first issues the loads of kBatch rows (16 bytes each), then
  // computes, so a warp keeps kBatch loads in flight instead of one. Loop bounds are
  // uniform across a warp (its rows differ by sub), so every lane reaches the shuffles;
  // rows past n only skip their loads and stores.
  for (int base = static_cast<int>(warp) * RPW; base < n; base += ROWS * kBatch) {
    Raw<C> raw[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int r = base + u * ROWS + sub;
      if (active && r < n) load_raw(row_ptr(kpool, lo + r), raw[u]);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int r = base + u * ROWS + sub;
      if (base + u * ROWS >= n) break;  // uniform: no row of this step is in range
      float kf[8];
      to_floats(raw[u], kf);
#pragma unroll
      for (int g = 0; g < kGMax; ++g) {
        if (g >= gn) break;
        float dot = 0.f;
        if (active && r < n) {
#pragma unroll
          for (int j = 0; j < 8; ++j) dot = fmaf(q_s[g][d0 + j], kf[j], dot);
        }
#pragma unroll
        for (int o = L / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (li == 0 && r < n) s_s[g][r] = dot;
      }
    }
  }
  __syncthreads();

  // 3. softmax per head over the partition.
  if (static_cast<int>(warp) < gn) {
    const int g = warp;
    float m = -FLT_MAX;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, s_s[g][i]);
    m = dev::warp_max(m);
    float l = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float e = __expf(s_s[g][i] - m);
      s_s[g][i] = e;
      l += e;
    }
    l = dev::warp_sum(l);
    if (lane == 0) stat[0][g] = n > 0 ? m : -FLT_MAX, stat[1][g] = l;
  }
  __syncthreads();

  // 4. p * V.
  float acc[kGMax][8];
#pragma unroll
  for (int g = 0; g < kGMax; ++g)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
  for (int base = row0; base < n; base += ROWS * kBatch) {
    if (!active) break;
    Raw<C> raw[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int r = base + u * ROWS;
      if (r < n) load_raw(row_ptr(vpool, lo + r), raw[u]);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int r = base + u * ROWS;
      if (r >= n) break;
      float vf[8];
      to_floats(raw[u], vf);
#pragma unroll
      for (int g = 0; g < kGMax; ++g) {
        if (g >= gn) break;
        const float p = s_s[g][r];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = fmaf(p, vf[j], acc[g][j]);
      }
    }
  }
  const bool direct = P.splits == 1;
  for (int g = 0; g < gn; ++g) {
    // Rows of a warp share lane positions li: reduce over them.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v = acc[g][j];
#pragma unroll
      for (int o = L; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      acc[g][j] = v;
    }
    if (sub == 0 && active)
#pragma unroll
      for (int j = 0; j < 8; ++j) red[warp][d0 + j] = acc[g][j];
    __syncthreads();
    for (int d = tid; d < hd; d += blockDim.x) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[w][d];
      const int h = kvh * P.group + g0 + g;
      if (direct) {
        const float inv = sink_inv(b.sinks, h, stat[0][g], stat[1][g]);
        const size_t off = token * b.out_stride + static_cast<size_t>(h) * hd + d;
        if (b.dtype == DType::bf16)
          static_cast<dev::bf16*>(b.out)[off] = __float2bfloat16_rn(s * inv);
        else
          static_cast<float*>(b.out)[off] = s * inv;
      } else {
        float* part = static_cast<float*>(b.workspace) +
                      ((static_cast<size_t>(seq) * b.n_heads + h) * P.splits + split) * (hd + 2);
        part[2 + d] = s;
        if (d == 0) part[0] = stat[0][g], part[1] = stat[1][g];
      }
    }
    __syncthreads();
  }
}

// Merges the partitions of one (sequence, head): one block of 128 threads. The weights
// exp(m_s - M) of all partitions go to shared memory first, so the output loop's loads are
// independent of each other.
constexpr int kReduceThreads = 128;
__global__ void __launch_bounds__(kReduceThreads) decode_reduce_kernel(DecodeParams P) {
  extern __shared__ float wsh[];  // [splits] weights, then [33] scratch
  const AttentionBatch& b = P.b;
  const int seq = blockIdx.y, h = blockIdx.x, hd = b.kv.head_dim;
  const size_t token =
      b.query_start ? static_cast<size_t>(b.query_start[seq]) : static_cast<size_t>(seq);
  const float* part = static_cast<const float*>(b.workspace) +
                      (static_cast<size_t>(seq) * b.n_heads + h) * P.splits * (hd + 2);
  float* scratch = wsh + P.splits;
  float m = -FLT_MAX;
  for (int s = threadIdx.x; s < P.splits; s += blockDim.x) m = fmaxf(m, part[s * (hd + 2)]);
  m = dev::warp_max(m);
  if ((threadIdx.x & 31u) == 0) scratch[threadIdx.x >> 5] = m;
  __syncthreads();
  float M = -FLT_MAX;
  for (int w = 0; w < kReduceThreads / 32; ++w) M = fmaxf(M, scratch[w]);
  float l = 0.f;
  for (int s = threadIdx.x; s < P.splits; s += blockDim.x) {
    const float ls = part[s * (hd + 2) + 1];
    const float w = ls > 0.f ? __expf(part[s * (hd + 2)] - M) : 0.f;
    wsh[s] = w;
    l += ls * w;
  }
  __syncthreads();  // scratch is read by all before block_sum rewrites it; wsh is complete
  const float Lsum = dev::block_sum(l, scratch);
  const float inv = sink_inv(b.sinks, h, M, Lsum);
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0.f;
#pragma unroll 8
    for (int s = 0; s < P.splits; ++s) o += part[s * (hd + 2) + 2 + d] * wsh[s];
    const size_t off = token * b.out_stride + static_cast<size_t>(h) * hd + d;
    if (b.dtype == DType::bf16)
      static_cast<dev::bf16*>(b.out)[off] = __float2bfloat16_rn(o * inv);
    else
      static_cast<float*>(b.out)[off] = o * inv;
  }
}

template <typename C>
Status launch_decode(const DecodeParams& P, dim3 grid, cudaStream_t st) {
  const int hd = P.b.kv.head_dim;
  if (hd <= 64)
    decode_kernel<C, 64><<<grid, kWarps * 32, 0, st>>>(P);
  else if (hd <= 128)
    decode_kernel<C, 128><<<grid, kWarps * 32, 0, st>>>(P);
  else
    decode_kernel<C, 256><<<grid, kWarps * 32, 0, st>>>(P);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace

Status attention_decode_partitioned_cuda_device(const AttentionBatch& b, void* stream) {
  SPARK_TRY(attention_check_args(b, true,
                                 attention_decode_partitioned_workspace_bytes(
                                     b.n_seqs, b.n_heads, b.kv.head_dim, b.max_seq_len)));
  if (b.n_seqs == 0) return Status::Ok();
  if (b.n_seqs > 65535)
    return make_error(Errc::usage, "attention_decode: more than 65535 sequences in one batch");
  DecodeParams P{b, b.n_heads / b.kv.n_kv_heads, 0,
                 static_cast<int>(attention_decode_splits(b.max_seq_len))};
  P.chunks = (P.group + kGMax - 1) / kGMax;
  if (static_cast<long long>(b.kv.n_kv_heads) * P.chunks > 65535)
    return make_error(Errc::usage,
                      "attention_decode: too many KV heads x head chunks for one grid");
  auto st = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(P.splits),
                  static_cast<unsigned>(b.kv.n_kv_heads * P.chunks),
                  static_cast<unsigned>(b.n_seqs));
  SPARK_TRY(cuda_check_launch("attention_decode", kWarps * 32, 0));
  SPARK_DISPATCH_KV(b.kv.dtype, C, SPARK_TRY(launch_decode<C>(P, grid, st)));
  if (P.splits > 1) {
    const size_t smem = (static_cast<size_t>(P.splits) + 33) * sizeof(float);
    SPARK_TRY(detail::prepare_launch(decode_reduce_kernel, "attention_decode (reduce)",
                                     kReduceThreads, smem));
    decode_reduce_kernel<<<dim3(static_cast<unsigned>(b.n_heads), static_cast<unsigned>(b.n_seqs)),
                           kReduceThreads, smem, st>>>(P);
    SPARK_CUDA_TRY(cudaGetLastError());
  }
  return Status::Ok();
}

}  // namespace spark::kernels
