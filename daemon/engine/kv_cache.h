#pragma once
// Paged KV cache storage: per layer a pool of blocks of `block_size` token slots for K and
// V (this rank's KV heads only). Which block belongs to whom is the BlockManager's job
// (block_manager.h); the model only reads and writes through block tables.
#include <cstddef>
#include <vector>

#include "kernels/paged_attention.h"

namespace spark::engine {

class KVCache {
 public:
  KVCache(int num_layers, int num_blocks, int block_size, int n_kv_heads, int head_dim);
  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  /// Layer `l`'s pools, in the layout paged_attention_ref expects.
  kernels::PagedKVLayer layer(int l);
  /// Bytes of K+V storage.
  size_t bytes() const { return (k_.size() + v_.size()) * sizeof(float); }

 private:
  int num_blocks_, block_size_, n_kv_heads_, head_dim_;
  size_t per_layer_;
  std::vector<float> k_, v_;
};

}  // namespace spark::engine
