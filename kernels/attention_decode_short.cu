// Decode attention for short contexts: the attended range of one KV head spread over a
// cluster of 8 blocks, each holding its share of K and V in shared memory, merged through
// distributed shared memory. Grid: (KV head x group chunk x 8, sequence); cluster: 8 blocks
// along x; block: 8 warps.
//
// At a short context the split-K kernel is latency, not bytes: the context length, the
// block table, the K/V rows, the partials' store, the fence and count, the last split's
// reads of the partials are six dependent trips to memory, for a few hundred KiB. Here:
//   1. the context length, the query offset and the block-table entries of every position
//      up to the launch's bound are loaded at once (the table row is as wide as the bound,
//      so the entries past the context are in the row and never used);
//   2. block c of the cluster copies rows [c R, (c + 1) R) of the attended range (R = its
//      length / 8, rounded up) of K and V to shared memory by cp.async in one batch, while
//      the query heads are read into registers (pre-scaled by scale * log2 e);
//   3. scores: L = head_dim / 8 lanes per row, one 16-byte shared load each, a reduction
//      over those lanes, one score per (head, row) in shared memory;
//   4. softmax per head over the block's rows by one warp (max m_c, exp2, sum l_c), fp32;
//   5. the block's output per head (sum of p V over its rows, unnormalised): each thread
//      sums 8 dimensions over every P-th row, the P parts added in shared memory;
//   6. cluster barrier; each output element is merged by one thread of the cluster from
//      the 8 blocks' (m_c, l_c, output) in their shared memory (log-sum-exp); a second
//      barrier keeps the blocks' memory alive until every read is done.
// Two trips to global memory and the store, against six; the rows are spread over 8
// multiprocessors, so none copies more than its share. The bound is what 8 blocks' shared
// memory holds, at most 1024 positions (attention_decode_short_max); longer contexts run
// the split-K kernel.
#include <cooperative_groups.h>

#include <algorithm>
#include <cfloat>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace spark::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kCluster = 8;  // blocks per (sequence, KV head): the portable cluster size
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGMax = 8;        // query heads per cluster; larger groups run in chunks
constexpr int kMaxRows = 1024;  // the most positions a launch takes, whatever memory allows
constexpr float kLog2e = 1.4426950408889634f;

size_t align16(size_t n) {
  return (n + 15) / 16 * 16;
}

// Shared memory of one block for up to `rows` positions (its share of the cluster's) of
// head_dim `hd` in elements of `es` bytes: K, V, the scores, the output parts, the block's
// output, the table entries of the launch's bound (`entries`).
struct ShortSmem {
  size_t v_off = 0, s_off = 0, p_off = 0, o_off = 0, t_off = 0, bytes = 0;
  ShortSmem(int rows, int hd, size_t es, int entries) {
    const size_t kv = align16(static_cast<size_t>(rows) * static_cast<size_t>(hd) * es);
    v_off = kv;
    s_off = v_off + kv;
    p_off = s_off + align16(static_cast<size_t>(kGMax) * static_cast<size_t>(rows) * sizeof(float));
    o_off = p_off + size_t{kThreads} * 8 * sizeof(float);
    t_off = o_off + align16(static_cast<size_t>(kGMax) * static_cast<size_t>(hd) * sizeof(float));
    bytes = t_off + align16(static_cast<size_t>(entries) * sizeof(int32_t));
  }
};

struct ShortParams {
  AttentionBatch b;
  int group;     // query heads per KV head
  int chunks;    // ceil(group / kGMax)
  int rows;      // positions one block's shared memory holds
  int entries;   // block-table entries of the bound: ceil(bound / block_size), <= the row
  int bs_shift;  // log2(block_size) when it is a power of two, else -1
  float qscale;  // scale * log2 e
  ShortSmem sm;
};

