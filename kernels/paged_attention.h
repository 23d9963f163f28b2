#pragma once
// Causal attention of a chunk of query tokens over a paged KV cache. The cache of one layer
// is a pool of blocks, each [block_size][n_kv_heads][head_dim] floats for K and for V; a
// sequence's block table maps its logical block b (positions b*block_size ...) to a pool
// block. GQA: query head h reads KV head h / (n_heads / n_kv_heads).
// paged_attention_ref is the CPU reference twin of the CUDA kernel.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/dtype.h"

namespace spark::kernels {

/// One layer's K and V block pools.
struct PagedKVLayer {
  float* k = nullptr;
  float* v = nullptr;
  int block_size = 16;
  int n_kv_heads = 0;
  int head_dim = 0;
};

/// Writes k/v rows ([n_tokens][n_kv_heads][head_dim]) of tokens at `positions` into the
/// cache through `block_table`.
void paged_kv_write_ref(const PagedKVLayer& kv, const int32_t* block_table,
                        const int32_t* positions, size_t n_tokens, const float* k, const float* v);

/// q and out are [n_tokens][n_heads][head_dim]; query token t at positions[t] attends to
/// cache positions max(0, positions[t] - window + 1) .. positions[t] (window 0 = unlimited),
/// which must already be written. Softmax is accumulated in double. `sinks` ([n_heads] or
/// null): each head's learned sink logit joins the softmax's denominator and weighs no value
/// (gpt-oss).
void paged_attention_ref(const PagedKVLayer& kv, const int32_t* block_table,
                         const int32_t* positions, size_t n_tokens, int n_heads, const float* q,
                         float* out, float scale, int window, const float* sinks = nullptr);

/// Writes k/v rows of tokens into the cache by slot: token t goes to pool slot slots[t]
/// (block * block_size + offset; < 0 = skip, for padding). k/v rows start every
/// k_stride / v_stride floats (a fused QKV row). Each stored value is rounded to `store`
/// (the cache's type), so a bf16 cache can be modelled on float pools.
void paged_kv_write_slots_ref(const PagedKVLayer& kv, const int32_t* slots, size_t n_tokens,
                              const float* k, size_t k_stride, const float* v, size_t v_stride,
                              DType store);

/// One layer's K and V block pools on the device, in the layout of PagedKVLayer:
/// [num_blocks][block_size][n_kv_heads][head_dim] each, elements of type `dtype`.
struct PagedKVDevice {
  void* k = nullptr;
  void* v = nullptr;
  DType dtype = DType::bf16;
  int block_size = 16;
  int n_kv_heads = 0;
  int head_dim = 0;
  int num_blocks = 0;  // pool size, for bounds checks of slots and block tables
};

/// Paged KV write on the device: token t's k/v rows (type `src`, row starts every
/// k_stride / v_stride elements) go to slot slots[t] of the pools (< 0 = skip; a slot
/// outside the pool is skipped too). src and cache types may differ (bf16 <-> f32, and the
/// cache may be e4m3: rounded to nearest even, saturating at +-448).
Status paged_kv_write_cuda_device(const PagedKVDevice& kv, const int32_t* slots, size_t n_tokens,
                                  DType src, const void* k, size_t k_stride, const void* v,
                                  size_t v_stride, void* stream);

/// A batch of sequences for attention over the paged cache. Sequence s has q_len_s =
/// query_start[s+1] - query_start[s] query tokens, which are the LAST q_len_s of its
/// seq_lens[s] context positions (their K/V already written to the cache): query i sits
/// at position seq_lens[s] - q_len_s + i and attends causally to positions
/// max(0, pos - window + 1) .. pos (window 0 = unlimited). Pointers are device pointers.
struct AttentionBatch {
  DType dtype = DType::bf16;  // of q and out
  const void* q = nullptr;    // [n_tokens] rows, n_heads heads of head_dim at the start
  size_t q_stride = 0;        // elements between query tokens
  void* out = nullptr;        // [n_tokens][n_heads * head_dim] (row stride out_stride)
  size_t out_stride = 0;
  int n_heads = 0;  // a multiple of kv.n_kv_heads (GQA)
  PagedKVDevice kv;
  const int32_t* block_tables = nullptr;  // [n_seqs][max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  const int32_t* seq_lens = nullptr;     // [n_seqs] context length including the queries
  const int32_t* query_start = nullptr;  // [n_seqs + 1] prefix sums of query counts
  int n_seqs = 0;
  size_t n_tokens = 0;  // query_start[n_seqs]
  // Host-side upper bounds that size the grid (a graph captured with bounds replays for
  // any smaller batch): the longest query run and the longest context in the batch.
  int max_query_len = 0;
  int max_seq_len = 0;
  float scale = 0;  // softmax scale, usually 1/sqrt(head_dim)
  int window = 0;   // sliding window (Mistral), 0 = off
  // Per query head learned sink logits (gpt-oss, fp32 [n_heads], device memory), joining
  // the softmax's denominator only; nullptr = none. Every CUDA path (prefill, split-K,
  // short-context and partitioned decode) adds exp(sink - m) once per query and head, when
  // it normalises the merged output (m: the row's maximum over the scores and the sink).
  const float* sinks = nullptr;
  void* workspace = nullptr;  // decode: split partials, attention_decode_workspace_bytes
  size_t workspace_bytes = 0;
  // Decode, for the kernel benchmark and the tests: 0 = the engine's choice (the
  // short-context kernel where attention_decode_short_takes says so, else split-K);
  // 1 = split-K with fewer rows per batch (4) under a register cap for 3 blocks per
  // multiprocessor (more warps in flight, fewer loads each), for groups of 3-4 heads of
  // head_dim 65-128 (other shapes: as 2); 2 = split-K at any context; 3 = the short-context
  // kernel at any batch size (Errc::usage past its bound); 4 = split-K with the products on
  // the tensor cores (where attention_decode_tc_fits, else Errc::usage; P and an fp32 q
  // rounded to bf16, as in prefill).
  int decode_variant = 0;
  // Decode: every cache row before each query's own position was written before the kernel
  // ahead in the stream began (by an earlier step), and the block tables, seq_lens and
  // query_start likewise; only the queries and their own rows come from the kernel ahead.
  // The short-context kernel then copies those earlier rows before it waits for that
  // kernel (programmatic launch), so at a short context its wait is followed by one trip
  // to memory. The engine sets it for its decode steps; false waits first.
  bool history_ready = false;
  // Prefill kernel, for the kernel benchmark and the tests: 0 = the engine's (the tiled
  // kernel, 64, 128 or 256 queries a block, or the skewed one, chosen from the grid's size
  // and the device's shared memory); 1 = the previous kernel; 2 / 3 / 4 = the tiled kernel with 64
  // / 128 / 256 queries a block (head_dim > 128: always 64; 256 needs 105 KiB of shared memory for
  // head_dim 128, so not on GB10); 5 = as 4 but rescaling the output on every key tile;
  // 6 = 256 queries in two groups of 4 warps out of phase (171 KiB at head_dim 128).
  // Pools of 2^32 or more 8-element units (or num_blocks 0) always run the previous kernel.
  int prefill_variant = 0;
};

/// Checks an AttentionBatch against its contract and the kernels' limits (head_dim a
/// multiple of 8 and <= 256, GQA divisibility, non-null pointers; for decode, a workspace
/// of attention_decode_workspace_bytes).
Status attention_check_args(const AttentionBatch& b, bool decode);
/// The same, with the decode workspace checked against `decode_workspace_need` bytes.
Status attention_check_args(const AttentionBatch& b, bool decode, size_t decode_workspace_need);

/// Prefill attention (flash-attention style: tiles of queries against tiles of keys with an
/// online softmax in fp32, causal, GQA), reading K/V, a cached prefix included, from the
/// paged cache. Any q_len per sequence, contexts up to the pool's size.
Status attention_prefill_cuda_device(const AttentionBatch& b, void* stream);

// ---- decode: split-K ("flash-decoding") over the paged cache --------------------------
// The grid has `cap` split slots per (sequence, KV head); how many a sequence uses is
// decided on the device from its own context length, so a graph captured with a large
// context bound does work in proportion to the real contexts, not to the bound. Each used
// split streams its chunk of positions once (K and V rows loaded together, online softmax
// in fp32), and the last split of a (sequence, KV head) to finish merges the partials
// (log-sum-exp) in the same launch.

#if defined(__CUDACC__)
#define SPARK_ATTN_HD __host__ __device__ __forceinline__
#else
#define SPARK_ATTN_HD inline
#endif

#if defined(__CUDACC__)
/// The factor that normalises an output accumulated against the reference m2 in the exp2
/// domain (l = the sum of exp2(s2 - m2) over the attended scores s2 = score * scale * log2 e):
/// 1 / l, or with head h's sink logit (natural units) in the denominator
/// a / (l a + exp2(k2 - r)), k2 = sink * log2 e, r = max(m2, k2), a = exp2(m2 - r).
/// 0 when l is 0 (no attended position).
__device__ __forceinline__ float attention_norm_factor(const float* sinks, int h, float m2,
                                                       float l) {
  if (!(l > 0.f)) return 0.f;
  if (!sinks) return 1.f / l;
  const float k2 = sinks[h] * 1.4426950408889634f;
  const float r = fmaxf(m2, k2);
  const float a = exp2f(m2 - r);
  return a / fmaf(l, a, exp2f(k2 - r));
}
#endif

/// Positions of one split are a multiple of this (one pass of every lane of a block).
inline constexpr int kDecodeMinChunk = 64;
/// Most split slots per (sequence, KV head): bounds the merge's work and the workspace.
inline constexpr int kDecodeMaxSplits = 64;
/// Blocks the split slots of a launch aim at (a few per multiprocessor on an H200 or GB10).
inline constexpr int kDecodeTargetBlocks = 512;

/// Split slots per (sequence, KV-head block) for a launch of `n_seqs` sequences, `kv_blocks`
/// KV-head blocks each and contexts up to `max_seq_len`: enough for kDecodeTargetBlocks
/// blocks, at most kDecodeMaxSplits, and no more than the bound can use.
SPARK_ATTN_HD int attention_decode_split_cap(int n_seqs, int kv_blocks, int max_seq_len) {
  if (n_seqs <= 0 || kv_blocks <= 0 || max_seq_len <= 0) return 1;
  const long long per = static_cast<long long>(n_seqs) * kv_blocks;
  long long cap = (kDecodeTargetBlocks + per - 1) / per;
  const long long useful = (max_seq_len + kDecodeMinChunk - 1) / kDecodeMinChunk;
  if (cap > useful) cap = useful;
  if (cap > kDecodeMaxSplits) cap = kDecodeMaxSplits;
  return cap < 1 ? 1 : static_cast<int>(cap);
}

/// How one sequence's attended range [first, ctx) is split: `used` splits of `chunk`
/// positions (the last may be shorter); split s covers [first + s*chunk, first + (s+1)*chunk).
struct DecodeSplitPlan {
  int first = 0;  // first attended position (sliding window), 0 without a window
  int chunk = 0;  // positions per split, a multiple of kDecodeMinChunk
  int used = 0;   // splits that hold at least one position, <= cap (0 when ctx <= 0)
};

/// The split of a query at position ctx - 1 (window 0 = unlimited) over `cap` slots.
SPARK_ATTN_HD DecodeSplitPlan attention_decode_plan(int ctx, int window, int cap) {
  DecodeSplitPlan p;
  if (ctx <= 0 || cap <= 0) return p;
  const int pos = ctx - 1;
  p.first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
  const int len = ctx - p.first;
  int chunk = (len + cap - 1) / cap;
  chunk = (chunk + kDecodeMinChunk - 1) / kDecodeMinChunk * kDecodeMinChunk;
  p.chunk = chunk;
  p.used = (len + chunk - 1) / chunk;
  return p;
}

/// Bytes of workspace attention_decode_cuda_device needs for these bounds (any number of
/// KV heads): per-(sequence, head) completion counters, then the splits' partials. The
/// counters must be zero before the first launch (cudaMemset the workspace once after
/// allocating it); every launch leaves them zero again.
size_t attention_decode_workspace_bytes(int n_seqs, int n_heads, int head_dim, int max_seq_len);

/// Decode attention: one query per sequence (query_start may be null, meaning 0..n_seqs),
/// over the paged cache, split-K as above, one launch. Cost follows each sequence's real
/// context; max_seq_len only bounds the split slots.
Status attention_decode_cuda_device(const AttentionBatch& b, void* stream);

/// Decode attention for short contexts (attention_decode_short.cu): a cluster of 8 blocks
/// per (sequence, KV head) holds the attended range of K and V in shared memory, each block
/// its eighth, and merges through distributed shared memory: two trips to global memory
/// where split-K takes six. It takes batches whose max_seq_len is at most
/// attention_decode_short_max(); attention_decode_cuda_device runs it for those
/// (decode_variant 0), so a graph captured with that bound uses it for every context up to
/// the bound, when its grid (8 blocks per sequence and KV head) fits in one wave of the
/// multiprocessors: at batch 1 it is faster than split-K (7.7 against 11.8 us at a context
/// of 256 on an H200), at 8 sequences and more slower (bench/kernels/NOTES.md). Errc::usage
/// past the bound.
Status attention_decode_short_cuda_device(const AttentionBatch& b, void* stream);

/// The context bound up to which attention_decode_cuda_device runs the short-context kernel
/// for `n_seqs` sequences of these heads on the current device (0: never, e.g. too many
/// sequences for one wave); a graph of such a step captured with this bound uses it.
int attention_decode_short_bound(int n_seqs, int n_heads, int n_kv_heads, int head_dim,
                                 DType kv_dtype);
/// Whether attention_decode_cuda_device runs the short-context kernel for `b`.
bool attention_decode_short_takes(const AttentionBatch& b);

/// Whether split-K's tensor-core form (decode_variant 4) takes a cache of `kv_dtype` and
/// `head_dim`: bf16 or e4m3, head_dim 32, 64 or 128.
inline bool attention_decode_tc_fits(DType kv_dtype, int head_dim) {
  return (kv_dtype == DType::bf16 || kv_dtype == DType::e4m3) &&
         (head_dim == 32 || head_dim == 64 || head_dim == 128);
}

/// The longest context the short-context kernel takes for `head_dim` and a cache of
/// `kv_dtype` on the current device: what 8 blocks' shared memory holds, at most 1024
/// (1024 for head_dim 128 on an H200 and on a GB10); 0 without a device or cluster launch,
/// before sm_90, and with the fallbacks forced (cuda_hopper_paths(), set_cuda_fallbacks()).
int attention_decode_short_max(int head_dim, DType kv_dtype);

/// CPU twin of the split-K decode of one query (position ctx - 1) for every head: each
/// split's softmax and weighted sum in fp32 over its chunk, merged by log-sum-exp as the
/// kernel does; each head's sink (`sinks`, [n_heads] or null) joins the merged denominator
/// once. q and out are [n_heads][head_dim].
void attention_decode_split_ref(const PagedKVLayer& kv, const int32_t* block_table, int ctx,
                                int n_heads, const float* q, float* out, float scale, int window,
                                int cap, const float* sinks = nullptr);

// ---- decode: the previous kernel (fixed partitions and a second merge launch) ----------
// Kept for comparison in the kernel benchmark: its grid, and so its cost, follows the
// context bound max_seq_len.

/// Context positions one block of the partitioned kernel covers.
inline constexpr int kDecodePartition = 128;

/// Partitions attention_decode_partitioned_cuda_device splits a context of max_seq_len into.
inline size_t attention_decode_splits(int max_seq_len) {
  return max_seq_len <= 0
             ? 0
             : static_cast<size_t>((max_seq_len + kDecodePartition - 1) / kDecodePartition);
}

/// Bytes of workspace attention_decode_partitioned_cuda_device needs for these bounds.
size_t attention_decode_partitioned_workspace_bytes(int n_seqs, int n_heads, int head_dim,
                                                    int max_seq_len);

/// Decode attention with one block per kDecodePartition positions of the bound and a
/// second kernel that merges the partitions.
Status attention_decode_partitioned_cuda_device(const AttentionBatch& b, void* stream);

}  // namespace spark::kernels
