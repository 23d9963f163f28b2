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
/// which must already be written. Softmax is accumulated in double.
void paged_attention_ref(const PagedKVLayer& kv, const int32_t* block_table,
                         const int32_t* positions, size_t n_tokens, int n_heads, const float* q,
                         float* out, float scale, int window);

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
/// outside the pool is skipped too). src and cache types may differ (bf16 <-> f32).
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
  float scale = 0;            // softmax scale, usually 1/sqrt(head_dim)
  int window = 0;             // sliding window (Mistral), 0 = off
  void* workspace = nullptr;  // decode: split partials, attention_decode_workspace_bytes
  size_t workspace_bytes = 0;
};

/// Checks an AttentionBatch against its contract and the kernels' limits (head_dim a
/// multiple of 8 and <= 256, GQA divisibility, non-null pointers, workspace size).
Status attention_check_args(const AttentionBatch& b, bool decode);

/// Prefill attention (flash-attention style: tiles of queries against tiles of keys with an
/// online softmax in fp32, causal, GQA), reading K/V, a cached prefix included, from the
/// paged cache. Any q_len per sequence, contexts up to the pool's size.
Status attention_prefill_cuda_device(const AttentionBatch& b, void* stream);

/// Context positions one decode block covers; longer contexts are split into partitions.
inline constexpr int kDecodePartition = 128;

/// Partitions attention_decode_cuda_device splits a context of max_seq_len into.
inline size_t attention_decode_splits(int max_seq_len) {
  return max_seq_len <= 0
             ? 0
             : static_cast<size_t>((max_seq_len + kDecodePartition - 1) / kDecodePartition);
}

/// Bytes of workspace attention_decode_cuda_device needs for these bounds.
size_t attention_decode_workspace_bytes(int n_seqs, int n_heads, int head_dim, int max_seq_len);

/// Decode attention: one query per sequence (query_start may be null, meaning 0..n_seqs),
/// over the paged cache; long contexts are split into partitions processed in parallel,
/// then reduced (log-sum-exp merge) into out.
Status attention_decode_cuda_device(const AttentionBatch& b, void* stream);

}  // namespace spark::kernels
