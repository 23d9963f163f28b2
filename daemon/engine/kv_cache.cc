#include "daemon/engine/kv_cache.h"

namespace spark::engine {

KVCache::KVCache(int num_layers, int num_blocks, int block_size, int n_kv_heads, int head_dim)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      per_layer_(static_cast<size_t>(num_blocks) * static_cast<size_t>(block_size) *
                 static_cast<size_t>(n_kv_heads) * static_cast<size_t>(head_dim)),
      k_(per_layer_ * static_cast<size_t>(num_layers)),
      v_(per_layer_ * static_cast<size_t>(num_layers)) {}

kernels::PagedKVLayer KVCache::layer(int l) {
  kernels::PagedKVLayer p;
  p.k = k_.data() + per_layer_ * static_cast<size_t>(l);
  p.v = v_.data() + per_layer_ * static_cast<size_t>(l);
  p.block_size = block_size_;
  p.n_kv_heads = n_kv_heads_;
  p.head_dim = head_dim_;
  return p;
}

}  // namespace spark::engine