template <typename C, int HD, int G>
__global__ void __launch_bounds__(kThreads, 1) short_kernel(ShortParams P) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  (void)P;  // clusters need sm_90: attention_decode_short_max() is 0 there, never launched
#else
  // Programmatic launch: with history_ready, the table, the context and the rows before
  // the query's own position are copied first and the wait comes before that last row and
  // the query are read (below); else the wait comes first.
  const bool early = P.b.history_ready;
  if (!early) {
    dev::pdl_wait();
    dev::pdl_trigger();
  }
  extern __shared__ __align__(16) unsigned char smem[];
  C* ks = reinterpret_cast<C*>(smem);
  C* vs = reinterpret_cast<C*>(smem + P.sm.v_off);
  float* sc = reinterpret_cast<float*>(smem + P.sm.s_off);     // [kGMax][rows]
  float* parts = reinterpret_cast<float*>(smem + P.sm.p_off);  // [parts][items][8]
  float* o_s = reinterpret_cast<float*>(smem + P.sm.o_off);    // [gn][hd], unnormalised
  int32_t* ent = reinterpret_cast<int32_t*>(smem + P.sm.t_off);
  __shared__ float m_s[kGMax], l_s[kGMax];

  cg::cluster_group cluster = cg::this_cluster();
  const int c = static_cast<int>(cluster.block_rank());
  const AttentionBatch& b = P.b;
  const int kvb = static_cast<int>(blockIdx.x) / kCluster, seq = blockIdx.y;
  const int kvh = kvb / P.chunks, chunk = kvb % P.chunks;
  const int hd = b.kv.head_dim, bs = b.kv.block_size;
  const int g0 = chunk * kGMax;
  const int gn = min(G, P.group - g0);
  const int tid = static_cast<int>(threadIdx.x);

  // 1. Context, query offset and the bound's table entries, all at once.
  const int32_t* table = b.block_tables + static_cast<size_t>(seq) * b.max_blocks_per_seq;
  for (int i = tid; i < P.entries; i += kThreads) ent[i] = __ldg(table + i);
  const int ctx = b.seq_lens[seq];
  const size_t token =
      b.query_start ? static_cast<size_t>(b.query_start[seq]) : static_cast<size_t>(seq);
  const int first = b.window > 0 && ctx - b.window > 0 ? ctx - b.window : 0;
  const int len = ctx > 0 ? ctx - first : 0;
  const int share = (len + kCluster - 1) / kCluster;
  const int lo = first + c * share;            // this block's first position
  const int n = max(0, min(share, ctx - lo));  // and how many
  __syncthreads();

  // 2. This block's K and V rows into shared memory; q of this lane's dimensions.
  const size_t row_elems = static_cast<size_t>(b.kv.n_kv_heads) * hd;
  const C* kpool = static_cast<const C*>(b.kv.k) + static_cast<size_t>(kvh) * hd;
  const C* vpool = static_cast<const C*>(b.kv.v) + static_cast<size_t>(kvh) * hd;
  constexpr int E = 16 / static_cast<int>(sizeof(C));  // elements per 16-byte copy
  const int per_row = hd / E;
  const int own = ctx - 1;  // the query's position: its row comes from the kernel ahead
  auto copy_row_piece = [&](int r, int e) {
    const int p = lo + r;
    const int tb = P.bs_shift >= 0 ? p >> P.bs_shift : p / bs;
    const size_t at = static_cast<size_t>(ent[tb] * bs + (p - tb * bs)) * row_elems + e;
    dev::cp_async16(ks + static_cast<size_t>(r) * hd + e, kpool + at);
    dev::cp_async16(vs + static_cast<size_t>(r) * hd + e, vpool + at);
  };
  for (int i = tid; i < n * per_row; i += kThreads) {
    const int r = i / per_row;
    if (early && lo + r == own) continue;
    copy_row_piece(r, (i - r * per_row) * E);
  }
  if (early) {
    dev::pdl_wait();
    dev::pdl_trigger();
    if (own >= lo && own < lo + n && tid < per_row) copy_row_piece(own - lo, tid * E);
  }
  dev::cp_async_commit();

  constexpr int L = HD / 8;    // lanes per row
  constexpr int RPW = 32 / L;  // rows per warp and load
  constexpr int NS = kWarps * RPW;
  const int lane = tid & 31, warp = tid >> 5;
  const int sub = lane / L, li = lane % L;
  const int d0 = li * 8;
  const bool active = d0 < hd;
  float q[G][8];
  dev::load_q_lane(b, token, P.group, kvh, g0, gn, d0, active, P.qscale, q);
  dev::cp_async_wait<0>();
  __syncthreads();

  // 3. Scores, in the log2 domain.
  for (int r = warp * RPW + sub; r - sub < n; r += NS) {  // uniform per warp: shuffles
    float kf[8];
    if (active && r < n)
      dev::load8(ks + static_cast<size_t>(r) * hd + d0, kf);
    else
#pragma unroll
      for (int j = 0; j < 8; ++j) kf[j] = 0.f;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float dot = dev::lanes_dot8<L>(q[g], kf);
      if (li == 0 && g < gn && r < n) sc[g * P.rows + r] = dot;
    }
  }
  __syncthreads();

  // 4. Softmax over this block's rows: probabilities in place of the scores.
  for (int g = warp; g < gn; g += kWarps) {
    float* sg = sc + g * P.rows;
    float m = -FLT_MAX;
    for (int r = lane; r < n; r += 32) m = fmaxf(m, sg[r]);
    m = dev::warp_max(m);
    float l = 0.f;
    for (int r = lane; r < n; r += 32) {
      const float p = exp2f(sg[r] - m);
      sg[r] = p;
      l += p;
    }
    l = dev::warp_sum(l);
    if (lane == 0) m_s[g] = m, l_s[g] = l;  // l = 0 for a block without rows
  }
  __syncthreads();

  // 5. The block's output: item = (head, 8 dimensions), part = which rows.
  const int hd8 = hd / 8;
  const int items = gn * hd8;  // <= kGMax * 32 = kThreads
  const int nparts = kThreads / items;
  {
    const int item = tid % items, part = tid / items;
    const int g = item / hd8, d = (item % hd8) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (part < nparts) {
      const float* sg = sc + g * P.rows;
      for (int r = part; r < n; r += nparts) {
        float vf[8];
        dev::load8(vs + static_cast<size_t>(r) * hd + d, vf);
        const float p = sg[r];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = fmaf(p, vf[j], acc[j]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j)
        parts[(static_cast<size_t>(part) * items + item) * 8 + j] = acc[j];
    }
  }
  __syncthreads();
  for (int i = tid; i < gn * hd; i += kThreads) {
    const int item = i / 8, j = i % 8;
    float o = 0.f;
    for (int pt = 0; pt < nparts; ++pt)
      o += parts[(static_cast<size_t>(pt) * items + item) * 8 + j];
    o_s[(item / hd8) * hd + (item % hd8) * 8 + j] = o;
  }

  // 6. Merge the cluster's blocks: element i of the output by thread i of the cluster.
  cluster.sync();
  const int i = c * kThreads + tid;
  if (i < gn * hd) {
    const int g = i / hd, d = i % hd;
    float mc[kCluster], lc[kCluster], oc[kCluster];
#pragma unroll
    for (int r = 0; r < kCluster; ++r) {
      mc[r] = *cluster.map_shared_rank(&m_s[g], r);
      lc[r] = *cluster.map_shared_rank(&l_s[g], r);
      oc[r] = *cluster.map_shared_rank(&o_s[g * hd + d], r);
    }
    float M = -FLT_MAX;
#pragma unroll
    for (int r = 0; r < kCluster; ++r) M = fmaxf(M, mc[r]);
    float sum = 0.f, o = 0.f;
#pragma unroll
    for (int r = 0; r < kCluster; ++r) {
      const float w = lc[r] > 0.f ? exp2f(mc[r] - M) : 0.f;
      sum += lc[r] * w;
      o += oc[r] * w;
    }
    // sum >= 1 when the context is not empty; the head's sink joins the merged denominator.
    const float res = o * attention_norm_factor(b.sinks, kvh * P.group + g0 + g, M, sum);
    const size_t at = token * b.out_stride + static_cast<size_t>((kvh * P.group + g0 + g) * hd + d);
    if (b.dtype == DType::bf16)
      static_cast<dev::bf16*>(b.out)[at] = __float2bfloat16_rn(res);
    else
      static_cast<float*>(b.out)[at] = res;
  }
  cluster.sync();  // the other blocks read this one's memory until here
#endif
}

