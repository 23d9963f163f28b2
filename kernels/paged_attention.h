#pragma once
// Causal attention of a chunk of query tokens over a paged KV cache. The cache of one layer
// is a pool of blocks, each [block_size][n_kv_heads][head_dim] floats for K and for V; a
// sequence's block table maps its logical block b (positions b*block_size ...) to a pool
// block. GQA: query head h reads KV head h / (n_heads / n_kv_heads).
// paged_attention_ref is the CPU reference twin of the CUDA kernel.
#include <cstddef>
#include <cstdint>

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

}  // namespace spark::kernels