template <typename Kernel>
Status launch_cluster(Kernel* kernel, const ShortParams& P, dim3 grid, cudaStream_t st) {
  SPARK_TRY(
      detail::prepare_launch(kernel, "attention_decode (short contexts)", kThreads, P.sm.bytes));
  SPARK_CUDA_TRY(dev::launch_clusters(kernel, grid, dim3(kThreads), P.sm.bytes, st, kCluster, P));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

template <typename C, int HD>
Status launch_hd(const ShortParams& P, int gmax, dim3 grid, cudaStream_t st) {
  if (gmax <= 1) return launch_cluster(short_kernel<C, HD, 1>, P, grid, st);
  if (gmax <= 2) return launch_cluster(short_kernel<C, HD, 2>, P, grid, st);
  if (gmax <= 4) return launch_cluster(short_kernel<C, HD, 4>, P, grid, st);
  return launch_cluster(short_kernel<C, HD, 8>, P, grid, st);
}

template <typename C>
Status launch(const ShortParams& P, int gmax, dim3 grid, cudaStream_t st) {
  const int hd = P.b.kv.head_dim;
  if (hd <= 64) return launch_hd<C, 64>(P, gmax, grid, st);
  if (hd <= 128) return launch_hd<C, 128>(P, gmax, grid, st);
  return launch_hd<C, 256>(P, gmax, grid, st);
}

// Positions of a cluster for a launch bound of `bound`, 16 at a time per block.
int block_rows(int bound) {
  return ((bound + kCluster - 1) / kCluster + 15) / 16 * 16;
}

}  // namespace

int attention_decode_short_max(int head_dim, DType kv_dtype) {
  if (head_dim <= 0 || head_dim > 256 || head_dim % 8 != 0) return 0;
  auto lim = cuda_device_limits();
  // Clusters need sm_90 (the kernel is a no-op built for earlier ones) and are skipped when
  // the fallbacks are forced.
  if (!lim || !lim->cluster_launch || !cuda_hopper_paths(lim->cc_major, cuda_fallbacks())) return 0;
  const size_t es = dtype_size(kv_dtype);
  int best = 0;
  for (int bound = 16; bound <= kMaxRows; bound += 16)  // entries: block size 1 at worst
    if (ShortSmem(block_rows(bound), head_dim, es, bound).bytes <= lim->smem_per_block_optin)
      best = bound;
  return best;
}

int attention_decode_short_bound(int n_seqs, int n_heads, int n_kv_heads, int head_dim,
                                 DType kv_dtype) {
  if (n_seqs <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0) return 0;
  auto lim = cuda_device_limits();
  if (!lim) return 0;
  const int chunks = (n_heads / n_kv_heads + kGMax - 1) / kGMax;
  const long long blocks = static_cast<long long>(n_seqs) * n_kv_heads * chunks * kCluster;
  if (blocks > lim->sm_count) return 0;  // more than one wave: split-K is faster (bench)
  return attention_decode_short_max(head_dim, kv_dtype);
}

// Whether the kernel's 16-byte copies fit the cache's rows: every head of every row starts
// on 16 bytes and is whole 16-byte pieces (bf16, fp32: head_dim % 8 == 0 does it; e4m3 rows
// need head_dim % 16 == 0; otherwise split-K reads them).
static bool short_rows_fit(const PagedKVDevice& kv) {
  const size_t es = dtype_size(kv.dtype);
  return (static_cast<size_t>(kv.head_dim) * es) % 16 == 0;
}

bool attention_decode_short_takes(const AttentionBatch& b) {
  if (!short_rows_fit(b.kv)) return false;
  if (b.decode_variant == 3) return true;
  if (b.decode_variant != 0 || b.max_seq_len <= 0) return false;
  return b.max_seq_len <= attention_decode_short_bound(b.n_seqs, b.n_heads, b.kv.n_kv_heads,
                                                       b.kv.head_dim, b.kv.dtype);
}

Status attention_decode_short_cuda_device(const AttentionBatch& b, void* stream) {
  SPARK_TRY(attention_check_args(b, true));
  if (b.n_seqs == 0) return Status::Ok();
  const int limit = attention_decode_short_max(b.kv.head_dim, b.kv.dtype);
  if (b.max_seq_len <= 0 || b.max_seq_len > limit)
    return make_error(Errc::usage, "attention_decode (short contexts): contexts up to " +
                                       std::to_string(b.max_seq_len) +
                                       " asked, this device's shared memory holds " +
                                       std::to_string(limit) + " for head_dim " +
                                       std::to_string(b.kv.head_dim));
  if (b.n_seqs > 65535)
    return make_error(Errc::usage, "attention_decode: more than 65535 sequences in one batch");
  if (!short_rows_fit(b.kv))
    return make_error(Errc::usage, "attention_decode (short contexts): head_dim " +
                                       std::to_string(b.kv.head_dim) + " of a " +
                                       dtype_name(b.kv.dtype) +
                                       " cache is not whole 16-byte pieces");
  ShortParams P{b, 0, 0, 0, 0, -1, 0.f, ShortSmem(16, 8, 2, 1)};
  P.group = b.n_heads / b.kv.n_kv_heads;
  P.chunks = (P.group + kGMax - 1) / kGMax;
  const long long blocks = static_cast<long long>(b.kv.n_kv_heads) * P.chunks * kCluster;
  if (blocks > 2147483647LL)
    return make_error(Errc::usage, "attention_decode: too many KV heads x head chunks");
  P.rows = block_rows(b.max_seq_len);
  P.entries =
      std::min((b.max_seq_len + b.kv.block_size - 1) / b.kv.block_size, b.max_blocks_per_seq);
  P.sm = ShortSmem(P.rows, b.kv.head_dim, dtype_size(b.kv.dtype), P.entries);
  for (int s = 0; s < 31; ++s)
    if ((1 << s) == b.kv.block_size) P.bs_shift = s;
  P.qscale = b.scale * kLog2e;
  const int gmax = P.group < kGMax ? P.group : kGMax;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(b.n_seqs));
  SPARK_DISPATCH_KV(b.kv.dtype, C,
                    SPARK_TRY(launch<C>(P, gmax, grid, static_cast<cudaStream_t>(stream))));
  return Status::Ok();
}

}  // namespace spark::kernels
